// Synthetic checkpoints: layout accepted by the strict loader, determinism, value scales.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/synth.h"
#include "bench/workload.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "cpu/ops.h"
#include "model/config.h"
#include "model/weights.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Small but structurally complete: 3 GDN layers + 1 attention layer, per-head dims of the real model.
json tiny_text_config() {
  return json{{"model_type", "qwen3_5_moe_text"},
              {"hidden_size", 128},
              {"num_hidden_layers", 4},
              {"vocab_size", 384},
              {"num_attention_heads", 2},
              {"num_key_value_heads", 1},
              {"head_dim", 256},
              {"linear_num_key_heads", 2},
              {"linear_num_value_heads", 4},
              {"linear_key_head_dim", 128},
              {"linear_value_head_dim", 128},
              {"linear_conv_kernel_dim", 4},
              {"num_experts", 8},
              {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 64},
              {"shared_expert_intermediate_size", 64},
              {"rope_parameters",
               {{"rope_type", "default"}, {"rope_theta", 10000000}, {"partial_rotary_factor", 0.25}}},
              {"eos_token_id", 3}};
}

struct TempDir {
  fs::path path;
  TempDir() {
    std::random_device rd;
    path = fs::temp_directory_path() / ("tansy-synth-" + std::to_string(rd()) + std::to_string(rd()));
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::vector<std::string> files_of(const fs::path& dir) {
  std::vector<std::string> v;
  for (auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

tansy::SynthOptions opts(uint64_t seed, int threads, size_t shard_bytes) {
  tansy::SynthOptions o;
  o.seed = seed;
  o.threads = threads;
  o.shard_bytes = shard_bytes;
  o.chunk_bytes = 4096;  // many chunks per tensor: exercises the split
  return o;
}

}  // namespace

TEST(Synth, TinyCheckpointLoadsThroughStrictLoader) {
  TempDir d;
  auto r = tansy::write_synthetic_checkpoint(tiny_text_config(), d.path, opts(7, 3, 200000));
  EXPECT_GT(r.shards, 1);  // small shard limit forces sharding
  auto cfg = tansy::load_config(d.path);
  ASSERT_TRUE(cfg.quant.has_value());
  EXPECT_EQ(cfg.quant->bits_for("language_model.model.layers.2.mlp.gate"), 8);
  EXPECT_EQ(cfg.quant->bits_for("language_model.model.layers.2.mlp.shared_expert_gate"), 8);
  EXPECT_EQ(cfg.quant->bits_for("language_model.model.layers.2.mlp.shared_expert.up_proj"), 4);
  auto store = tansy::TensorStore::open(d.path);
  EXPECT_EQ(int(store.tensors().size()), r.tensors);
  size_t bytes = 0;
  for (auto& [n, t] : store.tensors()) bytes += t.nbytes;
  EXPECT_EQ(bytes, r.data_bytes);
  auto w = tansy::load_weights(cfg, store);
  ASSERT_EQ(w.layers.size(), 4u);
  EXPECT_EQ(w.layers[3].kind, tansy::LayerKind::kFull);
  EXPECT_EQ(w.layers[0].moe.router.fmt, tansy::WFormat::kAffine8);
  EXPECT_EQ(w.layers[0].moe.sh_router.fmt, tansy::WFormat::kAffine8);
  EXPECT_EQ(w.layers[0].gdn.in_qkv.fmt, tansy::WFormat::kAffine4);
  EXPECT_EQ(w.stored_bytes, r.data_bytes);

  // Dequantized scales: embedding rows ~N(0,1)-like, projections ~1/sqrt(in), lm_head 4/sqrt(in).
  auto stats = [](const tansy::Linear& l) {
    std::vector<float> row(size_t(l.in));
    double s = 0, s2 = 0;
    for (int r = 0; r < l.out; ++r) {
      l.row(r, row.data());
      for (float v : row) s += v, s2 += double(v) * v;
    }
    double n = double(l.out) * l.in, mean = s / n;
    return std::pair<double, double>(mean, std::sqrt(s2 / n - mean * mean));
  };
  auto [em, es] = stats(w.embed);
  EXPECT_NEAR(em, 0.0, 0.05);
  EXPECT_NEAR(es, 1.0, 0.1);
  auto [qm, qs] = stats(w.layers[0].gdn.in_qkv);
  EXPECT_NEAR(qm, 0.0, 0.01);
  EXPECT_NEAR(qs * std::sqrt(128.0), 1.0, 0.1);
  auto [rm, rs] = stats(w.layers[1].moe.router);  // 8-bit codes
  EXPECT_NEAR(rm, 0.0, 0.01);
  EXPECT_NEAR(rs * std::sqrt(128.0), 1.0, 0.1);
  auto [lm, ls] = stats(w.lm_head);
  EXPECT_NEAR(ls * std::sqrt(128.0), 4.0, 0.4);
  // Norm multipliers are stored as 1 + w with w small.
  for (float v : w.layers[0].in_norm) EXPECT_NEAR(v, 1.0f, 0.11f);
  for (float v : w.layers[0].gdn.A_log) EXPECT_TRUE(v >= -1e-6f && v <= std::log(16.0f) + 1e-5f) << v;
  for (float v : w.layers[0].gdn.dt_bias)
    EXPECT_TRUE(v > -7.5f && v < -2.0f) << v;  // softplus^-1 of [1e-3, 1e-1]
}

TEST(Synth, DeterministicForSeedIndependentOfThreads) {
  TempDir a, b, c;
  tansy::write_synthetic_checkpoint(tiny_text_config(), a.path, opts(11, 1, 300000));
  tansy::write_synthetic_checkpoint(tiny_text_config(), b.path, opts(11, 4, 300000));
  tansy::write_synthetic_checkpoint(tiny_text_config(), c.path, opts(12, 2, 300000));
  ASSERT_EQ(files_of(a.path), files_of(b.path));
  int differing = 0;
  for (auto& f : files_of(a.path)) {
    EXPECT_EQ(read_all(a.path / f), read_all(b.path / f)) << f;
    if (f.find(".safetensors") != std::string::npos && f.find("index") == std::string::npos)
      differing += read_all(a.path / f) != read_all(c.path / f);
  }
  EXPECT_GT(differing, 0);  // another seed gives other values
}

TEST(Synth, RealConfigMatchesTheModel) {
  auto cfg = tansy::parse_config(tansy::real_model_config_json());
  EXPECT_TRUE(cfg.is_qwen36_35b_a3b);
  EXPECT_EQ(cfg.num_full_layers(), 10);
  EXPECT_EQ(cfg.eos_token_ids, (std::vector<int>{248046, 248044}));
  for (int i = 0; i < 40; ++i) {
    const std::string L = "language_model.model.layers." + std::to_string(i) + ".mlp.";
    EXPECT_EQ(cfg.quant->bits_for(L + "gate"), 8);
    EXPECT_EQ(cfg.quant->bits_for(L + "shared_expert_gate"), 8);
    EXPECT_EQ(cfg.quant->bits_for(L + "switch_mlp.up_proj"), 4);
  }
  auto j = tansy::real_model_config_json();
  EXPECT_EQ(j["quantization"], j["quantization_config"]);
}

// Expert selection rates of one layer's router (as written to the checkpoint, 8-bit codes) over
// `n` router inputs of independent N(0, 1) entries (the RMS-1 normed hidden state the router
// reads), sorted from the most chosen expert down, and the most chosen expert.
std::pair<std::vector<double>, int> router_rates(const tansy::Linear& router, int k, int n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(n) * router.in), logits(size_t(n) * router.out);
  for (auto& v : x) v = nd(gen);
  tansy::cpu::matmul(router, x.data(), n, logits.data());
  std::vector<int> count(static_cast<size_t>(router.out), 0), idx(static_cast<size_t>(k));
  std::vector<float> w(static_cast<size_t>(k));
  for (int t = 0; t < n; ++t) {
    tansy::cpu::route_topk(logits.data() + size_t(t) * router.out, router.out, k, idx.data(), w.data());
    for (int e : idx) ++count[size_t(e)];
  }
  const int top = int(std::max_element(count.begin(), count.end()) - count.begin());
  std::vector<double> rate;
  for (int c : count) rate.push_back(double(c) / n);
  std::sort(rate.rbegin(), rate.rend());
  return {rate, top};
}

// --router-skew: the routers of the written checkpoint, run on the CPU, choose experts at rates
// following the power law (rank r chosen by a share ~ r^-alpha); without it the load is flat.
TEST(Synth, RouterSkewFollowsThePowerLaw) {
  constexpr int E = 64, k = 4, n = 6000;
  constexpr double alpha = 0.6;
  auto cfg = tiny_text_config();
  cfg["hidden_size"] = 1024;  // row norms vary less with more inputs: less chance skew in the flat case
  cfg["num_experts"] = E;
  cfg["num_experts_per_tok"] = k;
  TempDir flat, skewed;
  tansy::write_synthetic_checkpoint(cfg, flat.path, opts(5, 2, 1 << 30));
  auto o = opts(5, 2, 1 << 30);
  o.router_skew = alpha;
  tansy::write_synthetic_checkpoint(cfg, skewed.path, o);
  EXPECT_NE(read_all(skewed.path / "tansy_synth.json").find("\"router_skew\": 0.6"), std::string::npos);

  const auto target = tansy::router_skew_rates(E, k, alpha);
  EXPECT_NEAR(std::accumulate(target.begin(), target.end(), 0.0), double(k), 1e-9);
  const double mean = double(k) / E;
  {
    auto store = tansy::TensorStore::open(flat.path);  // the weights point into it
    auto w = tansy::load_weights(tansy::load_config(flat.path), store);
    for (int layer : {0, 3}) {
      const auto [rate, top] = router_rates(w.layers[size_t(layer)].moe.router, k, n, 1);
      EXPECT_LT(rate.front() / mean, 1.5) << "flat router, layer " << layer;
      EXPECT_GT(rate.back() / mean, 0.6) << "flat router, layer " << layer;
    }
  }
  auto store = tansy::TensorStore::open(skewed.path);
  auto w = tansy::load_weights(tansy::load_config(skewed.path), store);
  int top_expert[2];
  for (int li = 0; li < 2; ++li) {
    const int layer = li == 0 ? 0 : 3;
    const auto [rate, top] = router_rates(w.layers[size_t(layer)].moe.router, k, n, 2 + li);
    top_expert[li] = top;
    const std::string at = "skewed router, layer " + std::to_string(layer);
    // most popular expert ~5x the mean rate, the least ~0.4x: within 20% of the power law
    EXPECT_NEAR(rate.front() / target.front(), 1.0, 0.2) << at << ": top rate " << rate.front();
    EXPECT_NEAR(rate.back() / target.back(), 1.0, 0.3) << at << ": bottom rate " << rate.back();
    // groups of 8 ranks (less noise than single ranks) within 15%
    for (int g = 0; g < E; g += 8) {
      double got = 0, want = 0;
      for (int r = g; r < g + 8; ++r) got += rate[size_t(r)], want += target[size_t(r)];
      EXPECT_NEAR(got / want, 1.0, 0.15) << at << ": ranks " << g + 1 << ".." << g + 8;
    }
    // least-squares slope of log(rate) on log(rank)
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (int r = 0; r < E; ++r) {
      const double x = std::log(r + 1.0), y = std::log(rate[size_t(r)]);
      sx += x, sy += y, sxx += x * x, sxy += x * y;
    }
    const double slope = (E * sxy - sx * sy) / (E * sxx - sx * sx);
    EXPECT_NEAR(slope, -alpha, 0.12) << at;
  }
  EXPECT_NE(top_expert[0], top_expert[1]) << "each layer draws its own popularity order";
}

TEST(Synth, RouterSkewRefusesWhatScalingCannotReach) {
  EXPECT_NO_THROW(tansy::router_skew_rates(256, 8, 0.5));
  EXPECT_THROW(tansy::router_skew_rates(256, 8, 1.0), tansy::Error);  // top expert would need 1.3 of tokens
  EXPECT_THROW(tansy::router_skew_rates(256, 8, -0.1), tansy::Error);
  TempDir d;
  auto o = opts(1, 1, 1 << 20);
  o.router_skew = 5.0;
  EXPECT_THROW(tansy::write_synthetic_checkpoint(tiny_text_config(), d.path, o), tansy::Error);
}

TEST(Synth, RefusesNonEmptyDirectoryAndBadConfig) {
  TempDir d;
  fs::create_directories(d.path);
  std::ofstream(d.path / "keep.txt") << "x";
  EXPECT_THROW(tansy::write_synthetic_checkpoint(tiny_text_config(), d.path, opts(1, 1, 1 << 20)),
               tansy::Error);
  TempDir e;
  auto bad = tiny_text_config();
  bad["hidden_size"] = 100;  // not a multiple of the group size
  EXPECT_THROW(tansy::write_synthetic_checkpoint(bad, e.path, opts(1, 1, 1 << 20)), tansy::Error);
  EXPECT_THROW(tansy::write_synthetic_checkpoint(json::array(), e.path, opts(1, 1, 1 << 20)), tansy::Error);
}

TEST(SynthTokenizer, RealLayoutUsesTheModelsSpecialIds) {
  const auto cfg = tansy::parse_config(tansy::real_model_config_json());
  const auto layout = tansy::synth_tokenizer_layout(cfg);
  EXPECT_EQ(layout.n_ordinary, 248044);
  EXPECT_EQ(layout.vocab_size(), 248070);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string text = tansy::synthetic_tokenizer_json(layout);
  const auto t1 = std::chrono::steady_clock::now();
  auto tok = tansy::Tokenizer::from_json(text);
  const auto t2 = std::chrono::steady_clock::now();
  std::printf("synthetic tokenizer: %.1f MB, generated in %.3f s, loaded in %.3f s\n",
              double(text.size()) / 1e6, std::chrono::duration<double>(t1 - t0).count(),
              std::chrono::duration<double>(t2 - t1).count());
  EXPECT_LT(std::chrono::duration<double>(t2 - t1).count(), 20.0);  // seconds even under sanitizers
  EXPECT_EQ(tok.vocab_size(), 248070);
  EXPECT_LT(tok.vocab_size(), cfg.vocab_size);  // embedding rows past it are padding
  // docs/MODEL.md §9 (and the config's eos list).
  EXPECT_EQ(tok.token_id("<|endoftext|>"), 248044);
  EXPECT_EQ(tok.token_id("<|im_start|>"), 248045);
  EXPECT_EQ(tok.token_id("<|im_end|>"), 248046);
  EXPECT_EQ(tok.token_id("<think>"), 248068);
  EXPECT_EQ(tok.token_id("</think>"), 248069);
  for (int eos : cfg.eos_token_ids) EXPECT_TRUE(tok.is_special(eos)) << eos;
  EXPECT_FALSE(tok.is_special(248068));
  // Every id decodes; every merged token is complete UTF-8 on its own, so a streamed token is
  // held back only when it is a lone UTF-8 lead byte.
  int held_back = 0;
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    ASSERT_TRUE(tok.is_valid(id)) << id;
    const std::string b = tok.token_bytes(id);
    ASSERT_FALSE(b.empty()) << id;
    if (id >= 256) {
      ASSERT_EQ(tansy::utf8_lossy(b), b) << id;
    } else {
      held_back += tansy::utf8_incomplete_tail(b) == 0;
    }
  }
  EXPECT_EQ(held_back, 0xF4 - 0xC2 + 1);
  // Round trips, and merges are used.
  for (std::string s :
       {"Hello, world! The quick brown fox jumps over the lazy dog.\n",
        "caf\xC3\xA9 \xCE\xB1\xCE\xB2\xCE\xB3 \xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x99\x82 tab\tend",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"}) {
    auto ids = tok.encode(s);
    EXPECT_EQ(tok.decode(ids), s);
    EXPECT_LT(ids.size(), s.size());
  }
  std::vector<int32_t> want = {248045};
  for (int32_t id : tok.encode("user")) want.push_back(id);
  EXPECT_EQ(tok.encode("<|im_start|>user"), want);
  EXPECT_EQ(tansy::synthetic_tokenizer_json(layout), text);  // deterministic
}

TEST(SynthTokenizer, OtherConfigsPutTheNamedTokensOnTop) {
  auto cfg = tansy::parse_config(tiny_text_config());
  auto layout = tansy::synth_tokenizer_layout(cfg);
  EXPECT_EQ(layout.vocab_size(), 384);
  auto tok = tansy::Tokenizer::from_json(tansy::synthetic_tokenizer_json(layout));
  EXPECT_EQ(tok.vocab_size(), 384);
  EXPECT_EQ(tok.token_id("<|endoftext|>"), 379);
  EXPECT_EQ(tok.token_id("<|im_start|>"), 380);
  EXPECT_EQ(tok.token_id("<|im_end|>"), 381);
  EXPECT_EQ(tok.token_id("<think>"), 382);
  EXPECT_EQ(tok.token_id("</think>"), 383);
  const std::string s = "abc \xC3\xA9\n";
  EXPECT_EQ(tok.decode(tok.encode(s)), s);
  cfg.vocab_size = 260;
  EXPECT_THROW(tansy::synth_tokenizer_layout(cfg), tansy::Error);
  // Refused before anything is written.
  TempDir d;
  auto small = tiny_text_config();
  small["vocab_size"] = 256;
  auto o = opts(1, 1, 1 << 20);
  o.tokenizer = true;
  EXPECT_THROW(tansy::write_synthetic_checkpoint(small, d.path, o), tansy::Error);
  EXPECT_TRUE(!fs::exists(d.path) || fs::is_empty(d.path));
  o.tokenizer = false;
  EXPECT_NO_THROW(tansy::write_synthetic_checkpoint(small, d.path, o));
}

TEST(SynthTokenizer, CheckpointWithTokenizerIsServable) {
  TempDir d;
  auto o = opts(3, 2, 1 << 30);
  o.tokenizer = true;
  auto r = tansy::write_synthetic_checkpoint(tiny_text_config(), d.path, o);
  EXPECT_EQ(r.tokenizer_ids, 384);
  EXPECT_EQ(files_of(d.path),
            (std::vector<std::string>{"chat_template.jinja", "config.json",
                                      "model-00001-of-00001.safetensors", "model.safetensors.index.json",
                                      "tansy_synth.json", "tokenizer.json", "tokenizer_config.json"}));
  EXPECT_TRUE(tansy::text::ChatTemplate::load(d.path).is_qwen36());
  auto tok = tansy::Tokenizer::load(d.path);
  EXPECT_EQ(tok.vocab_size(), tansy::load_config(d.path).vocab_size);
  auto tc = json::parse(read_all(d.path / "tokenizer_config.json"));
  EXPECT_EQ(tc["add_bos_token"], false);
  EXPECT_EQ(tc["added_tokens_decoder"]["381"]["content"], "<|im_end|>");
}

TEST(BenchWorkload, PromptAndDigestFollowTheContract) {
  auto p = tansy::synthetic_prompt(5, 248320);
  EXPECT_EQ(p, (std::vector<int32_t>{0, 143281, 13666, 156947, 27332}));
  EXPECT_EQ(tansy::synthetic_prompt(100001, 248320)[100000], 138912);  // i * 2654435761 wraps mod 2^32
  EXPECT_EQ(tansy::fnv1a64_ids({}), 0xcbf29ce484222325ULL);
  std::vector<int32_t> ids{1, 248319, -1};
  EXPECT_EQ(tansy::fnv1a64_ids(ids), 0x2c76eec96b9ab5bfULL);  // reference computed in Python
}

TEST(BenchWorkload, CostModelMatchesModelMd) {
  auto m = tansy::cost_model(tansy::parse_config(tansy::real_model_config_json()));
  // MODEL.md §10: ~1.67 GB read per decode token, ~2.95 B active parameters, 20 KiB KV per token,
  // 60 MiB of GDN state.
  EXPECT_NEAR(m.weight_bytes_per_token / 1e9, 1.67, 0.01);
  EXPECT_NEAR(m.active_params / 1e9, 2.95, 0.01);
  EXPECT_EQ(m.kv_bytes_per_context_token, 20480.0);
  EXPECT_EQ(m.gdn_state_bytes, 60.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(m.decode_bytes(1000), m.weight_bytes_per_token + 20480.0 * 1000 + 120.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(m.prefill_flops(4096), 4096 * (2 * m.active_params + 10.0 * 4 * 16 * 256 * 4096 / 2));
}
