// Incremental detokenization for streaming: a character may be spread over several tokens, so
// bytes are held back until they form complete UTF-8. The concatenation of everything push() and
// flush() return equals Tokenizer::decode of all ids, for any way the ids arrive.
#pragma once
#include <cstdint>
#include <string>

#include "text/tokenizer.h"

namespace tansy {

class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false)
      : tok_(tok), skip_special_(skip_special) {}
  std::string push(int32_t id);  // text that became complete with this token (often empty)
  std::string flush();           // whatever is left, incomplete bytes as U+FFFD; resets the state

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::string pending_;  // a trailing UTF-8 prefix that the next token may complete
};

}  // namespace tansy
