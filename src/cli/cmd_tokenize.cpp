// `tansy tokenize --model DIR`: UTF-8 text on stdin (special tokens recognised) -> ids on one line.
// With --jsonl, each stdin line is a JSON string and each output line its ids: the comparison
// tests push a whole corpus through one process this way.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "core/error.h"
#include "text/tokenizer.h"

namespace {

int run(const std::vector<std::string>& args) {
  tansy::cli::Flags flags(args, {"model"}, {"jsonl"});
  auto tok = tansy::Tokenizer::load(flags.get("model"));
  auto print_ids = [](const std::vector<int32_t>& ids) {
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line += ' ';
      line += std::to_string(ids[i]);
    }
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stdout);
  };
  if (flags.has("jsonl")) {
    std::string line;
    for (size_t n = 1; std::getline(std::cin, line); ++n) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        tansy::fail("line {}: not JSON: {}", n, e.what());
      }
      if (!j.is_string()) tansy::fail("line {}: expected a JSON string", n);
      print_ids(tok.encode(j.get<std::string>()));
    }
  } else {
    std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    if (std::cin.bad()) tansy::fail("cannot read stdin");
    print_ids(tok.encode(text));
  }
  return std::fflush(stdout) == 0 ? 0 : 1;
}

tansy::cli::Register reg("tokenize", "encode stdin text to token ids (--model DIR)", run);

}  // namespace
