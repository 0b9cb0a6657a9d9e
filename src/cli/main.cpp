// tansy: one model, one GPU family. Dispatches to the registered subcommands.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "cli/command.h"
#include "core/error.h"

namespace tansy::cli {

std::map<std::string, Command>& registry() {
  static std::map<std::string, Command> r;
  return r;
}

Flags::Flags(const std::vector<std::string>& args, const std::vector<std::string>& value_flags,
             const std::vector<std::string>& switch_flags) {
  auto is_in = [](const std::vector<std::string>& v, const std::string& s) {
    for (auto& x : v)
      if (x == s) return true;
    return false;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) fail("unexpected argument '{}'", a);
    std::string name = a.substr(2), value;
    auto eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      if (!is_in(value_flags, name)) fail("unknown option --{}", name);
    } else if (is_in(value_flags, name)) {
      if (i + 1 >= args.size()) fail("option --{} needs a value", name);
      value = args[++i];
    } else if (is_in(switch_flags, name)) {
      value = "1";
    } else {
      fail("unknown option --{}", name);
    }
    values_[name] = value;
  }
}

bool Flags::has(const std::string& name) const { return values_.count(name) > 0; }

std::string Flags::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) fail("missing required option --{}", name);
  return it->second;
}

std::string Flags::get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

long Flags::get_int(const std::string& name, long fallback, long lo, long hi) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0' || errno != 0)
    fail("--{} expects an integer, got '{}'", name, it->second);
  if (v < lo || v > hi) fail("--{} must be in [{}, {}], got {}", name, lo, hi, v);
  return v;
}

double Flags::get_double(const std::string& name, double fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  char* end = nullptr;
  double v = std::strtod(it->second.c_str(), &end);
  if (it->second.empty() || *end != '\0') fail("--{} expects a number, got '{}'", name, it->second);
  return v;
}

}  // namespace tansy::cli

static void usage() {
  std::fprintf(stderr, "usage: tansy <command> [options]\n\ncommands:\n");
  for (auto& [name, cmd] : tansy::cli::registry())
    std::fprintf(stderr, "  %-12s %s\n", name.c_str(), cmd.summary.c_str());
}

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    usage();
    return argc < 2 ? 2 : 0;
  }
  auto& reg = tansy::cli::registry();
  auto it = reg.find(argv[1]);
  if (it == reg.end()) {
    std::fprintf(stderr, "tansy: unknown command '%s' (tansy --help lists them)\n", argv[1]);
    return 2;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  try {
    return it->second.run(args);
  } catch (const tansy::Error& e) {
    std::fprintf(stderr, "tansy %s: %s\n", argv[1], e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tansy %s: internal error: %s\n", argv[1], e.what());
    return 1;
  }
}
