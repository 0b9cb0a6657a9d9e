// The tokenizer `tansy synth` writes next to a synthetic checkpoint, so that `tansy serve` and
// `tansy chat` can load it like a real one (see synth.h).
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/synth.h"
#include "core/error.h"
#include "model/config.h"
#include "text/chat_template.h"

namespace tansy {
namespace {

// The Qwen3.5/3.6 pre-tokenizer split (tests/fixtures/qwen3.6/pretokenizer_regex.txt).
constexpr const char* kSplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's byte-level alphabet: every byte spelled as one printable code point.
std::array<std::string, 256> byte_spellings() {
  std::array<std::string, 256> s;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    uint32_t c = printable ? uint32_t(b) : next++;
    std::string& o = s[size_t(b)];
    if (c < 0x80) {
      o += char(c);
    } else {  // every code point here is below 0x800
      o += char(0xC0 | (c >> 6));
      o += char(0x80 | (c & 0x3F));
    }
  }
  return s;
}

// ASCII the merged tokens are built from: printable characters, space and newline.
constexpr int kAlphabet = 96;
inline uint8_t alpha(int i) { return i == 95 ? uint8_t('\n') : uint8_t(0x20 + i); }

constexpr size_t kPairs = size_t(kAlphabet) * kAlphabet;                // 9,216
constexpr size_t kTwoByteChars = 0x800 - 0x80;                          // 1,920
constexpr size_t kTriples = size_t(kAlphabet) * kAlphabet * kAlphabet;  // 884,736
// 2654435761 is odd and not a multiple of 3, so i -> i * M mod 96^3 permutes the triples.
constexpr uint64_t kTriplePermute = 2654435761ULL;

std::string json_str(const std::string& s) { return nlohmann::json(s).dump(); }

}  // namespace

SynthTokenizerLayout synth_tokenizer_layout(const ModelConfig& cfg) {
  SynthTokenizerLayout l;
  if (cfg.is_qwen36_35b_a3b) {
    // The real model's ids (docs/MODEL.md §9). <|im_start|> 248045, <|im_end|> 248046 and <think>
    // 248068 are in LILY's golden prompt. <|endoftext|> 248044 and </think> 248069 are third-party
    // figures that MODEL.md §12.5 marks UNVERIFIED; they are used here because a tokenizer without
    // them cannot serve (end of text, end of reasoning), and they are what real_model_config_json's
    // eos list already assumes. A real checkpoint brings its own tokenizer.json; nothing here is
    // read by the engine as a fact about the real model.
    // The ids between them are used by the real tokenizer for tokens MODEL.md does not name
    // (vision and tool markers): they become visibly synthetic placeholders, so that every id
    // below vocab_size() decodes. MODEL.md's "248077 real ids" is UNVERIFIED too, so the
    // tokenizer ends after </think>; embedding rows from 248070 on are padding that the engine
    // never samples, as rows past a real tokenizer's last id are.
    l.n_ordinary = 248044;
    l.added = {{"<|endoftext|>", 248044, true}, {"<|im_start|>", 248045, true}, {"<|im_end|>", 248046, true}};
    for (int32_t id = 248047; id < 248068; ++id)
      l.added.push_back({"<|tansy_synth_reserved_" + std::to_string(id) + "|>", id, true});
    // Qwen3's tokenizer (tests/fixtures/qwen3-tokenizer) flags <think> and </think> as
    // added tokens that are not special; kept so here.
    l.added.push_back({"<think>", 248068, false});
    l.added.push_back({"</think>", 248069, false});
    return l;
  }
  // Other configurations: the five tokens the engine and server look up, at the top of the vocab.
  const int V = cfg.vocab_size;
  const int n_added = 5;
  if (V < 256 + n_added)
    fail(
        "synth: vocab_size {} leaves no room for a byte-level tokenizer (at least {} ids; tansy synth "
        "--no-tokenizer writes the weights alone)",
        V, 256 + n_added);
  l.n_ordinary = V - n_added;
  l.added = {{"<|endoftext|>", V - 5, true},
             {"<|im_start|>", V - 4, true},
             {"<|im_end|>", V - 3, true},
             {"<think>", V - 2, false},
             {"</think>", V - 1, false}};
  return l;
}

int SynthTokenizerLayout::vocab_size() const {
  int v = n_ordinary;
  for (auto& a : added) v = std::max(v, a.id + 1);
  return v;
}

std::string synthetic_tokenizer_json(const SynthTokenizerLayout& layout) {
  const size_t n_merges = size_t(layout.n_ordinary) - 256;
  if (layout.n_ordinary < 256)
    fail("synth tokenizer: {} ordinary ids cannot hold the 256 byte tokens", layout.n_ordinary);
  if (n_merges > kPairs + kTwoByteChars + kTriples)
    fail("synth tokenizer: {} ordinary ids exceed what the generator makes ({})", layout.n_ordinary,
         256 + kPairs + kTwoByteChars + kTriples);
  const auto sp = byte_spellings();
  std::string vocab, merges;
  vocab.reserve(size_t(layout.n_ordinary) * 16);
  merges.reserve(n_merges * 20);
  int32_t next_id = 0;
  auto add_vocab = [&](const std::string& spelled) {
    if (next_id) vocab += ',';
    vocab += json_str(spelled);
    vocab += ':';
    vocab += std::to_string(next_id++);
  };
  auto add_merge = [&](const std::string& a, const std::string& b) {
    if (!merges.empty()) merges += ',';
    merges += json_str(a + " " + b);
    add_vocab(a + b);
  };
  for (int b = 0; b < 256; ++b) add_vocab(sp[size_t(b)]);  // token id b is byte b
  size_t left = n_merges;
  // Rank order: ASCII pairs, then the two-byte UTF-8 characters (lead byte + continuation byte),
  // then ASCII triples (a pair + one character) in a fixed pseudo-random order. Every merged
  // token is complete, valid UTF-8, so a streamed token never waits for the next one unless it is
  // a lone lead byte (byte tokens 0xC2-0xF4).
  for (size_t i = 0; i < kPairs && left; ++i, --left)
    add_merge(sp[alpha(int(i / kAlphabet))], sp[alpha(int(i % kAlphabet))]);
  for (uint32_t c = 0x80; c < 0x800 && left; ++c, --left)
    add_merge(sp[0xC0 | (c >> 6)], sp[0x80 | (c & 0x3F)]);
  for (size_t i = 0; left; ++i, --left) {
    const size_t t = size_t((uint64_t(i) * kTriplePermute) % kTriples);
    const int a = int(t / kPairs), b = int(t / kAlphabet % kAlphabet), c = int(t % kAlphabet);
    add_merge(sp[alpha(a)] + sp[alpha(b)], sp[alpha(c)]);
  }
  if (next_id != layout.n_ordinary)
    fail("synth tokenizer: generated {} ordinary ids, expected {}", next_id, layout.n_ordinary);

  std::string added;
  for (auto& a : layout.added) {
    if (a.id < layout.n_ordinary) fail("synth tokenizer: added token {} overlaps the ordinary ids", a.id);
    if (!added.empty()) added += ',';
    added += fmt::format(
        R"({{"id":{},"content":{},"single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":{}}})",
        a.id, json_str(a.content), a.special ? "true" : "false");
  }
  const std::string byte_level =
      R"({"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":false})";
  std::string out;
  out.reserve(vocab.size() + merges.size() + added.size() + 1024);
  out += R"({"version":"1.0","truncation":null,"padding":null,"added_tokens":[)";
  out += added;
  out +=
      R"(],"normalizer":{"type":"NFC"},"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":)";
  out += json_str(kSplitRegex);
  out += R"(},"behavior":"Isolated","invert":false},)" + byte_level + "]},";
  out += R"("post_processor":)" + byte_level + R"(,"decoder":)" + byte_level + ",";
  out +=
      R"("model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":"","end_of_word_suffix":"",)"
      R"("fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":{)";
  out += vocab;
  out += R"(},"merges":[)";
  out += merges;
  out += "]}}\n";
  return out;
}

void write_synthetic_tokenizer(const ModelConfig& cfg, const std::filesystem::path& dir) {
  const SynthTokenizerLayout layout = synth_tokenizer_layout(cfg);
  if (layout.vocab_size() > cfg.vocab_size)
    fail("synth tokenizer: {} ids do not fit the embedding's {} rows", layout.vocab_size(), cfg.vocab_size);
  auto write = [&](const char* name, std::string_view text) {
    const auto p = dir / name;
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(text.data(), std::streamsize(text.size()));
    f.close();
    if (!f) fail("synth: cannot write {}", p.string());
  };
  write("tokenizer.json", synthetic_tokenizer_json(layout));
  // What transformers reads besides tokenizer.json: no BOS (MODEL.md §9), <|im_end|> ends a turn.
  nlohmann::ordered_json decoder = nlohmann::ordered_json::object();
  for (auto& a : layout.added)
    decoder[std::to_string(a.id)] = {{"content", a.content}, {"lstrip", false},      {"normalized", false},
                                     {"rstrip", false},      {"single_word", false}, {"special", a.special}};
  nlohmann::ordered_json tc = {
      {"add_bos_token", false},
      {"add_prefix_space", false},
      {"added_tokens_decoder", decoder},
      {"bos_token", nullptr},
      {"clean_up_tokenization_spaces", false},
      {"eos_token", "<|im_end|>"},
      {"errors", "replace"},
      {"model_max_length", cfg.max_position},
      {"pad_token", "<|endoftext|>"},
      {"split_special_tokens", false},
      {"tokenizer_class", "Qwen2Tokenizer"},
      {"unk_token", nullptr},
      {"tansy_synthetic", "byte-level BPE generated by tansy synth: not the real vocabulary"}};
  write("tokenizer_config.json", tc.dump(2) + "\n");
  // The one template tansy renders (the server refuses any other).
  write("chat_template.jinja", text::implemented_template());
}

}  // namespace tansy
