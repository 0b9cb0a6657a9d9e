// tansy synth: writes a synthetic checkpoint (real tensor layout, random values) for benchmarks
// and full-size tests, with a synthetic tokenizer and the chat template so that tansy serve can
// load it (unless --no-tokenizer). docs/BENCHMARK.md "The weights".
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench/commands.h"
#include "bench/synth.h"
#include "cli/command.h"
#include "core/error.h"

namespace tansy::bench {

const char kSynthSummary[] =
    "write a synthetic checkpoint: --out DIR [--seed S] [--config real|FILE] [--threads N] "
    "[--shard-gb 5] [--router-skew ALPHA] [--no-tokenizer]";

int run_synth(const std::vector<std::string>& args) {
  tansy::cli::Flags f(args, {"out", "seed", "config", "threads", "shard-gb", "router-skew"},
                      {"no-tokenizer"});
  const std::string out = f.get("out");
  const std::string which = f.get("config", "real");
  tansy::SynthOptions opt;
  opt.seed = uint64_t(f.get_int("seed", 0, 0, (1L << 62)));
  opt.threads = int(f.get_int("threads", 0, 0, 4096));
  double shard_gb = f.get_double("shard-gb", 5.0);
  if (!(shard_gb > 0 && shard_gb <= 1000)) tansy::fail("--shard-gb must be in (0, 1000], got {}", shard_gb);
  opt.shard_bytes = size_t(shard_gb * 1e9);
  // Power-law expert popularity (synth.h SynthOptions::router_skew; BENCHMARK.md "Skewed routing").
  opt.router_skew = f.get_double("router-skew", 0.0);
  if (!(opt.router_skew >= 0 && opt.router_skew <= 4))
    tansy::fail("--router-skew must be in [0, 4], got {}", opt.router_skew);
  // A synthetic tokenizer (synth.h) makes the directory servable: tansy serve / chat load it.
  opt.tokenizer = !f.has("no-tokenizer");

  nlohmann::json config;
  if (which == "real") {
    config = tansy::real_model_config_json();
  } else {
    std::ifstream in(which);
    if (!in) tansy::fail("cannot open --config file '{}'", which);
    try {
      config = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      tansy::fail("--config '{}' is not valid JSON: {}", which, e.what());
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  tansy::SynthResult r = tansy::write_synthetic_checkpoint(config, out, opt);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("synth: wrote %d tensors, %.3f GB in %d shard(s) to %s in %.1f s (%.2f GB/s), seed %llu\n",
              r.tensors, double(r.data_bytes) / 1e9, r.shards, out.c_str(), s, double(r.data_bytes) / 1e9 / s,
              static_cast<unsigned long long>(opt.seed));
  if (opt.router_skew > 0)
    std::printf("synth: router skew %g: expert of popularity rank r chosen by a share of tokens ~ r^-%g\n",
                opt.router_skew, opt.router_skew);
  if (opt.tokenizer)
    std::printf(
        "synth: wrote a synthetic byte-level BPE tokenizer (%d ids) and the chat template in %.2f s\n",
        r.tokenizer_ids, r.tokenizer_s);
  return 0;
}

}  // namespace tansy::bench
