#include <cublas_v2.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include "bench/ceilings.cuh"
#include "cuda/common/cuda_util.h"

namespace tansy::cuda {
namespace {

#define CUBLAS_CHECK(expr)                                                                            \
  do {                                                                                                \
    cublasStatus_t st_ = (expr);                                                                      \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                 \
      ::tansy::fail("cuBLAS error at {}:{}: {} ({})", __FILE__, __LINE__, cublasGetStatusString(st_), \
                    #expr);                                                                           \
  } while (0)

// Random fill on the device (hash of the index): measurements never run on zeros (METHOD.md).
__global__ void fill_random_u32(uint32_t* p, size_t n, uint64_t key) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = key + (i + 1) * 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    p[i] = uint32_t(z ^ (z >> 31));
  }
}

// Uniform in [-1, 1) as bf16, for the GEMM operands.
__global__ void fill_random_bf16(bf16* p, size_t n, uint64_t key) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = key + (i + 1) * 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    p[i] = __float2bfloat16(float(int64_t(z) >> 40) * (1.0f / 8388608.0f));
  }
}

constexpr int kReadThreads = 256;
constexpr int kReadUnroll = 8;

// Reads every 16-byte word once; the sum feeds a store that only happens for one impossible-in-
// practice value, so the loads cannot be optimized away and almost nothing is written.
__global__ void __launch_bounds__(kReadThreads)
    read_kernel(const uint4* __restrict__ p, size_t n, uint32_t* out) {
  uint32_t acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i + (kReadUnroll - 1) * stride < n; i += kReadUnroll * stride) {
    uint4 v[kReadUnroll];
#pragma unroll
    for (int u = 0; u < kReadUnroll; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < kReadUnroll; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    uint4 v = __ldcs(p + i);
    acc += v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

template <typename F>
double median_ms(int warmup, int reps, F&& launch) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  try {
    for (int i = 0; i < warmup; ++i) launch();
    CUDA_CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < reps; ++i) {
      CUDA_CHECK(cudaEventRecord(a));
      launch();
      CUDA_CHECK(cudaEventRecord(b));
      CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms);
    }
  } catch (...) {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    throw;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  size_t m = t.size() / 2;
  return t.size() % 2 ? t[m] : 0.5 * (t[m - 1] + t[m]);
}

std::string version_str(int v) { return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10); }

// The kernel module's version line: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  ..."
// or, for the open modules, "... Open Kernel Module for x86_64  580.159.04  ...": the first
// word after "Kernel Module" that looks like a version.
std::string nvidia_driver_version() {
  std::ifstream f("/proc/driver/nvidia/version");
  std::string line;
  if (f && std::getline(f, line)) {
    auto pos = line.find("Kernel Module");
    if (pos != std::string::npos) {
      std::istringstream ss(line.substr(pos + 13));
      std::string v;
      while (ss >> v)
        if (std::isdigit(static_cast<unsigned char>(v[0])) && v.find('.') != std::string::npos) return v;
    }
  }
  if (FILE* p = popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null", "r")) {
    char buf[128] = {0};
    std::string v = fgets(buf, sizeof buf, p) ? buf : "";
    pclose(p);
    while (!v.empty() && (v.back() == '\n' || v.back() == ' ')) v.pop_back();
    if (!v.empty()) return v;
  }
  return "unknown";
}

}  // namespace

DeviceInfo device_info() {
  DeviceInfo d;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  d.gpu = p.name;
  d.sm_count = p.multiProcessorCount;
  d.memory_gib = double(p.totalGlobalMem) / double(1ull << 30);
  int rt = 0, drv = 0;
  CUDA_CHECK(cudaRuntimeGetVersion(&rt));
  CUDA_CHECK(cudaDriverGetVersion(&drv));
  d.cuda_runtime = version_str(rt);
  d.cuda_driver = version_str(drv);
  d.driver = nvidia_driver_version();
  return d;
}

Ceilings measure_ceilings(int reps) {
  TANSY_CHECK(reps >= 3 && reps <= 1000, "measure_ceilings: reps {} outside [3, 1000]", reps);
  Ceilings c;
  c.reps = reps;
  int dev = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const unsigned fill_blocks = unsigned(sms) * 8;

  {
    // 2 GiB each way: ~35x the 60 MB L2, so the copy streams from and to HBM.
    const size_t bytes = size_t(2) << 30;
    DeviceBuffer<uint32_t> src(bytes / 4), dst(bytes / 4);
    DeviceBuffer<uint32_t> sink(1);
    fill_random_u32<<<fill_blocks, 256>>>(src.get(), src.size(), 1);
    launch_check("ceilings");
    fill_random_u32<<<fill_blocks, 256>>>(dst.get(), dst.size(), 2);
    launch_check("ceilings");
    double ms = median_ms(
        3, reps, [&] { CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice)); });
    c.copy_buffer_bytes = bytes;
    c.copy_gbps = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;

    const size_t n16 = bytes / 16;
    const unsigned blocks = unsigned(sms) * (2048 / kReadThreads);
    double rms = median_ms(3, reps, [&] {
      read_kernel<<<blocks, kReadThreads>>>(reinterpret_cast<const uint4*>(src.get()), n16, sink.get());
      launch_check("ceilings");
    });
    c.read_buffer_bytes = bytes;
    c.read_gbps = double(bytes) / (rms * 1e-3) / 1e9;
  }
  {
    const int n = 8192;
    const size_t elems = size_t(n) * n;
    DeviceBuffer<bf16> a(elems), b(elems), out(elems);
    fill_random_bf16<<<fill_blocks, 256>>>(a.get(), elems, 3);
    launch_check("ceilings");
    fill_random_bf16<<<fill_blocks, 256>>>(b.get(), elems, 4);
    launch_check("ceilings");
    cublasHandle_t h = nullptr;
    CUBLAS_CHECK(cublasCreate(&h));
    try {
      const float alpha = 1.0f, beta = 0.0f;
      double ms = median_ms(3, std::max(3, reps / 2), [&] {
        CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(), CUDA_R_16BF, n,
                                  b.get(), CUDA_R_16BF, n, &beta, out.get(), CUDA_R_16BF, n,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      });
      c.gemm_n = n;
      c.gemm_tflops = 2.0 * double(n) * n * n / (ms * 1e-3) / 1e12;
    } catch (...) {
      cublasDestroy(h);
      throw;
    }
    cublasDestroy(h);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  return c;
}

}  // namespace tansy::cuda
