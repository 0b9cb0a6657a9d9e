// tansy bench and tansy synth: benchmark tooling, not product code. Their drivers are in the
// tansy_bench library (bench/README.md); this file only puts them on the command line.
#include "bench/commands.h"
#include "cli/command.h"

namespace {

tansy::cli::Register bench("bench", tansy::bench::kBenchSummary, tansy::bench::run_bench);
tansy::cli::Register synth("synth", tansy::bench::kSynthSummary, tansy::bench::run_synth);

}  // namespace
