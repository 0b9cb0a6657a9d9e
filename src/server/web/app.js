// tansy's built-in chat. Every piece of model or user text reaches the page through
// textContent / createTextNode only: nothing the model writes is ever parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const store = {
  get(key, fallback) {
    try { const v = localStorage.getItem("tansy." + key); return v === null ? fallback : JSON.parse(v); }
    catch (e) { return fallback; }
  },
  set(key, value) { localStorage.setItem("tansy." + key, JSON.stringify(value)); },
};

let messages = store.get("messages", []);  // [{role, content, reasoning?, tool_calls?}]
let model = null;
let controller = null;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// Inline markdown: `code`, **bold**, *italic*. Built as nodes, never as HTML.
function inline(parent, text) {
  const re = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\n]+\*)/g;
  let last = 0, m;
  while ((m = re.exec(text)) !== null) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    const t = m[0];
    if (t.startsWith("`")) parent.appendChild(el("code", null, t.slice(1, -1)));
    else if (t.startsWith("**")) parent.appendChild(el("strong", null, t.slice(2, -2)));
    else parent.appendChild(el("em", null, t.slice(1, -1)));
    last = m.index + t.length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

// Block markdown: ``` fences, # headings, - / 1. lists, paragraphs.
function renderMarkdown(container, text) {
  container.replaceChildren();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^```\s*([\w+-]*)/);
    if (fence) {
      const body = [];
      for (i++; i < lines.length && !lines[i].startsWith("```"); i++) body.push(lines[i]);
      i++;
      const pre = el("pre");
      const code = el("code", null, body.join("\n"));
      if (fence[1]) code.dataset.lang = fence[1];
      pre.appendChild(code);
      container.appendChild(pre);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      const h = el("h" + Math.min(6, heading[1].length + 2));
      inline(h, heading[2]);
      container.appendChild(h);
      i++;
      continue;
    }
    if (/^\s*([-*]|\d+\.)\s+/.test(line)) {
      const ordered = /^\s*\d+\./.test(line);
      const list = el(ordered ? "ol" : "ul");
      while (i < lines.length && /^\s*([-*]|\d+\.)\s+/.test(lines[i])) {
        const li = el("li");
        inline(li, lines[i].replace(/^\s*([-*]|\d+\.)\s+/, ""));
        list.appendChild(li);
        i++;
      }
      container.appendChild(list);
      continue;
    }
    if (line.trim() === "") { i++; continue; }
    const para = [];
    while (i < lines.length && lines[i].trim() !== "" && !/^(```|#{1,6}\s|\s*([-*]|\d+\.)\s+)/.test(lines[i]))
      para.push(lines[i++]);
    const p = el("p");
    inline(p, para.join("\n"));
    container.appendChild(p);
  }
}

// One message's DOM; update() re-renders it from the message object.
function messageView(msg) {
  const box = el("div", "msg " + msg.role);
  box.appendChild(el("div", "role", msg.role));
  const reasoning = el("details", "reasoning");
  reasoning.appendChild(el("summary", null, "Reasoning"));
  const reasoningText = el("div");
  reasoning.appendChild(reasoningText);
  const content = el("div", "content");
  const tools = el("div", "tools");
  box.append(reasoning, content, tools);
  const update = () => {
    reasoning.hidden = !msg.reasoning;
    reasoningText.textContent = msg.reasoning || "";
    renderMarkdown(content, msg.content || "");
    tools.replaceChildren();
    for (const call of msg.tool_calls || []) {
      const d = el("details", "tool");
      d.open = true;
      d.appendChild(el("summary", null, "Tool call: " + call.function.name));
      d.appendChild(el("pre", null, call.function.arguments));
      tools.appendChild(d);
    }
  };
  update();
  $("log").appendChild(box);
  return { box, update };
}

function showError(text) {
  const box = el("div", "msg error", text);
  $("log").appendChild(box);
}

function renderAll() {
  $("log").replaceChildren();
  for (const m of messages) messageView(m);
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("apikey").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) { $("model").textContent = r.status === 401 ? "(API key needed)" : "(models: " + r.status + ")"; return; }
    const j = await r.json();
    model = j.data[0].id;
    $("model").textContent = model;
  } catch (e) {
    $("model").textContent = "(server unreachable)";
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// Reads server-sent events from a fetch response; calls onData for each `data:` payload.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n"))
        if (line.startsWith("data: ")) onData(line.slice(6));
    }
  }
}

// The tools field: empty, or a JSON array of OpenAI tools sent with every request.
function readTools() {
  const text = $("tools").value.trim();
  if (!text) return null;
  const tools = JSON.parse(text);
  if (!Array.isArray(tools)) throw new Error("the tools field must hold a JSON array");
  return tools;
}

async function send(text) {
  if (!model) await loadModel();
  if (!model) { showError("No model: check the server and the API key."); return; }
  let tools;
  try { tools = readTools(); } catch (e) { showError("Tools: " + e.message); return; }
  messages.push({ role: "user", content: text });
  store.set("messages", messages);
  messageView(messages[messages.length - 1]);
  const answer = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
  const view = messageView(answer);
  view.box.classList.add("streaming");
  controller = new AbortController();
  setBusy(true);
  $("status").textContent = "generating…";
  const body = {
    model,
    stream: true,
    messages: messages.map((m) => {
      const out = { role: m.role, content: m.content || "" };
      if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
      return out;
    }),
    max_tokens: Math.max(1, parseInt($("maxtokens").value, 10) || 512),
    chat_template_kwargs: { enable_thinking: $("thinking").checked },
  };
  if (tools && tools.length) body.tools = tools;
  let outcome = "done";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      let msg = "HTTP " + r.status;
      try { msg += ": " + (await r.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    await readEvents(r, (data) => {
      if (data === "[DONE]") return;
      const j = JSON.parse(data);
      if (j.error) throw new Error(j.error.message);
      const choice = j.choices && j.choices[0];
      if (!choice) return;
      const d = choice.delta || {};
      if (d.reasoning_content) answer.reasoning += d.reasoning_content;
      if (d.content) answer.content += d.content;
      for (const t of d.tool_calls || []) {
        if (!answer.tool_calls[t.index])
          answer.tool_calls[t.index] = { id: t.id, type: "function", function: { name: t.function.name, arguments: "" } };
        answer.tool_calls[t.index].function.arguments += t.function.arguments || "";
      }
      if (choice.finish_reason) outcome = choice.finish_reason;
      view.update();
      $("log").scrollTop = $("log").scrollHeight;
    });
  } catch (e) {
    if (e.name === "AbortError") outcome = "stopped";
    else { outcome = "error"; showError(e.message); }
  } finally {
    controller = null;
    setBusy(false);
    view.box.classList.remove("streaming");
    view.box.dataset.outcome = outcome;
    $("status").textContent = outcome === "stopped" ? "stopped" : outcome === "error" ? "error" : "finished (" + outcome + ")";
    if (!answer.tool_calls.length) delete answer.tool_calls;
    messages.push(answer);
    store.set("messages", messages);
  }
}

function init() {
  $("apikey").value = store.get("apikey", "");
  $("thinking").checked = store.get("thinking", false);
  $("tools").value = store.get("tools", "");
  $("tools").addEventListener("change", () => store.set("tools", $("tools").value));
  $("apikey").addEventListener("change", () => { store.set("apikey", $("apikey").value); model = null; loadModel(); });
  $("thinking").addEventListener("change", () => store.set("thinking", $("thinking").checked));
  $("form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("input").value.trim();
    if (!text || controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    messages = [];
    store.set("messages", messages);
    renderAll();
  });
  renderAll();
  loadModel();
}

document.addEventListener("DOMContentLoaded", init);
