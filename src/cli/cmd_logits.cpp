// tansy logits --model DIR --ids FILE --out FILE [--backend auto|cpu|cuda] [--cuda-precision auto|bf16|f32]
// Teacher-forced logits from an empty state: float32 [n_tokens, vocab_size], row-major, little-endian.
#include <cstdio>
#include <fstream>

#include "cli/command.h"
#include "cli/engine_setup.h"
#include "cli/ids_file.h"
#include "core/error.h"
#include "model/model.h"

namespace tansy::cli {
namespace {

int run_logits(const std::vector<std::string>& args) {
  Flags f(args, {"model", "ids", "out", "backend", "cuda-precision"});
  ModelOptions opt;
  opt.backend = backend_from_flags(f);
  opt.cuda_precision = cuda_precision_from_flags(f, opt.backend, f.get("model"));
  auto ids = read_ids_file(f.get("ids"));
  const std::string out_path = f.get("out");
  auto model = open_model(f.get("model"), opt);
  const int V = model->config().vocab_size;
  check_ids(ids, V);
  auto state = model->new_state(int(ids.size()));
  std::vector<float> logits(ids.size() * size_t(V));
  model->forward(*state, ids, logits, true);
  std::ofstream out(out_path, std::ios::binary);
  if (!out) fail("cannot write {}", out_path);
  out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * sizeof(float)));
  if (!out) fail("writing {} failed", out_path);
  return 0;
}

Register reg("logits", "teacher-forced logits of an id file (float32 [n, vocab])", run_logits);

}  // namespace
}  // namespace tansy::cli
