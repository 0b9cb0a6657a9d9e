// The ends of the model (src/cuda/head/): the embedding lookup against cpu::embed_row, the argmax
// against tansy::argmax, and the fused decode head (final norm + lm_head + argmax + position)
// against cpu::rmsnorm + cpu::matmul. Tolerances in gpu_test_util.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cpu/ops.h"
#include "cuda/head/head.cuh"
#include "gpu_test_util.h"
#include "model/model.h"

namespace tansy {
namespace {

using namespace gpu_test;
using cuda::bf16;
using cuda::DeviceBuffer;

TEST(Head, Embed) {
  for (WFormat fmt : {WFormat::kAffine4, WFormat::kAffine8, WFormat::kBF16}) {
    const int V = 1000, H = 2048;
    TestMatrix E = make_matrix(fmt, V, H);
    std::vector<int> ids = {0, 999, 17, 17, 523};
    DeviceBuffer<int> dids = to_device(ids);
    DeviceBuffer<float> h(ids.size() * H);
    poison(h);
    cuda::embed(E.dev, dids.get(), int(ids.size()), h.get(), 0);
    std::vector<float> ref(ids.size() * H);
    for (size_t t = 0; t < ids.size(); ++t) cpu::embed_row(E.host, ids[t], &ref[t * H]);
    EXPECT_REL(from_device(h.get(), h.size()), ref, 1e-5, std::string("embed ") + fmt_name(fmt));
  }
}

TEST(Head, Argmax) {
  for (int V : {248320, 256, 1}) {
    auto logits = randn(V, 4.f);
    if (V > 300) logits[123] = logits[200000] = 100.f;  // tie: lower index wins
    DeviceBuffer<float> dl = to_device(logits);
    DeviceBuffer<unsigned long long> scratch(cuda::kArgmaxBlocks);
    DeviceBuffer<int> dst(1), ring(4), counter(1);
    CUDA_CHECK(cudaMemset(counter.get(), 0, sizeof(int)));
    cuda::argmax(dl.get(), V, scratch.get(), dst.get(), ring.get(), counter.get(), 0);
    const int got = from_device(dst.get(), 1)[0];
    EXPECT_EQ(got, tansy::argmax(logits)) << "V=" << V;
    EXPECT_EQ(from_device(ring.get(), 1)[0], got);
    EXPECT_EQ(from_device(counter.get(), 1)[0], 1);
    std::printf("  argmax V=%d -> %d\n", V, got);
  }
}

// Buffers of one lm_head_argmax call and the arguments pointing at them (pos is left null).
struct HeadCall {
  DeviceBuffer<float> logits;
  DeviceBuffer<unsigned long long> scratch{size_t(cuda::lm_head_scratch())};
  DeviceBuffer<unsigned> counter{1};
  DeviceBuffer<int> tok{1};
  cuda::LmHeadArgs a;
  HeadCall(const cuda::DevLinear& W, const cuda::NormIn& x) : logits(W.out) {
    CUDA_CHECK(cudaMemset(counter.get(), 0, 4));
    a.W = W;
    a.x = x;
    a.logits = logits.get();
    a.limit = W.out;
    a.token = tok.get();
    a.scratch = scratch.get();
    a.counter = counter.get();
  }
  int run(int limit) {
    a.limit = limit;
    cuda::lm_head_argmax(a, 0);
    return from_device(tok.get(), 1)[0];
  }
};

// The batched head (continuous batching): n rows through lm_head_argmax_rows give each row's
// logits bit for bit, and its token and position, as lm_head_argmax on that row alone (the
// lm_head_argmax test checks that one against the CPU), at the real shape and a partial tile,
// with each row's own argmax range.
TEST(Head, LmHeadArgmaxRowsMatchesOneRow) {
  for (auto [out, in] : {std::pair{248320, 2048}, std::pair{4100, 2048}, std::pair{33, 256}}) {
    TestMatrix W = make_matrix(WFormat::kAffine4, out, in);
    for (int n : {1, 3, cuda::kLmHeadRows}) {
      const std::string label =
          "[" + std::to_string(out) + "x" + std::to_string(in) + "] rows " + std::to_string(n);
      std::vector<float> h, w, ss;
      std::vector<NormCase> cases;
      for (int t = 0; t < n; ++t) {
        cases.push_back(make_norm_case(in));
        h.insert(h.end(), cases.back().h.begin(), cases.back().h.end());
        ss.insert(ss.end(), cases.back().ss.begin(), cases.back().ss.end());
      }
      w = cases[0].w;
      DeviceBuffer<float> dh = to_device(h), dw = to_device(w), dss = to_device(ss), logits(size_t(n) * out);
      DeviceBuffer<bf16> xn(size_t(n) * in);
      DeviceBuffer<unsigned long long> scratch(size_t(cuda::lm_head_scratch()) * cuda::kLmHeadRows);
      DeviceBuffer<unsigned> counter(1);
      DeviceBuffer<int> tok{static_cast<size_t>(n)};
      DeviceBuffer<int> pos = to_device(std::vector<int>(static_cast<size_t>(n), 3));
      CUDA_CHECK(cudaMemset(counter.get(), 0, 4));
      cuda::LmHeadArgs a;
      a.W = W.dev;
      a.x.h = dh.get();
      a.x.ss = dss.get();
      a.x.w = dw.get();
      a.x.eps = 1e-6f;
      a.x.xn_out = xn.get();
      a.logits = logits.get();
      a.token = tok.get();
      a.scratch = scratch.get();
      a.counter = counter.get();
      cuda::LmHeadRows r;
      r.n = n;
      r.h = in;
      r.ss = cuda::kNormParts;
      r.xn = in;
      for (int t = 0; t < n; ++t) {
        r.pos[t] = pos.get() + t;
        r.limit[t] = std::max(1, out - t * (out / 5));
      }
      poison(logits);
      cuda::lm_head_argmax_rows(a, r, 0);
      const auto got = from_device(logits.get(), size_t(n) * out);
      const auto toks = from_device(tok.get(), n);
      const auto poss = from_device(pos.get(), n);
      EXPECT_EQ(from_device(counter.get(), 1)[0], 0u) << label << ": counter left zero";
      for (int t = 0; t < n; ++t) {
        NormCase c = cases[size_t(t)];
        c.w = w;  // the batch's norm weight
        NormDev d(c);
        HeadCall one(W.dev, d.in);
        const int want = one.run(r.limit[t]);
        const auto ref = from_device(one.logits.get(), out);
        EXPECT_EQ(std::memcmp(got.data() + size_t(t) * out, ref.data(), sizeof(float) * out), 0)
            << label << " row " << t << ": logits differ from the one-row kernel's";
        EXPECT_EQ(toks[size_t(t)], want) << label << " row " << t;
        EXPECT_EQ(poss[size_t(t)], 4) << label << " row " << t << ": position advanced once";
      }
    }
  }
}

// The fused decode head: final norm + lm_head + argmax + position in one launch, at the real
// shape, at partial tiles (rows not a multiple of 32, a single partial tile) and at the demo
// model's hidden size 256 (one tensor-copy slab per row, fewer groups than warps).
TEST(Head, LmHeadArgmax) {
  for (auto [out, in] : {std::pair{248320, 2048}, std::pair{4100, 2048}, std::pair{8184, 256},
                         std::pair{33, 256}, std::pair{7, 1024}}) {
    TestMatrix W = make_matrix(WFormat::kAffine4, out, in);
    const NormCase c = make_norm_case(in);
    NormDev d(c);
    HeadCall h(W.dev, d.in);
    DeviceBuffer<int> pos = to_device(std::vector<int>{7});
    h.a.pos = pos.get();
    int calls = 0;
    for (int limit : {out, std::max(1, out / 3)}) {
      poison(h.logits);
      const int id = h.run(limit);
      ++calls;
      const std::string label = "lm_head_argmax [" + std::to_string(out) + "x" + std::to_string(in) +
                                "] limit " + std::to_string(limit);
      const auto got = from_device(h.logits.get(), out);
      const auto xn = from_device_bf16(d.xn.get(), in);
      EXPECT_REL(xn, c.x, 5e-3, "  xn_out");
      std::vector<float> ref(out), ref_own(out);
      cpu::matmul(W.host, c.x.data(), 1, ref.data());
      cpu::matmul(W.host, xn.data(), 1, ref_own.data());
      // against the CPU norm: a bf16 rounding of x that falls the other way moves y by ~1e-3
      EXPECT_REL(got, ref, 3e-3, label);
      // on the kernel's own x: f32 accumulation order only (tensor-core adds, per quant group)
      EXPECT_REL(got, ref_own, 1e-4, "  same on the kernel's x");
      const std::vector<float> head(got.begin(), got.begin() + limit),
          head_ref(ref_own.begin(), ref_own.begin() + limit);
      EXPECT_EQ(id, tansy::argmax(head)) << label << ": the argmax of the kernel's own logits";
      ASSERT_TRUE(id >= 0 && id < limit) << label;
      const float best = *std::max_element(head_ref.begin(), head_ref.end());
      EXPECT_GE(ref_own[id], best - 1e-4f * (std::fabs(best) + 1.f))
          << label << ": the CPU's best logit is " << best;
      EXPECT_EQ(from_device(pos.get(), 1)[0], 7 + calls) << label << ": position advanced once per call";
      EXPECT_EQ(from_device(h.counter.get(), 1)[0], 0u) << label << ": counter left zero";
      std::printf("  %s -> id %d\n", label.c_str(), id);
    }
  }
  {  // ties go to the lower id, and ids from `limit` on never win: rows 5 and 9 are the largest
    TestMatrix W = make_matrix(WFormat::kAffine4, 40, 256);
    const NormCase c = make_norm_case(256);
    double sx = 0;
    for (float v : c.x) sx += v;
    std::fill(W.s.begin(), W.s.end(), uint16_t(0));
    std::fill(W.b.begin(), W.b.end(), uint16_t(0));
    for (int r : {5, 9})
      for (int gi = 0; gi < 4; ++gi) W.b[size_t(r) * 4 + gi] = f32_to_bf16(sx > 0 ? 1.f : -1.f);
    CUDA_CHECK(cudaMemcpy(W.ds.get(), W.s.data(), W.s.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(W.db.get(), W.b.data(), W.b.size() * 2, cudaMemcpyHostToDevice));
    NormDev d(c);
    HeadCall h(W.dev, d.in);
    for (auto [limit, want] : {std::pair{40, 5}, std::pair{6, 5}, std::pair{5, 0}})
      EXPECT_EQ(h.run(limit), want) << "limit " << limit;
    // refused: other formats, in beyond the register-held x or not a multiple of the 128-byte slab, a
    // limit outside 1..out
    cuda::LmHeadArgs& a = h.a;
    for (int bad : {0, 41}) {
      a.limit = bad;
      EXPECT_THROW(cuda::lm_head_argmax(a, 0), Error) << "limit " << bad;
    }
    a.limit = 40;
    TestMatrix W8 = make_matrix(WFormat::kAffine8, 40, 128);
    a.W = W8.dev;
    EXPECT_THROW(cuda::lm_head_argmax(a, 0), Error);
    TestMatrix Wwide = make_matrix(WFormat::kAffine4, 40, cuda::kFusedNormMaxDim + 256);
    a.W = Wwide.dev;
    EXPECT_THROW(cuda::lm_head_argmax(a, 0), Error);
    TestMatrix Wnarrow = make_matrix(WFormat::kAffine4, 40, 192);
    a.W = Wnarrow.dev;
    EXPECT_THROW(cuda::lm_head_argmax(a, 0), Error);
  }
}

}  // namespace
}  // namespace tansy
