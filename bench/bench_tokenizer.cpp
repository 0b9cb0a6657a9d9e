// Encoding throughput of the tokenizer on English text, one thread. The text is the license texts
// every Debian system ships (about 250 KB of English prose); TANSY_BENCH_TEXT names another file.
// The tokenizer defaults to the shared Qwen3 fixture; TANSY_TOKENIZER_DIR names another directory.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "text/tokenizer.h"

namespace fs = std::filesystem;

static std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

static std::string english_text() {
  if (const char* p = std::getenv("TANSY_BENCH_TEXT")) return read_file(p);
  std::string text;
  for (const char* name :
       {"Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1", "MPL-2.0"})
    text += read_file(fs::path("/usr/share/common-licenses") / name);
  return text;
}

static const tansy::Tokenizer& tokenizer() {
  static tansy::Tokenizer tok =
      tansy::Tokenizer::load(std::getenv("TANSY_TOKENIZER_DIR")
                                 ? fs::path(std::getenv("TANSY_TOKENIZER_DIR"))
                                 : fs::path(TANSY_SOURCE_DIR) / "tests" / "fixtures" / "qwen3-tokenizer");
  return tok;
}

static void BM_EncodeEnglish(benchmark::State& state) {
  const std::string text = english_text();
  if (text.size() < 100000) {
    state.SkipWithError("English benchmark text missing or too short");
    return;
  }
  const auto& tok = tokenizer();
  size_t tokens = 0;
  for (auto _ : state) {
    auto ids = tok.encode(text);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
  state.counters["bytes"] = double(text.size());
  state.counters["tokens"] = double(tokens);
}
BENCHMARK(BM_EncodeEnglish)->Unit(benchmark::kMillisecond);

static void BM_DecodeEnglish(benchmark::State& state) {
  const auto& tok = tokenizer();
  const std::string text = english_text();
  auto ids = tok.encode(text);
  for (auto _ : state) benchmark::DoNotOptimize(tok.decode(ids));
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(text.size()));
}
BENCHMARK(BM_DecodeEnglish)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
