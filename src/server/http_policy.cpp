#include "server/http_policy.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>

namespace tansy::server {

namespace {

std::string lower(std::string_view s) {
  std::string o(s);
  for (char& c : o) c = char(std::tolower(static_cast<unsigned char>(c)));
  return o;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// The host part of a Host header value ("name", "name:port", "[v6]", "[v6]:port"), lower case,
// brackets kept for IPv6. Empty when malformed.
std::string host_name(std::string_view h) {
  h = trim(h);
  if (h.empty()) return "";
  if (h.front() == '[') {
    size_t close = h.find(']');
    if (close == std::string_view::npos) return "";
    std::string_view rest = h.substr(close + 1);
    if (!rest.empty() && (rest.front() != ':' || rest.size() == 1)) return "";
    return lower(h.substr(0, close + 1));
  }
  size_t colon = h.find(':');
  if (colon != std::string_view::npos) {
    std::string_view port = h.substr(colon + 1);
    if (port.empty() || !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return "";
    h = h.substr(0, colon);
  }
  if (h.empty()) return "";
  for (char c : h)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_')) return "";
  return lower(h);
}

bool is_ip_literal(const std::string& host) {
  unsigned char buf[16];
  if (host.size() > 2 && host.front() == '[')
    return inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), buf) == 1;
  return inet_pton(AF_INET, host.c_str(), buf) == 1;
}

bool is_loopback_name(const std::string& host) {
  if (host == "localhost" || host == "[::1]") return true;
  if (host.size() > 10 && host.compare(host.size() - 10, 10, ".localhost") == 0) return true;
  unsigned char buf[4];
  return inet_pton(AF_INET, host.c_str(), buf) == 1 && buf[0] == 127;
}

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::string join(const std::vector<std::string>& v) {
  std::string o;
  for (auto& x : v) o += (o.empty() ? "" : ", ") + x;
  return o;
}

}  // namespace

HttpPolicy::HttpPolicy(HttpPolicyOptions opt) : opt_(std::move(opt)) {
  for (auto& h : opt_.allowed_hosts) h = h == "*" ? h : host_name(h);
  const std::string b = lower(opt_.bound_host);
  bound_wildcard_ = b == "0.0.0.0" || b == "::" || b == "[::]" || b.empty();
}

std::vector<std::string> HttpPolicy::split_list(std::string_view s) {
  std::vector<std::string> out;
  while (!s.empty()) {
    size_t comma = s.find(',');
    std::string_view item = trim(s.substr(0, comma));
    if (!item.empty()) out.emplace_back(item);
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

void HttpPolicy::add_route(const std::string& method, const std::string& pattern) {
  for (auto& r : routes_)
    if (r.pattern == pattern) {
      if (!contains(r.methods, method)) r.methods.push_back(method);
      return;
    }
  routes_.push_back({std::regex(pattern), pattern, {method}});
}

std::vector<std::string> HttpPolicy::methods_for(const std::string& path) const {
  std::vector<std::string> m;
  for (auto& r : routes_)
    if (std::regex_match(path, r.re))
      for (auto& x : r.methods)
        if (!contains(m, x)) m.push_back(x);
  if (!m.empty()) {
    if (contains(m, "GET") && !contains(m, "HEAD")) m.push_back("HEAD");
    m.push_back("OPTIONS");
  }
  return m;
}

bool HttpPolicy::host_allowed(std::string_view host_header) const {
  if (contains(opt_.allowed_hosts, "*")) return true;
  const std::string h = host_name(host_header);
  if (h.empty()) return false;
  if (is_loopback_name(h) || contains(opt_.allowed_hosts, h)) return true;
  // An IP literal cannot be rebound by DNS; one other than the bound address is a request meant
  // for another server, unless we listen on all of this machine's addresses.
  if (is_ip_literal(h)) {
    const std::string b = lower(opt_.bound_host);
    return bound_wildcard_ || h == b || h == "[" + b + "]";
  }
  return h == lower(opt_.bound_host);
}

bool HttpPolicy::origin_allowed(std::string_view origin, std::string_view host_header) const {
  if (contains(opt_.allowed_origins, "*")) return true;
  const std::string o = lower(trim(origin));
  for (auto& a : opt_.allowed_origins)
    if (lower(a) == o) return true;
  // Same origin: a page this server served itself (http://<Host>).
  return !host_header.empty() && o == "http://" + lower(trim(host_header));
}

bool HttpPolicy::is_json_content_type(std::string_view ct) {
  ct = trim(ct.substr(0, ct.find(';')));
  return lower(ct) == "application/json";
}

std::optional<PolicyRefusal> HttpPolicy::check(const httplib::Request& req, httplib::Response& res) const {
  const bool has_host = req.has_header("Host");
  const std::string host = req.get_header_value("Host");
  if (has_host && !host_allowed(host))
    return PolicyRefusal{421,
                         "the Host header names another server (start tansy serve with --allowed-hosts to "
                         "accept that name)",
                         "host_not_allowed"};

  const std::vector<std::string> methods = methods_for(req.path);
  const bool has_origin = req.has_header("Origin");
  bool cors = false;
  if (has_origin) {
    const std::string origin = req.get_header_value("Origin");
    if (!origin_allowed(origin, host))
      return PolicyRefusal{403,
                           "cross-origin requests are refused unless their origin is listed in "
                           "--allowed-origins",
                           "origin_not_allowed"};
    res.set_header("Access-Control-Allow-Origin", contains(opt_.allowed_origins, "*") ? "*" : origin);
    res.set_header("Vary", "Origin");
    cors = true;
  }

  if (req.method == "OPTIONS") {
    if (methods.empty()) return PolicyRefusal{404, "no route for OPTIONS " + req.path, ""};
    res.set_header("Allow", join(methods));
    if (cors && req.has_header("Access-Control-Request-Method")) {
      const std::string want = req.get_header_value("Access-Control-Request-Method");
      if (!contains(methods, want))
        return PolicyRefusal{405, "method " + want + " is not allowed on " + req.path, ""};
      res.set_header("Access-Control-Allow-Methods", join(methods));
      res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
      res.set_header("Access-Control-Max-Age", "600");
    }
    return PolicyRefusal{204, "", ""};
  }
  if (!methods.empty() && !contains(methods, req.method)) {
    res.set_header("Allow", join(methods));
    return PolicyRefusal{
        405, "method " + req.method + " is not allowed on " + req.path + " (allowed: " + join(methods) + ")",
        ""};
  }
  if (req.method == "POST" && !is_json_content_type(req.get_header_value("Content-Type")))
    return PolicyRefusal{415, "POST bodies must be sent with Content-Type: application/json", ""};
  return std::nullopt;
}

}  // namespace tansy::server
