// Errors: every failure the user can cause becomes a tansy::Error with a one-line message.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace tansy {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

#define TANSY_CHECK(cond, ...)               \
  do {                                       \
    if (!(cond)) ::tansy::fail(__VA_ARGS__); \
  } while (0)

}  // namespace tansy
