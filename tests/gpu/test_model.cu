// The CUDA backend end to end: the golden tiny models (tests/goldens, logits from Hugging Face),
// CUDA against the CPU backend layer by layer (trace hook), the decode graph against eager
// decoding, and (when TANSY_SYNTH_DIR names a synthetic full-size checkpoint) CUDA against CPU on
// the real shapes plus a quick prefill/decode timing.
//
// Tolerance for bf16 activations against the f32 goldens. The tiny random models amplify rounding
// along the sequence: Hugging Face itself, run in bf16 on the realdims-bf16 golden's weights,
// deviates from its own f32 logits by max|Δlogit|/max|logit| = 0.014, 0.015, 0.098, 0.25, 0.17 for
// sequences of 1, 7, 64, 65, 200 tokens (top-1 agreement 1/1, 6/7, 63/64, 60/65, 195/200). Hence:
// <= 0.05 up to 7 tokens, <= 0.6 beyond (this backend measured up to 0.49 on the H200), and top-1
// agreement wherever the reference's top-1 beats its runner-up by more than 0.25 * max|logit|.
// Bugs show up sharply in the short sequences and in the layer-by-layer comparison with the CPU.
#include <cuda_profiler_api.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>

#include "bench/synth.h"
#include "cpu/backend.h"
#include "cuda/backend.h"
#include "cuda/bf16/plan.h"
#include "gpu_test_util.h"
#include "model/model.h"

namespace tansy {
namespace {

using namespace gpu_test;
namespace fs = std::filesystem;

constexpr double kLogitTolShort = 0.05;  // sequences of <= 7 tokens
constexpr double kLogitTolLong = 0.6;
constexpr double kMarginFrac = 0.25;
constexpr double kTraceTol = 0.05;
// The mixer and MoE outputs are added to the residual stream; their error is measured against
// that stream's norm (the layer's hidden output) when it is the larger, because a branch whose own
// norm is small reads the stream-sized bf16 noise as a large relative error: realdims-mlx layer
// 2's mixer output has norm 1.86 against a stream of 12.2, and a CPU emulation of the GEMV prefill
// path's bf16 rounding points put its own relative error at 0.035-0.076 (no expert flips), with
// the H200 measuring 0.052. Its own relative error must still stay below kBranchOwnTol.
constexpr double kBranchOwnTol = 0.10;

// "layer.<i>.hidden" for "layer.<i>.mixer_out" and "layer.<i>.moe_out"; "" for other names.
std::string branch_stream(const std::string& name) {
  for (const char* suffix : {".mixer_out", ".moe_out"}) {
    const std::string s = suffix;
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0)
      return name.substr(0, name.size() - s.size()) + ".hidden";
  }
  return "";
}

// TANSY_SOURCE_DIR in the environment overrides the build's path (the tests may run from a copy).
fs::path goldens_dir() {
  const char* env = std::getenv("TANSY_SOURCE_DIR");
  return fs::path(env ? env : TANSY_SOURCE_DIR) / "tests" / "goldens";
}

template <typename T>
std::vector<T> read_bin(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + p.string());
  f.seekg(0, std::ios::end);
  const size_t bytes = size_t(f.tellg());
  f.seekg(0);
  std::vector<T> v(bytes / sizeof(T));
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(v.size() * sizeof(T)));
  return v;
}

struct LogitCheck {
  double rel_max = 0;  // max |Δ| / max |ref|
  int positions = 0, decisive = 0, decisive_agree = 0, agree = 0;
};

LogitCheck compare_logits(const std::vector<float>& got, const std::vector<float>& ref, int V) {
  LogitCheck c;
  double maxref = 0;
  for (float x : ref) maxref = std::max(maxref, double(std::fabs(x)));
  c.rel_max = max_abs_diff(got, ref) / std::max(maxref, 1e-30);
  c.positions = int(ref.size() / V);
  for (int p = 0; p < c.positions; ++p) {
    std::span<const float> r(&ref[size_t(p) * V], V), g(&got[size_t(p) * V], V);
    const int top = argmax(r);
    const float second = runner_up(r, top);
    const bool same = argmax(g) == top;
    c.agree += same;
    if (r[top] - second > kMarginFrac * maxref) {
      ++c.decisive;
      c.decisive_agree += same;
    }
  }
  return c;
}

void expect_logits(const std::vector<float>& got, const std::vector<float>& ref, int V,
                   const std::string& label) {
  const LogitCheck c = compare_logits(got, ref, V);
  std::printf("  %-44s max|dlogit|/max|logit| %.4f, top-1 %d/%d (decisive %d/%d)\n", label.c_str(), c.rel_max,
              c.agree, c.positions, c.decisive_agree, c.decisive);
  EXPECT_LE(c.rel_max, c.positions <= 7 ? kLogitTolShort : kLogitTolLong) << label;
  EXPECT_EQ(c.decisive_agree, c.decisive) << label;
}

std::unique_ptr<Model> open_cuda(const fs::path& dir, cuda::PrefillKernels prefill) {
  return make_cuda_model(dir, cuda::CudaPlanOptions{prefill});
}

// ---- goldens ----

class Golden : public ::testing::TestWithParam<std::string> {};

void run_golden_sequences(Model& m, const fs::path& dir, const std::string& path_name) {
  const auto meta = nlohmann::json::parse(std::ifstream(dir / "golden.json"));
  const int V = m.config().vocab_size;
  for (const auto& s : meta["sequences"]) {
    const auto ids = read_bin<int32_t>(dir / s["ids"].get<std::string>());
    const auto ref = read_bin<float>(dir / s["logits"].get<std::string>());
    ASSERT_EQ(ref.size(), ids.size() * size_t(V));
    auto st = m.new_state(int(ids.size()) + 8);
    std::vector<float> got(ref.size());
    m.forward(*st, ids, got, true);
    expect_logits(got, ref, V, path_name + " seq" + std::to_string(ids.size()));
  }
}

TEST_P(Golden, LogitsGemvPath) {
  const fs::path dir = goldens_dir() / GetParam();
  auto m = open_cuda(dir, cuda::PrefillKernels::kGemv);
  run_golden_sequences(*m, dir, GetParam() + " gemv");
}

TEST_P(Golden, LogitsTensorCorePrefill) {
  const fs::path dir = goldens_dir() / GetParam();
  auto m = open_cuda(dir, cuda::PrefillKernels::kTensorCore);
  run_golden_sequences(*m, dir, GetParam() + " tc");
}

// A prompt fed whole, in pieces, or token by token gives the same last logits.
TEST_P(Golden, SplitInvariance) {
  const fs::path dir = goldens_dir() / GetParam();
  auto m = open_cuda(dir, cuda::PrefillKernels::kTensorCore);
  const auto ids = read_bin<int32_t>(dir / "seq200.ids");
  const int V = m->config().vocab_size;
  std::vector<float> whole(V), pieces(V), single(V);
  auto a = m->new_state(256);
  m->forward(*a, ids, whole, false);
  auto b = m->new_state(256);
  const int cuts[] = {0, 1, 64, 65, 130, 200};
  for (int i = 0; i + 1 < 6; ++i)
    m->forward(*b, std::span<const int32_t>(ids).subspan(cuts[i], cuts[i + 1] - cuts[i]), pieces, false);
  auto c = m->new_state(256);
  for (size_t i = 0; i < ids.size(); ++i) m->forward(*c, std::span<const int32_t>(&ids[i], 1), single, false);
  EXPECT_EQ(b->n_tokens(), 200);
  EXPECT_REL(pieces, whole, 2e-2, GetParam() + " pieces vs whole");
  EXPECT_REL(single, whole, 2e-2, GetParam() + " token by token vs whole");
  // clone: continuing a clone equals continuing the original
  auto d = m->clone_state(*a);
  std::vector<float> l1(V), l2(V);
  const int32_t next = ids[3];
  m->forward(*a, std::span<const int32_t>(&next, 1), l1, false);
  m->forward(*d, std::span<const int32_t>(&next, 1), l2, false);
  EXPECT_EQ(max_abs_diff(l1, l2), 0.0) << "clone_state";
  // copy_state: b (200 tokens of its own, its own decode graph) takes a's 201 with no sync in
  // between; decoding the same token from both gives the same logits.
  ASSERT_TRUE(m->copy_state(*a, *b));
  EXPECT_EQ(b->n_tokens(), a->n_tokens());
  const int32_t after = ids[4];
  m->forward(*a, std::span<const int32_t>(&after, 1), l1, false);
  m->forward(*b, std::span<const int32_t>(&after, 1), l2, false);
  EXPECT_EQ(max_abs_diff(l1, l2), 0.0) << "copy_state";
  auto wider = m->new_state(257);
  EXPECT_THROW(m->copy_state(*a, *wider), Error) << "a destination of another capacity";
}

// A FeedEntry's cut computed in the piece's one pass (set_cut_in_one_pass) and in
// Model::feed_batch's two passes, each against a plain feed on the same kernels: the state shown
// at the cut and the state at the piece's end continue (three tokens fed after a clone) like the
// states of a feed without a cut, within the plan's tolerance. The reference for the state at the
// cut feeds its last tokens as a piece of at least two (the tensor-core prefill, as the one pass
// computes them): a one-token piece runs the decode step's kernels, whose bf16 rounding can flip a
// near-tied expert of the tiny random checkpoints (measured on the H200: 4-bit golden, cut one
// token in, 0.072 of the largest logit against the CPU where both prefill paths were 0.008). The
// two-pass path is compared only where its first pass is such a piece. The piece follows 37 tokens
// already fed (conv windows and keys from before it), its cuts 1 and 2 tokens in (windows partly
// from before the piece), at the edges of GDN chunks of 64 and one token from its end.
TEST_P(Golden, CutInOnePass) {
  const fs::path dir = goldens_dir() / GetParam();
  auto owned = open_cuda(dir, cuda::PrefillKernels::kTensorCore);
  auto* m = dynamic_cast<cuda::CudaModel*>(owned.get());
  ASSERT_NE(m, nullptr);
  const auto ids = read_bin<int32_t>(dir / "seq200.ids");
  const int V = m->config().vocab_size;
  const int before = 37;
  const std::span<const int32_t> all(ids), history = all.first(before), piece = all.subspan(before);
  const std::vector<int32_t> more = {ids[3], ids[7], ids[11]};
  std::vector<float> scratch(static_cast<size_t>(V));
  auto continue_from = [&](const SequenceState& s) {
    auto c = m->clone_state(s);
    std::vector<float> l(size_t(V) * more.size());
    m->forward(*c, more, l, true);
    return l;
  };
  m->set_cut_in_one_pass(false);
  // the state after ids [0, n) fed as [0, before - 1) and [before - 1, n): no cut, no one-token piece
  auto reference = [&](size_t n) {
    auto st = m->new_state(256);
    m->forward(*st, all.first(before - 1), scratch, false);
    m->forward(*st, all.subspan(before - 1, n - (before - 1)), scratch, false);
    return continue_from(*st);
  };
  const auto ref_end = reference(ids.size());
  for (int cut : {1, 2, 27, 28, 29, 93, 162}) {
    const auto ref_cut = reference(size_t(before + cut));
    for (int one_pass : {1, 0}) {
      m->set_cut_in_one_pass(one_pass == 1);
      auto st = m->new_state(256);
      m->forward(*st, history, scratch, false);
      FeedEntry e{st.get(), piece, nullptr};
      e.cut = size_t(cut);
      int calls = 0;
      std::vector<float> shown;
      e.on_cut = [&](const SequenceState& at) {
        ++calls;
        EXPECT_EQ(at.n_tokens(), before + cut);
        shown = continue_from(at);
      };
      m->feed_batch(std::span<const FeedEntry>(&e, 1));
      m->set_cut_in_one_pass(false);
      EXPECT_EQ(calls, 1);
      EXPECT_EQ(st->n_tokens(), int(ids.size()));
      const std::string at =
          GetParam() + (one_pass ? " one pass" : " two passes") + ", cut " + std::to_string(before + cut);
      if (one_pass || cut >= 2) expect_logits(shown, ref_cut, V, at + ": from the cut");
      expect_logits(continue_from(*st), ref_end, V, at + ": from the end");
    }
  }
}

// Records the experts the CUDA backend routes each MoE layer's tokens to, and makes the CPU
// reference take the same ones. Random routers put many experts' probabilities within bf16
// rounding of each other; without this a near-tie flip (a different but equally valid expert)
// would show up as a large layer difference and hide the numerical comparison.
struct RouteFollower {
  std::map<int, std::vector<int32_t>> routes;
  void record(Model& gpu) {
    routes.clear();
    gpu.set_route_trace(
        [this](int layer, std::span<const int32_t> idx) { routes[layer].assign(idx.begin(), idx.end()); });
  }
  void follow(Model& cpu) {
    cpu.set_route_override([this](int layer, int n, std::span<int32_t> idx) {
      auto it = routes.find(layer);
      if (it == routes.end() || it->second.size() != idx.size()) {
        ADD_FAILURE() << "no recorded routing for layer " << layer << " (" << n << " tokens)";
        return false;
      }
      std::copy(it->second.begin(), it->second.end(), idx.begin());
      return true;
    });
  }
  static void stop(Model& gpu, Model& cpu) {
    gpu.set_route_trace(nullptr);
    cpu.set_route_override(nullptr);
  }
};

// CUDA against the CPU backend, intermediate by intermediate, on the same prompt (the CPU
// following the CUDA backend's expert choices).
void compare_traces(Model& gpu, Model& cpu, std::span<const int32_t> ids, const std::string& label) {
  std::map<std::string, std::vector<float>> tg, tc;
  std::vector<std::string> order;
  gpu.set_trace([&](const std::string& n, std::span<const float> v) {
    tg[n].assign(v.begin(), v.end());
    order.push_back(n);
  });
  cpu.set_trace([&](const std::string& n, std::span<const float> v) { tc[n].assign(v.begin(), v.end()); });
  const int V = gpu.config().vocab_size;
  std::vector<float> lg(V), lc(V);
  auto sg = gpu.new_state(int(ids.size()) + 1);
  auto sc = cpu.new_state(int(ids.size()) + 1);
  RouteFollower rf;
  rf.record(gpu);
  gpu.forward(*sg, ids, lg, false);
  rf.follow(cpu);
  cpu.forward(*sc, ids, lc, false);
  RouteFollower::stop(gpu, cpu);
  gpu.set_trace(nullptr);
  cpu.set_trace(nullptr);
  ASSERT_FALSE(order.empty());
  double worst = 0;
  std::string worst_name;
  for (const auto& n : order) {
    ASSERT_TRUE(tc.count(n)) << "CPU trace lacks " << n;
    const double own = rel_err(tg[n], tc[n]);
    double e = own;
    // A branch added to the residual stream is measured against the stream it joins (the
    // layer's hidden output), with a looser check of its own relative error besides.
    const std::string hidden = branch_stream(n);
    if (!hidden.empty()) {
      ASSERT_TRUE(tc.count(hidden)) << "CPU trace lacks " << hidden;
      e = own * l2norm(tc[n]) / std::max(l2norm(tc[n]), l2norm(tc[hidden]));
      EXPECT_LE(own, kBranchOwnTol) << label << " " << n << " (own norm)";
    }
    if (e > worst) {
      worst = e;
      worst_name = n;
    }
    EXPECT_LE(e, kTraceTol) << label << " " << n << (hidden.empty() ? "" : " (against " + hidden + ")");
  }
  std::printf("  %-44s %zu intermediates, worst rel err %.4f at %s\n", label.c_str(), order.size(), worst,
              worst_name.c_str());
  expect_logits(lg, lc, V, label + " logits vs CPU");
}

TEST_P(Golden, LayerByLayerVsCpu) {
  const fs::path dir = goldens_dir() / GetParam();
  auto cpu = make_cpu_model(dir, ModelOptions{});
  const auto ids7 = read_bin<int32_t>(dir / "seq7.ids");
  for (auto [prefill, path] :
       {std::pair{cuda::PrefillKernels::kGemv, "gemv"}, std::pair{cuda::PrefillKernels::kTensorCore, "tc"}}) {
    auto gpu = open_cuda(dir, prefill);
    compare_traces(*gpu, *cpu, ids7, GetParam() + " " + path + " seq7");
  }
  // 200 tokens on the prefill kernels: three GDN chunk edges (64, 128, 192) and several attention
  // tiles inside one prompt.
  auto gpu = open_cuda(dir, cuda::PrefillKernels::kTensorCore);
  compare_traces(*gpu, *cpu, read_bin<int32_t>(dir / "seq200.ids"), GetParam() + " tc seq200");
}

// Greedy decoding through the CUDA graph equals eager decoding exactly, and follows the golden.
TEST_P(Golden, GreedyGraphMatchesEagerAndGolden) {
  const fs::path dir = goldens_dir() / GetParam();
  const auto meta = nlohmann::json::parse(std::ifstream(dir / "golden.json"));
  const auto prompt = read_bin<int32_t>(dir / meta["greedy"]["prompt"].get<std::string>());
  const auto golden = meta["greedy"]["tokens"].get<std::vector<int32_t>>();
  auto m = open_cuda(dir, cuda::PrefillKernels::kTensorCore);
  const int n = int(golden.size());
  std::vector<int32_t> graph_toks;
  auto st = m->new_state(int(prompt.size()) + n + 1);
  m->generate_greedy(*st, prompt, n, [&](int32_t t) {
    graph_toks.push_back(t);
    return true;
  });
  ASSERT_EQ(int(graph_toks.size()), n);
  EXPECT_EQ(st->n_tokens(), int(prompt.size()) + n - 1) << "the last token is emitted, not fed";
  // eager: forward + host argmax (a route trace keeps one-token forwards off the graph; the same
  // fused kernels run one launch at a time)
  std::vector<int32_t> eager;
  m->set_route_trace([](int, std::span<const int32_t>) {});
  auto se = m->new_state(int(prompt.size()) + n + 1);
  std::vector<float> logits(m->config().vocab_size);
  m->forward(*se, prompt, logits, false);
  for (int i = 0; i < n; ++i) {
    eager.push_back(argmax(logits));
    if (i + 1 < n) m->forward(*se, std::span<const int32_t>(&eager.back(), 1), logits, false);
  }
  m->set_route_trace(nullptr);
  EXPECT_EQ(graph_toks, eager) << "decode graph vs eager";
  // greedy_step (the server's path): the graph with the id moved in and out
  {
    auto sg = m->new_state(int(prompt.size()) + n + 1);
    const int V = m->config().vocab_size;
    std::vector<int32_t> steps = {
        m->greedy_step(*sg, prompt, V)};  // the prompt: chunked forward + device argmax
    while (int(steps.size()) < n)
      steps.push_back(m->greedy_step(*sg, std::span<const int32_t>(&steps.back(), 1), V));
    EXPECT_EQ(steps, eager) << "greedy_step vs eager";
    // a smaller limit: the argmax is taken over the prefix only
    const int limit = V / 2;
    const int32_t t = m->greedy_step(*sg, std::span<const int32_t>(&steps.back(), 1), limit);
    EXPECT_LT(t, limit);
  }
  // A reset state decodes exactly as a new one (the server reuses states).
  {
    ASSERT_TRUE(m->reset_state(*st));
    EXPECT_EQ(st->n_tokens(), 0);
    std::vector<int32_t> again;
    m->generate_greedy(*st, prompt, n, [&](int32_t t) {
      again.push_back(t);
      return true;
    });
    EXPECT_EQ(again, graph_toks) << "greedy decoding from a reset state";
  }
  // Against the golden: identical up to the first step where the reference's top-1 is not
  // decisive. The f32 CPU backend (which matches Hugging Face to ~1e-5) gives the margins; a step
  // whose top two logits are within kGreedyMargin * max|logit| may flip under bf16 activations
  // (CUDA vs CPU differ by ~0.01-0.02 of max|logit| on these models: see LayerByLayerVsCpu).
  constexpr double kGreedyMargin = 0.05;
  auto cpu = make_cpu_model(dir, ModelOptions{});
  std::vector<int32_t> seq(prompt.begin(), prompt.end());
  seq.insert(seq.end(), golden.begin(), golden.end() - 1);
  const int V = m->config().vocab_size;
  std::vector<float> all(size_t(seq.size()) * V);
  auto sc = cpu->new_state(int(seq.size()));
  cpu->forward(*sc, seq, all, true);
  int decisive = 0;  // golden steps before the first near tie
  for (; decisive < n; ++decisive) {
    std::span<const float> r(&all[(prompt.size() - 1 + decisive) * V], V);
    const int top = argmax(r);
    float second = -INFINITY, mx = 0;
    for (int i = 0; i < V; ++i) {
      mx = std::max(mx, std::fabs(r[i]));
      if (i != top) second = std::max(second, r[i]);
    }
    if (top != golden[decisive] || r[top] - second <= kGreedyMargin * mx) break;
  }
  int prefix = 0;
  while (prefix < n && graph_toks[prefix] == golden[prefix]) ++prefix;
  std::printf(
      "  %s greedy: %d/%d tokens match the golden before the first difference (%d decisive steps first)\n",
      GetParam().c_str(), prefix, n, decisive);
  EXPECT_GE(decisive, 1) << "the CPU reference disagrees with the golden's first token";
  EXPECT_GE(prefix, decisive)
      << "greedy continuation diverges from the Hugging Face golden at a decisive step";
  // early stop: the rejected token is not fed
  auto s2 = m->new_state(int(prompt.size()) + n + 1);
  int calls = 0;
  m->generate_greedy(*s2, prompt, n, [&](int32_t) { return ++calls < 3; });
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(s2->n_tokens(), int(prompt.size()) + 2);
}

INSTANTIATE_TEST_SUITE_P(RealDims, Golden, ::testing::Values("realdims-mlx", "realdims-bf16"));

// Shapes the kernels are not built for are refused at load with a clear message.
TEST(GoldenSmallDims, RejectedLoudly) {
  for (const char* name : {"smalldims-mlx", "smalldims-bf16"}) {
    try {
      auto m = make_cuda_model(goldens_dir() / name);
      ADD_FAILURE() << name << " loaded, but its head_dim is not 256";
    } catch (const Error& e) {
      std::printf("  %s refused: %s\n", name, e.what());
      EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos);
    }
  }
}

TEST(ModelErrors, BadInputs) {
  auto m = open_cuda(goldens_dir() / "realdims-mlx", cuda::PrefillKernels::kTensorCore);
  auto st = m->new_state(4);
  std::vector<float> logits(m->config().vocab_size);
  const std::vector<int32_t> bad = {1, m->config().vocab_size};
  EXPECT_THROW(m->forward(*st, bad, logits, false), Error);
  const std::vector<int32_t> many = {1, 2, 3, 4, 5};
  EXPECT_THROW(m->forward(*st, many, logits, false), Error);
  std::vector<float> small(3);
  const std::vector<int32_t> ok = {1};
  EXPECT_THROW(m->forward(*st, ok, small, false), Error);
  EXPECT_EQ(st->n_tokens(), 0);
}

// ---- synthetic full-size checkpoint ----

// TANSY_SYNTH_DIR names the checkpoint; when the directory does not exist yet it is written here
// (the real model's config, seed 0), so one device call can create and use it.
const char* synth_dir() {
  const char* dir = std::getenv("TANSY_SYNTH_DIR");
  if (!dir) return nullptr;
  static const bool ready = [&] {
    if (!fs::exists(fs::path(dir) / "config.json")) {
      const auto t0 = std::chrono::steady_clock::now();
      const SynthResult r = write_synthetic_checkpoint(real_model_config_json(), dir, SynthOptions{});
      std::printf("  wrote synthetic checkpoint: %.2f GB in %.1f s\n", double(r.data_bytes) / 1e9,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return true;
  }();
  (void)ready;
  return dir;
}

std::vector<int32_t> bench_prompt(int n, int vocab) {
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i)
    ids[i] = int32_t((uint64_t(uint32_t(uint64_t(i) * 2654435761u))) % uint64_t(vocab));
  return ids;
}

TEST(Synthetic, CudaVsCpuLayerByLayer) {
  if (!synth_dir()) GTEST_SKIP() << "set TANSY_SYNTH_DIR to a `tansy synth` checkpoint";
  auto cpu = make_cpu_model(synth_dir(), ModelOptions{});
  auto gpu = open_cuda(synth_dir(), cuda::PrefillKernels::kTensorCore);
  const auto ids = bench_prompt(6, gpu->config().vocab_size);
  compare_traces(*gpu, *cpu, ids, "synthetic tc 6 tokens");
  // Past one GDN chunk and one attention tile at the real shapes (64 tokens each).
  compare_traces(*gpu, *cpu, bench_prompt(70, gpu->config().vocab_size), "synthetic tc 70 tokens");
  // one decode step after the prompt (the single-token GEMV path)
  const int V = gpu->config().vocab_size;
  std::vector<float> lg(V), lc(V);
  auto sg = gpu->new_state(16);
  auto sc = cpu->new_state(16);
  RouteFollower rf;  // the CPU follows the CUDA backend's expert choices, prompt and step
  rf.record(*gpu);
  gpu->forward(*sg, ids, lg, false);
  rf.follow(*cpu);
  cpu->forward(*sc, ids, lc, false);
  const int32_t next = 17;
  // the decode step runs the fused kernels (no trace)
  rf.record(*gpu);
  gpu->forward(*sg, std::span<const int32_t>(&next, 1), lg, false);
  rf.follow(*cpu);
  cpu->forward(*sc, std::span<const int32_t>(&next, 1), lc, false);
  RouteFollower::stop(*gpu, *cpu);
  ASSERT_EQ(int(rf.routes.size()), gpu->config().num_layers) << "every layer routed once";
  expect_logits(lg, lc, V, "synthetic decode step vs CPU");
}

// A prompt longer than the bf16 plan's 4,096-token prefill chunk gives the same last logits fed
// whole (the plan cuts it into chunks itself), in pieces cut at and around the GDN chunk edges
// (64) and the prefill chunk edge (4,096), and token by token (the decode kernels): within the
// bf16 plan's tolerance. The pieces and the tokens follow the whole
// prompt's expert choices (set_route_override): the synthetic router's logits are near-uniform, so
// over 4,160 tokens x 40 layers hundreds of top-8 choices sit within rounding of a tie, and a
// flipped choice would hide what the comparison is for (the first run of this test, without it:
// 0.127 of max|logit| apart, the pieces and the tokens on the same top token, the whole on another).
// The tolerance is twice the plan's distance from the f32 CPU on this checkpoint (0.014-0.017 of
// max|logit| at 6 and 70 tokens, Synthetic.CudaVsCpuLayerByLayer): each path is a bf16 rounding of
// the same sums, so two of them may stand on either side of the exact value. Measured with route
// following on H100s: 0.017-0.018 (cf6881b) and 0.018-0.020 (8dd56bc), over Golden.SplitInvariance's
// 0.02, which was set for 200 tokens of the tiny goldens.
constexpr double kSplitTolSynthetic = 3.5e-2;
TEST(Synthetic, WholePiecesTokenByToken) {
  if (!synth_dir()) GTEST_SKIP() << "set TANSY_SYNTH_DIR to a `tansy synth` checkpoint";
  auto m = open_cuda(synth_dir(), cuda::PrefillKernels::kTensorCore);
  const int V = m->config().vocab_size, n = 4160, K = m->config().experts_per_tok;
  const auto ids = bench_prompt(n, V);
  std::map<int, std::vector<int32_t>> routes;  // layer -> [n, K], the whole prompt's
  m->set_route_trace([&](int layer, std::span<const int32_t> idx) {
    routes[layer].insert(routes[layer].end(), idx.begin(), idx.end());
  });
  std::vector<float> whole(V), pieces(V), single(V);
  auto a = m->new_state(n + 1);
  m->forward(*a, ids, whole, false);
  m->set_route_trace(nullptr);
  ASSERT_EQ(int(routes.size()), m->config().num_layers);
  for (const auto& [layer, r] : routes) ASSERT_EQ(r.size(), size_t(n) * K) << "layer " << layer;
  std::map<int, size_t> next;  // layer -> first token not yet followed
  int differed = 0;            // choices the follower changed
  m->set_route_override([&](int layer, int count, std::span<int32_t> idx) {
    const size_t t0 = next[layer];
    if (t0 + count > size_t(n)) {
      ADD_FAILURE() << "layer " << layer << " routed past the prompt";
      return false;
    }
    for (size_t i = 0; i < idx.size(); ++i) {
      const int32_t want = routes[layer][t0 * K + i];
      differed += idx[i] != want;
      idx[i] = want;
    }
    next[layer] = t0 + count;
    return true;
  });
  auto b = m->new_state(n + 1);
  const int cuts[] = {0, 1, 63, 64, 65, 2000, 4095, 4096, 4097, 4159, n};
  for (size_t i = 0; i + 1 < std::size(cuts); ++i)
    m->forward(*b, std::span<const int32_t>(ids).subspan(cuts[i], cuts[i + 1] - cuts[i]), pieces, false);
  EXPECT_EQ(b->n_tokens(), n);
  auto every_token_followed = [&](const char* path) {
    EXPECT_EQ(int(next.size()), m->config().num_layers) << path;
    for (const auto& [layer, t] : next) EXPECT_EQ(t, size_t(n)) << path << ": layer " << layer;
    next.clear();
  };
  every_token_followed("pieces");
  const int differed_pieces = std::exchange(differed, 0);
  auto c = m->new_state(n + 1);
  for (int i = 0; i < n; ++i) m->forward(*c, std::span<const int32_t>(&ids[i], 1), single, false);
  m->set_route_override(nullptr);
  EXPECT_EQ(c->n_tokens(), n);
  every_token_followed("token by token");
  std::printf("  synthetic 4,160 tokens: routing choices followed: %d (pieces), %d (token by token) of %d\n",
              differed_pieces, differed, n * K * m->config().num_layers);
  EXPECT_REL(pieces, whole, kSplitTolSynthetic, "synthetic 4,160 tokens: pieces vs whole");
  EXPECT_REL(single, whole, kSplitTolSynthetic, "synthetic 4,160 tokens: token by token vs whole");
  EXPECT_REL(single, pieces, kSplitTolSynthetic, "synthetic 4,160 tokens: token by token vs pieces");
  float mx = 0;
  for (float x : whole) mx = std::max(mx, std::fabs(x));
  const int top = argmax(whole);
  const float margin = (whole[top] - runner_up(whole, top)) / mx;
  std::printf("  synthetic 4,160 tokens: top %d, margin %.4f of max|logit|; pieces %d, token by token %d\n",
              top, margin, argmax(pieces), argmax(single));
  if (margin > 0.05f) {
    EXPECT_EQ(argmax(pieces), top) << "pieces: greedy next token";
    EXPECT_EQ(argmax(single), top) << "token by token: greedy next token";
  }
}

// Not a pass/fail test: prints the numbers (docs/BENCHMARK.md's workload, one round).
TEST(Synthetic, Timing) {
  if (!synth_dir()) GTEST_SKIP() << "set TANSY_SYNTH_DIR to a `tansy synth` checkpoint";
  auto m = open_cuda(synth_dir(), cuda::PrefillKernels::kTensorCore);
  for (int ctx : {256, 4096, 32768}) {
    const auto prompt = bench_prompt(ctx, m->config().vocab_size);
    double prefill_s = 0, decode_s = 0;
    uint64_t digest = 1469598103934665603ull;
    for (int round = 0; round < 2; ++round) {  // round 0 is the warm-up
      auto st = m->new_state(ctx + 80);
      CUDA_CHECK(cudaDeviceSynchronize());
      const auto t0 = std::chrono::steady_clock::now();
      auto t1 = t0;
      int got = 0;
      digest = 1469598103934665603ull;
      m->generate_greedy(*st, prompt, 65, [&](int32_t t) {
        if (got++ == 0)
          t1 = std::chrono::steady_clock::now();
        else
          digest = (digest ^ uint64_t(uint32_t(t))) * 1099511628211ull;
        return true;
      });
      const auto t2 = std::chrono::steady_clock::now();
      prefill_s = std::chrono::duration<double>(t1 - t0).count();
      decode_s = std::chrono::duration<double>(t2 - t1).count();
    }
    std::printf(
        "TIMING ctx %6d: prefill %9.1f tok/s (%.3f s), decode %7.1f tok/s (%.2f ms/token), digest %016llx\n",
        ctx, ctx / prefill_s, prefill_s, 64 / decode_s, 1e3 * decode_s / 64,
        static_cast<unsigned long long>(digest));
  }
}

// Not a pass/fail test: with TANSY_PROFILE_DECODE set, brackets the decode steps after a 4,096-token
// prefill with cudaProfilerStart/Stop, for `ncu --profile-from-start off` (per-kernel times).
TEST(Synthetic, DecodeProfile) {
  if (!synth_dir() || !std::getenv("TANSY_PROFILE_DECODE"))
    GTEST_SKIP() << "set TANSY_SYNTH_DIR and TANSY_PROFILE_DECODE";
  auto m = open_cuda(synth_dir(), cuda::PrefillKernels::kTensorCore);
  const auto prompt = bench_prompt(4096, m->config().vocab_size);
  auto st = m->new_state(4096 + 8);
  int got = 0;
  m->generate_greedy(*st, prompt, 3, [&](int32_t) {
    if (got++ == 0) CUDA_CHECK(cudaProfilerStart());
    return true;
  });
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaProfilerStop());
  EXPECT_EQ(got, 3);
}

}  // namespace
}  // namespace tansy
