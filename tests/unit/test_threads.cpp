// --threads reaches the CPU backend: the model owns a pool of exactly that many threads (the
// calling thread counts as one), and its results do not depend on the count.
#include <gtest/gtest.h>

#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/threadpool.h"
#include "model/model.h"
#include "test_util.h"

namespace {

// Threads of this process (Linux).
int process_threads() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

TEST(Threads, PoolHasTheRequestedSize) {
  EXPECT_EQ(tansy::ThreadPool(1).size(), 1);
  EXPECT_EQ(tansy::ThreadPool(3).size(), 3);
  EXPECT_GE(tansy::ThreadPool(0).size(), 1);
}

TEST(Threads, CpuModelStartsTheRequestedThreads) {
  const auto dir = tansy::test::goldens_dir() / "smalldims-mlx";
  const int before = process_threads();
  {
    tansy::ModelOptions opt;
    opt.threads = 4;
    auto m = tansy::open_model(dir, opt);
    EXPECT_EQ(process_threads(), before + 3) << "a pool of 4: the caller and 3 workers";
  }
  EXPECT_EQ(process_threads(), before) << "the model's workers end with it";
  tansy::ModelOptions bad;
  bad.threads = -1;
  EXPECT_THROW(tansy::open_model(dir, bad), tansy::Error);
}

TEST(Threads, LogitsDoNotDependOnTheThreadCount) {
  const auto dir = tansy::test::goldens_dir() / "smalldims-mlx";
  std::vector<std::vector<float>> out;
  for (int threads : {1, 3}) {
    tansy::ModelOptions opt;
    opt.threads = threads;
    auto m = tansy::open_model(dir, opt);
    const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7};
    std::vector<float> logits(ids.size() * size_t(m->config().vocab_size));
    auto st = m->new_state(16);
    m->forward(*st, ids, logits, true);
    out.push_back(std::move(logits));
  }
  EXPECT_EQ(out[0], out[1]);
}

}  // namespace
