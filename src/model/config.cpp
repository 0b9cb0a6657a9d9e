#include "model/config.h"

#include <fmt/ranges.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace tansy {

using nlohmann::json;

namespace {

// Field readers: every message names the field (with its path) and what was expected.
struct Reader {
  const json& j;
  std::string path;  // "text_config." or ""

  bool has(const char* k) const { return j.contains(k) && !j[k].is_null(); }

  int integer(const char* k, int lo, int hi) const {
    if (!has(k)) fail("config.json: missing field '{}{}'", path, k);
    return integer_value(k, j[k], lo, hi);
  }
  int integer_or(const char* k, int fallback, int lo, int hi) const {
    return has(k) ? integer_value(k, j[k], lo, hi) : fallback;
  }
  int integer_value(const char* k, const json& v, int lo, int hi) const {
    if (!v.is_number_integer())
      fail("config.json: field '{}{}' must be an integer, got {}", path, k, v.dump());
    int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) fail("config.json: field '{}{}' = {} is outside [{}, {}]", path, k, x, lo, hi);
    return int(x);
  }
  double number_or(const char* k, double fallback, double lo, double hi) const {
    if (!has(k)) return fallback;
    if (!j[k].is_number()) fail("config.json: field '{}{}' must be a number, got {}", path, k, j[k].dump());
    double x = j[k].get<double>();
    if (!(x >= lo && x <= hi)) fail("config.json: field '{}{}' = {} is outside [{}, {}]", path, k, x, lo, hi);
    return x;
  }
  void expect_bool(const char* k, bool want, bool required) const {
    if (!has(k)) {
      if (required) fail("config.json: missing field '{}{}' (must be {})", path, k, want);
      return;
    }
    if (!j[k].is_boolean() || j[k].get<bool>() != want)
      fail("config.json: field '{}{}' = {} is not supported (tansy implements {})", path, k, j[k].dump(),
           want);
  }
  void expect_string(const char* k, const std::vector<std::string>& allowed, bool required) const {
    if (!has(k)) {
      if (required) fail("config.json: missing field '{}{}'", path, k);
      return;
    }
    if (!j[k].is_string()) fail("config.json: field '{}{}' must be a string", path, k);
    for (auto& a : allowed)
      if (j[k].get<std::string>() == a) return;
    fail("config.json: field '{}{}' = {} is not supported (expected {})", path, k, j[k].dump(),
         fmt::join(allowed, " or "));
  }
};

std::vector<int> read_ids(const json& v, const char* what) {
  std::vector<int> ids;
  if (v.is_number_integer()) {
    ids.push_back(v.get<int>());
  } else if (v.is_array()) {
    for (auto& x : v) {
      if (!x.is_number_integer()) fail("config.json: '{}' must hold integers", what);
      ids.push_back(x.get<int>());
    }
  } else if (!v.is_null()) {
    fail("config.json: '{}' must be an integer or a list of integers", what);
  }
  return ids;
}

}  // namespace

int QuantConfig::bits_for(const std::string& module_path) const {
  auto it = bits_override.find(module_path);
  return it == bits_override.end() ? bits : it->second;
}

int ModelConfig::num_full_layers() const {
  int n = 0;
  for (auto k : layers) n += k == LayerKind::kFull;
  return n;
}

ModelConfig parse_config(const json& top) {
  if (!top.is_object()) fail("config.json: must be a JSON object");
  const json* tj = &top;
  std::string path;
  if (top.contains("text_config")) {
    if (!top["text_config"].is_object()) fail("config.json: field 'text_config' must be an object");
    Reader{top, ""}.expect_string("model_type", {"qwen3_5_moe"}, true);
    tj = &top["text_config"];
    path = "text_config.";
    Reader{*tj, path}.expect_string("model_type", {"qwen3_5_moe_text"}, false);
  } else {
    Reader{top, ""}.expect_string("model_type", {"qwen3_5_moe_text", "qwen3_5_moe"}, true);
  }
  Reader r{*tj, path};
  ModelConfig c;
  constexpr int kBig = 1 << 24;
  c.hidden_size = r.integer("hidden_size", 1, 65536);
  c.num_layers = r.integer("num_hidden_layers", 1, 1024);
  c.vocab_size = r.integer("vocab_size", 1, kBig);
  c.num_heads = r.integer("num_attention_heads", 1, 1024);
  c.num_kv_heads = r.integer("num_key_value_heads", 1, 1024);
  c.head_dim = r.integer_or("head_dim", c.hidden_size / c.num_heads, 2, 4096);
  c.lin_num_k_heads = r.integer("linear_num_key_heads", 1, 1024);
  c.lin_num_v_heads = r.integer("linear_num_value_heads", 1, 1024);
  c.lin_k_head_dim = r.integer("linear_key_head_dim", 1, 4096);
  c.lin_v_head_dim = r.integer("linear_value_head_dim", 1, 4096);
  c.conv_kernel = r.integer("linear_conv_kernel_dim", 1, 64);
  c.num_experts = r.integer("num_experts", 1, 65536);
  c.experts_per_tok = r.integer("num_experts_per_tok", 1, c.num_experts);
  c.moe_intermediate = r.integer("moe_intermediate_size", 1, kBig);
  c.shared_intermediate = r.integer("shared_expert_intermediate_size", 1, kBig);
  c.rms_eps = float(r.number_or("rms_norm_eps", 1e-6, 1e-12, 1e-2));
  c.max_position = r.integer_or("max_position_embeddings", 32768, 1, 1 << 30);

  r.expect_string("hidden_act", {"silu"}, false);
  r.expect_bool("tie_word_embeddings", false, false);
  if (top.contains("text_config")) Reader{top, ""}.expect_bool("tie_word_embeddings", false, false);
  r.expect_bool("attention_bias", false, false);
  r.expect_bool("attn_output_gate", true, false);
  if (r.has("norm_topk_prob")) r.expect_bool("norm_topk_prob", true, false);

  if (c.num_heads % c.num_kv_heads != 0)
    fail("config.json: field '{}num_attention_heads' ({}) must be a multiple of num_key_value_heads ({})",
         path, c.num_heads, c.num_kv_heads);
  if (c.lin_num_v_heads % c.lin_num_k_heads != 0)
    fail("config.json: field '{}linear_num_value_heads' ({}) must be a multiple of linear_num_key_heads ({})",
         path, c.lin_num_v_heads, c.lin_num_k_heads);
  if (c.hidden_size % 64 != 0)
    fail("config.json: field '{}hidden_size' ({}) must be a multiple of 64", path, c.hidden_size);

  // RoPE: rope_parameters (transformers 5) or legacy rope_theta / partial_rotary_factor / rope_scaling.
  double theta = 10000.0, partial = 0.25;
  const json* rp = nullptr;
  if (r.has("rope_parameters"))
    rp = &(*tj)["rope_parameters"];
  else if (r.has("rope_scaling"))
    rp = &(*tj)["rope_scaling"];
  if (rp) {
    if (!rp->is_object()) fail("config.json: field '{}rope_parameters' must be an object", path);
    Reader rr{*rp, path + "rope_parameters."};
    rr.expect_string("rope_type", {"default"}, false);
    if (rr.has("type")) rr.expect_string("type", {"default", "mrope"}, false);
    theta = rr.number_or("rope_theta", r.number_or("rope_theta", theta, 1, 1e12), 1, 1e12);
    partial =
        rr.number_or("partial_rotary_factor", r.number_or("partial_rotary_factor", partial, 0, 1), 1e-6, 1);
    if (rr.has("mrope_interleaved") && !(*rp)["mrope_interleaved"].is_boolean())
      fail("config.json: field '{}rope_parameters.mrope_interleaved' must be a boolean", path);
  } else {
    theta = r.number_or("rope_theta", theta, 1, 1e12);
    partial = r.number_or("partial_rotary_factor", partial, 1e-6, 1);
  }
  c.rope_theta = theta;
  double rd = c.head_dim * partial;
  if (std::fabs(rd - std::round(rd)) > 1e-9 || int(std::round(rd)) % 2 != 0 || rd < 2)
    fail(
        "config.json: partial_rotary_factor {} gives a rotary dimension {} that is not a positive even "
        "integer",
        partial, rd);
  c.rotary_dim = int(std::round(rd));

  // Layer schedule.
  if (r.has("layer_types")) {
    const json& lt = (*tj)["layer_types"];
    if (!lt.is_array() || int(lt.size()) != c.num_layers)
      fail("config.json: field '{}layer_types' must list {} entries (num_hidden_layers)", path, c.num_layers);
    for (size_t i = 0; i < lt.size(); ++i) {
      std::string s = lt[i].is_string() ? lt[i].get<std::string>() : "";
      if (s == "linear_attention")
        c.layers.push_back(LayerKind::kLinear);
      else if (s == "full_attention")
        c.layers.push_back(LayerKind::kFull);
      else
        fail("config.json: field '{}layer_types[{}]' = {} is not linear_attention or full_attention", path, i,
             lt[i].dump());
    }
  } else {
    int interval = r.integer_or("full_attention_interval", 4, 1, 1024);
    for (int i = 0; i < c.num_layers; ++i)
      c.layers.push_back((i + 1) % interval ? LayerKind::kLinear : LayerKind::kFull);
  }

  // End-of-sequence ids: the top-level list overrides text_config's scalar (chat checkpoints).
  auto check_ids = [&](const std::vector<int>& ids, const std::string& field) {
    for (int id : ids)
      if (id < 0 || id >= c.vocab_size)
        fail("config.json: field '{}' holds {}, outside the vocabulary", field, id);
    return ids;
  };
  if (r.has("eos_token_id"))
    c.eos_token_ids = check_ids(read_ids((*tj)["eos_token_id"], "eos_token_id"), path + "eos_token_id");
  if (tj != &top && top.contains("eos_token_id") && !top["eos_token_id"].is_null())
    c.eos_token_ids = check_ids(read_ids(top["eos_token_id"], "eos_token_id"), "eos_token_id");

  // MLX affine quantization block.
  const char* qkey = top.contains("quantization")          ? "quantization"
                     : top.contains("quantization_config") ? "quantization_config"
                                                           : nullptr;
  if (qkey) {
    const json& q = top[qkey];
    if (!q.is_object()) fail("config.json: field '{}' must be an object", qkey);
    Reader qr{q, std::string(qkey) + "."};
    if (qr.has("mode")) qr.expect_string("mode", {"affine"}, false);
    if (qr.has("quant_method"))
      fail("config.json: field '{}.quant_method' = {} is not MLX affine quantization", qkey,
           q["quant_method"].dump());
    QuantConfig qc;
    qc.group_size = qr.integer("group_size", 1, 1 << 20);
    qc.bits = qr.integer("bits", 1, 8);
    if (qc.group_size != 64)
      fail("config.json: field '{}.group_size' = {} is not supported (64)", qkey, qc.group_size);
    if (qc.bits != 4 && qc.bits != 8)
      fail("config.json: field '{}.bits' = {} is not supported (4 or 8)", qkey, qc.bits);
    for (auto& [k, v] : q.items()) {
      if (!v.is_object()) continue;
      Reader vr{v, std::string(qkey) + "." + k + "."};
      int gs = vr.integer("group_size", 1, 1 << 20), b = vr.integer("bits", 1, 8);
      if (gs != 64 || (b != 4 && b != 8))
        fail("config.json: field '{}.{}' = {} is not supported (group 64, 4 or 8 bits)", qkey, k, v.dump());
      qc.bits_override[k] = b;
    }
    c.quant = qc;
  }

  c.is_qwen36_35b_a3b = c.hidden_size == 2048 && c.num_layers == 40 && c.vocab_size == 248320 &&
                        c.num_heads == 16 && c.num_kv_heads == 2 && c.head_dim == 256 && c.rotary_dim == 64 &&
                        c.lin_num_k_heads == 16 && c.lin_num_v_heads == 32 && c.lin_k_head_dim == 128 &&
                        c.lin_v_head_dim == 128 && c.conv_kernel == 4 && c.num_experts == 256 &&
                        c.experts_per_tok == 8 && c.moe_intermediate == 512 && c.shared_intermediate == 512 &&
                        c.num_full_layers() == 10;
  c.name = c.is_qwen36_35b_a3b
               ? "Qwen3.6-35B-A3B"
               : fmt::format("qwen3_5_moe (custom: hidden {}, {} layers, {} experts top-{}, vocab {})",
                             c.hidden_size, c.num_layers, c.num_experts, c.experts_per_tok, c.vocab_size);
  return c;
}

ModelConfig load_config(const std::filesystem::path& dir) {
  auto path = dir / "config.json";
  std::ifstream in(path);
  if (!in) fail("cannot read {} (is {} a model directory?)", path.string(), dir.string());
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", path.string(), e.what());
  }
  ModelConfig c = parse_config(j);
  auto gpath = dir / "generation_config.json";
  if (std::filesystem::exists(gpath)) {
    std::ifstream gin(gpath);
    json g;
    try {
      g = json::parse(gin);
    } catch (const json::exception& e) {
      fail("{}: not valid JSON: {}", gpath.string(), e.what());
    }
    if (g.is_object() && g.contains("eos_token_id")) {
      auto ids = read_ids(g["eos_token_id"], "generation_config.eos_token_id");
      for (int id : ids)
        if (id < 0 || id >= c.vocab_size)
          fail("generation_config.json: eos_token_id {} is outside the vocabulary", id);
      if (!ids.empty()) c.eos_token_ids = ids;
    }
  }
  return c;
}

}  // namespace tansy
