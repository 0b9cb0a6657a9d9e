// safetensors reading: mmap, strict header validation, single-file and sharded checkpoints.
//
// Format: u64 little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data region. Offsets are relative to the data region.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace tansy {

enum class DType : uint8_t {
  BOOL,
  U8,
  I8,
  U16,
  I16,
  F16,
  BF16,
  U32,
  I32,
  F32,
  U64,
  I64,
  F64,
  F8_E4M3,
  F8_E5M2
};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// Throws Error for a name that is not a safetensors dtype.
DType parse_dtype(std::string_view name);

struct TensorView {
  std::string name;
  DType dtype{};
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // aligned to the element size (realigned copy if the file was not)
  size_t nbytes = 0;
  std::string file;  // file name it came from, for messages

  int64_t numel() const;
  std::string shape_str() const;  // "[8192, 256]"
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(data);
  }
};

// Read-only memory map of a whole file.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Parses and validates one safetensors image held in memory. `label` names it in errors.
// Checks: header length in range, JSON object, known dtypes, non-negative shapes,
// shape x dtype size == byte length (no overflow), offsets inside the data region,
// tensors non-overlapping. Returned views point into `data`.
std::vector<TensorView> parse_safetensors(const uint8_t* data, size_t size, const std::string& label);

// All tensors of a checkpoint directory: model.safetensors, or the shards named by
// model.safetensors.index.json (every shard's tensor set must match the index exactly).
class TensorStore {
 public:
  static TensorStore open(const std::filesystem::path& dir);
  // Single file, for tests and tools.
  static TensorStore open_file(const std::filesystem::path& file);

  const TensorView* find(std::string_view name) const;
  const std::map<std::string, TensorView, std::less<>>& tensors() const { return tensors_; }

 private:
  void add_file(const std::filesystem::path& file, const std::vector<std::string>* expected);
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::vector<std::unique_ptr<uint8_t[]>> realigned_;
  std::map<std::string, TensorView, std::less<>> tensors_;
};

}  // namespace tansy
