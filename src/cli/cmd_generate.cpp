// tansy generate --model DIR --ids FILE --max-tokens N [--backend auto|cpu|cuda] [--cuda-precision
// auto|bf16|f32] Greedy continuation; prints the new ids on one line, separated by spaces.
#include <cstdio>

#include "cli/command.h"
#include "cli/engine_setup.h"
#include "cli/ids_file.h"
#include "core/error.h"
#include "model/model.h"

namespace tansy::cli {
namespace {

int run_generate(const std::vector<std::string>& args) {
  Flags f(args, {"model", "ids", "max-tokens", "backend", "cuda-precision"}, {"stop-at-eos"});
  ModelOptions opt;
  opt.backend = backend_from_flags(f);
  opt.cuda_precision = cuda_precision_from_flags(f, opt.backend, f.get("model"));
  const int n = int(f.get_int("max-tokens", -1, 1, 1 << 20));
  if (n < 0) fail("missing required option --max-tokens");
  auto ids = read_ids_file(f.get("ids"));
  auto model = open_model(f.get("model"), opt);
  check_ids(ids, model->config().vocab_size);
  auto state = model->new_state(int(ids.size()) + n);
  const bool stop_at_eos = f.has("stop-at-eos");
  const auto& eos = model->config().eos_token_ids;
  bool first = true;
  model->generate_greedy(*state, ids, n, [&](int32_t t) {
    std::printf(first ? "%d" : " %d", t);
    first = false;
    std::fflush(stdout);
    for (int e : eos)
      if (stop_at_eos && t == e) return false;
    return true;
  });
  std::printf("\n");
  return 0;
}

Register reg("generate", "greedy continuation of an id file", run_generate);

}  // namespace
}  // namespace tansy::cli
