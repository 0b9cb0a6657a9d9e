#include "server/frontend.h"

#include <fmt/format.h>

namespace tansy::server {

std::string sse_event(const std::string& name, const Json& data) {
  return "event: " + name + "\ndata: " + data.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n\n";
}

namespace fe {

const char* type_name(const Json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  return "an object";
}

void bad(const std::string& path, const std::string& message) {
  // Every message names its field, whatever the call site wrote.
  if (path.empty() || message.find("'" + path + "'") != std::string::npos) api_fail(400, path, message);
  api_fail(400, path, fmt::format("'{}': {}", path, message));
}

void bad_type(const std::string& path, const Json& v, const char* want) {
  bad(path, fmt::format("'{}' must be {}, got {}", path, want, type_name(v)));
}

const Json& get(const Json& obj, const char* key) {
  static const Json null_value;
  auto it = obj.find(key);
  return it == obj.end() ? null_value : *it;
}

const Json& require(const Json& obj, const char* key, const std::string& path) {
  const Json& v = get(obj, key);
  if (v.is_null()) bad(path, fmt::format("'{}' is required", path));
  return v;
}

std::string str(const Json& v, const std::string& path) {
  if (!v.is_string()) bad_type(path, v, "a string");
  return v.get<std::string>();
}

const Json& object(const Json& v, const std::string& path) {
  if (!v.is_object()) bad_type(path, v, "an object");
  return v;
}

const Json& array(const Json& v, const std::string& path) {
  if (!v.is_array()) bad_type(path, v, "an array");
  return v;
}

bool boolean(const Json& v, const std::string& path) {
  if (!v.is_boolean()) bad_type(path, v, "a boolean");
  return v.get<bool>();
}

int64_t integer(const Json& v, const std::string& path, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) bad_type(path, v, "an integer");
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi))
    bad(path, fmt::format("'{}' must be in [{}, {}], got {}", path, lo, hi, v.dump()));
  int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) bad(path, fmt::format("'{}' must be in [{}, {}], got {}", path, lo, hi, x));
  return x;
}

double number(const Json& v, const std::string& path, double lo, double hi) {
  if (!v.is_number()) bad_type(path, v, "a number");
  double x = v.get<double>();
  if (!(x >= lo && x <= hi))
    bad(path, fmt::format("'{}' must be in [{}, {}], got {}", path, lo, hi, v.dump()));
  return x;
}

std::string join(const std::string& path, const char* key) { return path.empty() ? key : path + "." + key; }
std::string join(const std::string& path, size_t index) { return fmt::format("{}[{}]", path, index); }

std::vector<std::string> unknown_fields(const Json& body, std::initializer_list<const char*> known) {
  std::vector<std::string> out;
  for (auto& [k, v] : body.items()) {
    bool found = false;
    for (const char* x : known) found = found || k == x;
    if (!found) out.push_back(k);
  }
  return out;
}

}  // namespace fe
}  // namespace tansy::server
