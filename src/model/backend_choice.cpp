#include "model/backend_choice.h"

#include <fmt/format.h>

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

}  // namespace tansy
