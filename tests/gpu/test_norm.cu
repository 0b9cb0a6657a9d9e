// The separate RMSNorm launches (src/cuda/norm/) against cpu::rmsnorm and cpu::rmsnorm_gated.
// Tolerances in gpu_test_util.h.
#include <string>
#include <utility>
#include <vector>

#include "cpu/ops.h"
#include "cuda/norm/norm.cuh"
#include "gpu_test_util.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

TEST(Norm, AddRmsnorm) {
  for (auto [n, dim] : {std::pair{1, 2048}, std::pair{5, 2048}, std::pair{63, 2048}, std::pair{64, 2048},
                        std::pair{65, 2048}, std::pair{4096, 2048}, std::pair{3, 64}, std::pair{2, 5000}}) {
    auto h = randn(size_t(n) * dim, 3.f), r = randn(size_t(n) * dim), w = randn(dim, 0.2f, 1.f);
    round_bf16_inplace(r);
    auto dr = to_device_bf16(r);
    DeviceBuffer<float> dh = to_device(h), dw = to_device(w);
    DeviceBuffer<bf16> xn(size_t(n) * dim);
    poison(xn);
    cuda::add_rmsnorm(dh.get(), dr.get(), dw.get(), n, dim, 1e-6f, xn.get(), 0);
    std::vector<float> hs(h.size()), ref(h.size());
    for (size_t i = 0; i < h.size(); ++i) hs[i] = h[i] + r[i];
    for (int t = 0; t < n; ++t)
      cpu::rmsnorm(&hs[size_t(t) * dim], w.data(), dim, 1e-6f, &ref[size_t(t) * dim]);
    EXPECT_LE(max_abs_diff(from_device(dh.get(), h.size()), hs), 1e-5) << "residual sum is f32 h + r";
    EXPECT_REL(from_device_bf16(xn.get(), xn.size()), ref, kTolBf16,
               "add_rmsnorm n=" + std::to_string(n) + " dim=" + std::to_string(dim));
    // no residual: plain norm of h
    cuda::add_rmsnorm(dh.get(), nullptr, dw.get(), n, dim, 1e-6f, xn.get(), 0);
    EXPECT_REL(from_device_bf16(xn.get(), xn.size()), ref, kTolBf16, "  rmsnorm (no residual)");
  }
}

TEST(Norm, GatedRmsnorm) {
  const int heads = 32, dim = 128;
  const int64_t ldz = heads * dim + 64;
  for (int n : {1, 3, 63, 64, 65}) {
    auto o = randn(size_t(n) * heads * dim), z = randn(size_t(n) * ldz), w = randn(dim, 0.2f, 1.f);
    round_bf16_inplace(z);
    DeviceBuffer<float> dout = to_device(o), dw = to_device(w);
    auto dz = to_device_bf16(z);
    DeviceBuffer<bf16> y(size_t(n) * heads * dim);
    poison(y);
    cuda::gated_rmsnorm(dout.get(), heads * dim, dz.get(), ldz, dw.get(), n, heads, dim, 1e-6f, y.get(),
                        heads * dim, 0);
    std::vector<float> ref(y.size());
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < heads; ++j)
        cpu::rmsnorm_gated(&o[(size_t(t) * heads + j) * dim], &z[size_t(t) * ldz + size_t(j) * dim], w.data(),
                           dim, 1e-6f, &ref[(size_t(t) * heads + j) * dim]);
    EXPECT_REL(from_device_bf16(y.get(), y.size()), ref, kTolBf16, "gated_rmsnorm n=" + std::to_string(n));
  }
}

}  // namespace
}  // namespace tansy
