#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace tansy {

namespace {
struct DTypeInfo {
  DType t;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::BOOL, "BOOL", 1}, {DType::U8, "U8", 1},           {DType::I8, "I8", 1},
    {DType::U16, "U16", 2},   {DType::I16, "I16", 2},         {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2}, {DType::U32, "U32", 4},         {DType::I32, "I32", 4},
    {DType::F32, "F32", 4},   {DType::U64, "U64", 8},         {DType::I64, "I64", 8},
    {DType::F64, "F64", 8},   {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
};
// A header larger than this is not a checkpoint header (real ones are a few MB at most).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr size_t kMaxDims = 8;
constexpr unsigned __int128 kSaturate = (unsigned __int128)1 << 100;
}  // namespace

size_t dtype_size(DType t) {
  for (auto& d : kDTypes)
    if (d.t == t) return d.size;
  return 0;
}
const char* dtype_name(DType t) {
  for (auto& d : kDTypes)
    if (d.t == t) return d.name;
  return "?";
}
DType parse_dtype(std::string_view name) {
  for (auto& d : kDTypes)
    if (name == d.name) return d.t;
  fail("unknown dtype '{}'", name);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

MappedFile::MappedFile(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open {}: {}", path.string(), std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{} is not a regular file", path.string());
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      fail("cannot map {}: {}", path.string(), std::strerror(errno));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

std::vector<TensorView> parse_safetensors(const uint8_t* data, size_t size, const std::string& label) {
  if (size < 8)
    fail("{}: truncated: {} bytes, a safetensors file has at least an 8-byte header length", label, size);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | data[i];
  if (hlen > kMaxHeaderBytes)
    fail("{}: header length {} is implausible (limit {})", label, hlen, kMaxHeaderBytes);
  if (hlen > size - 8) fail("{}: truncated: header length {} exceeds the file ({} bytes)", label, hlen, size);
  const char* hbeg = reinterpret_cast<const char*>(data + 8);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(hbeg, hbeg + hlen);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: header is not valid JSON: {}", label, e.what());
  }
  if (!header.is_object()) fail("{}: header must be a JSON object", label);
  const uint8_t* region = data + 8 + hlen;
  const uint64_t region_size = size - 8 - hlen;

  std::vector<TensorView> out;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("{}: __metadata__ must be an object", label);
      for (auto& [k, v] : entry.items())
        if (!v.is_string()) fail("{}: __metadata__ value for '{}' must be a string", label, k);
      continue;
    }
    if (name.empty()) fail("{}: empty tensor name", label);
    if (!entry.is_object()) fail("{}: tensor '{}': entry must be an object", label, name);
    for (auto& [k, v] : entry.items())
      if (k != "dtype" && k != "shape" && k != "data_offsets")
        fail("{}: tensor '{}': unknown field '{}'", label, name, k);
    if (!entry.contains("dtype") || !entry["dtype"].is_string())
      fail("{}: tensor '{}': missing dtype", label, name);
    if (!entry.contains("shape") || !entry["shape"].is_array())
      fail("{}: tensor '{}': missing shape", label, name);
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2)
      fail("{}: tensor '{}': data_offsets must be [begin, end]", label, name);
    TensorView t;
    t.name = name;
    t.file = label;
    try {
      t.dtype = parse_dtype(entry["dtype"].get<std::string>());
    } catch (const Error& e) {
      fail("{}: tensor '{}': {}", label, name, e.what());
    }
    if (entry["shape"].size() > kMaxDims)
      fail("{}: tensor '{}': {} dimensions is too many", label, name, entry["shape"].size());
    // numel * size must not overflow: every step is bounded by the region size.
    unsigned __int128 bytes = dtype_size(t.dtype);
    for (auto& d : entry["shape"]) {
      if (!d.is_number_unsigned())
        fail("{}: tensor '{}': shape entries must be non-negative integers", label, name);
      uint64_t v = d.get<uint64_t>();
      if (v > (uint64_t(1) << 48)) fail("{}: tensor '{}': dimension {} is implausible", label, name, v);
      t.shape.push_back(int64_t(v));
      bytes *= v;
      if (bytes > kSaturate) bytes = kSaturate;  // keeps the product from overflowing
    }
    auto& off = entry["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail("{}: tensor '{}': data_offsets must be non-negative integers", label, name);
    uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e) fail("{}: tensor '{}': data_offsets [{}, {}] are reversed", label, name, b, e);
    if (e > region_size)
      fail("{}: tensor '{}': data_offsets [{}, {}] run past the data region ({} bytes; file truncated?)",
           label, name, b, e, region_size);
    if (bytes != e - b) {
      std::string need = bytes >> 64 ? std::string("more than 2^64") : std::to_string(uint64_t(bytes));
      fail("{}: tensor '{}': shape {} x {} needs {} bytes but data_offsets span {}", label, name,
           t.shape_str(), dtype_name(t.dtype), need, e - b);
    }
    t.data = region + b;
    t.nbytes = size_t(e - b);
    spans.emplace_back(b, e);
    out.push_back(std::move(t));
  }
  std::vector<size_t> order(spans.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return spans[a] < spans[b]; });
  for (size_t i = 1; i < order.size(); ++i) {
    auto& p = spans[order[i - 1]];
    auto& c = spans[order[i]];
    if (c.first < p.second && c.first != c.second && p.first != p.second)
      fail("{}: tensors '{}' and '{}' overlap", label, out[order[i - 1]].name, out[order[i]].name);
  }
  return out;
}

TensorStore TensorStore::open_file(const std::filesystem::path& file) {
  TensorStore s;
  s.add_file(file, nullptr);
  return s;
}

TensorStore TensorStore::open(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) fail("model directory {} does not exist", dir.string());
  TensorStore s;
  fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    nlohmann::json j;
    try {
      std::ifstream in(index);
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      fail("{}: not valid JSON: {}", index.string(), e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail("{}: missing object 'weight_map'", index.string());
    std::map<std::string, std::vector<std::string>> by_file;
    for (auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) fail("{}: weight_map['{}'] must be a file name", index.string(), name);
      std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos || f == "." ||
          f == "..")
        fail("{}: weight_map['{}'] names '{}', which is not a plain file name in the model directory",
             index.string(), name, f);
      by_file[f].push_back(name);
    }
    if (by_file.empty()) fail("{}: weight_map is empty", index.string());
    for (auto& [f, names] : by_file) s.add_file(dir / f, &names);
  } else if (fs::exists(dir / "model.safetensors")) {
    s.add_file(dir / "model.safetensors", nullptr);
  } else {
    fail("{} has neither model.safetensors nor model.safetensors.index.json", dir.string());
  }
  return s;
}

void TensorStore::add_file(const std::filesystem::path& file, const std::vector<std::string>* expected) {
  auto mf = std::make_unique<MappedFile>(file);
  std::string label = file.filename().string();
  auto views = parse_safetensors(mf->data(), mf->size(), label);
  if (expected) {
    std::set<std::string> want(expected->begin(), expected->end()), have;
    for (auto& v : views) have.insert(v.name);
    for (auto& w : want)
      if (!have.count(w)) fail("{}: tensor '{}' is listed in the index but missing from the file", label, w);
    for (auto& h : have)
      if (!want.count(h)) fail("{}: tensor '{}' is in the file but not in the index", label, h);
  }
  for (auto& v : views) {
    size_t align = dtype_size(v.dtype);
    if (reinterpret_cast<uintptr_t>(v.data) % align != 0) {
      // Unaligned data (legal in the format): keep an aligned copy so typed reads are valid.
      auto buf = std::make_unique<uint8_t[]>(v.nbytes + 16);
      uint8_t* p = buf.get();
      std::memcpy(p, v.data, v.nbytes);
      v.data = p;
      realigned_.push_back(std::move(buf));
    }
    std::string name = v.name;
    if (!tensors_.emplace(name, std::move(v)).second) fail("tensor '{}' appears in more than one file", name);
  }
  files_.push_back(std::move(mf));
}

const TensorView* TensorStore::find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

}  // namespace tansy
