"""The built-in web chat (GET /) in a real browser: Debian's chromium driven through
chromium-driver by selenium, against the real server on the bundled models/tansy-demo (CPU).
Skipped where chromium or chromedriver is missing (scripts/setup installs both)."""
import json
import os
import shutil
import time

import pytest
import requests

from api_support import REPO, ServerProcess

DEMO = os.path.join(REPO, "models", "tansy-demo")
CHROMEDRIVER = shutil.which("chromedriver")
CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.skipif(not os.path.isdir(DEMO), reason="models/tansy-demo is not in this checkout"),
    pytest.mark.skipif(not (CHROMEDRIVER and CHROMIUM), reason="chromium / chromedriver not installed"),
]
WHO = "I am Tansy Demo, a tiny language model bundled with tansy, an inference engine for Qwen3.6. I can tell you what a common English word means."


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    s = ServerProcess(None, str(tmp_path_factory.mktemp("logs") / "webchat.log"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser(demo):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1000,760"]:
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    d.set_page_load_timeout(30)
    yield d
    d.quit()


def wait_for(cond, timeout=60, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def console_errors(browser):
    return [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


def open_fresh(browser, demo):
    browser.get_log("browser")  # what earlier tests left
    browser.get(demo.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(demo.url + "/")
    wait_for(lambda: browser.find_element("id", "model").text == "tansy-demo", 30, "the model name")


def ask(browser, text, max_tokens=None):
    from selenium.webdriver.common.keys import Keys
    if max_tokens is not None:
        box = browser.find_element("id", "maxtokens")
        box.clear()
        box.send_keys(str(max_tokens))
    browser.find_element("id", "input").send_keys(text, Keys.ENTER)


def last_answer(browser):
    msgs = browser.find_elements("css selector", ".msg.assistant")
    return msgs[-1] if msgs else None


def test_headers_and_csp(demo):
    r = requests.get(demo.url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html")
    csp = r.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert '<script src="/app.js"' in r.text and "<script>" not in r.text and "style=" not in r.text
    for path, ctype in [("/app.js", "text/javascript"), ("/app.css", "text/css")]:
        a = requests.get(demo.url + path, timeout=10)
        assert a.status_code == 200 and a.headers["Content-Type"].startswith(ctype) and len(a.text) > 500


def test_streamed_answer_appears(browser, demo):
    open_fresh(browser, demo)
    # Record every state of the answer's text as the page changes it.
    browser.execute_script("""
        window.__seen = [];
        new MutationObserver(() => {
          const c = document.querySelectorAll('.msg.assistant .content');
          if (c.length) window.__seen.push(c[c.length - 1].textContent);
        }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});""")
    ask(browser, "Hello! Who are you?")
    wait_for(lambda: last_answer(browser) and last_answer(browser).get_attribute("data-outcome") == "stop", 60,
             "the end of the answer")
    content = last_answer(browser).find_element("css selector", ".content").text
    assert content == WHO
    # Streamed: the text grew through many partial states, each a prefix of the answer.
    seen = [t for t in dict.fromkeys(browser.execute_script("return window.__seen")) if t]
    assert len(seen) > 10 and all(WHO.startswith(t) for t in seen), seen
    # Kept in the browser: a reload shows the conversation again.
    browser.refresh()
    wait_for(lambda: len(browser.find_elements("css selector", ".msg")) == 2, 10, "the restored conversation")
    assert last_answer(browser).find_element("css selector", ".content").text == WHO
    assert console_errors(browser) == []


def test_reasoning_is_folded(browser, demo):
    open_fresh(browser, demo)
    browser.find_element("id", "thinking").click()
    ask(browser, "What does the word river mean?")
    wait_for(lambda: last_answer(browser) and last_answer(browser).get_attribute("data-outcome") == "stop", 60,
             "the answer")
    details = last_answer(browser).find_element("css selector", "details.reasoning")
    assert details.get_attribute("open") is None  # folded
    assert details.get_attribute("hidden") is None
    assert browser.execute_script("return arguments[0].querySelector('div').textContent", details) == \
        'The user asks what "river" means. Its most common sense is a noun.'
    browser.find_element("id", "thinking").click()
    assert console_errors(browser) == []


def test_stop_cancels_a_long_answer(browser, demo):
    open_fresh(browser, demo)
    gen0 = demo.metric("tansy_generation_tokens_total")
    # The demo model answers briefly; ignore_eos (added to the page's request here, as an API client
    # may send it) makes it go on until stopped.
    browser.execute_script("""
        const f = window.fetch;
        window.fetch = (url, opts) => {
          if (opts && opts.body && String(url).endsWith('/v1/chat/completions'))
            opts = Object.assign({}, opts, {body: JSON.stringify(Object.assign(JSON.parse(opts.body), {ignore_eos: true}))});
          return f(url, opts);
        };""")
    ask(browser, "Tell me a fortune.", max_tokens=20000)
    wait_for(lambda: last_answer(browser) and len(last_answer(browser).text) > 200, 60, "a long partial answer")
    browser.find_element("id", "stop").click()
    wait_for(lambda: last_answer(browser).get_attribute("data-outcome") == "stopped", 10, "the stopped state")
    assert browser.find_element("id", "status").text == "stopped"
    length = len(last_answer(browser).text)
    # The server stops computing: it becomes idle and the request ends far short of max_tokens.
    wait_for(lambda: not requests.get(demo.url + "/health", timeout=5).json()["busy"], 10, "the server to be idle")
    time.sleep(0.5)
    assert len(last_answer(browser).text) == length
    assert demo.metric("tansy_generation_tokens_total") - gen0 < 10000
    assert browser.find_element("id", "send").is_enabled()
    assert console_errors(browser) == []


def test_model_text_is_never_html(browser, demo):
    # A stored conversation whose texts hold markup and markdown: rendered as text and safe elements only.
    evil = "<img src=x id=pwn onerror=\"document.title='pwned'\"> **bold** `code`\n\n```js\nalert(1) <b>x</b>\n```"
    conv = [{"role": "user", "content": "<script>document.title='pwned'</script>"},
            {"role": "assistant", "content": evil, "reasoning": "<i>think</i>",
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f<b>", "arguments": "{\"a\":\"<u>\"}"}}]}]
    browser.get(demo.url + "/")
    browser.execute_script("localStorage.setItem('tansy.messages', arguments[0])", json.dumps(conv))
    browser.get(demo.url + "/")
    wait_for(lambda: len(browser.find_elements("css selector", ".msg")) == 2, 10, "the stored conversation")
    log = browser.find_element("id", "log")
    assert browser.find_elements("id", "pwn") == []
    for tag in ["img", "script", "b", "i", "u"]:
        assert log.find_elements("css selector", tag) == [], tag
    assert browser.title != "pwned"
    answer = last_answer(browser)
    assert answer.find_element("css selector", "strong").text == "bold"
    assert answer.find_element("css selector", "p code").text == "code"
    assert answer.find_element("css selector", "pre code").text == "alert(1) <b>x</b>"
    assert "<img src=x" in answer.find_element("css selector", ".content p").text
    assert "Tool call: f<b>" in answer.find_element("css selector", "details.tool").text
    assert console_errors(browser) == []


def test_csp_blocks_inline_script(browser, demo):
    open_fresh(browser, demo)
    browser.get_log("browser")  # drain
    browser.execute_script("""
        window.__violations = [];
        document.addEventListener('securitypolicyviolation', e => window.__violations.push(e.violatedDirective));
        const s = document.createElement('script');
        s.textContent = 'window.__inline_ran = true';
        document.body.appendChild(s);
        const t = document.createElement('style');
        t.textContent = 'body { background: red; }';
        document.head.appendChild(t);""")
    wait_for(lambda: browser.execute_script("return window.__violations.length") >= 2, 5, "CSP violations")
    assert browser.execute_script("return window.__inline_ran === undefined")
    assert browser.execute_script("return getComputedStyle(document.body).backgroundColor") != "rgb(255, 0, 0)"
    assert set(browser.execute_script("return window.__violations")) >= {"script-src-elem", "style-src-elem"}
    # The console check of the other tests sees such violations.
    assert any("Content Security Policy" in e["message"] for e in console_errors(browser))


def test_screenshot(browser, demo):
    open_fresh(browser, demo)
    browser.find_element("id", "thinking").click()
    ask(browser, "What does the word river mean?")
    wait_for(lambda: last_answer(browser) and last_answer(browser).get_attribute("data-outcome") == "stop", 60,
             "the answer")
    browser.find_element("id", "thinking").click()
    ask(browser, "Hello! Who are you?")
    wait_for(lambda: len(browser.find_elements("css selector", ".msg.assistant")) == 2 and
             last_answer(browser).get_attribute("data-outcome") == "stop", 60, "the second answer")
    browser.find_element("css selector", ".msg.assistant details.reasoning summary").click()
    out = os.environ.get("TANSY_WEBCHAT_SCREENSHOT")
    if out:  # docs/webchat.png is made with TANSY_WEBCHAT_SCREENSHOT=docs/webchat.png
        browser.save_screenshot(out)
    assert browser.get_screenshot_as_png()[:8] == b"\x89PNG\r\n\x1a\n"
    assert console_errors(browser) == []


def test_tool_calls_shown(browser, server):
    # The tiny scripted model (conftest's server): with thinking on it reasons, then calls get_weather.
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    browser.get_log("browser")
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server.url + "/")
    wait_for(lambda: browser.find_element("id", "model").text == "tiny", 30, "the model name")
    browser.find_element("css selector", "#toolbox summary").click()
    browser.find_element("id", "tools").send_keys(json.dumps([tool]))
    browser.find_element("id", "thinking").click()
    ask(browser, "Weather in Paris?", max_tokens=200)
    wait_for(lambda: last_answer(browser) and last_answer(browser).get_attribute("data-outcome") == "tool_calls", 60,
             "the tool call")
    call = last_answer(browser).find_element("css selector", "details.tool")
    assert call.find_element("css selector", "summary").text == "Tool call: get_weather"
    assert json.loads(call.find_element("css selector", "pre").text) == {"city": "Paris"}
    assert last_answer(browser).find_element("css selector", "details.reasoning").get_attribute("hidden") is None
    # A malformed tools field is reported, not sent.
    browser.find_element("id", "tools").send_keys("not json")
    ask(browser, "Again")
    wait_for(lambda: browser.find_elements("css selector", ".msg.error"), 10, "the error message")
    assert "Tools:" in browser.find_elements("css selector", ".msg.error")[-1].text
    assert console_errors(browser) == []


def test_api_key_field(browser, start_server, scripts):
    s = start_server("webchat-auth", "--api-key", "sekret")
    browser.get_log("browser")
    browser.get(s.url + "/")  # the page itself needs no key
    browser.execute_script("localStorage.clear()")
    browser.get(s.url + "/")
    wait_for(lambda: browser.find_element("id", "model").text == "(API key needed)", 30, "the key prompt")
    browser.get_log("browser")  # the refused /v1/models request is logged by the browser as a failed load
    key = browser.find_element("id", "apikey")
    key.send_keys("sekret")
    browser.find_element("id", "input").click()  # leaving the field stores the key and retries
    wait_for(lambda: browser.find_element("id", "model").text == "tiny", 30, "the model name")
    ask(browser, "Hi")
    wait_for(lambda: last_answer(browser) and last_answer(browser).get_attribute("data-outcome") == "stop", 60,
             "the answer")
    assert last_answer(browser).find_element("css selector", ".content").text == scripts["answer"]["text"]
    assert browser.execute_script("return JSON.parse(localStorage.getItem('tansy.apikey'))") == "sekret"
    assert console_errors(browser) == []
