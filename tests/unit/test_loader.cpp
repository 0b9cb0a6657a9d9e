// Strict weight loading: every tensor consumed or explicitly skipped; anything missing, extra,
// mis-shaped or mis-typed is an Error naming the tensor. Both checkpoint formats.
#include <gtest/gtest.h>

#include "core/error.h"
#include "core/safetensors.h"
#include "model/weights.h"
#include "test_util.h"

namespace tansy {
namespace {

namespace fs = std::filesystem;

// Copies a golden model into a temp dir with its tensors passed through `edit`; returns the error
// message of loading it ("" when it loads).
template <typename Edit>
std::string load_edited(const char* model, Edit edit) {
  test::TempDir d;
  fs::copy_file(test::goldens_dir() / model / "config.json", d.path() / "config.json");
  auto t = test::read_raw(test::goldens_dir() / model / "model.safetensors");
  edit(t);
  test::write_raw(d.path() / "model.safetensors", t);
  try {
    ModelConfig cfg = load_config(d.path());
    TensorStore st = TensorStore::open(d.path());
    load_weights(cfg, st);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(Loader, LoadsGoldenModelsInBothFormats) {
  for (const char* m : {"realdims-mlx", "realdims-bf16", "smalldims-mlx", "smalldims-bf16"}) {
    EXPECT_EQ(load_edited(m, [](auto&) {}), "") << m;
  }
  ModelConfig cfg = load_config(test::goldens_dir() / "realdims-mlx");
  TensorStore st = TensorStore::open(test::goldens_dir() / "realdims-mlx");
  ModelWeights w = load_weights(cfg, st);
  EXPECT_EQ(w.format, CheckpointFormat::kMlxAffine);
  EXPECT_EQ(w.layers[0].moe.router.fmt, WFormat::kAffine8);
  EXPECT_EQ(w.layers[0].moe.sh_router.fmt, WFormat::kAffine8);
  EXPECT_EQ(w.layers[0].moe.gate[3].fmt, WFormat::kAffine4);
  EXPECT_EQ(w.layers[3].kind, LayerKind::kFull);
  EXPECT_EQ(int(w.layers[0].gdn.conv.size()), cfg.lin_conv_dim() * cfg.conv_kernel);
}

TEST(Loader, MissingTensorIsNamed) {
  const std::string victim = "language_model.model.layers.2.linear_attn.dt_bias";
  auto msg = load_edited("realdims-mlx", [&](auto& t) { t.erase(victim); });
  EXPECT_NE(msg.find("missing tensor '" + victim + "'"), std::string::npos) << msg;
  const std::string v2 = "model.language_model.layers.1.mlp.experts.down_proj";
  msg = load_edited("realdims-bf16", [&](auto& t) { t.erase(v2); });
  EXPECT_NE(msg.find(v2), std::string::npos) << msg;
}

TEST(Loader, ExtraTensorIsNamed) {
  auto msg = load_edited("realdims-mlx", [](auto& t) {
    t["language_model.model.layers.0.mlp.mystery.weight"] = test::RawTensor{"F32", {1}, std::string(4, '\0')};
  });
  EXPECT_NE(msg.find("unexpected tensor 'language_model.model.layers.0.mlp.mystery.weight'"),
            std::string::npos)
      << msg;
}

TEST(Loader, VisionTowerAndMtpAreSkipped) {
  auto msg = load_edited("realdims-mlx", [](auto& t) {
    t["vision_tower.blocks.0.attn.qkv.weight"] = test::RawTensor{"BF16", {2}, std::string(4, '\0')};
  });
  EXPECT_EQ(msg, "");
  msg = load_edited("realdims-bf16", [](auto& t) {
    t["mtp.fc.weight"] = test::RawTensor{"BF16", {2}, std::string(4, '\0')};
    t["model.visual.patch_embed.proj.weight"] = test::RawTensor{"BF16", {2}, std::string(4, '\0')};
  });
  EXPECT_EQ(msg, "");
}

TEST(Loader, WrongShapeIsNamed) {
  const std::string victim = "language_model.model.layers.3.self_attn.q_norm.weight";
  auto msg = load_edited("realdims-mlx", [&](auto& t) {
    t[victim].shape = {128};
    t[victim].bytes.resize(256);
  });
  EXPECT_NE(msg.find("tensor '" + victim + "' has shape [128]"), std::string::npos) << msg;
  const std::string v2 = "model.language_model.layers.0.linear_attn.in_proj_z.weight";
  msg = load_edited("realdims-bf16", [&](auto& t) {
    auto& x = t[v2];
    std::swap(x.shape[0], x.shape[1]);
  });
  EXPECT_NE(msg.find("tensor '" + v2 + "' has shape"), std::string::npos) << msg;
}

TEST(Loader, WrongDtypeIsNamed) {
  const std::string victim = "language_model.model.layers.0.linear_attn.in_proj_qkv.scales";
  auto msg = load_edited("realdims-mlx", [&](auto& t) { t[victim].dtype = "F16"; });
  EXPECT_NE(msg.find("tensor '" + victim + "' has dtype F16"), std::string::npos) << msg;
  const std::string v2 = "model.language_model.layers.0.linear_attn.out_proj.weight";
  msg = load_edited("realdims-bf16", [&](auto& t) { t[v2].dtype = "I16"; });
  EXPECT_NE(msg.find("tensor '" + v2 + "' has dtype I16"), std::string::npos) << msg;
}

TEST(Loader, QuantBitsCrossCheckedWithConfig) {
  // Re-label an 8-bit router as 4-bit in shape terms: halve the packed columns.
  const std::string victim = "language_model.model.layers.1.mlp.gate.weight";
  auto msg = load_edited("realdims-mlx", [&](auto& t) {
    auto& x = t[victim];
    x.shape[1] /= 2;
    x.bytes.resize(x.bytes.size() / 2);
  });
  EXPECT_NE(msg.find(victim), std::string::npos) << msg;
  EXPECT_NE(msg.find("declares 8 bits"), std::string::npos) << msg;
  // Unsupported code width (3 bits would need 6 packed words for 64 inputs).
  const std::string v2 = "language_model.model.layers.1.mlp.shared_expert.up_proj.weight";
  msg = load_edited("realdims-mlx", [&](auto& t) {
    auto& x = t[v2];
    x.shape[1] = 6;
    x.bytes.resize(size_t(x.shape[0]) * 6 * 4);
  });
  EXPECT_NE(msg.find(v2), std::string::npos) << msg;
}

TEST(Loader, FormatMismatchWithConfig) {
  // An MLX checkpoint whose config lost its quantization block.
  test::TempDir d;
  auto cfg = nlohmann::json::parse(test::read_file(test::goldens_dir() / "realdims-mlx" / "config.json"));
  cfg.erase("quantization");
  cfg.erase("quantization_config");
  test::write_file(d.path() / "config.json", cfg.dump());
  fs::copy_file(test::goldens_dir() / "realdims-mlx" / "model.safetensors", d.path() / "model.safetensors");
  try {
    ModelConfig c = load_config(d.path());
    TensorStore st = TensorStore::open(d.path());
    load_weights(c, st);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no 'quantization' block"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tansy
