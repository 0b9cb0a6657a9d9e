// Token id files: little-endian int32, no header.
#pragma once
#include <cstdint>
#include <filesystem>
#include <vector>

namespace tansy::cli {
std::vector<int32_t> read_ids_file(const std::filesystem::path& path);
void check_ids(const std::vector<int32_t>& ids, int vocab_size);
}  // namespace tansy::cli
