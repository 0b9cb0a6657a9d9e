// `tansy detokenize --model DIR`: whitespace-separated ids on stdin -> the decoded text.
// With --jsonl, each stdin line is a JSON array of ids and each output line the text as a JSON string.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
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
  if (flags.has("jsonl")) {
    std::string line;
    for (size_t n = 1; std::getline(std::cin, line); ++n) {
      std::vector<int32_t> ids;
      try {
        for (auto& v : nlohmann::json::parse(line)) {
          if (!v.is_number_integer() ||
              !tok.is_valid(v.get<int64_t>() > INT32_MAX ? -1 : int32_t(v.get<int64_t>())))
            tansy::fail("line {}: {} is not a token id of this tokenizer", n, v.dump());
          ids.push_back(int32_t(v.get<int64_t>()));
        }
      } catch (const nlohmann::json::exception& e) {
        tansy::fail("line {}: expected a JSON array of ids: {}", n, e.what());
      }
      std::string out = nlohmann::json(tok.decode(ids)).dump() + "\n";
      std::fwrite(out.data(), 1, out.size(), stdout);
    }
    return std::fflush(stdout) == 0 ? 0 : 1;
  }
  std::string in((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  if (std::cin.bad()) tansy::fail("cannot read stdin");
  std::vector<int32_t> ids;
  auto is_space = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
  };
  for (size_t i = 0; i < in.size();) {
    if (is_space(in[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < in.size() && !is_space(in[j])) ++j;
    std::string word = in.substr(i, j - i);
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(word.c_str(), &end, 10);
    if (*end != '\0' || errno != 0 || word[0] == '+' || word[0] == '-' ||
        !tok.is_valid(v > INT32_MAX ? -1 : int32_t(v)))
      tansy::fail("'{}' is not a token id of this tokenizer (0..{})",
                  word.size() > 40 ? word.substr(0, 40) + "..." : word, tok.vocab_size() - 1);
    ids.push_back(int32_t(v));
    i = j;
  }
  std::string text = tok.decode(ids);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return std::fflush(stdout) == 0 ? 0 : 1;
}

tansy::cli::Register reg("detokenize", "decode whitespace-separated token ids from stdin (--model DIR)", run);

}  // namespace
