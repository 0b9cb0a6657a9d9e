// The built-in web chat: GET / (the page), /app.js, /app.css and /favicon.svg, compiled into the binary from
// src/server/web. Served with a strict Content-Security-Policy: scripts and styles only from
// these routes, requests only to this server, no frames, no inline code.
#pragma once

namespace httplib {
class Server;
}

namespace tansy::server {

void add_web_routes(httplib::Server& http);

}  // namespace tansy::server
