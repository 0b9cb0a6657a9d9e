#include "server/web.h"

#include <httplib.h>

#include <string>
#include <string_view>

#include "web_assets.h"

namespace tansy::server {

namespace {

constexpr const char* kCsp =
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

void serve(const std::function<void(const char*, httplib::Server::Handler)>& get, const char* path,
           std::string_view body, const char* type) {
  get(path, [body, type](const httplib::Request&, httplib::Response& res) {
    res.set_header("Content-Security-Policy", kCsp);
    res.set_header("X-Content-Type-Options", "nosniff");
    res.set_header("Referrer-Policy", "no-referrer");
    res.set_header("Cache-Control", "no-cache");
    res.set_content(std::string(body), type);
  });
}

}  // namespace

void add_web_routes(const std::function<void(const char* path, httplib::Server::Handler)>& get) {
  serve(get, "/", kWeb_index_html, "text/html; charset=utf-8");
  serve(get, "/app.js", kWeb_app_js, "text/javascript; charset=utf-8");
  serve(get, "/app.css", kWeb_app_css, "text/css; charset=utf-8");
  serve(get, "/favicon.svg", kWeb_favicon_svg, "image/svg+xml");
}

}  // namespace tansy::server
