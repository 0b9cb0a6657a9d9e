// The server's browser-safety policy, metrics labels and log escaping, without a socket.
#include <gtest/gtest.h>

#include "server/http_policy.h"
#include "server/metrics.h"
#include "server/request_log.h"

namespace tansy::server {
namespace {

HttpPolicy policy(std::vector<std::string> origins = {}, std::string bound = "127.0.0.1",
                  std::vector<std::string> hosts = {}) {
  HttpPolicy p(HttpPolicyOptions{bound, hosts, origins});
  p.add_route("POST", "/v1/chat/completions");
  p.add_route("GET", "/v1/models");
  p.add_route("GET", R"(/v1/models/(.+))");
  p.add_route("GET", "/health");
  return p;
}

httplib::Request request(std::string method, std::string path, httplib::Headers headers) {
  httplib::Request r;
  r.method = std::move(method);
  r.path = std::move(path);
  r.headers = std::move(headers);
  return r;
}

TEST(HttpPolicy, HostMustNameThisServer) {
  HttpPolicy p = policy();
  for (const char* ok :
       {"127.0.0.1", "127.0.0.1:8000", "localhost", "LOCALHOST:80", "[::1]:8000", "a.localhost", "127.5.6.7"})
    EXPECT_TRUE(p.host_allowed(ok)) << ok;
  for (const char* bad : {"evil.example", "evil.example:8000", "10.0.0.1", "[::2]", "", "a b", "localhost:x",
                          "127.0.0.1.nip.io", "[::1", "localhost.evil.example"})
    EXPECT_FALSE(p.host_allowed(bad)) << bad;
  HttpPolicy any = policy({}, "0.0.0.0", {"tansy.lan"});
  EXPECT_TRUE(any.host_allowed("10.0.0.1:8000"));
  EXPECT_TRUE(any.host_allowed("tansy.lan:8000"));
  EXPECT_FALSE(any.host_allowed("evil.example"));
  EXPECT_TRUE(policy({}, "127.0.0.1", {"*"}).host_allowed("evil.example"));
}

TEST(HttpPolicy, OriginsAllowedOnlyWhenListedOrSame) {
  HttpPolicy none = policy();
  EXPECT_FALSE(none.origin_allowed("http://evil.example", "127.0.0.1:8000"));
  EXPECT_FALSE(none.origin_allowed("null", "127.0.0.1:8000"));
  EXPECT_TRUE(none.origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000"));
  EXPECT_FALSE(none.origin_allowed("https://127.0.0.1:8000", "127.0.0.1:8000"));
  HttpPolicy some = policy({"http://app.example"});
  EXPECT_TRUE(some.origin_allowed("http://app.example", "127.0.0.1:8000"));
  EXPECT_FALSE(some.origin_allowed("http://app.example.evil", "127.0.0.1:8000"));
}

TEST(HttpPolicy, JsonContentType) {
  EXPECT_TRUE(HttpPolicy::is_json_content_type("application/json"));
  EXPECT_TRUE(HttpPolicy::is_json_content_type("Application/JSON; charset=utf-8"));
  for (const char* bad : {"", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                          "application/jsonx", "text/json"})
    EXPECT_FALSE(HttpPolicy::is_json_content_type(bad)) << bad;
}

TEST(HttpPolicy, Checks) {
  HttpPolicy p = policy({"http://app.example"});
  httplib::Response res;
  auto r = p.check(
      request("POST", "/v1/chat/completions", {{"Host", "127.0.0.1"}, {"Content-Type", "text/plain"}}), res);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 415);
  res = {};
  r = p.check(
      request(
          "POST", "/v1/chat/completions",
          {{"Host", "127.0.0.1"}, {"Origin", "http://evil.example"}, {"Content-Type", "application/json"}}),
      res);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 403);
  EXPECT_FALSE(res.has_header("Access-Control-Allow-Origin"));
  res = {};
  EXPECT_FALSE(p.check(
      request(
          "POST", "/v1/chat/completions",
          {{"Host", "127.0.0.1"}, {"Origin", "http://app.example"}, {"Content-Type", "application/json"}}),
      res));
  EXPECT_EQ(res.get_header_value("Access-Control-Allow-Origin"), "http://app.example");
  res = {};
  r = p.check(request("GET", "/v1/chat/completions", {{"Host", "127.0.0.1"}}), res);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 405);
  EXPECT_EQ(res.get_header_value("Allow"), "POST, OPTIONS");
  res = {};
  r = p.check(request("OPTIONS", "/v1/models/tiny",
                      {{"Host", "127.0.0.1"},
                       {"Origin", "http://app.example"},
                       {"Access-Control-Request-Method", "GET"}}),
              res);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 204);
  EXPECT_EQ(res.get_header_value("Access-Control-Allow-Methods"), "GET, HEAD, OPTIONS");
  EXPECT_NE(res.get_header_value("Access-Control-Allow-Headers").find("Authorization"), std::string::npos);
  res = {};
  r = p.check(request("GET", "/health", {{"Host", "rebind.evil.example"}}), res);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 421);
  res = {};
  EXPECT_FALSE(p.check(request("GET", "/unknown", {{"Host", "localhost"}}), res));  // routing answers 404
}

TEST(HttpPolicy, SplitList) {
  EXPECT_EQ(HttpPolicy::split_list(" http://a, ,http://b ,"),
            (std::vector<std::string>{"http://a", "http://b"}));
  EXPECT_TRUE(HttpPolicy::split_list("").empty());
}

TEST(Metrics, LabelsFromAFixedSetAndEscaped) {
  EXPECT_EQ(route_label("/v1/chat/completions"), "/v1/chat/completions");
  EXPECT_EQ(route_label("/v1/models/anything"), "/v1/models");
  EXPECT_EQ(route_label("/v1/x\"} 1\nfake_metric{a=\"b"), "other");
  EXPECT_EQ(escape_label("a\\b\"c\nd\xff\x01"), "a\\\\b\\\"c\\nd??");
  Metrics m;
  m.request_done("/v1/x\"} 1\nfake", 404);
  m.unauthorized();
  std::string text = m.render({});
  EXPECT_NE(text.find("tansy_requests_total{endpoint=\"other\",status=\"404\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("tansy_unauthorized_requests_total 1\n"), std::string::npos);
  EXPECT_EQ(text.find("fake"), std::string::npos);
}

TEST(RequestLog, EscapesEverythingThatCouldBreakALine) {
  EXPECT_EQ(log_escape("a\nb\rc\td\\e"), "a\\nb\\rc\\td\\\\e");
  EXPECT_EQ(log_escape(std::string("x\0y", 3)), "x\\x00y");
  EXPECT_EQ(log_escape("\xff\xc0\x80 ok \xc3\xa9"), "\\xff\\xc0\\x80 ok \xc3\xa9");
  EXPECT_EQ(log_escape("\xe4\xb8"), "\\xe4\\xb8");  // cut sequence
}

}  // namespace
}  // namespace tansy::server
