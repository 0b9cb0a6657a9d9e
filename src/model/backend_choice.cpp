#include "model/backend_choice.h"

#include <fmt/format.h>

#include <filesystem>

#include "core/error.h"
#ifdef TANSY_HAVE_CUDA_BACKEND
#include "cuda/device_query.h"
#endif

namespace tansy {

DeviceProbe probe_devices() {
  DeviceProbe p;
#ifdef TANSY_HAVE_CUDA_BACKEND
  p.cuda_built = true;
  const cuda::DeviceQuery q = cuda::query_devices();
  p.devices = q.devices;
  p.name = q.name;
  p.major = q.major;
  p.minor = q.minor;
  p.error = q.error;
#endif
  return p;
}

namespace {

std::string device_text(const DeviceProbe& p) { return fmt::format("{}, sm_{}{}", p.name, p.major, p.minor); }

std::string no_device_text(const DeviceProbe& p) {
  return p.error.empty() ? "no CUDA device" : fmt::format("no CUDA device: {}", p.error);
}

}  // namespace

BackendChoice choose_backend(const std::string& requested, const DeviceProbe& p) {
  if (requested == "cpu") return {"cpu", "requested"};
  if (requested == "cuda") {
    if (!p.cuda_built) fail("--backend cuda: this build of tansy has no CUDA backend (built without nvcc)");
    if (p.devices <= 0) fail("--backend cuda: {}", no_device_text(p));
    if (p.major != 9)
      fail("--backend cuda: device 0 ({}) is not a Hopper GPU; tansy's kernels are built for sm_90a only",
           device_text(p));
    return {"cuda", device_text(p)};
  }
  if (requested != "auto") fail("--backend must be auto, cpu or cuda, got '{}'", requested);
  if (!p.cuda_built) return {"cpu", "this build has no CUDA backend"};
  if (p.devices <= 0) return {"cpu", no_device_text(p)};
  if (p.major != 9) return {"cpu", fmt::format("device 0 ({}) is not Hopper", device_text(p))};
  return {"cuda", device_text(p)};
}

PrecisionChoice choose_cuda_precision(const std::string& requested, unsigned long long bytes) {
  if (requested == "bf16" || requested == "f32") return {requested, "requested"};
  if (requested != "auto") fail("--cuda-precision must be auto, bf16 or f32, got '{}'", requested);
  const double mb = double(bytes) / (1 << 20);
  if (bytes <= kF32AutoBytes) return {"f32", fmt::format("checkpoint of {:.1f} MiB <= 1 GiB", mb)};
  return {"bf16", fmt::format("checkpoint of {:.1f} MiB > 1 GiB", mb)};
}

unsigned long long checkpoint_bytes(const std::string& dir) {
  namespace fs = std::filesystem;
  unsigned long long total = 0;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() != ".safetensors" || !it->is_regular_file(ec)) continue;
    const auto size = it->file_size(ec);
    if (!ec) total += size;
  }
  if (ec) fail("{}: cannot read the checkpoint directory: {}", dir, ec.message());
  return total;
}

}  // namespace tansy
