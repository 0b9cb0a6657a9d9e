// tansy chat: an interactive terminal chat on the engine (no HTTP). Streams the answer as it is
// generated, with the reasoning dimmed; the conversation is kept, so later turns reuse the prefix
// cache. Commands: /reset, /think on|off, /exit. Ctrl-C stops the answer being generated.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "cli/command.h"
#include "cli/engine_setup.h"
#include "core/error.h"
#include "server/chat_output.h"
#include "text/chat_template.h"

namespace {

using tansy::text::Json;

std::atomic<bool> g_interrupted{false};

void on_sigint(int) { g_interrupted = true; }

int run(const std::vector<std::string>& args) {
  std::vector<std::string> values = tansy::cli::engine_flags();
  values.insert(values.end(), {"temperature", "max-tokens", "system", "seed"});
  tansy::cli::Flags flags(args, values, {"no-think"});
  auto loaded = tansy::cli::load_engine(flags);
  tansy::Engine& engine = *loaded.engine;
  tansy::SamplingParams sampling = loaded.defaults.sampling;
  sampling.temperature = flags.get_double("temperature", sampling.temperature);
  if (sampling.temperature < 0) tansy::fail("--temperature must be >= 0");
  if (flags.has("seed")) sampling.seed = uint64_t(flags.get_int("seed", 0, 0, INT64_MAX));
  const long max_tokens = flags.get_int("max-tokens", 4096, 1, 1 << 30);
  bool think = !flags.has("no-think");

  const bool tty = isatty(STDOUT_FILENO);
  const char* dim = tty ? "\x1b[2m" : "";
  const char* plain = tty ? "\x1b[0m" : "";
  struct sigaction sa {};
  sa.sa_handler = on_sigint;
  sigaction(SIGINT, &sa, nullptr);

  Json messages = Json::array();
  if (flags.has("system")) messages.push_back({{"role", "system"}, {"content", flags.get("system")}});
  const size_t base = messages.size();
  const auto im_start = engine.tokenizer().token_id("<|im_start|>");
  std::fprintf(stderr, "tansy chat: %s (%s). /reset, /think on|off, /exit; Ctrl-C stops an answer.\n",
               loaded.dir.filename().c_str(), engine.model().backend_name().c_str());

  std::string line;
  for (;;) {
    std::fputs(tty ? "\x1b[1m> \x1b[0m" : "> ", stdout);
    std::fflush(stdout);
    g_interrupted = false;
    if (!std::getline(std::cin, line)) break;
    if (line.empty()) continue;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      messages.erase(messages.begin() + std::ptrdiff_t(base), messages.end());
      std::puts("(conversation cleared)");
      continue;
    }
    if (line == "/think on" || line == "/think off") {
      think = line == "/think on";
      std::printf("(thinking %s)\n", think ? "on" : "off");
      continue;
    }
    messages.push_back({{"role", "user"}, {"content", line}});
    tansy::text::TemplateOptions opt;
    opt.enable_thinking = think;
    tansy::text::RenderedPrompt rendered;
    try {
      rendered = loaded.chat_template->render({messages, nullptr, opt});
    } catch (const tansy::Error& e) {
      std::printf("error: %s\n", e.what());
      messages.erase(messages.end() - 1);
      continue;
    }
    const std::string& prompt = rendered.text;
    tansy::GenRequest req;
    req.prompt = tansy::text::encode_prompt(engine.tokenizer(), rendered);
    const long room = long(engine.options().max_seq) - long(req.prompt.size());
    if (room < 1) {
      std::printf("error: the conversation (%zu tokens) fills the context (%d); /reset to start over\n",
                  req.prompt.size(), engine.options().max_seq);
      messages.erase(messages.end() - 1);
      continue;
    }
    req.max_tokens = int(std::min(max_tokens, room));
    req.sampling = sampling;
    req.cancelled = [] { return g_interrupted.load(); };
    for (size_t i = req.prompt.size(); im_start && i-- > 0;)
      if (req.prompt[i] == *im_start) {
        req.cache_cut = i;
        break;
      }

    const bool starts_in_reasoning =
        prompt.size() >= 8 && prompt.compare(prompt.size() - 8, 8, "<think>\n") == 0;
    tansy::server::ChatOutput out(starts_in_reasoning, nullptr, "chat-0");
    bool in_reasoning = false;
    auto show = [&](const std::vector<Json>& deltas) {
      for (const Json& d : deltas) {
        const bool r = d.contains("reasoning_content");
        const std::string& t = d[r ? "reasoning_content" : "content"].get_ref<const std::string&>();
        if (r != in_reasoning) std::fputs(r ? dim : plain, stdout);
        if (!r && in_reasoning) std::fputs("\n", stdout);
        in_reasoning = r;
        std::fwrite(t.data(), 1, t.size(), stdout);
      }
      std::fflush(stdout);
    };
    auto t0 = std::chrono::steady_clock::now();
    tansy::GenResult res = engine.generate(req, [&](const tansy::GenStep& s) {
      show(out.push(s.text));
      return true;
    });
    show(out.finish());
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%s\n", plain);
    std::fprintf(stderr, "%s[%d prompt tokens, %d cached; %d generated in %.2f s; %s]%s\n", dim,
                 res.prompt_tokens, res.cached_tokens, res.completion_tokens, secs,
                 res.finish == tansy::Finish::kCancelled ? "interrupted" : tansy::finish_name(res.finish),
                 plain);
    Json msg = out.message();
    messages.push_back({{"role", "assistant"},
                        {"content", msg["content"].is_null() ? "" : msg["content"]},
                        {"reasoning_content", msg["reasoning_content"]}});
  }
  std::puts("");
  return 0;
}

tansy::cli::Register reg("chat", "interactive terminal chat (streams the answer, reasoning dimmed)", run);

}  // namespace
