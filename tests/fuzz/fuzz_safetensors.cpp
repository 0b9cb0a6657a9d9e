// libFuzzer target: the safetensors header and layout validation on arbitrary file images. It
// either returns views that lie inside the image or throws tansy::Error.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A copy of exactly `size` bytes, so that ASan sees any read past the end.
  std::vector<uint8_t> img(data, data + size);
  try {
    auto views = tansy::parse_safetensors(img.data(), img.size(), "fuzz");
    for (const auto& v : views) {
      if (v.nbytes == 0) continue;
      uint8_t sum = 0;
      for (size_t i = 0; i < v.nbytes; ++i) sum = uint8_t(sum + v.data[i]);  // every byte readable
      if (v.numel() < 0) __builtin_trap();
      (void)sum;
    }
  } catch (const tansy::Error&) {
  }
  return 0;
}
