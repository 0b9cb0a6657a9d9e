#include "cli/engine_setup.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "model/backend_choice.h"
#include "text/chat_template.h"

namespace tansy::cli {

namespace fs = std::filesystem;

const std::vector<std::string>& engine_flags() {
  static const std::vector<std::string> f = {"model",   "backend",      "cuda-precision", "threads",
                                             "max-seq", "prefix-cache", "prefill-chunk",  "max-running"};
  return f;
}

fs::path resolve_model_dir(const Flags& flags) {
  if (flags.has("model")) {
    fs::path p = flags.get("model");
    if (!fs::is_directory(p)) fail("--model {}: not a directory", p.string());
    return p;
  }
  const fs::path rel = fs::path("models") / "tansy-demo";
  std::vector<fs::path> tried = {fs::current_path() / rel};
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  // The executable lives in <repo>/build*/; look upwards from it.
  for (fs::path d = ec ? fs::path() : exe.parent_path(); !d.empty() && d != d.root_path();
       d = d.parent_path())
    tried.push_back(d / rel);
  for (auto& p : tried)
    if (fs::is_directory(p)) return p;
  fail("no --model given and the default model {} was not found (looked in {} and above the executable)",
       rel.string(), fs::current_path().string());
}

std::string backend_from_flags(const Flags& flags) {
  const std::string requested = flags.get("backend", "auto");
  if (requested != "auto" && requested != "cpu" && requested != "cuda")
    fail("--backend must be auto, cpu or cuda, got '{}'", requested);
  // cpu needs no probe (and must work where the CUDA runtime would misbehave).
  const DeviceProbe probe = requested == "cpu" ? DeviceProbe{} : probe_devices();
  const BackendChoice c = choose_backend(requested, probe);
  if (requested == "auto")
    std::fprintf(stderr, "tansy: backend auto -> %s (%s)\n", c.backend.c_str(), c.reason.c_str());
  return c.backend;
}

std::string cuda_precision_from_flags(const Flags& flags, const std::string& backend, const fs::path& dir) {
  const std::string requested = flags.get("cuda-precision", "auto");
  const bool cuda = backend == "cuda";
  // Validates the value on every backend; only CUDA's auto looks at the checkpoint's size.
  const PrecisionChoice c =
      choose_cuda_precision(requested, cuda && requested == "auto" ? checkpoint_bytes(dir.string()) : 0);
  if (!cuda) return requested;  // the CPU backend is f32 throughout
  if (requested == "auto")
    std::fprintf(stderr, "tansy: cuda precision auto -> %s (%s)\n", c.precision.c_str(), c.reason.c_str());
  return c.precision;
}

LoadedEngine load_engine(const Flags& flags) {
  LoadedEngine le;
  le.dir = resolve_model_dir(flags);
  le.chat_template = std::make_shared<const text::ChatTemplate>(text::ChatTemplate::load(le.dir));
  std::fprintf(stderr, "tansy: %s\n", le.chat_template->describe().c_str());
  ModelOptions mo;
  mo.backend = backend_from_flags(flags);
  mo.cuda_precision = cuda_precision_from_flags(flags, mo.backend, le.dir);
  mo.threads = int(flags.get_int("threads", 0, 0, 1024));
  le.defaults = load_generation_defaults(le.dir);
  Tokenizer tok = Tokenizer::load(le.dir);
  std::fprintf(stderr, "tansy: loading %s on %s%s\n", le.dir.string().c_str(), mo.backend.c_str(),
               mo.backend == "cuda" ? (" (" + mo.cuda_precision + " plan)").c_str() : "");
  auto model = open_model(le.dir, mo);
  EngineOptions eo;
  const int max_pos = model->config().max_position;
  eo.max_seq = int(flags.get_int("max-seq", std::min(max_pos, 32768), 2, max_pos));
  // auto (the default): as many states as the pool's memory holds (EngineOptions); N: at most N
  if (const std::string pc = flags.get("prefix-cache", "auto"); pc != "auto") {
    if (pc.empty() || pc.find_first_not_of("0123456789") != std::string::npos)
      fail("--prefix-cache expects auto or a number of states, got '{}'", pc);
    eo.prefix_cache_entries = size_t(flags.get_int("prefix-cache", 0, 0, 65536));
  }
  // CUDA prefills a whole 4,096-token chunk at tensor-core speed (~0.17 s on an H200); smaller
  // pieces would re-read every expert's weights per piece. The CPU keeps short pieces, so that
  // cancellation stays prompt.
  const long chunk_default = model->backend_name() == "cuda" ? 4096 : eo.prefill_chunk;
  eo.prefill_chunk = int(flags.get_int("prefill-chunk", chunk_default, 1, max_pos));
  eo.max_running = int(flags.get_int("max-running", eo.max_running, 1, 1024));
  le.engine = std::make_unique<Engine>(std::move(model), std::move(tok), eo);
  return le;
}

}  // namespace tansy::cli
