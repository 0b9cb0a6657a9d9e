// safetensors parsing: valid files, and every way a corrupt, truncated or hostile file must fail
// with a clear Error (never a crash; CI also runs these under ASan/UBSan).
#include <gtest/gtest.h>

#include "core/error.h"
#include "core/safetensors.h"
#include "test_util.h"

namespace tansy {
namespace {

using nlohmann::json;
using test::safetensors_image;

std::vector<TensorView> parse(const std::string& img) {
  return parse_safetensors(reinterpret_cast<const uint8_t*>(img.data()), img.size(), "test.safetensors");
}

// Expects an Error whose message contains `needle`.
void expect_error(const std::string& img, const std::string& needle) {
  try {
    parse(img);
    FAIL() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

json entry(const char* dtype, std::vector<int64_t> shape, uint64_t b, uint64_t e) {
  return {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {b, e}}};
}

TEST(Safetensors, ParsesValidFile) {
  json h = {{"a", entry("F32", {2, 3}, 0, 24)},
            {"b", entry("BF16", {4}, 24, 32)},
            {"__metadata__", {{"format", "pt"}}}};
  std::string data(32, '\0');
  float one = 1.0f;
  std::memcpy(&data[4], &one, 4);
  const std::string img = safetensors_image(h, data);  // the views point into it: keep it alive
  auto v = parse(img);
  ASSERT_EQ(v.size(), 2u);
  const TensorView& a = v[0].name == "a" ? v[0] : v[1];
  EXPECT_EQ(a.dtype, DType::F32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.nbytes, 24u);
  EXPECT_EQ(a.as<float>()[1], 1.0f);
  EXPECT_EQ(a.numel(), 6);
}

TEST(Safetensors, EmptyTensorAndZeroDims) {
  json h = {{"e", entry("F32", {0, 5}, 0, 0)}, {"s", entry("U8", {}, 0, 1)}};
  auto v = parse(safetensors_image(h, std::string(1, 'x')));
  EXPECT_EQ(v.size(), 2u);
}

TEST(Safetensors, RejectsTooShort) { expect_error("abc", "truncated"); }

TEST(Safetensors, RejectsHeaderPastEnd) {
  std::string img = safetensors_image({{"a", entry("U8", {1}, 0, 1)}}, "x");
  expect_error(img.substr(0, 20), "truncated");
}

TEST(Safetensors, RejectsHugeHeaderLength) {
  std::string img(16, '\0');
  img[7] = 0x7f;  // 2^62-ish
  expect_error(img, "implausible");
}

TEST(Safetensors, RejectsBadJson) {
  std::string h = "{\"a\": [1, 2";
  std::string img(8, '\0');
  img[0] = char(h.size());
  expect_error(img + h, "not valid JSON");
}

TEST(Safetensors, RejectsNonObjectHeader) {
  expect_error(safetensors_image(json::array({1, 2}), ""), "JSON object");
}

TEST(Safetensors, RejectsUnknownDtype) {
  expect_error(safetensors_image({{"a", entry("Q4_K", {1}, 0, 1)}}, "x"), "unknown dtype 'Q4_K'");
}

TEST(Safetensors, RejectsSizeMismatch) {
  expect_error(safetensors_image({{"w", entry("F32", {3}, 0, 8)}}, std::string(8, '\0')), "needs 12 bytes");
}

TEST(Safetensors, RejectsOffsetsPastData) {
  expect_error(safetensors_image({{"w", entry("F32", {4}, 0, 16)}}, std::string(8, '\0')),
               "past the data region");
}

TEST(Safetensors, RejectsReversedOffsets) {
  expect_error(safetensors_image({{"w", entry("U8", {0}, 4, 2)}}, std::string(8, '\0')), "reversed");
}

TEST(Safetensors, RejectsOverlap) {
  json h = {{"a", entry("F32", {2}, 0, 8)}, {"b", entry("F32", {2}, 4, 12)}};
  expect_error(safetensors_image(h, std::string(12, '\0')), "overlap");
}

TEST(Safetensors, RejectsNegativeAndNonIntegerShapes) {
  expect_error(safetensors_image({{"a", {{"dtype", "U8"}, {"shape", {-1}}, {"data_offsets", {0, 1}}}}}, "x"),
               "non-negative");
  expect_error(safetensors_image({{"a", {{"dtype", "U8"}, {"shape", {1.5}}, {"data_offsets", {0, 1}}}}}, "x"),
               "non-negative");
}

TEST(Safetensors, RejectsShapeOverflow) {
  // 2^40 * 2^40 elements would overflow 64 bits; must be caught, not wrap to a small size.
  json h = {{"a", entry("F32", {int64_t(1) << 40, int64_t(1) << 40, 0}, 0, 0)}};
  EXPECT_NO_THROW(parse(safetensors_image(h, "")));  // a zero dim makes it empty, legitimately
  json h2 = {{"a", entry("F32", {int64_t(1) << 40, int64_t(1) << 40}, 0, 16)}};
  expect_error(safetensors_image(h2, std::string(16, '\0')), "needs");
}

TEST(Safetensors, RejectsMissingFields) {
  expect_error(safetensors_image({{"a", {{"shape", {1}}, {"data_offsets", {0, 1}}}}}, "x"), "missing dtype");
  expect_error(safetensors_image({{"a", {{"dtype", "U8"}, {"data_offsets", {0, 1}}}}}, "x"), "missing shape");
  expect_error(safetensors_image({{"a", {{"dtype", "U8"}, {"shape", {1}}}}}, "x"), "data_offsets");
  expect_error(
      safetensors_image({{"a", {{"dtype", "U8"}, {"shape", {1}}, {"data_offsets", {0, 1}}, {"x", 1}}}}, "x"),
      "unknown field");
  expect_error(safetensors_image({{"__metadata__", {{"k", 1}}}}, ""), "must be a string");
}

TEST(Safetensors, RandomCorruptionNeverCrashes) {
  // Flip random bytes of a valid image: each parse either succeeds or throws Error.
  json h = {{"a", entry("F32", {2, 3}, 0, 24)}, {"b", entry("BF16", {4}, 24, 32)}};
  const std::string good = safetensors_image(h, std::string(32, '\1'));
  std::mt19937 rng(7);
  for (int iter = 0; iter < 3000; ++iter) {
    std::string img = good;
    int flips = 1 + int(rng() % 4);
    for (int f = 0; f < flips; ++f) img[rng() % img.size()] = char(rng());
    if (rng() % 4 == 0) img.resize(rng() % img.size());
    try {
      parse(img);
    } catch (const Error&) {
    }
  }
}

TEST(TensorStore, ShardedIndexMustMatchFiles) {
  test::TempDir d;
  test::write_file(d.path() / "a.safetensors", safetensors_image({{"x", entry("U8", {1}, 0, 1)}}, "x"));
  test::write_file(d.path() / "b.safetensors", safetensors_image({{"y", entry("U8", {1}, 0, 1)}}, "y"));
  test::write_file(d.path() / "model.safetensors.index.json",
                   json({{"weight_map", {{"x", "a.safetensors"}, {"y", "b.safetensors"}}}}).dump());
  auto s = TensorStore::open(d.path());
  ASSERT_NE(s.find("x"), nullptr);
  ASSERT_NE(s.find("y"), nullptr);
  EXPECT_EQ(*s.find("y")->data, 'y');

  // A tensor the index names but the shard lacks.
  test::write_file(
      d.path() / "model.safetensors.index.json",
      json({{"weight_map", {{"x", "a.safetensors"}, {"y", "b.safetensors"}, {"z", "b.safetensors"}}}})
          .dump());
  try {
    TensorStore::open(d.path());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'z'"), std::string::npos) << e.what();
  }
  // A tensor in a shard the index does not name.
  test::write_file(d.path() / "model.safetensors.index.json",
                   json({{"weight_map", {{"x", "a.safetensors"}}}}).dump());
  test::write_file(d.path() / "a.safetensors",
                   safetensors_image({{"x", entry("U8", {1}, 0, 1)}, {"w", entry("U8", {1}, 1, 2)}}, "xw"));
  EXPECT_THROW(TensorStore::open(d.path()), Error);
}

TEST(TensorStore, HostileIndexPaths) {
  test::TempDir d;
  for (const char* f : {"../evil.safetensors", "/etc/passwd", "sub/x.safetensors", ".."}) {
    test::write_file(d.path() / "model.safetensors.index.json", json({{"weight_map", {{"x", f}}}}).dump());
    try {
      TensorStore::open(d.path());
      FAIL() << f;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not a plain file name"), std::string::npos) << e.what();
    }
  }
  test::write_file(d.path() / "model.safetensors.index.json", "{\"weight_map\": 5}");
  EXPECT_THROW(TensorStore::open(d.path()), Error);
  test::write_file(d.path() / "model.safetensors.index.json", "not json");
  EXPECT_THROW(TensorStore::open(d.path()), Error);
}

TEST(TensorStore, MissingFilesAndDirs) {
  test::TempDir d;
  EXPECT_THROW(TensorStore::open(d.path() / "nope"), Error);
  EXPECT_THROW(TensorStore::open(d.path()), Error);
  test::write_file(d.path() / "model.safetensors.index.json",
                   json({{"weight_map", {{"x", "gone.safetensors"}}}}).dump());
  EXPECT_THROW(TensorStore::open(d.path()), Error);
}

TEST(TensorStore, DuplicateAcrossShards) {
  test::TempDir d;
  test::write_file(d.path() / "a.safetensors", safetensors_image({{"x", entry("U8", {1}, 0, 1)}}, "x"));
  test::write_file(d.path() / "b.safetensors", safetensors_image({{"x", entry("U8", {1}, 0, 1)}}, "x"));
  // An index cannot map one name to two files, so duplicates arrive via a shard holding an unlisted copy.
  test::write_file(d.path() / "model.safetensors.index.json",
                   json({{"weight_map", {{"x", "a.safetensors"}}}}).dump());
  EXPECT_NO_THROW(TensorStore::open(d.path()));
}

TEST(TensorStore, UnalignedDataIsRealigned) {
  test::TempDir d;
  // A U8 tensor of odd length pushes the F32 tensor off its 4-byte alignment.
  std::string data = "abc";
  float v = 3.5f;
  data.append(reinterpret_cast<const char*>(&v), 4);
  std::string img = safetensors_image({{"p", entry("U8", {3}, 0, 3)}, {"f", entry("F32", {1}, 3, 7)}}, data);
  test::write_file(d.path() / "model.safetensors", img);
  auto s = TensorStore::open(d.path());
  const TensorView* f = s.find("f");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f->data) % 4, 0u);
  EXPECT_EQ(f->as<float>()[0], 3.5f);
}

}  // namespace
}  // namespace tansy
