#include "server/tokenize_api.h"

#include <fmt/format.h>

#include "core/error.h"
#include "server/frontend.h"
#include "text/chat_template.h"

namespace tansy::server {

using namespace fe;

namespace {

void check_model(const Json& body, const TokenizeContext& ctx) {
  const Json& m = get(body, "model");
  if (m.is_null()) return;  // optional, as in vLLM
  std::string model = str(m, "model");
  if (model != ctx.model_id)
    api_fail(404, "model",
             fmt::format("The model '{}' does not exist (this server serves '{}')", model, ctx.model_id),
             "model_not_found");
}

bool flag(const Json& body, const char* key, bool fallback) {
  const Json& v = get(body, key);
  return v.is_null() ? fallback : boolean(v, key);
}

}  // namespace

Json tokenize_request(const Json& body, const TokenizeContext& ctx) {
  object(body, "");
  check_model(body, ctx);
  const bool strs = flag(body, "return_token_strs", false);
  // Qwen's tokenizer adds no BOS/EOS, so add_special_tokens changes nothing; it is still checked.
  flag(body, "add_special_tokens", true);
  const bool has_prompt = !get(body, "prompt").is_null(), has_messages = !get(body, "messages").is_null();
  if (has_prompt == has_messages)
    bad("prompt", "give exactly one of 'prompt' (a string) and 'messages' (a chat)");
  Json out = Json::object();
  std::string text;
  if (has_prompt) {
    text = str(get(body, "prompt"), "prompt");
  } else {
    // The chat request's own validation and rendering, so the ids are exactly what
    // /v1/chat/completions would run.
    Json chat = body;
    chat["model"] = ctx.model_id;
    for (const char* k : {"prompt", "return_token_strs", "add_special_tokens"}) chat.erase(k);
    ApiRequest r = parse_chat_request(chat, ctx.defaults, ctx.tokenizer.vocab_size());
    try {
      text = text::render_chat(r.render.messages, r.render.tools, r.render.options);
    } catch (const Error& e) {
      api_fail(400, "messages", e.what());
    }
  }
  std::vector<int32_t> ids = ctx.tokenizer.encode(text, true);
  out["count"] = ids.size();
  out["max_model_len"] = ctx.max_model_len;
  out["tokens"] = ids;
  if (strs) {
    Json s = Json::array();
    for (int32_t id : ids) s.push_back(utf8_lossy(ctx.tokenizer.token_bytes(id)));
    out["token_strs"] = s;
  } else {
    out["token_strs"] = nullptr;
  }
  if (has_messages) out["prompt"] = text;
  return out;
}

Json detokenize_request(const Json& body, const TokenizeContext& ctx) {
  object(body, "");
  check_model(body, ctx);
  const Json& t = array(require(body, "tokens", "tokens"), "tokens");
  std::vector<int32_t> ids;
  for (size_t i = 0; i < t.size(); ++i) {
    int64_t id = integer(t[i], join("tokens", i), 0, ctx.tokenizer.vocab_size() - 1);
    if (!ctx.tokenizer.is_valid(int32_t(id)))
      bad(join("tokens", i), fmt::format("token id {} is not in the vocabulary", id));
    ids.push_back(int32_t(id));
  }
  return Json{{"prompt", ctx.tokenizer.decode(ids)}};
}

}  // namespace tansy::server
