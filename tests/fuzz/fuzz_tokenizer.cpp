// libFuzzer target: the Qwen3 tokenizer (tests/fixtures/qwen3-tokenizer) encoding arbitrary text,
// with and without special tokens, and decoding arbitrary id sequences. Every id it produces must
// be valid, and decoding the ids of valid UTF-8 must give valid UTF-8 back.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "text/tokenizer.h"

namespace {
const tansy::Tokenizer& tokenizer() {
  static tansy::Tokenizer t = tansy::Tokenizer::load(TANSY_SOURCE_DIR "/tests/fixtures/qwen3-tokenizer");
  return t;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const tansy::Tokenizer& tok = tokenizer();
  std::string_view raw(reinterpret_cast<const char*>(data), size);
  tansy::utf8_incomplete_tail(raw);
  const std::string text = tansy::utf8_lossy(raw);  // encode() takes valid UTF-8
  for (bool special : {true, false}) {
    std::vector<int32_t> ids = tok.encode(text, special);
    for (int32_t id : ids)
      if (!tok.is_valid(id)) __builtin_trap();
    const std::string back = tok.decode(ids);
    if (tansy::utf8_lossy(back) != back) __builtin_trap();
  }
  // The bytes as little-endian ids, some out of range: decode either answers or throws Error.
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 3 < size; i += 4) {
    uint32_t v = uint32_t(data[i]) | uint32_t(data[i + 1]) << 8 | uint32_t(data[i + 2]) << 16 |
                 uint32_t(data[i + 3] & 0x03) << 24;
    ids.push_back(int32_t(v % 160000));
  }
  try {
    tok.decode(ids, (size & 1) != 0);
  } catch (const tansy::Error&) {
  }
  return 0;
}
