// config.json: the real 35B-A3B shape is recognised, smaller configs of the architecture load, and
// anything outside the architecture is rejected with a message naming the field.
#include <gtest/gtest.h>

#include "core/error.h"
#include "model/config.h"
#include "test_util.h"

namespace tansy {
namespace {

using nlohmann::json;

// The real model's config.json, as docs/MODEL.md §1 describes it (VLM wrapper, MLX quantization block).
json real_config() {
  json layer_types = json::array();
  for (int i = 0; i < 40; ++i) layer_types.push_back(i % 4 == 3 ? "full_attention" : "linear_attention");
  json q = {{"group_size", 64}, {"bits", 4}};
  for (int i = 0; i < 40; ++i) {
    q["language_model.model.layers." + std::to_string(i) + ".mlp.gate"] = {{"group_size", 64}, {"bits", 8}};
    q["language_model.model.layers." + std::to_string(i) + ".mlp.shared_expert_gate"] = {{"group_size", 64},
                                                                                         {"bits", 8}};
  }
  return {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}},
          {"model_type", "qwen3_5_moe"},
          {"tie_word_embeddings", false},
          {"eos_token_id", {248046, 248044}},
          {"quantization", q},
          {"vision_config", {{"depth", 27}}},
          {"text_config",
           {{"model_type", "qwen3_5_moe_text"},
            {"hidden_size", 2048},
            {"num_hidden_layers", 40},
            {"vocab_size", 248320},
            {"num_attention_heads", 16},
            {"num_key_value_heads", 2},
            {"head_dim", 256},
            {"attn_output_gate", true},
            {"linear_num_key_heads", 16},
            {"linear_num_value_heads", 32},
            {"linear_key_head_dim", 128},
            {"linear_value_head_dim", 128},
            {"linear_conv_kernel_dim", 4},
            {"num_experts", 256},
            {"num_experts_per_tok", 8},
            {"moe_intermediate_size", 512},
            {"shared_expert_intermediate_size", 512},
            {"hidden_act", "silu"},
            {"rms_norm_eps", 1e-6},
            {"tie_word_embeddings", false},
            {"max_position_embeddings", 262144},
            {"full_attention_interval", 4},
            {"layer_types", layer_types},
            {"rope_parameters",
             {{"rope_type", "default"},
              {"rope_theta", 10000000},
              {"partial_rotary_factor", 0.25},
              {"mrope_section", {11, 11, 10}},
              {"mrope_interleaved", true}}},
            {"eos_token_id", 248044},
            {"mamba_ssm_dtype", "float32"},
            {"dtype", "bfloat16"}}}};
}

void expect_error(const json& j, const std::string& needle) {
  try {
    parse_config(j);
    FAIL() << "accepted; expected an error naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Config, RecognisesTheRealModel) {
  ModelConfig c = parse_config(real_config());
  EXPECT_TRUE(c.is_qwen36_35b_a3b);
  EXPECT_EQ(c.name, "Qwen3.6-35B-A3B");
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_EQ(c.num_full_layers(), 10);
  EXPECT_EQ(c.lin_conv_dim(), 8192);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{248046, 248044}));
  ASSERT_TRUE(c.quant.has_value());
  EXPECT_EQ(c.quant->bits_for("language_model.model.layers.3.mlp.gate"), 8);
  EXPECT_EQ(c.quant->bits_for("language_model.model.layers.3.mlp.switch_mlp.up_proj"), 4);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
}

TEST(Config, AcceptsSmallConfigsAndFlatLayout) {
  json j = real_config();
  json t = j["text_config"];
  t["hidden_size"] = 128;
  t["num_experts"] = 8;
  t["num_experts_per_tok"] = 2;
  t.erase("layer_types");  // derived from full_attention_interval
  t["num_hidden_layers"] = 8;
  t["model_type"] = "qwen3_5_moe_text";
  ModelConfig c = parse_config(t);  // flat text config
  EXPECT_FALSE(c.is_qwen36_35b_a3b);
  EXPECT_EQ(c.layers.size(), 8u);
  EXPECT_EQ(c.layers[3], LayerKind::kFull);
  EXPECT_EQ(c.layers[2], LayerKind::kLinear);
  EXPECT_FALSE(c.quant.has_value());
  EXPECT_NE(c.name.find("custom"), std::string::npos);
}

TEST(Config, LoadsEveryGoldenConfig) {
  for (const char* m : {"realdims-mlx", "realdims-bf16", "smalldims-mlx", "smalldims-bf16"}) {
    ModelConfig c = load_config(test::goldens_dir() / m);
    EXPECT_EQ(c.quant.has_value(), std::string(m).find("mlx") != std::string::npos) << m;
  }
}

TEST(Config, RejectionsNameTheField) {
  auto with = [](const std::string& key, json v) {
    json j = real_config();
    j["text_config"][key] = v;
    return j;
  };
  auto without = [](const std::string& key) {
    json j = real_config();
    j["text_config"].erase(key);
    return j;
  };
  expect_error(with("hidden_act", "gelu"), "text_config.hidden_act");
  expect_error(with("tie_word_embeddings", true), "text_config.tie_word_embeddings");
  expect_error(with("attn_output_gate", false), "text_config.attn_output_gate");
  expect_error(with("hidden_size", "2048"), "text_config.hidden_size");
  expect_error(with("hidden_size", 100), "text_config.hidden_size");
  expect_error(with("num_experts_per_tok", 300), "text_config.num_experts_per_tok");
  expect_error(with("num_key_value_heads", 3), "num_attention_heads");
  expect_error(with("linear_num_value_heads", 33), "linear_num_value_heads");
  expect_error(with("layer_types", json::array({"full_attention"})), "text_config.layer_types");
  json lt = real_config()["text_config"]["layer_types"];
  lt[5] = "sliding_attention";
  expect_error(with("layer_types", lt), "text_config.layer_types[5]");
  expect_error(with("eos_token_id", 999999), "eos_token_id");
  expect_error(without("vocab_size"), "text_config.vocab_size");
  expect_error(without("num_experts"), "text_config.num_experts");
  json rp = real_config()["text_config"]["rope_parameters"];
  rp["rope_type"] = "yarn";
  expect_error(with("rope_parameters", rp), "rope_parameters.rope_type");
  rp = real_config()["text_config"]["rope_parameters"];
  rp["partial_rotary_factor"] = 0.3;
  expect_error(with("rope_parameters", rp), "partial_rotary_factor");

  json j = real_config();
  j["model_type"] = "llama";
  expect_error(j, "model_type");
  j = real_config();
  j["text_config"] = 5;
  expect_error(j, "text_config");
  j = real_config();
  j["quantization"]["bits"] = 3;
  expect_error(j, "quantization.bits");
  j = real_config();
  j["quantization"]["group_size"] = 32;
  expect_error(j, "quantization.group_size");
  j = real_config();
  j["quantization"]["mode"] = "mxfp4";
  expect_error(j, "quantization.mode");
  expect_error(json::array(), "JSON object");
}

TEST(Config, FileErrors) {
  test::TempDir d;
  EXPECT_THROW(load_config(d.path()), Error);
  test::write_file(d.path() / "config.json", "{not json");
  EXPECT_THROW(load_config(d.path()), Error);
  test::write_file(d.path() / "config.json", real_config().dump());
  test::write_file(d.path() / "generation_config.json", R"({"eos_token_id": [248046]})");
  EXPECT_EQ(load_config(d.path()).eos_token_ids, (std::vector<int>{248046}));
}

}  // namespace
}  // namespace tansy
