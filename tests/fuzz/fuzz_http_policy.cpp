// libFuzzer target: the HTTP policy's header checks (Host, Origin, Content-Type, routes) and the
// escaping of metrics labels and log values, on arbitrary bytes.
#include <cstddef>
#include <cstdint>
#include <string>

#include "server/http_policy.h"
#include "server/metrics.h"
#include "server/request_log.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string s(reinterpret_cast<const char*>(data), size);
  // Fields separated by NUL: host, origin, content type, method, path.
  std::string f[5];
  for (size_t i = 0, k = 0; i < s.size() && k < 5; ++i) {
    if (s[i] == '\0')
      ++k;
    else
      f[k] += s[i];
  }
  static tansy::server::HttpPolicy policy = [] {
    tansy::server::HttpPolicy p({"127.0.0.1", {"tansy.lan"}, {"http://app.example"}});
    p.add_route("POST", "/v1/chat/completions");
    p.add_route("GET", R"(/v1/models/(.+))");
    return p;
  }();
  httplib::Request req;
  req.method = f[3];
  req.path = f[4];
  req.headers = {{"Host", f[0]}, {"Origin", f[1]}, {"Content-Type", f[2]}};
  httplib::Response res;
  policy.check(req, res);
  policy.host_allowed(f[0]);
  tansy::server::HttpPolicy::split_list(s);
  for (char c : tansy::server::escape_label(s))
    if (c == '\n' || static_cast<unsigned char>(c) >= 0x7f || c == '\0') __builtin_trap();
  for (char c : tansy::server::log_escape(s))
    if (c == '\n' || c == '\r' || c == '\0') __builtin_trap();
  const std::string label = tansy::server::route_label(s);
  if (label != "other" && label[0] != '/') __builtin_trap();
  return 0;
}
