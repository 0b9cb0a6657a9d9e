#include "server/server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <malloc.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>

#include "core/error.h"
#include "engine/scheduler.h"
#include "server/anthropic.h"
#include "server/chat_output.h"
#include "server/frontend.h"
#include "server/http_listener.h"
#include "server/http_policy.h"
#include "server/metrics.h"
#include "server/openai.h"
#include "server/request_log.h"
#include "server/responses.h"
#include "server/structured.h"
#include "server/tokenize_api.h"
#include "server/web.h"
#include "text/chat_template.h"

namespace tansy::server {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kMaxJsonDepth = 64;  // deeper bodies are refused before parsing: renderers recurse

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// The request's connection, watched so that a request notices its client went away while it
// computes (or waits), not only when a write fails, and the engine stops within one step. The
// listener names the socket (each connection has its own thread); the server used to find it by
// scanning /proc/self/fd for the peer's address, ~0.1 ms of every request's time to first token.
class ConnectionWatch {
 public:
  ConnectionWatch() : fd_(GuardedHttpServer::current_socket()) {}
  bool alive() const {
    if (fd_ < 0) return true;  // unknown: rely on write failures
    pollfd p{fd_, short(POLLIN | POLLRDHUP), 0};
    if (poll(&p, 1, 0) < 0) return true;
    if (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL)) return false;
    if (p.revents & POLLIN) {
      char c;
      if (recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0) return false;
    }
    return true;
  }

 private:
  int fd_ = -1;
};

// Nesting depth of a JSON text, counted outside strings.
int json_depth(std::string_view s) {
  int depth = 0, max_depth = 0;
  bool in_str = false, esc = false;
  for (char c : s) {
    if (in_str) {
      if (esc)
        esc = false;
      else if (c == '\\')
        esc = true;
      else if (c == '"')
        in_str = false;
    } else if (c == '"') {
      in_str = true;
    } else if (c == '[' || c == '{') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return max_depth;
}

Json parse_body(const std::string& body) {
  if (body.empty()) api_fail(400, "", "the request body is empty; expected a JSON object");
  if (json_depth(body) > kMaxJsonDepth)
    api_fail(400, "", fmt::format("the request body nests deeper than {} levels", kMaxJsonDepth));
  try {
    return Json::parse(body);
  } catch (const Json::exception& e) {
    api_fail(400, "", fmt::format("the request body is not valid JSON: {}", e.what()));
  }
}

std::string random_id(const char* prefix) {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard lk(mu);
  return fmt::format("{}{:016x}{:08x}", prefix, rng(), uint32_t(rng()));
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool ends_with(std::string_view s, std::string_view suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

// A request ready to run: what the engine needs and what the response needs.
struct Job {
  ApiRequest api;
  GenRequest gen;
  bool starts_in_reasoning = false;
  std::string id;
  int64_t created = 0;
  Clock::time_point arrival;
  std::string endpoint;
};

}  // namespace

struct Server::Impl {
  Engine& engine;
  ServerOptions opt;
  Scheduler sched;
  Metrics metrics;
  GuardedHttpServer http;
  HttpPolicy policy;
  int64_t started = unix_now();

  Impl(Engine& e, ServerOptions o)
      : engine(e),
        opt(std::move(o)),
        sched(e.max_running() + opt.max_queue),
        http(opt.limits),
        policy(HttpPolicyOptions{opt.host, opt.allowed_hosts, opt.allowed_origins}) {}

  // ---- preparing requests ------------------------------------------------------------------

  void check_model(const ApiRequest& r) const {
    if (r.model != opt.model_id)
      api_fail(404, "model",
               fmt::format("The model '{}' does not exist (this server serves '{}')", r.model, opt.model_id),
               "model_not_found");
  }

  void log_ignored(const ApiRequest& r) const {
    if (r.ignored_fields.empty()) return;
    std::string names;
    for (auto& f : r.ignored_fields) names += (names.empty() ? "" : ", ") + log_escape(f);
    request_note().detail += " ignored fields outside the OpenAI schema: " + names + ";";
  }

  // Fills max_tokens and checks the context limit.
  void fit_context(Job& j, std::optional<int> max_tokens, const char* what) const {
    const int64_t n = int64_t(j.gen.prompt.size()), limit = engine.options().max_seq;
    if (n == 0) api_fail(400, what, "the prompt is empty after tokenization");
    const int64_t want = max_tokens ? *max_tokens : limit - n;
    if (n + std::max<int64_t>(want, 1) > limit)
      api_fail(
          400, what,
          fmt::format(
              "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in "
              "the {}, {} in the completion). Please reduce the length of the {} or completion.",
              limit, n + std::max<int64_t>(want, 1), n, what, std::max<int64_t>(want, 1), what),
          "context_length_exceeded");
    j.gen.max_tokens = int(want);
  }

  void fill_sampling(Job& j) const {
    j.gen.sampling = j.api.sampling;
    j.gen.stop = j.api.stop;
    j.gen.logprobs = j.api.logprobs;
    j.gen.ignore_eos = j.api.ignore_eos;
    j.gen.deadline = j.arrival + std::chrono::microseconds(int64_t(opt.request_timeout_s * 1e6));
  }

  Job prepare_chat(const Json& body) const {
    Job j;
    j.arrival = Clock::now();
    j.endpoint = "/v1/chat/completions";
    j.api = parse_chat_request(body, opt.defaults, engine.config().vocab_size);
    check_model(j.api);
    log_ignored(j.api);
    text::RenderedPrompt rendered;
    try {
      rendered = (opt.chat_template ? *opt.chat_template : text::ChatTemplate::qwen36()).render(j.api.render);
    } catch (const Error& e) {
      api_fail(400, "messages", e.what());
    }
    const Tokenizer& tok = engine.tokenizer();
    j.gen.prompt = text::encode_prompt(tok, rendered, opt.special_tokens_in_content_parse);
    const std::string& prompt = rendered.text;
    fit_context(j, j.api.max_tokens, "messages");
    fill_sampling(j);
    j.starts_in_reasoning = ends_with(prompt, "<think>\n");
    // Cache the state at the start of the assistant turn: the next request of this conversation
    // shares everything before it, while the turn itself is re-rendered (reasoning dropped).
    if (auto im_start = tok.token_id("<|im_start|>")) {
      for (size_t i = j.gen.prompt.size(); i-- > 0;)
        if (j.gen.prompt[i] == *im_start) {
          j.gen.cache_cut = i;
          break;
        }
    }
    if (j.api.tool_choice == ToolChoice::kRequired || j.api.tool_choice == ToolChoice::kNamed) {
      // Without constrained decoding, a call is guaranteed by writing its opening ourselves
      // once the reasoning is over; the model fills in the function (name) and arguments.
      std::string open = j.api.tool_choice == ToolChoice::kNamed
                             ? "<tool_call>\n<function=" + j.api.tool_name + ">\n"
                             : std::string("<tool_call>\n<function=");
      if (j.starts_in_reasoning) {
        auto end_think = tok.token_id("</think>");
        if (!end_think) api_fail(500, "", "the tokenizer has no </think> token");
        j.gen.force_trigger = *end_think;
        open = "\n\n" + open;
      }
      j.gen.forced = tok.encode(open, true);
    }
    // Structured output (response_format, forced or strict tool calls): the grammar takes over
    // after the reasoning; the forced opening above is part of what it allows.
    j.gen.constraint = chat_constraint(j.api, tok, engine.eos_ids(), j.starts_in_reasoning, j.gen.max_tokens);
    j.id = random_id("chatcmpl-");
    j.created = unix_now();
    return j;
  }

  Job prepare_completion(const Json& body) const {
    Job j;
    j.arrival = Clock::now();
    j.endpoint = "/v1/completions";
    j.api = parse_completion_request(body, opt.defaults, engine.config().vocab_size);
    check_model(j.api);
    log_ignored(j.api);
    j.gen.prompt = j.api.prompt_text ? engine.tokenizer().encode(*j.api.prompt_text, true) : j.api.prompt_ids;
    // An empty prompt (which OpenAI accepts) starts from a document boundary, as its models do.
    if (j.gen.prompt.empty())
      if (auto eot = engine.tokenizer().token_id("<|endoftext|>")) j.gen.prompt.push_back(*eot);
    fit_context(j, j.api.max_tokens, "prompt");
    fill_sampling(j);
    // A repeated or extended prompt resumes after all but its last token (which must be fed
    // again for its logits).
    j.gen.cache_cut = j.gen.prompt.size() - 1;
    j.gen.constraint = completion_constraint(j.api, engine.tokenizer(), engine.eos_ids(), j.gen.max_tokens);
    j.id = random_id("cmpl-");
    j.created = unix_now();
    return j;
  }

  // ---- running ---------------------------------------------------------------------------

  // Runs a job: it waits for a place in the engine, then on_start runs (false: the client left),
  // then on_step sees every step (after metrics are recorded). Throws ApiError when time ran out
  // before it got a place.
  GenResult execute(Job& j, const ConnectionWatch& watch, const std::function<bool(const GenStep&)>& on_step,
                    const std::function<bool()>& on_start = {}) {
    j.gen.cancelled = [&watch] { return !watch.alive(); };
    bool first = true;
    Clock::time_point last{};
    GenResult r = engine.generate(
        j.gen,
        [&](const GenStep& s) {
          if (s.token >= 0) {
            auto now = Clock::now();
            if (first)
              metrics.time_to_first_token(std::chrono::duration<double>(now - j.arrival).count());
            else
              metrics.inter_token_latency(std::chrono::duration<double>(now - last).count());
            first = false;
            last = now;
          }
          return on_step(s);
        },
        on_start);
    if (!r.admitted && r.finish == Finish::kTimeout)
      api_fail(503, "",
               fmt::format("timed out after {} s waiting for earlier requests", opt.request_timeout_s),
               "timeout");
    metrics.tokens(r.prompt_tokens, r.completion_tokens);
    metrics.request_duration(std::chrono::duration<double>(Clock::now() - j.arrival).count());
    return r;
  }

  Json usage(const GenResult& r) const {
    return {{"prompt_tokens", r.prompt_tokens},
            {"completion_tokens", r.completion_tokens},
            {"total_tokens", r.prompt_tokens + r.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", r.cached_tokens}}}};
  }

  std::string token_text(int32_t id) const { return utf8_lossy(engine.tokenizer().token_bytes(id)); }

  Json chat_logprob(int32_t id, const LogprobInfo& lp) const {
    auto entry = [&](int32_t t, float l) {
      std::string bytes = engine.tokenizer().token_bytes(t);
      Json b = Json::array();
      for (unsigned char c : bytes) b.push_back(int(c));
      return Json{{"token", utf8_lossy(bytes)}, {"logprob", l}, {"bytes", b}};
    };
    Json e = entry(id, lp.logprob);
    e["top_logprobs"] = Json::array();
    for (auto& t : lp.top) e["top_logprobs"].push_back(entry(t.id, t.logprob));
    return e;
  }

  // Completions' legacy logprobs layout, for a run of tokens starting at text offset `offset`.
  struct LegacyLogprobs {
    Json tokens = Json::array(), token_logprobs = Json::array(), top = Json::array(), offsets = Json::array();
    void add(const Impl& s, int32_t id, const LogprobInfo& lp, size_t offset) {
      tokens.push_back(s.token_text(id));
      token_logprobs.push_back(lp.logprob);
      Json t = Json::object();
      for (auto& x : lp.top) t[s.token_text(x.id)] = x.logprob;
      top.push_back(t);
      offsets.push_back(offset);
    }
    bool empty() const { return tokens.empty(); }
    Json take() {
      Json j{{"tokens", tokens},
             {"token_logprobs", token_logprobs},
             {"top_logprobs", top},
             {"text_offset", offsets}};
      *this = LegacyLogprobs{};
      return j;
    }
  };

  std::string chat_finish_reason(const Job&, const GenResult& r, const ChatOutput& out) const {
    if (r.finish == Finish::kLength) return "length";
    // A named function's call is forced through its schema: a complete call, so "tool_calls".
    if (out.has_tool_calls()) return "tool_calls";
    return "stop";
  }

  void check_outcome(const GenResult& r) const {
    if (r.finish == Finish::kTimeout)
      api_fail(504, "", fmt::format("the request did not finish within {} s", opt.request_timeout_s),
               "timeout");
  }

  // ---- non-streaming ---------------------------------------------------------------------

  Json run_chat(Job& j, const ConnectionWatch& watch, GenResult& r) {
    ChatOutput out(j.starts_in_reasoning, j.api.render.tools, j.id);
    Json lps = Json::array();
    r = execute(j, watch, [&](const GenStep& s) {
      out.push(s.text);
      if (s.logprobs) lps.push_back(chat_logprob(s.token, *s.logprobs));
      return true;
    });
    if (r.finish == Finish::kCancelled) return nullptr;
    check_outcome(r);
    out.finish();
    Json choice{{"index", 0},
                {"message", out.message()},
                {"logprobs", nullptr},
                {"finish_reason", chat_finish_reason(j, r, out)}};
    if (j.gen.logprobs >= 0) choice["logprobs"] = Json{{"content", lps}, {"refusal", nullptr}};
    if (!r.stop_string.empty()) choice["stop_reason"] = r.stop_string;
    return Json{{"id", j.id},
                {"object", "chat.completion"},
                {"created", j.created},
                {"model", opt.model_id},
                {"choices", {choice}},
                {"usage", usage(r)},
                {"system_fingerprint", fingerprint()}};
  }

  Json run_completion(Job& j, const ConnectionWatch& watch, GenResult& r) {
    std::string text;
    LegacyLogprobs lps;
    r = execute(j, watch, [&](const GenStep& s) {
      if (s.logprobs) lps.add(*this, s.token, *s.logprobs, text.size());
      text += s.text;
      return true;
    });
    if (r.finish == Finish::kCancelled) return nullptr;
    check_outcome(r);
    Json choice{{"index", 0},
                {"text", text},
                {"logprobs", nullptr},
                {"finish_reason", r.finish == Finish::kLength ? "length" : "stop"}};
    if (j.gen.logprobs >= 0) choice["logprobs"] = lps.take();
    if (!r.stop_string.empty()) choice["stop_reason"] = r.stop_string;
    return Json{{"id", j.id},
                {"object", "text_completion"},
                {"created", j.created},
                {"model", opt.model_id},
                {"choices", {choice}},
                {"usage", usage(r)},
                {"system_fingerprint", fingerprint()}};
  }

  std::string fingerprint() const { return "tansy-" + engine.model().backend_plan(); }

  // ---- streaming -------------------------------------------------------------------------

  // Writes server-sent events; remembers whether the client is still reading.
  struct SseWriter {
    httplib::DataSink& sink;
    ChatFrontend* frontend = nullptr;  // another API: chunks are translated into its events
    bool ok = true;
    bool event(const Json& j) { return raw(frontend ? frontend->chunk(j) : "data: " + dump(j) + "\n\n"); }
    bool done() { return raw(frontend ? frontend->done() : std::string("data: [DONE]\n\n")); }
    bool error(const ApiError& e) {
      if (frontend) return raw(frontend->error(e));
      return raw("data: " + e.body() + "\n\n") && done();
    }
    bool raw(const std::string& s) {
      if (ok && !s.empty()) ok = sink.write(s.data(), s.size());
      return ok;
    }
  };

  Json chunk_base(const Job& j) const {
    Json c{{"id", j.id},
           {"object", j.api.chat ? "chat.completion.chunk" : "text_completion"},
           {"created", j.created},
           {"model", opt.model_id},
           {"system_fingerprint", fingerprint()}};
    return c;
  }

  void stream_job(Job& j, const ConnectionWatch& watch, SseWriter& w, int& status) {
    GenResult r;
    // Every way out (the client leaving mid-stream included) records the outcome for the log.
    struct Outcome {
      const Job& j;
      const GenResult& r;
      const SseWriter& w;
      int& status;
      ~Outcome() {
        if (!w.ok) status = 499;
        request_note().status = status;
        request_note().detail += fmt::format(" {} stream prompt {} (cached {}) completion {} finish {}", j.id,
                                             r.prompt_tokens, r.cached_tokens, r.completion_tokens,
                                             status == 499 ? "cancelled" : finish_name(r.finish));
      }
    } outcome{j, r, w, status};
    try {
      auto emit = [&](Json choice) {
        Json c = chunk_base(j);
        c["choices"] = Json::array({std::move(choice)});
        if (j.api.include_usage) c["usage"] = nullptr;
        return w.event(c);
      };
      if (j.api.chat) {
        ChatOutput out(j.starts_in_reasoning, j.api.render.tools, j.id);
        Json pending_lps = Json::array();
        auto send_deltas = [&](const std::vector<Json>& deltas) {
          for (auto& d : deltas) {
            Json choice{{"index", 0}, {"delta", d}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
            if (!pending_lps.empty()) {
              choice["logprobs"] = Json{{"content", pending_lps}, {"refusal", nullptr}};
              pending_lps = Json::array();
            }
            if (!emit(choice)) return false;
          }
          return true;
        };
        // The role goes out once the request has a place in the engine.
        auto role = [&] {
          return emit(Json{{"index", 0},
                           {"delta", {{"role", "assistant"}, {"content", ""}}},
                           {"logprobs", nullptr},
                           {"finish_reason", nullptr}});
        };
        r = execute(
            j, watch,
            [&](const GenStep& s) {
              if (s.logprobs) pending_lps.push_back(chat_logprob(s.token, *s.logprobs));
              return send_deltas(out.push(s.text));
            },
            role);
        if (r.finish == Finish::kCancelled) {
          status = 499;
          return;
        }
        check_outcome(r);
        if (!send_deltas(out.finish())) return;
        Json last{{"index", 0},
                  {"delta", Json::object()},
                  {"logprobs", nullptr},
                  {"finish_reason", chat_finish_reason(j, r, out)}};
        if (!pending_lps.empty()) last["logprobs"] = Json{{"content", pending_lps}, {"refusal", nullptr}};
        if (!r.stop_string.empty()) last["stop_reason"] = r.stop_string;
        if (!emit(last)) return;
      } else {
        LegacyLogprobs lps;
        size_t offset = 0;
        auto text_choice = [&](const std::string& text, Json finish) {
          Json choice{{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish}};
          if (!lps.empty()) choice["logprobs"] = lps.take();
          return choice;
        };
        r = execute(j, watch, [&](const GenStep& s) {
          if (s.logprobs) lps.add(*this, s.token, *s.logprobs, offset);
          offset += s.text.size();
          if (s.text.empty()) return true;  // logprobs travel with the next text
          return emit(text_choice(s.text, nullptr));
        });
        if (r.finish == Finish::kCancelled) {
          status = 499;
          return;
        }
        check_outcome(r);
        Json last = text_choice("", r.finish == Finish::kLength ? "length" : "stop");
        if (!r.stop_string.empty()) last["stop_reason"] = r.stop_string;
        if (!emit(last)) return;
      }
      if (j.api.include_usage) {
        Json c = chunk_base(j);
        c["choices"] = Json::array();
        c["usage"] = usage(r);
        if (!w.event(c)) return;
      }
      w.done();
    } catch (const ApiError& e) {
      status = e.status;
      w.error(e);
    } catch (const std::exception& e) {
      status = 500;
      request_note().detail += " internal error: " + log_escape(e.what());
      w.error(ApiError(500, fmt::format("internal error: {}", e.what())));
    }
  }

  // ---- HTTP plumbing ---------------------------------------------------------------------

  void send_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    if (e.status == 503) res.set_header("Retry-After", "1");
    res.set_content(e.body(), "application/json");
  }

  void handle_generate(const httplib::Request& req, httplib::Response& res, bool chat) {
    const char* endpoint = chat ? "/v1/chat/completions" : "/v1/completions";
    std::shared_ptr<Job> job;
    try {
      Json body = parse_body(req.body);
      job = std::make_shared<Job>(chat ? prepare_chat(body) : prepare_completion(body));
      std::shared_ptr<Scheduler::Ticket> ticket = sched.enqueue();
      if (!ticket)
        api_fail(503, "",
                 fmt::format("the server is busy ({} requests are waiting); retry later", opt.max_queue),
                 "queue_full");
      auto watch = std::make_shared<ConnectionWatch>();
      if (job->api.stream) {
        res.set_header("Cache-Control", "no-cache");
        res.set_header("X-Accel-Buffering", "no");
        res.set_chunked_content_provider("text/event-stream",
                                         [this, job, ticket, watch](size_t, httplib::DataSink& sink) {
                                           SseWriter w{sink};
                                           int status = 200;
                                           stream_job(*job, *watch, w, status);
                                           metrics.request_done(job->endpoint, status);
                                           if (w.ok) sink.done();
                                           return w.ok;
                                         });
        return;  // counted when the stream ends
      }
      GenResult r;
      Json out = chat ? run_chat(*job, *watch, r) : run_completion(*job, *watch, r);
      if (out.is_null()) {  // the client left: nobody reads this
        send_error(res, ApiError(499, "client closed the request"));
        metrics.request_done(endpoint, 499);
        request_note().detail += fmt::format(" {} prompt {} (cached {}) completion {} finish cancelled",
                                             job->id, r.prompt_tokens, r.cached_tokens, r.completion_tokens);
        return;
      }
      res.set_content(dump(out), "application/json");
      metrics.request_done(endpoint, 200);
      request_note().detail +=
          fmt::format(" {} prompt {} (cached {}) completion {} finish {}", job->id, r.prompt_tokens,
                      r.cached_tokens, r.completion_tokens, finish_name(r.finish));
    } catch (const ApiError& e) {
      send_error(res, e);
      metrics.request_done(endpoint, e.status);
      request_note().detail += " " + log_escape(e.what());
    }
  }

  // ---- other APIs on the chat path (Anthropic Messages, OpenAI Responses) -----------------

  Job prepare_frontend(const Json& body, ChatFrontend& fe) const {
    Job j = prepare_chat(fe.chat_body(body));
    j.endpoint = fe.endpoint();
    j.id = fe.make_id(random_id("").substr(0, 24));
    fe.prompt_tokens = int(j.gen.prompt.size());
    if (!fe.ignored_fields.empty()) {
      std::string names;
      for (auto& f : fe.ignored_fields) names += (names.empty() ? "" : ", ") + log_escape(f);
      request_note().detail += " ignored fields outside its schema: " + names + ";";
    }
    if (fe.thinking_budget >= 0 && j.starts_in_reasoning) {
      const Tokenizer& tok = engine.tokenizer();
      auto end_think = tok.token_id("</think>");
      if (!end_think) api_fail(500, "", "the tokenizer has no </think> token");
      if (!j.gen.force_trigger) j.gen.force_trigger = *end_think;  // tool_choice may have set it already
      j.gen.trigger_budget = fe.thinking_budget;
      j.gen.budget_forced = tok.encode("\n</think>", true);
    }
    return j;
  }

  void handle_frontend(const httplib::Request& req, httplib::Response& res,
                       std::shared_ptr<ChatFrontend> fe) {
    const std::string endpoint = fe->endpoint();
    auto fail = [&](const ApiError& e) {
      res.status = fe->error_status(e);
      res.set_content(fe->error_body(e), "application/json");
      metrics.request_done(endpoint, res.status);
      request_note().detail += fmt::format(" {}", log_escape(e.what()));
    };
    try {
      Json body = parse_body(req.body);
      auto job = std::make_shared<Job>(prepare_frontend(body, *fe));
      std::shared_ptr<Scheduler::Ticket> ticket = sched.enqueue();
      if (!ticket)
        api_fail(503, "",
                 fmt::format("the server is busy ({} requests are waiting); retry later", opt.max_queue),
                 "queue_full");
      auto watch = std::make_shared<ConnectionWatch>();
      if (fe->stream()) {
        res.set_header("Cache-Control", "no-cache");
        res.set_header("X-Accel-Buffering", "no");
        res.set_chunked_content_provider("text/event-stream",
                                         [this, job, ticket, watch, fe](size_t, httplib::DataSink& sink) {
                                           SseWriter w{sink, fe.get()};
                                           int status = 200;
                                           stream_job(*job, *watch, w, status);
                                           metrics.request_done(job->endpoint, status);
                                           if (w.ok) sink.done();
                                           return w.ok;
                                         });
        return;
      }
      GenResult r;
      Json out = run_chat(*job, *watch, r);
      if (out.is_null()) {  // the client left: nobody reads this
        fail(ApiError(499, "client closed the request"));
        request_note().detail += fmt::format(" {} prompt {} (cached {}) completion {} finish cancelled",
                                             job->id, r.prompt_tokens, r.cached_tokens, r.completion_tokens);
        return;
      }
      res.set_content(dump(fe->response(out)), "application/json");
      metrics.request_done(endpoint, 200);
      request_note().detail +=
          fmt::format(" {} prompt {} (cached {}) completion {} finish {}", job->id, r.prompt_tokens,
                      r.cached_tokens, r.completion_tokens, finish_name(r.finish));
    } catch (const ApiError& e) {
      fail(e);
    }
  }

  // Anthropic's /v1/messages/count_tokens: the prompt /v1/messages would run, counted.
  void handle_count_tokens(const httplib::Request& req, httplib::Response& res) {
    try {
      Json chat = anthropic_count_tokens_body(parse_body(req.body));
      Job j = prepare_chat(chat);
      res.set_content(dump(Json{{"input_tokens", j.gen.prompt.size()}}), "application/json");
      metrics.request_done("/v1/messages/count_tokens", 200);
    } catch (const ApiError& e) {
      res.status = anthropic_status(e.status);
      res.set_content(anthropic_error_body(e.status, e.what()), "application/json");
      metrics.request_done("/v1/messages/count_tokens", res.status);
    }
  }

  void handle_tokenize(const httplib::Request& req, httplib::Response& res, bool encode) {
    const char* endpoint = encode ? "/tokenize" : "/detokenize";
    try {
      Json body = parse_body(req.body);
      TokenizeContext ctx{engine.tokenizer(), opt.model_id, engine.options().max_seq, opt.defaults};
      res.set_content(dump(encode ? tokenize_request(body, ctx) : detokenize_request(body, ctx)),
                      "application/json");
      metrics.request_done(endpoint, 200);
    } catch (const ApiError& e) {
      send_error(res, e);
      metrics.request_done(endpoint, e.status);
    }
  }

  static bool anthropic_path(const std::string& path) { return path.rfind("/v1/messages", 0) == 0; }

  bool authorized(const httplib::Request& req) const {
    if (opt.api_key.empty()) return true;
    // Constant time in the key's length, so response timing does not reveal a matching prefix.
    auto same = [](const std::string& want, const std::string& got) {
      unsigned diff = got.size() != want.size();
      for (size_t i = 0; i < want.size(); ++i)
        diff |= unsigned(want[i]) ^ unsigned(i < got.size() ? got[i] : 0);
      return diff == 0;
    };
    // Anthropic's clients send the key as x-api-key.
    return same("Bearer " + opt.api_key, req.get_header_value("Authorization")) ||
           (req.has_header("x-api-key") && same(opt.api_key, req.get_header_value("x-api-key")));
  }

  Json model_card() const {
    return {{"id", opt.model_id},
            {"object", "model"},
            {"created", started},
            {"owned_by", "tansy"},
            {"max_model_len", engine.options().max_seq},
            {"sampling_defaults", sampling_defaults()}};
  }

  Json sampling_defaults() const {
    const SamplingParams& d = opt.defaults;
    return {{"temperature", d.temperature},
            {"top_p", d.top_p},
            {"top_k", d.top_k},
            {"min_p", d.min_p},
            {"presence_penalty", d.presence_penalty},
            {"frequency_penalty", d.frequency_penalty},
            {"repetition_penalty", d.repetition_penalty}};
  }

  // Registers a handler and its method with the policy (405 with Allow, CORS preflights).
  void route(const std::string& method, const std::string& pattern, httplib::Server::Handler h) {
    policy.add_route(method, pattern);
    if (method == "GET")
      http.Get(pattern, std::move(h));
    else if (method == "POST")
      http.Post(pattern, std::move(h));
    else
      fail("route {}: unsupported method {}", pattern, method);
  }

  void setup() {
    http.set_payload_max_length(opt.max_body_bytes);
    http.on_refused = [](const std::string& why) { log_line("tansy serve: " + log_escape(why)); };
    // Every request, whatever its route (those added later included), passes the browser-safety
    // policy and then the API key check before its body is read.
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      request_note() = RequestNote{Clock::now(), 0, ""};
      if (auto refusal = policy.check(req, res)) {
        res.status = refusal->status;
        if (!refusal->message.empty())
          res.set_content(anthropic_path(req.path)
                              ? anthropic_error_body(refusal->status, refusal->message)
                              : ApiError(refusal->status, refusal->message, "", refusal->code).body(),
                          "application/json");
        metrics.request_done(req.path, refusal->status);
        return httplib::Server::HandlerResponse::Handled;
      }
      if ((req.path.rfind("/v1/", 0) == 0 || req.path == "/tokenize" || req.path == "/detokenize") &&
          !authorized(req)) {
        ApiError e(401,
                   "Incorrect or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                   "", "invalid_api_key");
        send_error(res, e);
        if (anthropic_path(req.path))
          res.set_content(anthropic_error_body(401, e.what()), "application/json");
        metrics.unauthorized();
        return httplib::Server::HandlerResponse::Handled;
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    http.set_logger([](const httplib::Request& req, const httplib::Response& res) {
      RequestNote& n = request_note();
      const int status = n.status ? n.status : res.status;
      const double ms = n.start == Clock::time_point{}
                            ? 0
                            : std::chrono::duration<double, std::milli>(Clock::now() - n.start).count();
      log_line(fmt::format("{} {} {}{}{} {:.0f} ms from {}", log_escape(req.method), log_escape(req.path),
                           status, status == 499 ? " cancelled" : "", n.detail, ms,
                           log_escape(req.remote_addr)));
      n = RequestNote{};
    });
    http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      std::string msg =
          res.status == 413 ? fmt::format("the request body exceeds {} bytes", opt.max_body_bytes)
          : res.status == 404
              ? fmt::format("no route for {} {}", log_escape(req.method), log_escape(req.path))
          : res.status == 405
              ? fmt::format("method {} is not allowed on {}", log_escape(req.method), log_escape(req.path))
              : fmt::format("HTTP error {}", res.status);
      res.set_content(
          anthropic_path(req.path) ? anthropic_error_body(res.status, msg) : ApiError(res.status, msg).body(),
          "application/json");
      metrics.request_done("other", res.status);
    });
    http.set_exception_handler(
        [this](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
          std::string what = "unknown exception";
          try {
            std::rethrow_exception(ep);
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          request_note().detail += " internal error: " + log_escape(what);
          res.status = 500;
          res.set_content(anthropic_path(req.path) ? anthropic_error_body(500, "internal error: " + what)
                                                   : ApiError(500, "internal error: " + what).body(),
                          "application/json");
          metrics.request_done(req.path, 500);
        });

    route("POST", "/v1/chat/completions",
          [this](const httplib::Request& req, httplib::Response& res) { handle_generate(req, res, true); });
    route("POST", "/v1/completions",
          [this](const httplib::Request& req, httplib::Response& res) { handle_generate(req, res, false); });
    // ---- other APIs (anthropic.h, responses.h, tokenize_api.h, web.h) ----
    route("POST", "/v1/messages", [this](const httplib::Request& req, httplib::Response& res) {
      handle_frontend(req, res, make_anthropic_frontend());
    });
    route("POST", "/v1/messages/count_tokens",
          [this](const httplib::Request& req, httplib::Response& res) { handle_count_tokens(req, res); });
    route("POST", "/v1/responses", [this](const httplib::Request& req, httplib::Response& res) {
      handle_frontend(req, res, make_responses_frontend());
    });
    route("POST", "/tokenize",
          [this](const httplib::Request& req, httplib::Response& res) { handle_tokenize(req, res, true); });
    route("POST", "/detokenize",
          [this](const httplib::Request& req, httplib::Response& res) { handle_tokenize(req, res, false); });
    add_web_routes(
        [this](const char* path, httplib::Server::Handler h) { route("GET", path, std::move(h)); });
    // ---- end of other APIs ----
    route("GET", "/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(dump(Json{{"object", "list"}, {"data", {model_card()}}}), "application/json");
      metrics.request_done("/v1/models", 200);
    });
    route("GET", R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
      if (req.matches[1] != opt.model_id) {
        send_error(res, ApiError(404, fmt::format("The model '{}' does not exist", req.matches[1].str()),
                                 "model", "model_not_found"));
        metrics.request_done("/v1/models", 404);
        return;
      }
      res.set_content(dump(model_card()), "application/json");
      metrics.request_done("/v1/models", 200);
    });
    route("GET", "/health", [this](const httplib::Request&, httplib::Response& res) {
      const Engine::Load l = engine.load();
      res.set_content(dump(Json{{"status", "ok"},
                                {"model", opt.model_id},
                                {"queue", l.waiting},
                                {"busy", l.running > 0},
                                {"running", l.running},
                                {"waiting", l.waiting},
                                {"max_running", engine.max_running()},
                                {"pool", {{"states", engine.pool_states()}, {"used", l.states_used}}}}),
                      "application/json");
    });
    route("GET", "/metrics", [this](const httplib::Request&, httplib::Response& res) {
      Metrics::Snapshot s;
      const Engine::Load l = engine.load();
      s.queue_waiting = l.waiting;
      s.running = l.running;
      s.max_running = engine.max_running();
      s.pool_states = engine.pool_states();
      s.pool_used = l.states_used;
      s.engine_steps = l.steps;
      auto c = engine.cache_stats();
      s.cache_hits = c.hits;
      s.cache_misses = c.misses;
      s.cache_tokens = c.cached_tokens;
      s.cache_entries = c.entries;
      s.cache_capacity = c.capacity;
      s.cache_evictions = c.evictions;
      s.cache_bytes = c.bytes;
      res.set_content(metrics.render(s), "text/plain; version=0.0.4; charset=utf-8");
    });
  }
};

Server::Server(Engine& engine, ServerOptions opt) : impl_(std::make_unique<Impl>(engine, std::move(opt))) {
  impl_->setup();
}

Server::~Server() = default;

void Server::run() {
  Impl& s = *impl_;
  // glibc gives threads that allocate concurrently arenas of their own (up to 8 per core) and
  // keeps what they free; with a thread per connection that grew the resident size by tens of MB
  // per few thousand requests (tests/api/test_soak.py: +26 MB over 4,935 requests with the tiny
  // model, +0-1 MB with 2 arenas), a growth that flattens once every arena is large. Two arenas are
  // plenty for the server's allocations; MALLOC_ARENA_MAX in the environment still decides.
  if (!std::getenv("MALLOC_ARENA_MAX")) mallopt(M_ARENA_MAX, 2);
  const int port = s.http.bind_exclusive(s.opt.host, s.opt.port);
  log_line(fmt::format(
      "tansy serve: listening on http://{}:{} (model '{}', {} backend, context {} tokens, prefix cache "
      "{} entries{}, queue {})",
      s.opt.host, port, s.opt.model_id, s.engine.model().backend_plan(), s.engine.options().max_seq,
      s.engine.cache_stats().capacity,
      s.engine.options().prefix_cache_entries == kPrefixCacheAuto ? " (auto)" : "", s.opt.max_queue));
  log_line("tansy serve: " + s.engine.describe_capacity());
  log_line("tansy serve: sampling defaults: " + s.opt.defaults_source);
  const ConnectionLimits& l = s.opt.limits;
  log_line(fmt::format(
      "tansy serve: connections: at most {} ({} per client address); request head within {} s, body within "
      "{} "
      "s; idle keep-alive {} s; allowed origins: {}",
      l.max_connections, l.max_per_client, l.header_timeout_s, l.body_timeout_s, l.idle_timeout_s,
      s.opt.allowed_origins.empty() ? "none"
                                    : log_escape(fmt::format("{}", fmt::join(s.opt.allowed_origins, ", ")))));
  s.http.serve();
}

void Server::stop() { impl_->http.stop_serving(); }

}  // namespace tansy::server
