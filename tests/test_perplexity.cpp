// Perplexity protocol: the window plan by hand, and the numbers against HF
// transformers on pyllama-16m (scripts/make_model_fixtures.py).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "eval/perplexity.h"
#include "model/tokenizer.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

TEST(PerplexityPlan, NonOverlappingWindowsWithBosDropTheRemainder) {
  PerplexityOptions options;
  options.context = 4;
  options.bos = 0;
  // 10 stream tokens, 3 per window: windows at 0, 3, 6; token 9 dropped.
  const auto windows = plan_perplexity_windows(10, options);
  ASSERT_EQ(windows.size(), 3u);
  for (size_t i = 0; i < windows.size(); ++i) {
    EXPECT_EQ(windows[i].stream_begin, static_cast<int64_t>(3 * i));
    EXPECT_EQ(windows[i].stream_length, 3);
    EXPECT_EQ(windows[i].score_from, windows[i].stream_begin);  // BOS predicts the first
  }
}

TEST(PerplexityPlan, StridedWindowsScoreEachTokenOnce) {
  PerplexityOptions options;
  options.context = 4;  // no BOS: 4 stream tokens per window
  options.stride = 2;
  const auto windows = plan_perplexity_windows(9, options);
  ASSERT_EQ(windows.size(), 3u);  // starts 0, 2, 4; a start at 6 would need tokens up to 9
  EXPECT_EQ(windows[0].score_from, 1);  // token 0 has nothing to predict it
  EXPECT_EQ(windows[1].score_from, 4);
  EXPECT_EQ(windows[2].score_from, 6);
  int64_t scored = 0;
  for (const auto& w : windows) scored += w.stream_begin + w.stream_length - w.score_from;
  EXPECT_EQ(scored, 7);  // tokens 1..7
}

TEST(PerplexityPlan, RejectsImpossibleSettings) {
  PerplexityOptions options;
  options.context = 1;
  EXPECT_THROW(plan_perplexity_windows(10, options), std::invalid_argument);
  options.context = 8;
  options.stride = 9;
  EXPECT_THROW(plan_perplexity_windows(10, options), std::invalid_argument);
  options.stride.reset();
  options.max_windows = 1;
  EXPECT_EQ(plan_perplexity_windows(100, options).size(), 1u);
}

// HF transformers' perplexity on the first windows of heldout.txt, with the
// protocol of the pyllama-16m README.
TEST(PerplexityPyLlama, FirstWindowsEqualTransformers) {
  const auto ref = nlohmann::json::parse(
      testing::read_file(testing::fixtures_dir() / "reference" / "pyllama_ppl.json"));
  const auto tokenizer = Tokenizer::from_file(testing::pyllama_dir() / "tokenizer.json");
  const auto tokens = tokenizer.encode(testing::read_file(testing::shared_dir() / "data" / "heldout.txt"));
  const auto& fp32 = ref.at("fp32");
  PerplexityOptions options;
  options.context = ref.at("context").get<int64_t>();
  options.bos = ref.at("bos").get<int32_t>();
  options.max_windows = ref.at("windows").get<int64_t>();
  options.batch = 2;
  const Transformer model = Transformer::load(testing::pyllama_dir(), {c10::Device(c10::kCPU), c10::kFloat});
  const PerplexityResult result = evaluate_perplexity(model, tokens, options);
  EXPECT_EQ(result.windows, *options.max_windows);
  EXPECT_EQ(result.tokens_scored, fp32.at("tokens_scored").get<int64_t>());
  const double expected = fp32.at("perplexity").get<double>();
  EXPECT_NEAR(result.perplexity / expected, 1.0, 1e-3) << result.perplexity << " vs " << expected;
  const auto window_nll = fp32.at("window_mean_nll").get<std::vector<double>>();
  ASSERT_EQ(window_nll.size(), result.window_mean_nll.size());
  for (size_t i = 0; i < window_nll.size(); ++i) EXPECT_NEAR(result.window_mean_nll[i], window_nll[i], 1e-4);
  // The whole file holds as many windows as the README's table says.
  PerplexityOptions all = options;
  all.max_windows.reset();
  EXPECT_EQ(static_cast<int64_t>(plan_perplexity_windows(static_cast<int64_t>(tokens.size()), all).size()),
            ref.at("total_windows").get<int64_t>());
}

}  // namespace
}  // namespace kvforge
