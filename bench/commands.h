// The benchmark tooling's two subcommands. Their drivers live in the tansy_bench library
// (bench/README.md); the tansy executable registers them (src/cli/bench_commands.cpp), so the
// product library never sees them. Flag parsing is the CLI's (cli/command.h).
#pragma once
#include <string>
#include <vector>

namespace tansy::bench {

// tansy bench: the speed contract of docs/BENCHMARK.md (bench/cmd_bench.cpp).
extern const char kBenchSummary[];
int run_bench(const std::vector<std::string>& args);

// tansy synth: writes a synthetic checkpoint (bench/cmd_synth.cpp).
extern const char kSynthSummary[];
int run_synth(const std::vector<std::string>& args);

}  // namespace tansy::bench
