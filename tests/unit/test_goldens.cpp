// The CPU backend against Hugging Face transformers' float32 goldens (tools/make_goldens.py), in
// both checkpoint formats, and prefill-split invariance (whole == chunked == token by token).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/model.h"
#include "test_util.h"

namespace tansy {
namespace {

namespace fs = std::filesystem;

template <typename T>
std::vector<T> read_vec(const fs::path& p) {
  std::string s = test::read_file(p);
  std::vector<T> v(s.size() / sizeof(T));
  std::memcpy(v.data(), s.data(), v.size() * sizeof(T));
  return v;
}

// Every directory of tests/goldens with a golden.json (tools/make_goldens.py writes four).
std::vector<std::string> golden_models() {
  std::vector<std::string> names;
  std::error_code ec;
  for (auto& e : fs::directory_iterator(test::goldens_dir(), ec))
    if (fs::exists(e.path() / "golden.json")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(Goldens, AllFourArePresent) { EXPECT_EQ(golden_models().size(), 4u); }

class Golden : public ::testing::TestWithParam<std::string> {};

// Per row: max |tansy - HF| / max |HF| <= 1e-3.
TEST_P(Golden, LogitsMatchTransformers) {
  const fs::path dir = test::goldens_dir() / GetParam();
  auto g = nlohmann::json::parse(test::read_file(dir / "golden.json"));
  auto model = open_model(dir, ModelOptions{});
  const int V = model->config().vocab_size;
  double worst = 0;
  for (auto& s : g["sequences"]) {
    auto ids = read_vec<int32_t>(dir / s["ids"].get<std::string>());
    auto ref = read_vec<float>(dir / s["logits"].get<std::string>());
    ASSERT_EQ(ref.size(), ids.size() * size_t(V));
    auto st = model->new_state(int(ids.size()));
    std::vector<float> out(ref.size());
    model->forward(*st, ids, out, true);
    for (size_t r = 0; r < ids.size(); ++r) {
      double mx = 0, diff = 0;
      for (int c = 0; c < V; ++c) {
        mx = std::max(mx, double(std::fabs(ref[r * V + c])));
        diff = std::max(diff, double(std::fabs(out[r * V + c] - ref[r * V + c])));
      }
      ASSERT_TRUE(std::isfinite(diff));
      EXPECT_LE(diff / mx, 1e-3) << "sequence length " << ids.size() << ", row " << r;
      worst = std::max(worst, diff / mx);
    }
  }
  std::printf("[golden] %s: worst per-row max|dlogit|/max|logit| = %.3g\n", GetParam().c_str(), worst);
  RecordProperty("worst_rel_err", std::to_string(worst));
}

TEST_P(Golden, GreedyContinuationMatches) {
  const fs::path dir = test::goldens_dir() / GetParam();
  auto g = nlohmann::json::parse(test::read_file(dir / "golden.json"));
  auto want = g["greedy"]["tokens"].get<std::vector<int32_t>>();
  auto prompt = read_vec<int32_t>(dir / g["greedy"]["prompt"].get<std::string>());
  auto model = open_model(dir, ModelOptions{});
  auto st = model->new_state(int(prompt.size() + want.size()));
  std::vector<int32_t> got;
  model->generate_greedy(*st, prompt, int(want.size()), [&](int32_t t) {
    got.push_back(t);
    return true;
  });
  EXPECT_EQ(got, want);
}

TEST_P(Golden, PrefillSplitInvariance) {
  const fs::path dir = test::goldens_dir() / GetParam();
  auto ids = read_vec<int32_t>(dir / "seq200.ids");
  auto model = open_model(dir, ModelOptions{});
  const size_t V = size_t(model->config().vocab_size), n = ids.size();
  auto run = [&](const std::vector<int>& pieces) {
    auto st = model->new_state(int(n));
    std::vector<float> all(n * V);
    size_t pos = 0;
    for (int len : pieces) {
      model->forward(*st, std::span<const int32_t>(ids.data() + pos, len),
                     std::span<float>(all.data() + pos * V, len * V), true);
      pos += len;
    }
    EXPECT_EQ(pos, n);
    EXPECT_EQ(st->n_tokens(), int(n));
    return all;
  };
  auto whole = run({int(n)});
  auto chunked = run({1, 63, 65, 71});
  auto single = run(std::vector<int>(n, 1));
  for (size_t i = 0; i < whole.size(); ++i) {
    ASSERT_NEAR(whole[i], chunked[i], 1e-5f * std::max(1.0f, std::fabs(whole[i]))) << i;
    ASSERT_NEAR(whole[i], single[i], 1e-5f * std::max(1.0f, std::fabs(whole[i]))) << i;
  }
  // Last-position-only output equals the last row; a cloned state continues identically.
  auto st = model->new_state(int(n));
  std::vector<float> last(V), cont(V), cont2(V);
  model->forward(*st, std::span<const int32_t>(ids.data(), n - 1), last, false);
  auto copy = model->clone_state(*st);
  model->forward(*st, std::span<const int32_t>(ids.data() + n - 1, 1), cont, false);
  model->forward(*copy, std::span<const int32_t>(ids.data() + n - 1, 1), cont2, false);
  for (size_t c = 0; c < V; ++c) {
    EXPECT_NEAR(last[c], whole[(n - 2) * V + c], 1e-5f * std::max(1.0f, std::fabs(last[c])));
    EXPECT_EQ(cont[c], cont2[c]);
  }
}

// copy_state into a state that held other, more tokens: continuing the copy gives the source's
// logits bit for bit (nothing of the destination's own keys, values or GDN state is left), and
// the source continues like a state nobody copied from; into a state holding fewer tokens as well.
// A destination of another capacity is an error.
TEST_P(Golden, CopyStateContinuesLikeTheSource) {
  const fs::path dir = test::goldens_dir() / GetParam();
  auto ids = read_vec<int32_t>(dir / "seq200.ids");
  auto model = open_model(dir, ModelOptions{});
  const size_t V = size_t(model->config().vocab_size);
  const int cap = 256, k = 100;
  const std::span<const int32_t> all(ids);
  ASSERT_EQ(all.size(), 200u);
  auto src = model->new_state(cap), ref = model->new_state(cap), dst = model->new_state(cap);
  std::vector<float> scratch(V);
  model->forward(*src, all.first(k), scratch, false);
  model->forward(*ref, all.first(k), scratch, false);
  const std::vector<int32_t> other(ids.rbegin(), ids.rbegin() + 150);
  model->forward(*dst, other, scratch, false);
  ASSERT_TRUE(model->copy_state(*src, *dst));
  EXPECT_EQ(dst->n_tokens(), k);
  const auto rest = all.subspan(k);
  std::vector<float> from_copy(rest.size() * V), from_src(rest.size() * V), from_ref(rest.size() * V);
  model->forward(*dst, rest, from_copy, true);  // the copy first: feeding it must not touch the source
  model->forward(*src, rest, from_src, true);
  model->forward(*ref, rest, from_ref, true);
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same_bits(from_copy, from_src)) << "the copy continues unlike its source";
  EXPECT_TRUE(same_bits(from_src, from_ref)) << "copying changed the source";
  auto shorter = model->new_state(cap);
  model->forward(*shorter, all.first(3), scratch, false);
  ASSERT_TRUE(model->copy_state(*src, *shorter));
  EXPECT_EQ(shorter->n_tokens(), 200);
  std::vector<float> a(V), b(V);
  model->forward(*src, all.subspan(5, 1), a, false);
  model->forward(*shorter, all.subspan(5, 1), b, false);
  EXPECT_TRUE(same_bits(a, b)) << "a copy into a state that held fewer tokens";
  auto wider = model->new_state(cap + 1);
  try {
    model->copy_state(*src, *wider);
    ADD_FAILURE() << "copy_state into a state of another capacity did not fail";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "copy_state: the destination holds up to 257 tokens, the source up to 256");
  }
}

INSTANTIATE_TEST_SUITE_P(All, Golden, ::testing::ValuesIn(golden_models()), [](const auto& info) {
  std::string s = info.param;
  std::replace(s.begin(), s.end(), '-', '_');
  return s;
});

// A route override's weights: the token's softmax renormalised over the forced experts.
TEST(Model, OverrideWeightsAreTheSoftmaxOverTheForcedExperts) {
  const float logits[] = {1.f, 2.f, 0.5f, 3.f};
  const int32_t forced[] = {3, 1};
  float w[4] = {-1.f, -1.f, -1.f, -1.f};
  Model::override_weights(logits, 4, forced, w, 2);  // every other slot
  const float e3 = 1.f, e1 = std::exp(-1.f);
  EXPECT_FLOAT_EQ(w[0], e3 / (e3 + e1));
  EXPECT_FLOAT_EQ(w[2], e1 / (e3 + e1));
  EXPECT_EQ(w[1], -1.f);
  EXPECT_EQ(w[3], -1.f);
  const int32_t outside[] = {3, 4};
  EXPECT_THROW(Model::override_weights(logits, 4, outside, w), Error);
}

// Following the routes a model recorded gives its own logits (to rounding: the weights are recomputed);
// following other routes changes them (so a test that follows routes can tell the two apart).
TEST(Model, RouteOverrideFollowsTheGivenExperts) {
  auto model = open_model(test::goldens_dir() / "realdims-mlx", ModelOptions{});
  const auto ids = read_vec<int32_t>(test::goldens_dir() / "realdims-mlx" / "seq7.ids");
  const int V = model->config().vocab_size, K = model->config().experts_per_tok;
  const int E = model->config().num_experts;
  std::map<int, std::vector<int32_t>> routes;
  model->set_route_trace(
      [&](int layer, std::span<const int32_t> idx) { routes[layer].assign(idx.begin(), idx.end()); });
  std::vector<float> own(V), followed(V), other(V);
  auto a = model->new_state(int(ids.size()));
  model->forward(*a, ids, own, false);
  model->set_route_trace(nullptr);
  ASSERT_EQ(int(routes.size()), model->config().num_layers);
  for (bool shift : {false, true}) {
    int calls = 0;
    std::map<int, std::vector<int32_t>> given, used;  // what the override wrote, what the layers traced
    model->set_route_trace(
        [&](int layer, std::span<const int32_t> idx) { used[layer].assign(idx.begin(), idx.end()); });
    model->set_route_override([&](int layer, int n, std::span<int32_t> idx) {
      ++calls;
      EXPECT_EQ(size_t(n) * K, idx.size());
      if (layer == 0) {  // the inputs of the first layer are the first run's: so are its own choices
        EXPECT_TRUE(std::equal(idx.begin(), idx.end(), routes[layer].begin())) << "the layer's own choices";
      }
      for (size_t i = 0; i < idx.size(); ++i) {
        idx[i] = routes[layer][i];
        if (shift && i % K == 0) {  // a token's first choice moved to an expert it did not choose
          int e = (idx[i] + 1) % E;
          while (std::find(&routes[layer][i], &routes[layer][i] + K, e) != &routes[layer][i] + K)
            e = (e + 1) % E;
          idx[i] = e;
        }
      }
      given[layer].assign(idx.begin(), idx.end());
      return true;
    });
    auto b = model->new_state(int(ids.size()));
    model->forward(*b, ids, shift ? other : followed, false);
    model->set_route_override(nullptr);
    model->set_route_trace(nullptr);
    EXPECT_EQ(calls, model->config().num_layers);
    EXPECT_EQ(used, given) << "the layers route to the experts the override gave";
  }
  auto rel = [&](const std::vector<float>& x) {
    float mx = 0, d = 0;
    for (int i = 0; i < V; ++i)
      mx = std::max(mx, std::fabs(own[i])), d = std::max(d, std::fabs(x[i] - own[i]));
    return d / mx;
  };
  // The followed run recomputes the weights (override_weights) in its own order: rounding apart.
  std::printf("[route override] followed %.3g, moved %.3g of max|logit|\n", rel(followed), rel(other));
  EXPECT_LE(rel(followed), 1e-5);
  EXPECT_GE(rel(other), 1e-3);
}

TEST(Model, BadInputsAreErrors) {
  auto model = open_model(test::goldens_dir() / "realdims-mlx", ModelOptions{});
  auto st = model->new_state(4);
  std::vector<float> lg(model->config().vocab_size * 8);
  std::vector<int32_t> bad = {0, model->config().vocab_size};
  EXPECT_THROW(model->forward(*st, bad, lg, true), Error);
  std::vector<int32_t> neg = {-1};
  EXPECT_THROW(model->forward(*st, neg, lg, true), Error);
  std::vector<int32_t> empty;
  EXPECT_THROW(model->forward(*st, empty, lg, true), Error);
  std::vector<int32_t> five = {1, 2, 3, 4, 5};
  EXPECT_THROW(model->forward(*st, five, lg, true), Error);  // over capacity
  EXPECT_THROW(open_model(test::goldens_dir() / "no-such-model", ModelOptions{}), Error);
  ModelOptions o;
  o.backend = "tpu";
  EXPECT_THROW(open_model(test::goldens_dir() / "realdims-mlx", o), Error);
}

}  // namespace
}  // namespace tansy
