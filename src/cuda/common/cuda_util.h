// CUDA error checking and owning device buffers. Every CUDA failure becomes a tansy::Error
// naming the call site, so a bad launch stops the program with a one-line message.
#pragma once
// fmt 9 turns constexpr off when it sees __NVCC__, which breaks its own C++20 code in nvcc's host
// pass (CMake sets this too, for CUDA sources that include fmt before this header).
#if defined(__CUDACC__) && !defined(FMT_USE_CONSTEXPR)
#define FMT_USE_CONSTEXPR 1
#endif
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/error.h"

namespace tansy::cuda {

// Sequences one batched decode step carries (continuous batching): the per-row pointer tables
// of the batched kernels (DecodeRows, GdnDecodeRows, AttnDecodeRows) have this many entries.
constexpr int kMaxBatch = 64;

using bf16 = __nv_bfloat16;

#define CUDA_CHECK(expr)                                                                                  \
  do {                                                                                                    \
    cudaError_t err_ = (expr);                                                                            \
    if (err_ != cudaSuccess)                                                                              \
      ::tansy::fail("CUDA error at {}:{}: {} ({})", __FILE__, __LINE__, cudaGetErrorString(err_), #expr); \
  } while (0)

// After every launch (the one way launches are checked): configuration errors surface here as
// "<what>: launch failed: ...", asynchronous faults at the next synchronising call.
void launch_check(const char* what);

// Multiprocessors of the current device (read once).
int sm_count();

// Owning, untyped-size device allocation (cudaMalloc, never managed memory).
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) { resize(n); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }

  // Discards the contents.
  void resize(size_t n) {
    if (n == n_) return;
    release();
    if (n == 0) return;
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, n * sizeof(T));
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error so later calls are not blamed
      ::tansy::fail("cudaMalloc of {} MiB failed: {}", (n * sizeof(T)) >> 20, cudaGetErrorString(e));
    }
    p_ = static_cast<T*>(p);
    n_ = n;
  }
  void upload(const T* host, size_t n, size_t offset = 0) {
    TANSY_CHECK(offset + n <= n_, "DeviceBuffer::upload out of range ({} + {} > {})", offset, n, n_);
    CUDA_CHECK(cudaMemcpy(p_ + offset, host, n * sizeof(T), cudaMemcpyHostToDevice));
  }
  void download(T* host, size_t n, size_t offset = 0) const {
    TANSY_CHECK(offset + n <= n_, "DeviceBuffer::download out of range ({} + {} > {})", offset, n, n_);
    CUDA_CHECK(cudaMemcpy(host, p_ + offset, n * sizeof(T), cudaMemcpyDeviceToHost));
  }

  T* get() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

 private:
  void release() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
};

inline unsigned ceil_div(size_t a, size_t b) { return unsigned((a + b - 1) / b); }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace tansy::cuda
