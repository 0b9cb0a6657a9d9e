// Subcommands register themselves (one file each: cmd_<name>.cpp), so main.cpp never changes.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace tansy::cli {

using CommandFn = std::function<int(const std::vector<std::string>& args)>;

struct Command {
  std::string summary;
  CommandFn run;
};

std::map<std::string, Command>& registry();

struct Register {
  Register(const std::string& name, const std::string& summary, CommandFn fn) {
    registry()[name] = Command{summary, std::move(fn)};
  }
};

// Minimal flag parsing: --name value pairs and bare --switches. Unknown flags are errors.
class Flags {
 public:
  // value_flags take a value; switch_flags do not.
  Flags(const std::vector<std::string>& args, const std::vector<std::string>& value_flags,
        const std::vector<std::string>& switch_flags = {});
  bool has(const std::string& name) const;
  std::string get(const std::string& name) const;  // throws Error when missing
  std::string get(const std::string& name, const std::string& fallback) const;
  long get_int(const std::string& name, long fallback, long lo, long hi) const;
  double get_double(const std::string& name, double fallback) const;

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace tansy::cli
