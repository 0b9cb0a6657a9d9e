// tansy bench: the speed contract of docs/BENCHMARK.md. Batch 1, greedy; for each context length a
// fresh process (this binary re-executed with a hidden --child flag) loads the model, runs one
// warm-up of exactly the measured shape, then one measured prefill and 64 measured decode steps.
// The parent collects one JSON line per child, takes medians over rounds, checks that digests
// agree, and reports each figure against floors from ceilings measured in the same run.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/error.h"
#include "model/config.h"
#include "model/model.h"
#include "model/stage_profiler.h"
#ifdef TANSY_HAVE_CUDA
#include "bench/ceilings.cuh"
#endif
#include "bench/commands.h"
#include "bench/workload.h"

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr int kDecodeSteps = 64;
constexpr const char* kResultTag = "TANSY_BENCH_RESULT ";
const std::vector<int> kDefaultContexts = {256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

std::vector<int> parse_contexts(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    errno = 0;
    long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno != 0 || v < 1 || v > (1L << 22))
      tansy::fail("--contexts: '{}' is not a context length in [1, {}]", item, 1L << 22);
    out.push_back(int(v));
  }
  if (out.empty()) tansy::fail("--contexts: empty list");
  return out;
}

// ---------------------------------------------------------------------------------------------
// Child side: one process, one context.

struct Run {
  double prefill_s = 0, decode_s = 0;
  std::vector<int32_t> ids;  // 1 + kDecodeSteps generated ids
};

// Prefill = submit -> first generated id on the host; decode = first id -> the id produced by
// the 64th decode step on the host (65 ids generated, 64 decode steps timed).
Run measure_once(tansy::Model& model, const std::vector<int32_t>& prompt) {
  auto st = model.new_state(int(prompt.size()) + kDecodeSteps);
  Run r;
  std::vector<double> t;
  t.reserve(kDecodeSteps + 1);
  r.ids.reserve(kDecodeSteps + 1);
  const double t0 = now_s();
  model.generate_greedy(*st, prompt, kDecodeSteps + 1, [&](int32_t tok) {
    t.push_back(now_s());
    r.ids.push_back(tok);
    return true;
  });
  if (r.ids.size() != size_t(kDecodeSteps + 1))
    tansy::fail("generate_greedy returned {} tokens, expected {}", r.ids.size(), kDecodeSteps + 1);
  r.prefill_s = t[0] - t0;
  r.decode_s = t[kDecodeSteps] - t[0];
  return r;
}

// The sampled arm: Qwen's recommended thinking settings with a fixed seed, through the backend's
// TokenSampler (on CUDA: the device sampler after the decode graph). Timed as measure_once.
tansy::SamplingParams sampled_arm_params() {
  tansy::SamplingParams p;
  p.temperature = 0.6;
  p.top_p = 0.95;
  p.top_k = 20;
  p.seed = 1234;
  return p;
}

Run measure_sampled(tansy::Model& model, const std::vector<int32_t>& prompt) {
  auto st = model.new_state(int(prompt.size()) + kDecodeSteps);
  tansy::SamplerSpec spec{sampled_arm_params(), prompt, model.config().vocab_size, -1};
  Run r;
  const double t0 = now_s();
  auto sampler = model.make_sampler(spec);
  sampler->feed(*st, prompt);
  std::vector<double> t;
  for (int i = 0; i <= kDecodeSteps; ++i) {
    if (i > 0) sampler->feed(*st, std::span<const int32_t>(&r.ids.back(), 1));
    r.ids.push_back(sampler->next(nullptr, -1).token);
    t.push_back(now_s());
  }
  r.prefill_s = t[0] - t0;
  r.decode_s = t[kDecodeSteps] - t[0];
  return r;
}

// The digest covers the 64 ids the measured decode steps produced (which depend on the prefill's
// first token, fed back as the first decode input).
uint64_t decode_digest(const Run& r) { return tansy::fnv1a64_ids(std::span(r.ids).subspan(1)); }

json child_context(const std::string& dir, const std::string& backend, int ctx, bool sampled) {
  tansy::ModelOptions opt;
  opt.backend = backend;
  double t0 = now_s();
  auto model = tansy::open_model(dir, opt);
  double load_s = now_s() - t0;
  const auto prompt = tansy::synthetic_prompt(ctx, model->config().vocab_size);
  Run warm = measure_once(*model, prompt);
  Run r = measure_once(*model, prompt);
  json arm;
  if (sampled) {
    Run sw = measure_sampled(*model, prompt);
    Run sr = measure_sampled(*model, prompt);
    arm = json{{"decode_tps", kDecodeSteps / sr.decode_s},
               {"prefill_tps", ctx / sr.prefill_s},
               {"digest", hex64(decode_digest(sr))},
               {"warmup_digest", hex64(decode_digest(sw))},
               {"warmup_decode_tps", kDecodeSteps / sw.decode_s}};
  }
  return json{{"context", ctx},
              {"sampled", arm},
              {"load_s", load_s},
              {"prefill_s", r.prefill_s},
              {"decode_s", r.decode_s},
              {"prefill_tps", ctx / r.prefill_s},
              {"decode_tps", kDecodeSteps / r.decode_s},
              {"digest", hex64(decode_digest(r))},
              {"warmup_digest", hex64(decode_digest(warm))},
              {"warmup_prefill_tps", ctx / warm.prefill_s},
              {"warmup_decode_tps", kDecodeSteps / warm.decode_s},
              {"first_token", r.ids[0]},
              {"ids", r.ids},
              {"backend", model->backend_name()}};
}

json child_ceilings() {
#ifdef TANSY_HAVE_CUDA
  auto d = tansy::cuda::device_info();
  auto c = tansy::cuda::measure_ceilings();
  return json{{"gpu", d.gpu},
              {"driver", d.driver},
              {"cuda_runtime", d.cuda_runtime},
              {"cuda_driver", d.cuda_driver},
              {"sm_count", d.sm_count},
              {"memory_gib", d.memory_gib},
              {"ceilings",
               {{"copy_gbps", c.copy_gbps},
                {"copy_buffer_bytes", c.copy_buffer_bytes},
                {"copy_note", "device-to-device cudaMemcpy, bytes read + written, median"},
                {"read_gbps", c.read_gbps},
                {"read_buffer_bytes", c.read_buffer_bytes},
                {"read_note", "read-only reduction kernel, 16-byte loads, bytes read, median"},
                {"gemm_tflops", c.gemm_tflops},
                {"gemm_n", c.gemm_n},
                {"gemm_note", "cuBLAS bf16 GEMM n^3, f32 accumulation, random data, median"},
                {"reps", c.reps}}}};
#else
  tansy::fail("this build has no CUDA backend: no ceilings to measure");
#endif
}

#ifdef TANSY_HAVE_CUDA
json stages_json(const std::vector<tansy::StageTime>& v) {
  json a = json::array();
  for (auto& s : v)
    a.push_back(
        {{"name", s.name}, {"ms", s.ms}, {"bytes", s.bytes}, {"flops", s.flops}, {"launches", s.launches}});
  return a;
}
#endif

json child_stages([[maybe_unused]] const std::string& dir, [[maybe_unused]] const std::string& backend,
                  [[maybe_unused]] int ctx) {
#ifdef TANSY_HAVE_CUDA
  tansy::ModelOptions opt;
  opt.backend = backend;
  auto model = tansy::open_model(dir, opt);
  auto* prof = dynamic_cast<tansy::StageProfiler*>(model.get());
  if (!prof)
    return json{{"error", fmt::format("the {} backend exposes no per-stage breakdown (implement "
                                      "tansy::StageProfiler, src/model/stage_profiler.h)",
                                      model->backend_name())}};
  const auto prompt = tansy::synthetic_prompt(ctx, model->config().vocab_size);
  Run warm = measure_once(*model, prompt);
  auto st = model->new_state(ctx + 8);
  auto prefill = prof->profile_prefill(*st, prompt);
  std::vector<tansy::StageTime> decode;
  int32_t tok = warm.ids[0];
  for (int i = 0; i < 3; ++i) decode = prof->profile_decode_step(*st, tok);  // the last of three: warm
  return json{{"context", ctx}, {"prefill", stages_json(prefill)}, {"decode", stages_json(decode)}};
#else
  return json{{"error", "this build has no CUDA backend: no per-stage breakdown"}};
#endif
}

// ---------------------------------------------------------------------------------------------
// Parent side.

struct ChildOutcome {
  std::optional<json> result;
  std::string error;
};

std::string self_exe() {
  std::error_code ec;
  auto p = fs::read_symlink("/proc/self/exe", ec);
  if (ec) tansy::fail("cannot locate this executable (/proc/self/exe): {}", ec.message());
  return p.string();
}

// Runs this binary with `args`, waits at most timeout_s, and returns the JSON of its result line.
// The child's other output goes to our stderr, so stdout keeps only the table.
ChildOutcome run_child(const std::vector<std::string>& args, double timeout_s) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) tansy::fail("pipe: {}", std::strerror(errno));
  const std::string exe = self_exe();
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(exe.c_str()));
  for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid < 0) tansy::fail("fork: {}", std::strerror(errno));
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    execv(exe.c_str(), argv.data());
    std::fprintf(stderr, "tansy bench: exec %s failed: %s\n", exe.c_str(), std::strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  std::string out;
  const double deadline = now_s() + timeout_s;
  bool timed_out = false;
  char buf[65536];
  for (;;) {
    double left = deadline - now_s();
    if (left <= 0) {
      timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    int pr = poll(&p, 1, int(std::min(left, 1.0) * 1000) + 1);
    if (pr < 0 && errno == EINTR) continue;
    if (pr <= 0) continue;
    ssize_t n = read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, size_t(n));
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  ChildOutcome o;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(kResultTag, 0) == 0) {
      try {
        o.result = json::parse(line.substr(std::strlen(kResultTag)));
      } catch (const json::exception& e) {
        o.error = fmt::format("child printed an unreadable result: {}", e.what());
      }
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  }
  if (timed_out) {
    o.result.reset();
    o.error = fmt::format("timed out after {:.0f} s (killed)", timeout_s);
  } else if (WIFSIGNALED(status)) {
    o.result.reset();
    o.error = fmt::format("child killed by signal {}", WTERMSIG(status));
  } else if (WEXITSTATUS(status) != 0) {
    o.result.reset();
    o.error = fmt::format("child exited with status {} (its message is above)", WEXITSTATUS(status));
  } else if (!o.result && o.error.empty()) {
    o.error = "child printed no result";
  }
  return o;
}

std::string commit_id(const tansy::cli::Flags& f) {
  if (f.has("commit")) return f.get("commit");
  if (const char* e = std::getenv("TANSY_COMMIT"); e && *e) return e;
  return "unknown";
}

json weights_note(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "tansy_synth.json");
  json j;
  if (in) {
    try {
      j = json::parse(in);
    } catch (const json::exception&) {
      j = json();
    }
  }
  if (j.is_object() && j.contains("seed")) {
    const double skew = j.value("router_skew", 0.0);
    return json{
        {"synthetic", true},
        {"seed", j["seed"]},
        {"router_skew", skew},
        {"note", skew > 0
                     ? fmt::format("synthetic checkpoint (tansy synth): real tensor names, shapes and MLX "
                                   "4-bit layout, random values; skewed router: expert of popularity "
                                   "rank r chosen by a share of tokens ~ r^-{}",
                                   skew)
                     : std::string("synthetic checkpoint (tansy synth): real tensor names, shapes and "
                                   "MLX 4-bit layout, random values; random router weights spread "
                                   "tokens roughly uniformly over experts")}};
  }
  return json{{"synthetic", false}};
}

void print_stage_table(const char* title, const json& stages, double read_gbps, double gemm_tflops) {
  if (!stages.is_array()) return;
  double total = 0;
  for (auto& s : stages) total += s["ms"].get<double>();
  std::printf("\n%s (total %.3f ms)\n", title, total);
  std::printf("  %-28s %10s %7s %12s %10s %10s\n", "stage", "ms", "share", "bytes/flops", "of BW", "of GEMM");
  for (auto& s : stages) {
    double ms = s["ms"].get<double>(), bytes = s["bytes"].get<double>(), flops = s["flops"].get<double>();
    std::string bw =
        bytes > 0 && read_gbps > 0 ? fmt::format("{:.2f}", bytes / (ms * 1e-3) / (read_gbps * 1e9)) : "-";
    std::string fl = flops > 0 && gemm_tflops > 0
                         ? fmt::format("{:.2f}", flops / (ms * 1e-3) / (gemm_tflops * 1e12))
                         : "-";
    std::string amount = bytes > 0   ? fmt::format("{:.1f} MB", bytes / 1e6)
                         : flops > 0 ? fmt::format("{:.1f} GF", flops / 1e9)
                                     : "-";
    std::printf("  %-28s %10.4f %6.1f%% %12s %10s %10s\n", s["name"].get<std::string>().c_str(), ms,
                total > 0 ? 100 * ms / total : 0.0, amount.c_str(), bw.c_str(), fl.c_str());
  }
}

}  // namespace

namespace tansy::bench {

const char kBenchSummary[] =
    "speed contract (BENCHMARK.md): --model DIR [--contexts 256,512,...] [--rounds 2] "
    "[--json FILE] [--backend cuda|cpu] [--commit ID] [--stages] [--child-timeout S] "
    "[--sampled-contexts 256,4096]";

int run_bench(const std::vector<std::string>& args) {
  tansy::cli::Flags f(args,
                      {"model", "contexts", "rounds", "json", "backend", "commit", "child-timeout", "context",
                       "stages-context", "sampled-contexts"},
                      {"child", "child-ceilings", "child-stages", "stages", "no-ceilings", "sampled"});
  const std::string backend = f.get("backend", "cuda");
  if (backend != "cuda" && backend != "cpu") tansy::fail("--backend must be cuda or cpu, got '{}'", backend);

  // Hidden child modes: one line of JSON on stdout, tagged.
  if (f.has("child") || f.has("child-stages")) {
    const std::string dir = f.get("model");
    if (!f.has("context")) tansy::fail("--context is required with the child modes");
    const int ctx = int(f.get_int("context", 0, 1, 1L << 22));
    json j =
        f.has("child") ? child_context(dir, backend, ctx, f.has("sampled")) : child_stages(dir, backend, ctx);
    std::printf("%s%s\n", kResultTag, j.dump().c_str());
    return 0;
  }
  if (f.has("child-ceilings")) {
    std::printf("%s%s\n", kResultTag, child_ceilings().dump().c_str());
    return 0;
  }

  const std::string dir = f.get("model");
  const tansy::ModelConfig cfg = tansy::load_config(dir);  // fail early on a bad directory
  const auto contexts = f.has("contexts") ? parse_contexts(f.get("contexts")) : kDefaultContexts;
  for (int c : contexts)
    if (c + kDecodeSteps > cfg.max_position)
      tansy::fail("--contexts: {} + {} decode tokens exceed max_position_embeddings {}", c, kDecodeSteps,
                  cfg.max_position);
  // The sampled arm runs at these contexts (each adds two prefills and 130 decode steps).
  const auto sampled_contexts =
      f.has("sampled-contexts") ? parse_contexts(f.get("sampled-contexts")) : std::vector<int>{256, 4096};
  const int rounds = int(f.get_int("rounds", 2, 1, 100));
  const double timeout = double(f.get_int("child-timeout", 900, 10, 86400));
  const std::string json_path = f.get("json", "");
  const bool want_ceilings = backend == "cuda" && !f.has("no-ceilings");
#ifndef TANSY_HAVE_CUDA
  if (backend == "cuda")
    tansy::fail("this build has no CUDA backend (rebuild with nvcc, or pass --backend cpu)");
#endif
  if (rounds < 2)
    std::fprintf(stderr, "tansy bench: warning: --rounds %d: the contract asks for the median of >= 2\n",
                 rounds);

  const tansy::CostModel cost = tansy::cost_model(cfg);
  json report = {
      {"contract",
       "BENCHMARK.md: batch 1, greedy, synthetic prompt ids, fresh process per context, "
       "1 warm-up, 1 measured prefill + 64 measured decode steps, median over rounds"},
      {"engine", "tansy"},
      {"commit", commit_id(f)},
      {"date", utc_now()},
      {"backend", backend},
      {"model", cfg.name},
      {"model_dir", dir},
      {"weights", weights_note(dir)},
      {"rounds", rounds},
      {"decode_steps", kDecodeSteps},
      {"digest_of", "64-bit FNV-1a over the little-endian int32 ids produced by the 64 decode steps"},
      {"cost_model",
       {{"weight_bytes_per_token", cost.weight_bytes_per_token},
        {"kv_bytes_per_context_token", cost.kv_bytes_per_context_token},
        {"gdn_state_bytes", cost.gdn_state_bytes},
        {"active_params", cost.active_params},
        {"decode_bytes", "weights + KV bytes x (context + 32) + 2 x GDN state (read and written)"},
        {"prefill_flops",
         "context x (2 x active params + attn_layers x 4 x heads x head_dim x context / 2)"}}}};

  double read_gbps = 0, gemm_tflops = 0;
  if (want_ceilings) {
    std::fprintf(stderr, "tansy bench: measuring ceilings\n");
    auto o = run_child({"bench", "--child-ceilings", "--backend", backend}, timeout);
    if (!o.result) tansy::fail("ceiling measurement failed: {}", o.error);
    for (auto& [k, v] : o.result->items()) report[k] = v;
    read_gbps = (*o.result)["ceilings"]["read_gbps"].get<double>();
    gemm_tflops = (*o.result)["ceilings"]["gemm_tflops"].get<double>();
  }

  // Rounds outermost: drift in the card's state spreads over every context instead of one.
  std::vector<std::vector<json>> runs(contexts.size());
  std::vector<std::vector<std::string>> errors(contexts.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < contexts.size(); ++i) {
      const int ctx = contexts[i];
      std::vector<std::string> child = {"bench",     "--child",           "--model",   dir,
                                        "--context", std::to_string(ctx), "--backend", backend};
      if (std::find(sampled_contexts.begin(), sampled_contexts.end(), ctx) != sampled_contexts.end())
        child.push_back("--sampled");
      auto o = run_child(child, timeout);
      if (o.result) {
        const json& j = *o.result;
        std::fprintf(stderr,
                     "tansy bench: round %d/%d context %d: prefill %.1f tok/s, decode %.2f tok/s, digest %s "
                     "(load %.1f s)\n",
                     r + 1, rounds, ctx, j["prefill_tps"].get<double>(), j["decode_tps"].get<double>(),
                     j["digest"].get<std::string>().c_str(), j["load_s"].get<double>());
        runs[i].push_back(j);
      } else {
        std::fprintf(stderr, "tansy bench: round %d/%d context %d: FAILED: %s\n", r + 1, rounds, ctx,
                     o.error.c_str());
        errors[i].push_back(fmt::format("round {}: {}", r + 1, o.error));
      }
    }
  }

  int failures = 0;
  json results = json::array();
  for (size_t i = 0; i < contexts.size(); ++i) {
    const int ctx = contexts[i];
    json row = {{"context", ctx}};
    std::vector<double> pre, dec;
    std::vector<std::string> digests;
    bool agree = true;
    for (auto& j : runs[i]) {
      pre.push_back(j["prefill_tps"].get<double>());
      dec.push_back(j["decode_tps"].get<double>());
      digests.push_back(j["digest"].get<std::string>());
      agree = agree && j["digest"] == j["warmup_digest"];
    }
    for (auto& d : digests) agree = agree && d == digests[0];
    if (!errors[i].empty() || runs[i].empty()) {
      ++failures;
      row["error"] = errors[i];
    }
    if (!runs[i].empty()) {
      row["prefill_tps"] = median(pre);
      row["decode_tps"] = median(dec);
      row["digest"] = digests[0];
      row["first_token"] = runs[i][0]["first_token"];
      row["ids"] = runs[i][0]["ids"];  // all 65 generated ids of round 1, for cross-engine comparison
      row["load_s"] = runs[i][0]["load_s"];
      row["digests_agree"] = agree;
      row["prefill_tps_rounds"] = pre;
      row["decode_tps_rounds"] = dec;
      row["digest_rounds"] = digests;
      if (!agree) ++failures;
      if (!runs[i][0]["sampled"].is_null()) {
        std::vector<double> sdec;
        std::vector<std::string> sdig;
        bool sagree = true;
        for (auto& j : runs[i]) {
          const json& a = j["sampled"];
          sdec.push_back(a["decode_tps"].get<double>());
          sdig.push_back(a["digest"].get<std::string>());
          sagree =
              sagree && a["digest"] == a["warmup_digest"] && a["digest"] == runs[i][0]["sampled"]["digest"];
        }
        row["sampled"] = {{"settings", "temperature 0.6, top_p 0.95, top_k 20, seed 1234 (device sampler)"},
                          {"decode_tps", median(sdec)},
                          {"decode_tps_rounds", sdec},
                          {"digest", sdig[0]},
                          {"digest_rounds", sdig},
                          {"digests_agree", sagree},
                          {"of_greedy", median(sdec) / median(dec)}};
        if (!sagree) ++failures;
      }
      const double dbytes = cost.decode_bytes(ctx + kDecodeSteps / 2.0), pflops = cost.prefill_flops(ctx);
      row["decode_bytes_per_token"] = dbytes;
      row["prefill_flops"] = pflops;
      if (read_gbps > 0) row["bandwidth_floor_fraction"] = dbytes * median(dec) / (read_gbps * 1e9);
      if (gemm_tflops > 0)
        row["compute_floor_fraction"] = pflops / (ctx / median(pre)) / (gemm_tflops * 1e12);
    }
    results.push_back(row);
  }
  report["results"] = results;

  if (f.has("stages")) {
    const int sctx = int(f.get_int("stages-context", 4096, 1, 1L << 22));
    auto o = run_child(
        {"bench", "--child-stages", "--model", dir, "--context", std::to_string(sctx), "--backend", backend},
        timeout);
    report["stages"] = o.result ? *o.result : json{{"error", o.error}};
  }

  // Table.
  std::printf("tansy bench  commit %s  backend %s  model %s\n", report["commit"].get<std::string>().c_str(),
              backend.c_str(), cfg.name.c_str());
  if (report.contains("gpu"))
    std::printf(
        "gpu %s  driver %s  CUDA %s (driver %s)  copy %.0f GB/s  read %.0f GB/s  bf16 GEMM %.0f TFLOP/s\n",
        report["gpu"].get<std::string>().c_str(), report["driver"].get<std::string>().c_str(),
        report["cuda_runtime"].get<std::string>().c_str(), report["cuda_driver"].get<std::string>().c_str(),
        report["ceilings"]["copy_gbps"].get<double>(), read_gbps, gemm_tflops);
  std::string weights_desc = "checkpoint";
  if (report["weights"]["synthetic"].get<bool>()) {
    const double skew = report["weights"].value("router_skew", 0.0);
    weights_desc = skew > 0 ? fmt::format("synthetic (skewed router, alpha {})", skew)
                            : "synthetic (random router: near-uniform expert load)";
  }
  std::printf("median of %d round(s), %d decode steps; weights: %s\n", rounds, kDecodeSteps,
              weights_desc.c_str());
  std::printf("%9s %13s %12s %18s %9s %9s  %s\n", "context", "prefill tok/s", "decode tok/s", "digest",
              "BW floor", "FLOP flr", "status");
  for (auto& row : results) {
    if (!row.contains("prefill_tps")) {
      std::printf("%9d %13s %12s %18s %9s %9s  FAILED\n", row["context"].get<int>(), "-", "-", "-", "-", "-");
      continue;
    }
    auto frac = [&](const char* k) {
      return row.contains(k) ? fmt::format("{:.3f}", row[k].get<double>()) : std::string("-");
    };
    std::string status = row.contains("error")              ? "SOME ROUNDS FAILED"
                         : row["digests_agree"].get<bool>() ? "ok"
                                                            : "DIGEST MISMATCH";
    std::printf("%9d %13.1f %12.2f %18s %9s %9s  %s\n", row["context"].get<int>(),
                row["prefill_tps"].get<double>(), row["decode_tps"].get<double>(),
                row["digest"].get<std::string>().c_str(), frac("bandwidth_floor_fraction").c_str(),
                frac("compute_floor_fraction").c_str(), status.c_str());
  }
  for (auto& row : results)
    if (row.contains("sampled")) {
      const json& a = row["sampled"];
      std::printf(
          "%9d sampled (T 0.6, top_p 0.95, top_k 20, seed 1234): decode %.2f tok/s = %.3f of greedy, "
          "digest %s %s\n",
          row["context"].get<int>(), a["decode_tps"].get<double>(), a["of_greedy"].get<double>(),
          a["digest"].get<std::string>().c_str(), a["digests_agree"].get<bool>() ? "ok" : "DIGEST MISMATCH");
    }
  if (report.contains("stages")) {
    const json& s = report["stages"];
    if (s.contains("error")) {
      std::printf("\nper-stage breakdown: %s\n", s["error"].get<std::string>().c_str());
    } else {
      print_stage_table("decode step stages", s["decode"], read_gbps, gemm_tflops);
      print_stage_table(fmt::format("prefill stages ({} tokens)", s["context"].get<int>()).c_str(),
                        s["prefill"], read_gbps, gemm_tflops);
    }
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << report.dump(2) << "\n";
    out.close();
    if (!out) tansy::fail("cannot write --json file '{}'", json_path);
  }
  if (failures) tansy::fail("{} context(s) failed or disagreed between runs (see above)", failures);
  return 0;
}

}  // namespace tansy::bench
