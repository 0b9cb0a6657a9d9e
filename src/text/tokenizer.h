// Byte-level BPE tokenizer loading a Hugging Face tokenizer.json (the format Qwen ships), built to
// give exactly the ids of the `tokenizers` library: added tokens split first, then the normalizer,
// the Split pre-tokenizer regex, the byte-level mapping and ranked BPE merges. Features of the file
// that are not implemented make load() fail with their name instead of mis-tokenizing.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tansy {

class Tokenizer {
 public:
  // Reads model_dir/tokenizer.json.
  static Tokenizer load(const std::filesystem::path& model_dir);
  // Same, from the JSON text itself (tests build variants in memory).
  static Tokenizer from_json(std::string_view json_text);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Text must be valid UTF-8. With parse_special, tokens flagged special are matched as in HF;
  // without it they are tokenized as plain text (HF's encode_special_tokens). Non-special added
  // tokens are always matched, as in HF.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // Like encode(text, true), except that a special token overlapping one of the `plain` byte
  // ranges (sorted, disjoint) is tokenized as ordinary text: a rendered prompt's message content
  // cannot spell the template's control tokens.
  std::vector<int32_t> encode_plain_ranges(std::string_view text,
                                           std::span<const std::pair<size_t, size_t>> plain) const;
  // Invalid UTF-8 in the joined token bytes becomes U+FFFD per maximal subpart, as HF does.
  // Unknown ids are an error (HF would drop them silently).
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  std::optional<int32_t> token_id(std::string_view token) const;  // as spelled in tokenizer.json
  std::string token_bytes(int32_t id) const;  // raw bytes this token decodes to (maybe partial UTF-8)
  int vocab_size() const;                     // highest defined id + 1
  bool is_special(int32_t id) const;
  bool is_valid(int32_t id) const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Replaces each maximal invalid subpart of bytes with U+FFFD (what Rust's from_utf8_lossy and
// Python's errors="replace" do).
std::string utf8_lossy(std::string_view bytes);
// Where a trailing UTF-8 prefix that more bytes could still complete begins (bytes.size() if none).
size_t utf8_incomplete_tail(std::string_view bytes);

}  // namespace tansy
