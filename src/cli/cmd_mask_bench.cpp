// `tansy mask-bench --model DIR --schemas FILE [--out FILE] [--repeat N]`: the cost of structured
// output's token masks on one core. Each case's document (written for it, valid under its schema)
// is tokenized as a model would write it and fed to a fresh constraint; every step's mask is
// timed. Cold: a new grammar runtime (empty caches), as for a schema seen the first time; warm:
// the same runtime again, as for a repeated schema. Also times schema compilation and building
// the vocabulary trie.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "core/error.h"
#include "grammar/constraint.h"
#include "grammar/json_schema.h"
#include "text/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;
using tansy::grammar::Json;

double us_since(Clock::time_point t) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
}

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(q * double(v.size() - 1) + 0.5))];
}

std::shared_ptr<tansy::grammar::Grammar> build(const Json& c) {
  namespace g = tansy::grammar;
  if (c.contains("tools")) {
    std::vector<g::ToolSpec> specs;
    for (auto& t : c["tools"]) specs.push_back({t["name"], t["parameters"], true});
    return g::tool_call_grammar(specs, g::ToolMode::kRequired);
  }
  if (c.value("json_object", false)) return g::json_object_grammar();
  return g::json_schema_grammar(c["schema"]);
}

int run(const std::vector<std::string>& args) {
  tansy::cli::Flags flags(args, {"model", "schemas", "out", "repeat"});
  const int repeat = int(flags.get_int("repeat", 3, 1, 100));
  auto tok = tansy::Tokenizer::load(flags.get("model"));
  std::ifstream in(flags.get("schemas"));
  if (!in) tansy::fail("cannot read {}", flags.get("schemas"));
  Json cases = Json::parse(in);

  auto t0 = Clock::now();
  auto vocab = tansy::grammar::Vocabulary::of(tok);
  const double vocab_ms = us_since(t0) / 1000;
  const int32_t end = *tok.token_id("<|im_end|>");
  std::vector<uint32_t> mask((size_t(tok.vocab_size()) + 31) / 32);
  std::vector<double> all_cold, all_warm, compiles;
  Json per_case = Json::array();
  fmt::print("vocabulary: {} tokens, trie {} nodes, built in {:.0f} ms\n", tok.vocab_size(),
             vocab->trie->nodes(), vocab_ms);
  fmt::print("{:<18} {:>6} {:>11} {:>12} {:>12} {:>12} {:>12}\n", "case", "tokens", "compile ms",
             "cold med us", "cold p90 us", "cold max us", "warm med us");
  for (const Json& c : cases) {
    const std::string text = c.contains("text") ? c["text"].get<std::string>() : c["doc"].dump();
    const std::vector<int32_t> ids = tok.encode(text, true);
    auto tc = Clock::now();
    auto rt = std::make_shared<tansy::grammar::Runtime>(build(c), vocab->trie);
    rt->initial();
    const double compile_ms = us_since(tc) / 1000;
    compiles.push_back(compile_ms);
    std::vector<double> cold, warm;
    for (int pass = 0; pass <= repeat; ++pass) {
      tansy::grammar::GrammarConstraint con(rt, vocab, {{end}, std::nullopt, -1});
      for (int32_t id : ids) {
        auto ts = Clock::now();
        con.fill_mask(mask);
        (pass == 0 ? cold : warm).push_back(us_since(ts));
        if (!((mask[size_t(id) >> 5] >> (id & 31)) & 1))
          tansy::fail("case {}: the document's token {} ('{}') is masked out", c["name"].get<std::string>(),
                      id, tok.token_bytes(id));
        con.accept(id);
      }
      if (!con.can_end()) tansy::fail("case {}: the document is not complete", c["name"].get<std::string>());
    }
    all_cold.insert(all_cold.end(), cold.begin(), cold.end());
    all_warm.insert(all_warm.end(), warm.begin(), warm.end());
    fmt::print("{:<18} {:>6} {:>11.2f} {:>12.1f} {:>12.1f} {:>12.0f} {:>12.1f}\n",
               c["name"].get<std::string>(), ids.size(), compile_ms, quantile(cold, 0.5), quantile(cold, 0.9),
               quantile(cold, 1.0), quantile(warm, 0.5));
    per_case.push_back(
        {{"case", c["name"]},
         {"tokens", ids.size()},
         {"compile_ms", compile_ms},
         {"cold_us",
          {{"median", quantile(cold, 0.5)}, {"p90", quantile(cold, 0.9)}, {"max", quantile(cold, 1.0)}}},
         {"warm_us",
          {{"median", quantile(warm, 0.5)}, {"p90", quantile(warm, 0.9)}, {"max", quantile(warm, 1.0)}}},
         {"states", rt->states()}});
  }
  Json out = {{"vocab_size", tok.vocab_size()},
              {"trie_nodes", vocab->trie->nodes()},
              {"vocab_build_ms", vocab_ms},
              {"threads", 1},
              {"warm_passes", repeat},
              {"cold_us",
               {{"median", quantile(all_cold, 0.5)},
                {"p90", quantile(all_cold, 0.9)},
                {"max", quantile(all_cold, 1.0)},
                {"mean",
                 [&] {
                   double s = 0;
                   for (double x : all_cold) s += x;
                   return all_cold.empty() ? 0 : s / double(all_cold.size());
                 }()}}},
              {"warm_us",
               {{"median", quantile(all_warm, 0.5)},
                {"p90", quantile(all_warm, 0.9)},
                {"max", quantile(all_warm, 1.0)}}},
              {"compile_ms", {{"median", quantile(compiles, 0.5)}, {"max", quantile(compiles, 1.0)}}},
              {"cases", per_case}};
  fmt::print(
      "all: cold median {:.1f} us (p90 {:.1f}, max {:.0f}), warm median {:.1f} us; compile median {:.2f} ms, "
      "max {:.2f} ms\n",
      quantile(all_cold, 0.5), quantile(all_cold, 0.9), quantile(all_cold, 1.0), quantile(all_warm, 0.5),
      quantile(compiles, 0.5), quantile(compiles, 1.0));
  if (flags.has("out")) {
    std::ofstream o(flags.get("out"));
    o << out.dump(2) << "\n";
    if (!o) tansy::fail("cannot write {}", flags.get("out"));
  }
  return 0;
}

tansy::cli::Register reg("mask-bench", "time structured-output token masks (--model DIR --schemas FILE)",
                         run);

}  // namespace
