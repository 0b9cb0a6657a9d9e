// libFuzzer target: config.json parsing (model/config.h) of arbitrary JSON. It either gives a
// configuration or throws tansy::Error naming the field; nothing else may escape.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, false);
  if (j.is_discarded()) return 0;
  try {
    tansy::parse_config(j);
  } catch (const tansy::Error&) {
  }
  return 0;
}
