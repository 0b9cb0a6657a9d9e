// Browser safety and method rules for every route of tansy serve, checked before routing (so
// routes added later are covered without doing anything):
// - Host must name this server: a loopback name (localhost, 127.0.0.1, [::1]), the bound
//   address, any IP literal when bound to a wildcard address, or a name from --allowed-hosts.
//   Otherwise 421: a DNS-rebinding page reaches the server under its own host name.
// - Origin, when a browser sends one, must be this server itself or listed in --allowed-origins
//   (default none); otherwise 403. Allowed origins get CORS answers, preflights included.
// - POST bodies must be declared application/json; otherwise 415. This refuses the "simple"
//   cross-origin requests (text/plain, forms) that browsers send without a preflight.
// - A known path asked with a method it does not have gets 405 with Allow.
#pragma once
#include <httplib.h>

#include <optional>
#include <regex>
#include <string>
#include <string_view>
#include <vector>

namespace tansy::server {

struct HttpPolicyOptions {
  std::string bound_host = "127.0.0.1";
  std::vector<std::string> allowed_hosts;    // extra Host names; "*": any
  std::vector<std::string> allowed_origins;  // e.g. "http://localhost:3000"; "*": any
};

// What the policy decided for a request that must not reach its handler.
struct PolicyRefusal {
  int status;
  std::string message;
  std::string code;
};

class HttpPolicy {
 public:
  explicit HttpPolicy(HttpPolicyOptions opt);

  // Records the methods of a route pattern (httplib's regex syntax), for 405 and preflights.
  void add_route(const std::string& method, const std::string& pattern);
  // The methods a path has (OPTIONS included when any), or empty for an unknown path.
  std::vector<std::string> methods_for(const std::string& path) const;

  // Checks a request before routing. Sets CORS and Allow headers on res as they apply; returns
  // the refusal to answer instead of routing, if any. A preflight is answered with status 204.
  std::optional<PolicyRefusal> check(const httplib::Request& req, httplib::Response& res) const;

  bool host_allowed(std::string_view host_header) const;
  bool origin_allowed(std::string_view origin, std::string_view host_header) const;
  static bool is_json_content_type(std::string_view content_type);
  // Splits a comma-separated flag value, dropping spaces and empty items.
  static std::vector<std::string> split_list(std::string_view s);

 private:
  HttpPolicyOptions opt_;
  bool bound_wildcard_ = false;
  struct Route {
    std::regex re;
    std::string pattern;
    std::vector<std::string> methods;
  };
  std::vector<Route> routes_;
};

}  // namespace tansy::server
