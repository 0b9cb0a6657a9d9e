// Tokenizer and streaming detokenizer: loading errors, special tokens, UTF-8 handling, and the
// stream decoder's property (pieces concatenate to decode(all ids)) over random inputs.
// Exactness of the ids themselves is checked against Hugging Face in tests/python.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"

namespace fs = std::filesystem;
using tansy::Tokenizer;
using json = nlohmann::json;

namespace {

fs::path qwen3_dir() { return fs::path(TANSY_SOURCE_DIR) / "tests" / "fixtures" / "qwen3-tokenizer"; }

const Tokenizer& qwen3() {
  static Tokenizer tok = Tokenizer::load(qwen3_dir());
  return tok;
}

// GPT-2's printable spelling of byte b.
std::string byte_char(int b) {
  int next = 256;
  for (int x = 0; x < 256; ++x) {
    bool printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
    int cp = printable ? x : next++;
    if (x == b) {
      std::string s;
      if (cp < 0x80)
        s += char(cp);
      else {
        s += char(0xC0 | (cp >> 6));
        s += char(0x80 | (cp & 0x3F));
      }
      return s;
    }
  }
  return {};
}

// A minimal byte-level BPE tokenizer.json: the 256 byte tokens, merges "h e", "he l", "l o",
// "hel lo", and one special added token.
json tiny_json() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["he"] = 256;
  vocab["hel"] = 257;
  vocab["lo"] = 258;
  vocab["hello"] = 259;
  json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", json::array({{{"id", 260},
                                     {"content", "<|end|>"},
                                     {"single_word", false},
                                     {"lstrip", false},
                                     {"rstrip", false},
                                     {"normalized", false},
                                     {"special", true}}})},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers", json::array({{{"type", "Split"},
                                        {"pattern", {{"Regex", "\\s+|\\S+"}}},
                                        {"behavior", "Isolated"},
                                        {"invert", false}},
                                       {{"type", "ByteLevel"},
                                        {"add_prefix_space", false},
                                        {"trim_offsets", false},
                                        {"use_regex", false}}})}}},
      {"post_processor",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"decoder",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", json::array({"h e", json::array({"he", "l"}), "l o", "hel lo"})}}}};
  return j;
}

void expect_load_error(const json& j, const std::string& needle) {
  try {
    Tokenizer::from_json(j.dump());
    FAIL() << "loaded, expected an error containing '" << needle << "'";
  } catch (const tansy::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

bool valid_utf8(const std::string& s) { return tansy::utf8_lossy(s) == s; }

}  // namespace

TEST(Tokenizer, TinyModelMergesByRank) {
  auto tok = Tokenizer::from_json(tiny_json().dump());
  EXPECT_EQ(tok.encode("hello"), (std::vector<int32_t>{259}));
  EXPECT_EQ(tok.encode("hel"), (std::vector<int32_t>{257}));
  // "hell": h e -> he, he l -> hel, then 'l' stays alone ("l o" has nothing to pair with).
  EXPECT_EQ(tok.encode("hell"), (std::vector<int32_t>{257, 'l'}));
  EXPECT_EQ(tok.encode("hello<|end|> lo"),
            (std::vector<int32_t>{259, 260, int32_t(tok.token_id(byte_char(' ')).value()), 258}));
  EXPECT_EQ(tok.vocab_size(), 261);
  EXPECT_TRUE(tok.is_special(260));
  EXPECT_FALSE(tok.is_special(259));
  EXPECT_EQ(tok.token_id("hello"), 259);
  EXPECT_EQ(tok.token_id("<|end|>"), 260);
  EXPECT_FALSE(tok.token_id("nope").has_value());
}

TEST(Tokenizer, LoadErrorsNameTheFeature) {
  EXPECT_THROW(Tokenizer::load("/nonexistent/dir"), tansy::Error);
  EXPECT_THROW(Tokenizer::from_json("{not json"), tansy::Error);
  auto j = tiny_json();
  j["normalizer"] = {{"type", "Lowercase"}};
  expect_load_error(j, "Lowercase");
  j = tiny_json();
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_load_error(j, "Whitespace");
  j = tiny_json();
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
  expect_load_error(j, "Removed");
  j = tiny_json();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "^\\s+"}};
  expect_load_error(j, "anchors");
  j = tiny_json();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(unclosed"}};
  expect_load_error(j, "does not compile");
  j = tiny_json();
  j["model"]["type"] = "WordPiece";
  expect_load_error(j, "WordPiece");
  j = tiny_json();
  j["model"]["dropout"] = 0.1;
  expect_load_error(j, "dropout");
  j = tiny_json();
  j["model"]["merges"].push_back("x yz");
  expect_load_error(j, "missing from the vocab");
  j = tiny_json();
  j["model"]["vocab"].erase(byte_char(0xFF));
  expect_load_error(j, "0xFF");
  j = tiny_json();
  j["decoder"] = {{"type", "WordPiece"}};
  expect_load_error(j, "decoder");
  j = tiny_json();
  j["post_processor"] = {{"type", "TemplateProcessing"}};
  expect_load_error(j, "TemplateProcessing");
  j = tiny_json();
  j["truncation"] = {{"max_length", 5}};
  expect_load_error(j, "truncation");
  j = tiny_json();
  j["added_tokens"][0]["content"] = "hello";
  expect_load_error(j, "vocab gives it 259");
}

TEST(Tokenizer, Qwen3SpecialTokens) {
  const auto& tok = qwen3();
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.token_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok.token_id("<think>"), 151667);
  EXPECT_TRUE(tok.is_special(151645));
  EXPECT_FALSE(tok.is_special(151667));  // <think> is an added token, not a special one
  auto ids = tok.encode("<|im_start|>user\nhi<|im_end|>");
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids.back(), 151645);
  EXPECT_EQ(tok.decode(ids), "<|im_start|>user\nhi<|im_end|>");
  EXPECT_EQ(tok.decode(ids, /*skip_special=*/true), "user\nhi");
  // Without special parsing the markers are plain text, but non-special added tokens still match.
  auto plain = tok.encode("<|im_start|><think>", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 151644), 0);
  EXPECT_EQ(plain.back(), 151667);
  EXPECT_EQ(tok.decode(plain), "<|im_start|><think>");
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(Tokenizer, RejectsBadInputAndIds) {
  const auto& tok = qwen3();
  EXPECT_THROW(tok.encode("abc\xFF"), tansy::Error);
  EXPECT_THROW(tok.encode("\xED\xA0\x80"), tansy::Error);  // a UTF-16 surrogate
  std::vector<int32_t> bad{1, -1};
  EXPECT_THROW(tok.decode(bad), tansy::Error);
  bad = {151669};
  EXPECT_THROW(tok.decode(bad), tansy::Error);
  EXPECT_THROW(tok.token_bytes(1 << 30), tansy::Error);
}

TEST(Tokenizer, LongInputsDoNotBlowUp) {
  const auto& tok = qwen3();
  std::string spaces(1 << 20, ' '), word(200000, 'a'), nl(100000, '\n');
  EXPECT_EQ(tok.decode(tok.encode(spaces + "x")), spaces + "x");
  EXPECT_EQ(tok.decode(tok.encode(word)), word);
  EXPECT_EQ(tok.decode(tok.encode(nl + " \t" + nl)), nl + " \t" + nl);
}

TEST(Utf8, LossyReplacesMaximalSubparts) {
  using tansy::utf8_lossy;
  const std::string R = "\xEF\xBF\xBD";
  EXPECT_EQ(utf8_lossy("ok \xC3\xA9"), "ok \xC3\xA9");
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), R);  // truncated 4-byte sequence: one replacement
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98x"), R + "x");
  EXPECT_EQ(utf8_lossy("\xE0\x80"), R + R);          // E0 needs A0..BF next
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), R + R + R);  // surrogates are invalid
  EXPECT_EQ(utf8_lossy("\xC0\xAF\xFF"), R + R + R);
  EXPECT_EQ(tansy::utf8_incomplete_tail("ab\xF0\x9F"), 2u);
  EXPECT_EQ(tansy::utf8_incomplete_tail("ab\xF0\x9F\x98\x80"), 6u);
  EXPECT_EQ(tansy::utf8_incomplete_tail("ab\x80"), 3u);
}

TEST(StreamDecoder, RealTextEmitsOnlyCompleteCharacters) {
  const auto& tok = qwen3();
  // clang-format 14 re-splits this literal on every run (it miscounts the glyphs' widths).
  // clang-format off
  const std::string text = "Family 👨‍👩‍👧‍👦 and 👍🏽, 中文字符 𠀀𪚥, हिन्दी भाषा, مرحبا بالعالم, é, <|im_end|> done";
  // clang-format on
  auto ids = tok.encode(text);
  tansy::StreamDecoder sd(tok);
  std::string acc;
  size_t multi_token_chars = 0;
  for (int32_t id : ids) {
    std::string piece = sd.push(id);
    EXPECT_TRUE(valid_utf8(piece));
    if (piece.empty()) ++multi_token_chars;
    acc += piece;
    EXPECT_EQ(text.compare(0, acc.size(), acc), 0) << "emitted text is not a prefix";
  }
  acc += sd.flush();
  EXPECT_EQ(acc, text);
  EXPECT_GT(multi_token_chars, 0u) << "the text should contain characters spread over several tokens";
}

TEST(StreamDecoder, RandomIdsMatchDecodeForEverySplit) {
  const auto& tok = qwen3();
  // Ids whose bytes are partial UTF-8 make the property non-trivial: collect some.
  std::vector<int32_t> partial, whole;
  for (int32_t id = 0; id < tok.vocab_size(); ++id) {
    if (!tok.is_valid(id)) continue;
    (valid_utf8(tok.token_bytes(id)) ? whole : partial).push_back(id);
  }
  ASSERT_GT(partial.size(), 1000u);
  std::mt19937 rng(1234);
  for (int round = 0; round < 2000; ++round) {
    std::vector<int32_t> ids;
    int n = 1 + int(rng() % 24);
    for (int i = 0; i < n; ++i) {
      unsigned r = rng() % 10;
      if (r < 5)
        ids.push_back(partial[rng() % partial.size()]);
      else if (r < 9)
        ids.push_back(whole[rng() % whole.size()]);
      else
        ids.push_back(151643 + int32_t(rng() % 26));  // added and special tokens
    }
    bool skip = round % 2;
    tansy::StreamDecoder sd(tok, skip);
    std::string acc;
    for (int32_t id : ids) acc += sd.push(id);
    acc += sd.flush();
    ASSERT_EQ(acc, tok.decode(ids, skip)) << "round " << round;
  }
}

TEST(StreamDecoder, FlushResetsAndRejectsUnknownIds) {
  const auto& tok = qwen3();
  auto ids = tok.encode("𪚥");
  ASSERT_GT(ids.size(), 1u);  // one rare CJK character, several byte-level tokens
  tansy::StreamDecoder sd(tok);
  EXPECT_EQ(sd.push(ids[0]), "");
  EXPECT_EQ(sd.flush(), "\xEF\xBF\xBD");  // an incomplete character at the end is replaced, as decode does
  EXPECT_EQ(sd.flush(), "");
  EXPECT_THROW(sd.push(-5), tansy::Error);
}
