// --backend auto|cpu|cuda and --cuda-precision auto|bf16|f32 (model/backend_choice.h): the decision
// for every kind of machine, and what this build's real probe reports.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "model/backend_choice.h"
#include "test_util.h"

namespace {

using tansy::choose_backend;
using tansy::DeviceProbe;

DeviceProbe built(int devices, const char* name = "", int major = 0, int minor = 0, const char* error = "") {
  DeviceProbe p;
  p.cuda_built = true;
  p.devices = devices;
  p.name = name;
  p.major = major;
  p.minor = minor;
  p.error = error;
  return p;
}

std::string error_of(const std::string& requested, const DeviceProbe& p) {
  try {
    choose_backend(requested, p);
  } catch (const tansy::Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(BackendChoice, AutoPicksCudaOnlyOnHopperInACudaBuild) {
  auto h200 = built(1, "NVIDIA H200", 9, 0);
  auto c = choose_backend("auto", h200);
  EXPECT_EQ(c.backend, "cuda");
  EXPECT_EQ(c.reason, "NVIDIA H200, sm_90");

  c = choose_backend("auto", DeviceProbe{});  // CPU-only build
  EXPECT_EQ(c.backend, "cpu");
  EXPECT_EQ(c.reason, "this build has no CUDA backend");

  c = choose_backend(
      "auto",
      built(0, "", 0, 0,
            "cudaGetDeviceCount failed: CUDA driver version is insufficient for CUDA runtime version"));
  EXPECT_EQ(c.backend, "cpu");
  EXPECT_EQ(c.reason,
            "no CUDA device: cudaGetDeviceCount failed: CUDA driver version is insufficient for CUDA runtime "
            "version");
  EXPECT_EQ(choose_backend("auto", built(0)).reason, "no CUDA device");

  c = choose_backend("auto", built(2, "NVIDIA A100-SXM4-80GB", 8, 0));
  EXPECT_EQ(c.backend, "cpu");
  EXPECT_EQ(c.reason, "device 0 (NVIDIA A100-SXM4-80GB, sm_80) is not Hopper");
  EXPECT_EQ(choose_backend("auto", built(1, "NVIDIA B200", 10, 0)).backend, "cpu");
}

TEST(BackendChoice, ExplicitChoicesAreKeptOrRefusedClearly) {
  EXPECT_EQ(choose_backend("cpu", built(1, "NVIDIA H200", 9, 0)).backend, "cpu");
  EXPECT_EQ(choose_backend("cpu", DeviceProbe{}).backend, "cpu");
  EXPECT_EQ(choose_backend("cuda", built(1, "NVIDIA H100 80GB HBM3", 9, 0)).backend, "cuda");
  EXPECT_NE(error_of("cuda", DeviceProbe{}).find("no CUDA backend"), std::string::npos);
  EXPECT_EQ(error_of("cuda", built(0)), "--backend cuda: no CUDA device");
  EXPECT_EQ(
      error_of("cuda", built(0, "", 0, 0, "cudaGetDeviceCount failed: no CUDA-capable device is detected")),
      "--backend cuda: no CUDA device: cudaGetDeviceCount failed: no CUDA-capable device is detected");
  EXPECT_NE(error_of("cuda", built(1, "NVIDIA A100", 8, 0)).find("not a Hopper GPU"), std::string::npos);
  EXPECT_NE(error_of("gpu", DeviceProbe{}).find("auto, cpu or cuda"), std::string::npos);
}

TEST(BackendChoice, ThisBuildsProbe) {
  const DeviceProbe p = tansy::probe_devices();  // must not throw, with or without a driver
#ifdef TANSY_HAVE_CUDA_BACKEND
  EXPECT_TRUE(p.cuda_built);
  if (p.devices > 0) {
    EXPECT_FALSE(p.name.empty());
  }
#else
  EXPECT_FALSE(p.cuda_built);
  EXPECT_EQ(p.devices, 0);
  EXPECT_EQ(choose_backend("auto", p).backend, "cpu");
  EXPECT_THROW(choose_backend("cuda", p), tansy::Error);
#endif
}

// --cuda-precision auto|bf16|f32 (model/backend_choice.h).
TEST(CudaPrecision, AutoPicksF32ForSmallCheckpointsOnly) {
  using tansy::choose_cuda_precision;
  EXPECT_EQ(choose_cuda_precision("auto", 11u << 20).precision, "f32");
  EXPECT_EQ(choose_cuda_precision("auto", tansy::kF32AutoBytes).precision, "f32");
  EXPECT_EQ(choose_cuda_precision("auto", tansy::kF32AutoBytes + 1).precision, "bf16");
  EXPECT_EQ(choose_cuda_precision("auto", 19ull << 30).precision, "bf16");
  EXPECT_NE(choose_cuda_precision("auto", 11u << 20).reason.find("11.0 MiB"), std::string::npos);
  EXPECT_EQ(choose_cuda_precision("bf16", 1).precision, "bf16");
  EXPECT_EQ(choose_cuda_precision("f32", 19ull << 30).precision, "f32");
  EXPECT_THROW(choose_cuda_precision("fp16", 1), tansy::Error);
  EXPECT_THROW(choose_cuda_precision("", 1), tansy::Error);
}

TEST(CudaPrecision, CheckpointBytesCountsSafetensorsFiles) {
  const std::string demo = (tansy::test::source_dir() / "models" / "tansy-demo").string();
  const auto bytes = tansy::checkpoint_bytes(demo);
  EXPECT_GT(bytes, 1u << 20);
  EXPECT_LT(bytes, tansy::kF32AutoBytes);
  EXPECT_THROW(tansy::checkpoint_bytes("/nonexistent/dir"), tansy::Error);
}
