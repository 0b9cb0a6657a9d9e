#include "cli/ids_file.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include "core/error.h"

namespace tansy::cli {

std::vector<int32_t> read_ids_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read ids file {}", path.string());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.empty()) fail("ids file {} is empty: the prompt needs at least one token", path.string());
  if (bytes.size() % 4 != 0)
    fail("ids file {} has {} bytes, not a whole number of int32 ids", path.string(), bytes.size());
  std::vector<int32_t> ids(bytes.size() / 4);
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto* b = reinterpret_cast<const unsigned char*>(&bytes[4 * i]);
    ids[i] = int32_t(uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24);
  }
  return ids;
}

void check_ids(const std::vector<int32_t>& ids, int vocab_size) {
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab_size)
      fail("token id {} at position {} is outside the vocabulary (0..{})", ids[i], i, vocab_size - 1);
}

}  // namespace tansy::cli
