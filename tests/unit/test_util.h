// Helpers shared by the unit tests: paths, temp dirs, and a safetensors writer for crafted files.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

namespace tansy::test {

inline std::filesystem::path source_dir() {
  if (const char* e = std::getenv("TANSY_SOURCE_DIR")) return e;
#ifdef TANSY_SOURCE_DIR
  return TANSY_SOURCE_DIR;
#else
  return ".";
#endif
}

inline std::filesystem::path goldens_dir() { return source_dir() / "tests" / "goldens"; }

// A fresh, unique temporary directory removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("tansy_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Serialises a safetensors image from a header object and a data region.
inline std::string safetensors_image(const nlohmann::json& header, const std::string& data) {
  std::string h = header.dump();
  uint64_t n = h.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((n >> (8 * i)) & 0xff);
  return out + h + data;
}

struct RawTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// Splits a safetensors file into its tensors (tests use it to rewrite golden checkpoints).
inline std::map<std::string, RawTensor> read_raw(const std::filesystem::path& p) {
  std::string img = read_file(p);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(img[i]);
  auto header = nlohmann::json::parse(img.substr(8, n));
  std::map<std::string, RawTensor> out;
  for (auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    uint64_t b = e["data_offsets"][0], en = e["data_offsets"][1];
    out[name] = RawTensor{e["dtype"], e["shape"].get<std::vector<int64_t>>(), img.substr(8 + n + b, en - b)};
  }
  return out;
}

inline void write_raw(const std::filesystem::path& p, const std::map<std::string, RawTensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (auto& [name, t] : tensors) {
    header[name] = {{"dtype", t.dtype},
                    {"shape", t.shape},
                    {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  write_file(p, safetensors_image(header, data));
}

}  // namespace tansy::test
