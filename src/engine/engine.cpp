#include "engine/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/stop.h"
#include "text/detokenizer.h"

namespace tansy {

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::kStop:
      return "stop";
    case Finish::kLength:
      return "length";
    case Finish::kCancelled:
      return "cancelled";
    case Finish::kTimeout:
      return "timeout";
  }
  return "?";
}

GenerationDefaults load_generation_defaults(const std::filesystem::path& model_dir) {
  GenerationDefaults d;
  auto path = model_dir / "generation_config.json";
  std::ifstream in(path);
  if (!in) {
    d.source = "OpenAI defaults (no generation_config.json): temperature 1, top_p 1";
    return d;
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    fail("{}: not valid JSON: {}", path.string(), e.what());
  }
  if (!j.is_object()) fail("{}: must be a JSON object", path.string());
  std::vector<std::string> used;
  auto num = [&](const char* key, double& dst, double lo, double hi) {
    if (!j.contains(key) || j[key].is_null()) return;
    if (!j[key].is_number() || j[key].get<double>() < lo || j[key].get<double>() > hi)
      fail("{}: '{}' must be a number in [{}, {}]", path.string(), key, lo, hi);
    dst = j[key].get<double>();
    used.push_back(fmt::format("{} {}", key, dst));
  };
  SamplingParams& s = d.sampling;
  num("temperature", s.temperature, 0, 100);
  num("top_p", s.top_p, 1e-9, 1);
  num("min_p", s.min_p, 0, 1);
  num("repetition_penalty", s.repetition_penalty, 1e-9, 100);
  num("presence_penalty", s.presence_penalty, -2, 2);
  num("frequency_penalty", s.frequency_penalty, -2, 2);
  if (j.contains("top_k") && !j["top_k"].is_null()) {
    if (!j["top_k"].is_number_integer()) fail("{}: 'top_k' must be an integer", path.string());
    s.top_k = std::max(0, j["top_k"].get<int>());
    used.push_back(fmt::format("top_k {}", s.top_k));
  }
  // Hugging Face treats do_sample=false as greedy whatever the temperature says.
  if (j.contains("do_sample") && j["do_sample"].is_boolean() && !j["do_sample"].get<bool>()) {
    s.temperature = 0;
    used.push_back("do_sample false (greedy)");
  }
  d.source = used.empty()
                 ? "OpenAI defaults (generation_config.json sets no sampling fields): temperature 1, top_p 1"
                 : fmt::format("{}: {}", path.string(), fmt::join(used, ", "));
  return d;
}

bool is_plain_greedy(const SamplingParams& p) {
  // Sampler::sample: penalties and logit_bias apply before the temperature test; with none of
  // them and temperature <= 0 it returns the argmax of the raw logits (lowest id on ties).
  return p.temperature <= 0.0 && p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 &&
         p.frequency_penalty == 0.0 && p.logit_bias.empty();
}

Engine::Engine(std::unique_ptr<Model> model, Tokenizer tokenizer, const EngineOptions& opt)
    : model_(std::move(model)), tok_(std::move(tokenizer)), opt_(opt), cache_(opt.prefix_cache_entries) {
  TANSY_CHECK(opt_.max_seq >= 2, "max_seq must be at least 2");
  TANSY_CHECK(opt_.prefill_chunk >= 1, "prefill_chunk must be positive");
  eos_ = model_->config().eos_token_ids;
  if (eos_.empty())
    for (const char* t : {"<|im_end|>", "<|endoftext|>"})
      if (auto id = tok_.token_id(t)) eos_.push_back(*id);
  TANSY_CHECK(!eos_.empty(), "the model declares no eos_token_id and the tokenizer has no <|im_end|>");
}

Engine::CacheStats Engine::cache_stats() const {
  return {hits_.load(), misses_.load(), cached_tokens_total_.load(), entries_.load(), cache_.capacity()};
}

void Engine::publish_cache_stats() {
  hits_ = cache_.hits();
  misses_ = cache_.misses();
  entries_ = cache_.size();
}

GenResult Engine::generate(const GenRequest& req, const std::function<bool(const GenStep&)>& on_step) {
  std::unique_lock lk(mu_, std::try_to_lock);
  TANSY_CHECK(lk.owns_lock(), "engine: generate() called while another request runs (scheduler bug)");
  const int n_prompt = int(req.prompt.size());
  const int vocab = model_->config().vocab_size;
  TANSY_CHECK(n_prompt > 0, "the prompt is empty");
  TANSY_CHECK(req.max_tokens >= 1, "max_tokens must be at least 1");
  TANSY_CHECK(int64_t(n_prompt) + req.max_tokens <= opt_.max_seq,
              "prompt ({} tokens) plus max_tokens ({}) exceeds the context limit of {} tokens", n_prompt,
              req.max_tokens, opt_.max_seq);
  for (int32_t id : req.prompt)
    TANSY_CHECK(id >= 0 && id < vocab, "token id {} is outside the vocabulary [0, {})", id, vocab);

  GenResult res;
  res.prompt_tokens = n_prompt;
  auto stop_now = [&]() -> std::optional<Finish> {
    if (req.cancelled && req.cancelled()) return Finish::kCancelled;
    if (std::chrono::steady_clock::now() >= req.deadline) return Finish::kTimeout;
    return std::nullopt;
  };

  // The last prompt token is always fed, so that its logits exist.
  PrefixCache::Hit hit = cache_.lookup(*model_, req.prompt, size_t(n_prompt - 1));
  std::unique_ptr<SequenceState> state = std::move(hit.state);
  if (!state) {
    // A state the cache let go of is emptied and reused: no allocation (and on CUDA no graph
    // capture) on the request's path.
    if (spare_ && model_->reset_state(*spare_))
      state = std::move(spare_);
    else
      state = model_->new_state(opt_.max_seq);
  }
  res.cached_tokens = hit.n_tokens;
  cached_tokens_total_ += uint64_t(hit.n_tokens);
  publish_cache_stats();

  // One buffer for every request (generate() is not reentrant): no 1 MB allocation per request.
  if (logits_.size() != size_t(vocab)) logits_.assign(size_t(vocab), 0.f);
  std::vector<float>& logits = logits_;
  // Embedding rows past the tokenizer's last id are padding: never sample or report them.
  const size_t n_real = size_t(std::min(vocab, tok_.vocab_size()));
  auto forward = [&](std::span<const int32_t> ids) {
    model_->forward(*state, ids, logits, false);
    std::fill(logits.begin() + std::ptrdiff_t(n_real), logits.end(), -std::numeric_limits<float>::infinity());
  };
  std::vector<int32_t> fed(req.prompt.begin(), req.prompt.begin() + hit.n_tokens);
  // Plain greedy: the host path would take the argmax over [0, n_real), so the model may fuse
  // feeding tokens with choosing the next one (Model::greedy_step: on CUDA the logits stay on
  // the device), from the prompt's last piece on. Forced tokens still pending take precedence,
  // as they do on the host path.
  // constraint: a constrained request samples through the mask, never through greedy_step.
  const bool greedy_fast =
      opt_.greedy_fast_path && is_plain_greedy(req.sampling) && req.logprobs < 0 && !req.constraint;
  int32_t next_greedy = -1;  // the next token, already chosen by greedy_step (-1: none)
  // Every other request samples on the backend that holds the logits (on CUDA: the device), which
  // follows the reference Sampler's rule; with the fast path off, on the host (tests compare).
  std::unique_ptr<TokenSampler> sampler;
  if (!greedy_fast) {
    SamplerSpec spec{req.sampling, req.prompt, int(n_real), req.logprobs};
    sampler = opt_.greedy_fast_path ? model_->make_sampler(spec) : model_->make_host_sampler(spec);
  }
  // Without a cache there is nothing to snapshot at the cut: prefill straight through (a snapshot
  // is a whole state copy, ~10 ms on CUDA for a new state and its decode graph).
  const size_t cut = cache_.capacity() > 0 ? req.cache_cut : 0;
  for (int pos = hit.n_tokens; pos < n_prompt;) {
    if (auto f = stop_now()) {
      res.finish = *f;
      return res;
    }
    int end = std::min(n_prompt, pos + opt_.prefill_chunk);
    if (cut > size_t(pos) && cut < size_t(end)) end = int(cut);
    const std::span<const int32_t> piece(req.prompt.data() + pos, size_t(end - pos));
    if (greedy_fast && end == n_prompt)
      next_greedy = model_->greedy_step(*state, piece, int(n_real));
    else if (sampler && end == n_prompt)
      sampler->feed(*state, piece);
    else
      forward(piece);
    fed.insert(fed.end(), req.prompt.begin() + pos, req.prompt.begin() + end);
    pos = end;
    if (size_t(pos) == cut && pos < n_prompt) {
      keep_spare(cache_.insert(fed, model_->clone_state(*state)));
      publish_cache_stats();
    }
  }

  // The greedy fast path's argmax when greedy_step has not run (after forced tokens).
  std::optional<Sampler> greedy_sampler;
  if (!sampler) greedy_sampler.emplace(req.sampling, req.prompt);
  StreamDecoder decoder(tok_);
  StopMatcher stops(req.stop);
  std::vector<uint32_t> mask;  // constraint: the allowed-token bitmask, reused every step
  if (req.constraint) mask.resize((size_t(vocab) + 31) / 32);
  bool document_done = false;    // constraint: ended by a complete document
  bool ended = false;            // by a stop string or an end-of-sequence token
  std::vector<int32_t> pending;  // forced tokens still to emit, in reverse order
  bool armed = false;            // forcing happens once per request
  auto arm_forcing = [&] {
    pending.assign(req.forced.rbegin(), req.forced.rend());
    armed = true;
  };
  auto arm_budget = [&] {
    pending.assign(req.forced.rbegin(), req.forced.rend());
    pending.insert(pending.end(), req.budget_forced.rbegin(), req.budget_forced.rend());
    armed = true;
  };
  if (!req.force_trigger) arm_forcing();
  res.finish = Finish::kLength;
  for (int i = 0; i < req.max_tokens; ++i) {
    GenStep step;
    int32_t tok;
    if (!armed && i == req.trigger_budget) arm_budget();
    int32_t forced = -1;
    if (!pending.empty()) {
      forced = pending.back();
      pending.pop_back();
      step.forced = true;
    }
    // constraint: the mask is computed while the backend runs the step just fed (on CUDA the
    // feed only enqueued it), and applied by the sampler on the device.
    const uint32_t* allowed = nullptr;
    if (forced < 0 && req.constraint && req.constraint->active()) {
      req.constraint->fill_mask(mask);
      allowed = mask.data();
    }
    std::optional<LogprobInfo> lp;
    if (sampler) {
      SampleChoice c = sampler->next(allowed, forced);
      tok = c.token;
      lp = std::move(c.logprobs);
    } else {
      tok = forced >= 0 ? forced : next_greedy >= 0 ? next_greedy : greedy_sampler->sample(logits);
      greedy_sampler->accept(tok);
    }
    if (forced < 0 && !armed && req.force_trigger && tok == *req.force_trigger) arm_forcing();
    next_greedy = -1;
    if (req.constraint) req.constraint->accept(tok);  // constraint: sampled and forced tokens alike
    ++res.completion_tokens;
    step.token = tok;
    const bool eos = !req.ignore_eos && std::find(eos_.begin(), eos_.end(), tok) != eos_.end();
    // The end-of-sequence token is not part of the text, so it gets no logprobs entry.
    if (req.logprobs >= 0 && !eos) step.logprobs = std::move(lp);
    if (eos) {
      res.finish = Finish::kStop;
      res.stop_token = tok;
      ended = true;
    } else {
      step.text = stops.push(decoder.push(tok));
      if (stops.stopped()) {
        res.finish = Finish::kStop;
        res.stop_string = stops.matched();
        ended = true;
      } else if (req.constraint && req.constraint->complete()) {
        // constraint: a document that nothing may follow ends the generation (no end-of-turn token).
        res.finish = Finish::kStop;
        ended = document_done = true;
      }
    }
    const bool last = ended || i + 1 == req.max_tokens;
    // A backend that only enqueues the step gets the token before the caller does, so the step
    // runs while the caller formats and sends it (that time then costs nothing per token). State
    // and `fed` still agree when the caller cancels or time runs out: both hold the token.
    const bool ahead = !last && sampler && sampler->feed_is_async();
    if (ahead) {
      sampler->feed(*state, std::span<const int32_t>(&tok, 1));
      fed.push_back(tok);
    }
    if (!on_step(step)) {
      res.finish = Finish::kCancelled;
      break;
    }
    if (last) break;
    if (auto f = stop_now()) {
      res.finish = *f;
      break;
    }
    if (ahead) continue;
    if (sampler)
      sampler->feed(*state, std::span<const int32_t>(&tok, 1));
    else if (pending.empty())
      next_greedy = model_->greedy_step(*state, std::span<const int32_t>(&tok, 1), int(n_real));
    else
      forward(std::span<const int32_t>(&tok, 1));
    fed.push_back(tok);
  }
  if (res.finish == Finish::kLength || (res.finish == Finish::kStop && (res.stop_token || document_done))) {
    GenStep last;
    last.text = stops.push(decoder.flush());
    if (stops.stopped() && !res.stop_token) {
      res.finish = Finish::kStop;
      res.stop_string = stops.matched();
    } else {
      last.text += stops.flush();
    }
    if (!last.text.empty()) on_step(last);
  }
  // The end state is stored cold: measured on multi-turn chat (tools/measure_prefix_cache.py,
  // docs/API.md), the next turn resumes from the cut inside the prompt, because the template
  // re-renders the answer; an end state kept hot would evict the cuts of other conversations.
  keep_spare(cache_.insert(std::move(fed), std::move(state), /*cold=*/req.cache_cut > 0));
  publish_cache_stats();
  return res;
}

}  // namespace tansy
