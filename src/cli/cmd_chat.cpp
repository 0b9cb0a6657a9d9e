// tansy chat: an interactive terminal chat on the engine (no HTTP). Streams the answer as it is
// generated, with the reasoning dimmed; the conversation is kept, so later turns reuse the prefix
// cache. Commands: /reset, /think on|off, /exit (other /words are answered here, never sent; "//"
// sends a message starting with "/"). Ctrl-C stops the answer being generated.
//
// On a terminal the line is read here, not by the terminal's line discipline, which silently cuts
// a line at 4,095 bytes; bracketed paste makes a multi-line paste one message.
#include <signal.h>
#include <termios.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>

#include "cli/command.h"
#include "cli/engine_setup.h"
#include "core/error.h"
#include "server/chat_output.h"
#include "text/chat_template.h"

namespace {

using tansy::text::Json;

std::atomic<bool> g_interrupted{false};

void on_sigint(int) { g_interrupted = true; }

// Reads whole lines from a terminal: no length limit, a bracketed paste (newlines included) is part
// of one line, backspace edits, Enter submits. Restores the terminal when destroyed.
class TerminalReader {
 public:
  TerminalReader() {
    if (tcgetattr(STDIN_FILENO, &saved_) != 0) return;
    termios raw = saved_;
    raw.c_lflag &= tcflag_t(~(ICANON | ECHO));
    raw.c_cc[VMIN] = 1;
    raw.c_cc[VTIME] = 0;
    if (tcsetattr(STDIN_FILENO, TCSANOW, &raw) != 0) return;
    active_ = true;
    std::fputs("\x1b[?2004h", stdout);  // bracketed paste on
    std::fflush(stdout);
  }
  ~TerminalReader() {
    if (!active_) return;
    std::fputs("\x1b[?2004l", stdout);
    std::fflush(stdout);
    tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
  }
  bool active() const { return active_; }

  // False at end of input (Ctrl-D on an empty line). Ctrl-C clears the line being typed.
  bool read_line(std::string& line) {
    line.clear();
    bool pasting = false;
    std::string esc;  // an escape sequence being read
    for (;;) {
      char c;
      ssize_t n = ::read(STDIN_FILENO, &c, 1);
      if (n < 0 && errno == EINTR) {
        if (g_interrupted.exchange(false)) {
          line.clear();
          std::fputs("^C\n> ", stdout);
          std::fflush(stdout);
        }
        continue;
      }
      if (n <= 0) return !line.empty();
      if (!esc.empty() || c == '\x1b') {
        esc += c;
        // CSI sequences end with a byte in 0x40-0x7e; ESC + another byte ends at once.
        const bool csi = esc.size() >= 2 && esc[1] == '[';
        if (esc.size() == 1 || (csi && !(c >= 0x40 && c <= 0x7e)) || (csi && esc.size() == 2)) continue;
        if (esc == "\x1b[200~") pasting = true;
        if (esc == "\x1b[201~") pasting = false;
        esc.clear();  // other keys (arrows, ...) are ignored
        continue;
      }
      if (c == '\r' || c == '\n') {
        if (pasting) {
          line += '\n';
          std::fputs("\n", stdout);
          std::fflush(stdout);
          continue;
        }
        std::fputs("\n", stdout);
        std::fflush(stdout);
        return true;
      }
      if (c == 0x04) {  // Ctrl-D
        if (line.empty()) return false;
        continue;
      }
      if (c == 0x7f || c == 0x08) {
        if (line.empty() || line.back() == '\n') continue;
        while (!line.empty() && (static_cast<unsigned char>(line.back()) & 0xC0) == 0x80) line.pop_back();
        if (!line.empty()) line.pop_back();
        std::fputs("\b \b", stdout);
        std::fflush(stdout);
        continue;
      }
      if (static_cast<unsigned char>(c) < 0x20 && c != '\t') continue;
      line += c;
      std::fputc(c, stdout);
      std::fflush(stdout);
    }
  }

 private:
  termios saved_{};
  bool active_ = false;
};

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
  sigaction(SIGINT, &sa, nullptr);  // no SA_RESTART: a read in progress sees EINTR
  std::unique_ptr<TerminalReader> term;
  if (isatty(STDIN_FILENO)) term = std::make_unique<TerminalReader>();
  auto read_line = [&](std::string& l) {
    if (term && term->active()) return term->read_line(l);
    return bool(std::getline(std::cin, l));
  };

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
    if (!read_line(line)) break;
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
    if (line.rfind("//", 0) == 0) {
      line.erase(0, 1);  // "//..." sends a message that starts with "/"
    } else if (line[0] == '/') {
      std::printf(
          "unknown command %s (commands: /reset, /think on|off, /exit; start a message with // to send "
          "a leading /)\n",
          line.substr(0, line.find_first_of(" \n")).c_str());
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
