// Stop strings matched across token boundaries: text that might be the start of a stop string
// is held back until the next token decides, and a matched stop string is never emitted.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace tansy {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  // Appends generated text; returns the part that is now safe to emit. After a match,
  // stopped() is true and the stop string and everything after it are dropped.
  std::string push(std::string_view text);
  // End of generation without a match: the held-back text.
  std::string flush();

  bool stopped() const { return matched_ >= 0; }
  const std::string& matched() const;  // the stop string that matched

 private:
  std::vector<std::string> stops_;
  std::string held_;
  int matched_ = -1;
};

}  // namespace tansy
