// The bf16 plan's device sampler in its decode loop (bf16/sampler.cu) against the host sampler on
// the same model: the device writes its choice into the decode graph's input and the next feed
// uploads nothing, while the host sampler feeds through forward() (the same graph, the id
// uploaded). Both follow the reference rule, so they must pick the same tokens, and with
// logprobs the same alternatives; a sampled continuation that drifted to the graph's own argmax
// (the id the graph leaves in its input) would differ from the host's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/backend.h"
#include "model/model.h"

namespace tansy {
namespace {

namespace fs = std::filesystem;

fs::path golden_dir(const char* name) {
  const char* env = std::getenv("TANSY_SOURCE_DIR");
  return fs::path(env ? env : TANSY_SOURCE_DIR) / "tests" / "goldens" / name;
}

std::vector<int32_t> read_ids(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<int32_t> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

struct Decoded {
  std::vector<int32_t> tokens;
  std::vector<LogprobInfo> logprobs;
};

// The engine's loop: the prompt, then each choice fed back.
Decoded decode(Model& m, TokenSampler& s, const std::vector<int32_t>& prompt, int n) {
  Decoded r;
  auto st = m.new_state(int(prompt.size()) + n + 1);
  s.feed(*st, prompt);
  for (int i = 0; i < n; ++i) {
    SampleChoice c = s.next(nullptr, -1);
    r.tokens.push_back(c.token);
    if (c.logprobs) r.logprobs.push_back(*c.logprobs);
    if (i + 1 < n) s.feed(*st, std::span<const int32_t>(&r.tokens.back(), 1));
  }
  return r;
}

TEST(SampledDecode, DeviceSamplerMatchesTheHostSamplerOnTheModel) {
  const fs::path dir = golden_dir("realdims-bf16");
  const auto meta = nlohmann::json::parse(std::ifstream(dir / "golden.json"));
  const auto prompt = read_ids(dir / meta["greedy"]["prompt"].get<std::string>());
  ASSERT_FALSE(prompt.empty());
  auto m = make_cuda_model(dir);
  const int V = m->config().vocab_size;
  const int n = 24;
  struct Setting {
    const char* name;
    SamplingParams p;
    int logprobs;
  };
  std::vector<Setting> settings(4);
  settings[0] = {"T 1.0", {}, -1};
  settings[0].p.temperature = 1.0;
  settings[1] = {"T 0.6 top_p 0.95 top_k 20 + top_logprobs 5", {}, 5};
  settings[1].p.temperature = 0.6, settings[1].p.top_p = 0.95, settings[1].p.top_k = 20;
  settings[2] = {"T 1.5 top_k 32, presence 1.5", {}, -1};
  settings[2].p.temperature = 1.5, settings[2].p.top_k = 32, settings[2].p.presence_penalty = 1.5;
  settings[3] = {"T 2.0 + logprobs 0", {}, 0};
  settings[3].p.temperature = 2.0;
  // The graph's own argmax chain, to see that sampling moved away from it.
  SamplingParams greedy;
  greedy.temperature = 0;
  auto gs = m->make_host_sampler(SamplerSpec{greedy, prompt, V, -1});
  const Decoded argmax_chain = decode(*m, *gs, prompt, n);
  gs.reset();
  for (const Setting& s : settings) {
    SCOPED_TRACE(s.name);
    SamplingParams p = s.p;
    p.seed = 4321;
    const SamplerSpec spec{p, prompt, V, s.logprobs};
    Decoded dev, host;
    {
      auto d = m->make_sampler(spec);
      ASSERT_TRUE(d->feed_is_async()) << "not the device sampler";
      dev = decode(*m, *d, prompt, n);
    }
    {
      auto h = m->make_host_sampler(spec);
      host = decode(*m, *h, prompt, n);
    }
    EXPECT_EQ(dev.tokens, host.tokens);
    EXPECT_NE(dev.tokens, argmax_chain.tokens)
        << "the setting never left the argmax: the test proves nothing";
    ASSERT_EQ(dev.logprobs.size(), host.logprobs.size());
    for (size_t i = 0; i < dev.logprobs.size() && dev.tokens == host.tokens; ++i) {
      EXPECT_NEAR(dev.logprobs[i].logprob, host.logprobs[i].logprob,
                  1e-4 * std::max(1.f, std::fabs(host.logprobs[i].logprob)));
      ASSERT_EQ(dev.logprobs[i].top.size(), host.logprobs[i].top.size());
      for (size_t k = 0; k < host.logprobs[i].top.size(); ++k) {
        EXPECT_EQ(dev.logprobs[i].top[k].id, host.logprobs[i].top[k].id)
            << "token " << i << " alternative " << k;
        EXPECT_NEAR(dev.logprobs[i].top[k].logprob, host.logprobs[i].top[k].logprob,
                    1e-4 * std::max(1.f, std::fabs(host.logprobs[i].top[k].logprob)));
      }
    }
    size_t lead = 0;  // the tokens before the first difference
    while (lead < dev.tokens.size() && lead < host.tokens.size() && dev.tokens[lead] == host.tokens[lead])
      ++lead;
    std::printf("  %-48s %zu of %d leading tokens agree\n", s.name, lead, n);
  }
}

}  // namespace
}  // namespace tansy
