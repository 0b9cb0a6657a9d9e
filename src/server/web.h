// The built-in web chat: GET / (the page), /app.js, /app.css and /favicon.svg, compiled into the binary from
// src/server/web. Served with a strict Content-Security-Policy: scripts and styles only from
// these routes, requests only to this server, no frames, no inline code.
#pragma once
#include <httplib.h>

#include <functional>

namespace tansy::server {

// Registers the page's GET routes through `get` (the server's route(), so the HTTP policy knows them).
void add_web_routes(const std::function<void(const char* path, httplib::Server::Handler)>& get);

}  // namespace tansy::server
