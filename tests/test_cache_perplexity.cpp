// eval/cache_perplexity.h: the KL / percentile / top-1 statistics against a
// float64 brute force, and on pyllama-16m: the 16-bit cache in any chunk
// size gives `kvforge perplexity`'s numbers, a configuration that quantizes
// nothing gives the 16-bit cache's exactly, and chunked prefill of a
// quantizing configuration against a hand-written token-by-token decoding
// loop.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "eval/cache_perplexity.h"
#include "eval/cache_policy_factory.h"
#include "eval/perplexity.h"
#include "model/device.h"
#include "model/tokenizer.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

// ---------------------------------------------------------------------------
// The statistics, without a model.

std::vector<double> row_of(const at::Tensor& matrix, int64_t row) {
  const at::Tensor r = matrix[row].to(at::kDouble).contiguous();
  return {r.data_ptr<double>(), r.data_ptr<double>() + r.numel()};
}

// log-sum-exp of one row, in float64 scalar arithmetic.
double log_sum_exp(const std::vector<double>& x) {
  const double m = *std::max_element(x.begin(), x.end());
  double sum = 0;
  for (const double v : x) sum += std::exp(v - m);
  return m + std::log(sum);
}

double brute_kl(const std::vector<double>& p_logits, const std::vector<double>& q_logits) {
  const double lp = log_sum_exp(p_logits), lq = log_sum_exp(q_logits);
  double kl = 0;
  for (size_t v = 0; v < p_logits.size(); ++v) {
    const double log_p = p_logits[v] - lp, log_q = q_logits[v] - lq;
    kl += std::exp(log_p) * (log_p - log_q);
  }
  return kl;
}

size_t brute_argmax(const std::vector<double>& x) {
  size_t best = 0;
  for (size_t v = 1; v < x.size(); ++v) {
    if (x[v] > x[best]) best = v;  // strict: the first maximum wins
  }
  return best;
}

// The percentile by its definition: the value at rank f (n - 1) of the
// sorted values, linearly between the two ranks around it.
double brute_percentile(std::vector<double> values, double fraction) {
  std::sort(values.begin(), values.end());
  const double rank = fraction * static_cast<double>(values.size() - 1);
  const double below = std::floor(rank);
  const size_t lower = static_cast<size_t>(below), upper = std::min(lower + 1, values.size() - 1);
  return values[lower] + (rank - below) * (values[upper] - values[lower]);
}

TEST(CachePerplexityStatistics, PercentilesFollowLlamaCppOnAnalyticCases) {
  std::vector<double> hundred_and_one(101);
  for (size_t i = 0; i < hundred_and_one.size(); ++i) hundred_and_one[i] = static_cast<double>(i);
  // 0 .. 100: ranks f (n - 1) = 99 and 99.9 hold the values 99 and 99.9.
  EXPECT_DOUBLE_EQ(sorted_percentile(hundred_and_one, 0.99), 99.0);
  EXPECT_NEAR(sorted_percentile(hundred_and_one, 0.999), 99.9, 1e-12);
  std::vector<double> thousand(1000);
  for (size_t i = 0; i < thousand.size(); ++i) thousand[i] = static_cast<double>(i + 1);
  // 0.99 x 999 = 989.01: 0.01 of the way from 990 to 991.
  EXPECT_NEAR(sorted_percentile(thousand, 0.99), 990.01, 1e-9);
  EXPECT_NEAR(sorted_percentile(thousand, 0.999), 998.001 + 1, 1e-9);  // 0.999 x 999 = 998.001
  EXPECT_EQ(sorted_percentile(std::vector<double>{3.5}, 0.999), 3.5);
  EXPECT_EQ(sorted_percentile(std::vector<double>{}, 0.5), 0.0);
  EXPECT_EQ(sorted_percentile(thousand, 0.0), 1.0);
  EXPECT_EQ(sorted_percentile(thousand, 1.0), 1000.0);
}

TEST(CachePerplexityStatistics, KlPercentilesAndTop1EqualAFloat64BruteForce) {
  at::manual_seed(5);
  const int64_t positions = 1500, vocab = 37;
  const at::Tensor reference = at::randn({positions, vocab}) * 3;
  at::Tensor logits = reference + at::randn({positions, vocab}) * 0.7;  // some argmaxes flip
  logits.narrow(0, 0, 100).copy_(reference.narrow(0, 0, 100));          // some positions identical
  logits.narrow(0, 100, 50).copy_(reference.narrow(0, 100, 50) + 2.5);  // a shift: the same distribution
  const at::Tensor nll = at::rand({positions}) * 6;

  // Small slices (7 rows at a time) must give what one slice gives.
  const NextTokenComparison sliced = compare_next_token(reference, logits, 7 * vocab);
  const NextTokenComparison whole = compare_next_token(reference, logits);
  ASSERT_EQ(sliced.kl.numel(), positions);
  EXPECT_TRUE(at::equal(sliced.kl, whole.kl));
  EXPECT_TRUE(at::equal(sliced.same_top1, whole.same_top1));

  CachePerplexityAccumulator accumulator;
  const int64_t split = 700;  // two spans, as two chunks would give
  accumulator.add(nll.narrow(0, 0, split), {sliced.kl.narrow(0, 0, split), sliced.same_top1.narrow(0, 0, split)});
  accumulator.add(nll.narrow(0, split, positions - split),
                  {sliced.kl.narrow(0, split, positions - split), sliced.same_top1.narrow(0, split, positions - split)});
  accumulator.add_window();
  const CachePerplexity got = accumulator.result();

  std::vector<double> kl(static_cast<size_t>(positions));
  double kl_sum = 0, nll_sum = 0, nll_squared = 0;
  int64_t same = 0;
  const std::vector<double> nll_values = row_of(nll.unsqueeze(0), 0);
  for (int64_t i = 0; i < positions; ++i) {
    const std::vector<double> p = row_of(reference, i), q = row_of(logits, i);
    kl[static_cast<size_t>(i)] = brute_kl(p, q);
    kl_sum += kl[static_cast<size_t>(i)];
    same += brute_argmax(p) == brute_argmax(q) ? 1 : 0;
    nll_sum += nll_values[static_cast<size_t>(i)];
    nll_squared += nll_values[static_cast<size_t>(i)] * nll_values[static_cast<size_t>(i)];
  }
  // KL of one position sums V = 37 terms p (log p - log q) of magnitude
  // < 10 in float64 (u = 1.1e-16), after log-softmaxes over 37 terms: in
  // another summation order they agree to ~ 2 V u 10 ~ 1e-13 each; 1e-12
  // leaves room and still catches any formula error (KL here ~ 0.1-1).
  constexpr double kKlTolerance = 1e-12;
  for (int64_t i = 0; i < positions; ++i) {
    ASSERT_NEAR(sliced.kl[i].item<double>(), kl[static_cast<size_t>(i)], kKlTolerance) << "position " << i;
  }
  for (int64_t i = 0; i < 150; ++i) EXPECT_NEAR(kl[static_cast<size_t>(i)], 0.0, kKlTolerance);
  const double n = static_cast<double>(positions);
  EXPECT_EQ(got.windows, 1);
  EXPECT_EQ(got.tokens_scored, positions);
  EXPECT_NEAR(got.kl_mean, kl_sum / n, kKlTolerance);
  EXPECT_NEAR(got.kl_p99, brute_percentile(kl, 0.99), kKlTolerance);
  EXPECT_NEAR(got.kl_p999, brute_percentile(kl, 0.999), kKlTolerance);
  EXPECT_GT(got.kl_p999, got.kl_p99);
  EXPECT_DOUBLE_EQ(got.top1_agreement, static_cast<double>(same) / n);
  EXPECT_LT(got.top1_agreement, 0.99) << "the perturbation must flip some argmaxes";
  EXPECT_GT(got.top1_agreement, 0.1);
  // NLL statistics: float32 values summed in float64, 1500 terms < 6:
  // 1500 x 6 x 1.1e-16 ~ 1e-12 in the sums.
  const double mean = nll_sum / n;
  EXPECT_NEAR(got.mean_nll, mean, 1e-12);
  EXPECT_NEAR(got.nll_stderr, std::sqrt((nll_squared / n - mean * mean) / (n - 1)), 1e-12);
  EXPECT_NEAR(got.perplexity, std::exp(mean), 1e-11);
  EXPECT_EQ(accumulator.running_perplexity(), got.perplexity);
}

TEST(CachePerplexityStatistics, RefusesMismatchedInputs) {
  EXPECT_THROW(compare_next_token(at::zeros({3, 4}), at::zeros({3, 5})), std::invalid_argument);
  CachePerplexityAccumulator accumulator;
  EXPECT_THROW(accumulator.add(at::zeros({3}), {at::zeros({2}, at::kDouble), at::zeros({3}, at::kBool)}),
               std::invalid_argument);
  const CachePerplexity empty = accumulator.result();
  EXPECT_EQ(empty.tokens_scored, 0);
  EXPECT_EQ(empty.top1_agreement, 1.0);
  EXPECT_EQ(accumulator.running_perplexity(), 1.0);
}

// ---------------------------------------------------------------------------
// On pyllama-16m (CPU, float32): a small context and a few windows.

constexpr int64_t kContext = 256;
constexpr double kFloat32Unit = 5.9604644775390625e-08;  // 2^-24

struct Fixture {
  Transformer model;
  std::vector<int32_t> tokens;
};

std::vector<int32_t> heldout_tokens() {
  const auto tokenizer = Tokenizer::from_file(testing::pyllama_dir() / "tokenizer.json");
  return tokenizer.encode(testing::read_file(testing::shared_dir() / "data" / "heldout.txt"));
}

const Fixture& pyllama() {
  static const Fixture fixture{Transformer::load(testing::pyllama_dir(), {c10::Device(c10::kCPU), c10::kFloat}),
                               heldout_tokens()};
  return fixture;
}

// The same model in float64 (RMSNorm and the attention softmax still round
// to float32 inside, the logits come out in float32).
const Fixture& pyllama_float64() {
  static const Fixture fixture{Transformer::load(testing::pyllama_dir(), {c10::Device(c10::kCPU), c10::kDouble}),
                               heldout_tokens()};
  return fixture;
}

PerplexityOptions protocol(const Fixture& f, int64_t windows, int64_t context = kContext) {
  PerplexityOptions options;
  options.context = context;
  options.bos = static_cast<int32_t>(f.model.config().bos_token_id.value());
  options.max_windows = windows;
  return options;
}

QuantizerConfig per_token_config(const ModelConfig& model, int64_t sink, int64_t residual) {
  QuantizerConfig c;
  c.name = "rtn-test";
  c.settings.method = QuantMethod::kRtn;
  c.settings.bits = 2;
  c.settings.keys = {Grouping::kPerToken, model.head_dim};
  c.settings.values = {Grouping::kPerToken, model.head_dim};
  c.settings.sink_tokens = sink;
  c.settings.residual_tokens = residual;
  c.layers.resize(static_cast<size_t>(model.num_layers));
  return c;
}

// KIVI's layout: keys per channel in 16-token groups flushed every 32
// tokens, values per token, the newest 32 in 16 bits.
QuantizerConfig kivi_config(const ModelConfig& model) {
  QuantizerConfig c;
  c.name = "kivi-test";
  c.settings.method = QuantMethod::kKivi;
  c.settings.bits = 2;
  c.settings.keys = {Grouping::kPerChannelTokens, 16};
  c.settings.keys.residual_rule = ResidualRule::kBlockFlush;
  c.settings.values = {Grouping::kPerToken, model.head_dim};
  c.settings.residual_tokens = 32;
  c.layers.resize(static_cast<size_t>(model.num_layers));
  return c;
}

double max_abs_logit(const Fixture& f) {
  c10::InferenceMode inference;
  const at::Tensor ids = at::tensor(std::vector<int64_t>(f.tokens.begin(), f.tokens.begin() + kContext)).unsqueeze(0);
  return f.model.forward(ids).abs().max().item<double>();
}

// How far two float32 evaluations of the model's NLL may drift apart when
// they differ only in the order of their reductions (attention over a
// chunk's keys instead of the window's, GEMMs of other shapes). A float32
// sum of K terms in some order carries a rounding error of about
// sqrt(K) u times the size of its terms (u = 2^-24; the probabilistic
// bound of Higham and Mary, which holds with high probability, where K u
// is the worst case); each of the L layers adds one such reordered
// reduction (K <= max(hidden, intermediate, context)) to the residual
// stream, relative to its scale, so the logits move by at most
// L sqrt(K) u max|z|, and an NLL = logsumexp(z) - z_target by twice that.
// Means and the standard error of NLLs move no more than one NLL.
double reordering_tolerance(const Fixture& f) {
  const ModelConfig& c = f.model.config();
  const double k = static_cast<double>(std::max({c.hidden_size, c.intermediate_size, kContext}));
  return 2.0 * static_cast<double>(c.num_layers) * std::sqrt(k) * kFloat32Unit * max_abs_logit(f);
}

TEST(CachePerplexityPyllama, FullPrecisionThroughTheCacheEqualsKvforgePerplexityInAnyChunk) {
  const Fixture& f = pyllama();
  const double tolerance = reordering_tolerance(f);  // 4.3e-4 for max|z| = 22.8 (measured: <= 2e-7)
  struct Case {
    std::optional<int64_t> stride;
    int64_t batch, windows;
    std::vector<int64_t> chunks;
  };
  // Disjoint windows in every chunk size down to decoding; overlapping
  // windows (only the tokens past the previous window scored) two per pass.
  // Chunks of 100 and 50 leave a shorter last chunk; 1 is decoding.
  for (const Case& c : {Case{std::nullopt, 1, 2, {kContext, 1000, 100}}, Case{std::nullopt, 1, 1, {1}},
                        Case{200, 2, 3, {kContext, 50}}}) {
    PerplexityOptions options = protocol(f, c.windows);
    options.stride = c.stride;
    options.batch = c.batch;
    const PerplexityResult expected = evaluate_perplexity(f.model, f.tokens, options);
    for (const int64_t chunk : c.chunks) {
      const auto started = std::chrono::steady_clock::now();
      const CachePerplexityResult got = evaluate_cache_perplexity(f.model, f.tokens, {}, {options, chunk});
      std::printf("stride %lld batch %lld chunk %lld: %.3f s, mean NLL %.9f vs %.9f (diff %.3g, tolerance %.3g)\n",
                  static_cast<long long>(c.stride.value_or(0)), static_cast<long long>(c.batch),
                  static_cast<long long>(chunk),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
                  got.perplexity[0].mean_nll, expected.mean_nll, got.perplexity[0].mean_nll - expected.mean_nll,
                  tolerance);
      ASSERT_EQ(got.perplexity.size(), 1u);
      ASSERT_EQ(got.seconds.size(), 1u);
      const CachePerplexity& fp16 = got.perplexity[0];
      EXPECT_EQ(fp16.windows, expected.windows);
      EXPECT_EQ(fp16.tokens_scored, expected.tokens_scored);
      EXPECT_NEAR(fp16.mean_nll, expected.mean_nll, tolerance);
      EXPECT_NEAR(fp16.nll_stderr, expected.nll_stderr, tolerance);
      EXPECT_NEAR(fp16.perplexity / expected.perplexity, 1.0, 2 * tolerance);
      // Against itself: the same log-softmaxes, KL exactly 0.
      EXPECT_EQ(fp16.kl_mean, 0.0);
      EXPECT_EQ(fp16.kl_p99, 0.0);
      EXPECT_EQ(fp16.kl_p999, 0.0);
      EXPECT_EQ(fp16.top1_agreement, 1.0);
    }
  }
}

TEST(CachePerplexityPyllama, NothingQuantizedEqualsTheFullPrecisionCacheExactly) {
  const Fixture& f = pyllama();
  const QuantizerConfig exact = per_token_config(f.model.config(), kContext, 0);  // the sink holds the window
  const QuantizerConfig* configs[] = {&exact};
  for (const auto& [chunk, batch] : {std::pair{kContext, int64_t{1}}, std::pair{int64_t{64}, int64_t{2}}}) {
    PerplexityOptions options = protocol(f, 2);
    options.batch = batch;  // both windows in one pass through each cache
    const CachePerplexityResult got = evaluate_cache_perplexity(f.model, f.tokens, configs, {options, chunk});
    ASSERT_EQ(got.perplexity.size(), 2u);
    const CachePerplexity &fp16 = got.perplexity[0], &same = got.perplexity[1];
    EXPECT_EQ(same.windows, 2);
    EXPECT_EQ(same.tokens_scored, fp16.tokens_scored);
    EXPECT_EQ(same.mean_nll, fp16.mean_nll);
    EXPECT_EQ(same.nll_stderr, fp16.nll_stderr);
    EXPECT_EQ(same.kl_mean, 0.0);
    EXPECT_EQ(same.kl_p999, 0.0);
    EXPECT_EQ(same.top1_agreement, 1.0);
  }
}

TEST(CachePerplexityPyllama, RefusesAChunkBelowOneAndAConfigurationOfAnotherModel) {
  const Fixture& f = pyllama();
  EXPECT_THROW(evaluate_cache_perplexity(f.model, f.tokens, {}, {protocol(f, 1), 0}), std::invalid_argument);
  QuantizerConfig short_config = per_token_config(f.model.config(), 0, 0);
  short_config.layers.pop_back();
  const QuantizerConfig* configs[] = {&short_config};
  EXPECT_THROW(evaluate_cache_perplexity(f.model, f.tokens, configs, {protocol(f, 1), 64}), std::invalid_argument);
}

// Decoding token by token is slow on a CPU: a shorter window.
constexpr int64_t kDecodedContext = 160;

// What decoding gives, written out: every window token by token through a
// fresh 16-bit cache and a fresh quantizing cache; the NLL and KL of every
// scored position.
struct DecodedScores {
  std::vector<double> nll, kl;
  int64_t same_top1 = 0;
};

DecodedScores decode_token_by_token(const Fixture& f, const QuantizerConfig& config, const PerplexityOptions& options) {
  const int64_t context = options.context;
  c10::InferenceMode inference;
  DecodedScores scores;
  for (const PerplexityWindow& window : plan_perplexity_windows(static_cast<int64_t>(f.tokens.size()), options)) {
    std::vector<int64_t> ids{*options.bos};
    ids.insert(ids.end(), f.tokens.begin() + window.stream_begin,
               f.tokens.begin() + window.stream_begin + window.stream_length);
    const at::Tensor input = at::tensor(ids).unsqueeze(0);
    const auto full = make_cache_policy(f.model, nullptr, 1, context);
    const auto quantized = make_cache_policy(f.model, &config, 1, context);
    ForwardOptions with_full, with_quantized;
    with_full.cache = full.get();
    with_quantized.cache = quantized.get();
    for (int64_t t = 0; t + 1 < context; ++t) {
      const at::Tensor token = input.narrow(1, t, 1);
      const at::Tensor p = f.model.forward(token, with_full)[0][0];
      const at::Tensor q = f.model.forward(token, with_quantized)[0][0];
      if (t < window.score_from - window.stream_begin) continue;  // BOS predicts stream index begin
      const std::vector<double> p_row = row_of(p.unsqueeze(0), 0), q_row = row_of(q.unsqueeze(0), 0);
      // The protocol's NLL: log-softmax of the float32 logits.
      scores.nll.push_back(-at::log_softmax(q, -1)[ids[static_cast<size_t>(t + 1)]].item<double>());
      scores.kl.push_back(brute_kl(p_row, q_row));
      scores.same_top1 += brute_argmax(p_row) == brute_argmax(q_row) ? 1 : 0;
    }
  }
  return scores;
}

double mean_of(const std::vector<double>& values) {
  double sum = 0;
  for (const double v : values) sum += v;
  return sum / static_cast<double>(values.size());
}

void print_against_decoding(const QuantizerConfig& config, int64_t chunk, const CachePerplexity& got,
                            const DecodedScores& decoded) {
  std::printf("%s chunk %lld: mean NLL %.9f vs decoding %.9f, KL %.6g vs %.6g, p99.9 %.4g, top-1 %.4f vs %.4f\n",
              config.name.c_str(), static_cast<long long>(chunk), got.mean_nll, mean_of(decoded.nll), got.kl_mean,
              mean_of(decoded.kl), got.kl_p999, got.top1_agreement,
              static_cast<double>(decoded.same_top1) / static_cast<double>(decoded.nll.size()));
}

TEST(CachePerplexityPyllama, ChunkedPrefillEqualsTokenByTokenDecodingWhereNoWindowMoves) {
  // Per-token groups, a sink, no residual window: the tokens a prefix
  // quantizes do not depend on later tokens, so every chunk sees what
  // decoding sees. In float64: 2-bit codes are discontinuous, and float32
  // reordering noise (see reordering_tolerance) flips a few codes near a
  // rounding boundary between two paths (measured in float32: mean NLL
  // 0.0065 apart at chunk 64, KL 2.3); float64 reductions make such flips
  // vanishingly rare (~1e-16 relative noise against code steps of ~0.3 of
  // a token's range).
  const Fixture& f = pyllama_float64();
  const QuantizerConfig config = per_token_config(f.model.config(), 4, 0);
  const PerplexityOptions options = protocol(f, 1, kDecodedContext);
  const DecodedScores decoded = decode_token_by_token(f, config, options);
  // Both paths round the same (to ~1e-16) values to float32 at the same
  // points (RMSNorm input, attention softmax, logits): equal, or one
  // float32 unit of a logit apart where a value straddles a rounding
  // boundary: an NLL or a KL moves by at most 2 u max|z| then.
  const double tolerance = 2 * kFloat32Unit * max_abs_logit(f);
  const QuantizerConfig* configs[] = {&config};
  for (const int64_t chunk : {int64_t{48}, kDecodedContext}) {
    const CachePerplexity got = evaluate_cache_perplexity(f.model, f.tokens, configs, {options, chunk}).perplexity[1];
    print_against_decoding(config, chunk, got, decoded);
    EXPECT_EQ(got.tokens_scored, static_cast<int64_t>(decoded.nll.size()));
    EXPECT_NEAR(got.mean_nll, mean_of(decoded.nll), tolerance);
    EXPECT_NEAR(got.kl_mean, mean_of(decoded.kl), tolerance);
    EXPECT_EQ(got.top1_agreement, static_cast<double>(decoded.same_top1) / static_cast<double>(decoded.nll.size()));
    EXPECT_GT(got.kl_mean, 0.1) << "2-bit keys and values must move the distributions";
  }
}

TEST(CachePerplexityPyllama, WindowedConfigurationIsDecodingAtChunkOneAndQuantizesMoreInLargerChunks) {
  const Fixture& f = pyllama();
  const QuantizerConfig config = kivi_config(f.model.config());
  const PerplexityOptions options = protocol(f, 1, kDecodedContext);
  const DecodedScores decoded = decode_token_by_token(f, config, options);
  const QuantizerConfig* configs[] = {&config};
  // Chunk 1 runs the very forward passes of the loop above; only the
  // scoring differs (the KL tolerance of KlPercentilesAndTop1EqualAFloat64BruteForce,
  // V = 8192 terms: 2 V u 10 ~ 2e-11).
  const CachePerplexity one = evaluate_cache_perplexity(f.model, f.tokens, configs, {options, 1}).perplexity[1];
  print_against_decoding(config, 1, one, decoded);
  EXPECT_EQ(one.tokens_scored, static_cast<int64_t>(decoded.nll.size()));
  EXPECT_NEAR(one.mean_nll, mean_of(decoded.nll), 1e-10);
  EXPECT_NEAR(one.kl_mean, mean_of(decoded.kl), 1e-10);
  EXPECT_EQ(one.top1_agreement, static_cast<double>(decoded.same_top1) / static_cast<double>(decoded.nll.size()));
  EXPECT_GT(one.kl_mean, 1e-3);
  // A 64-token chunk's early queries also see quantized what leaves the
  // 16-bit windows later in the chunk: more error than decoding.
  const CachePerplexity chunked = evaluate_cache_perplexity(f.model, f.tokens, configs, {options, 64}).perplexity[1];
  print_against_decoding(config, 64, chunked, decoded);
  EXPECT_GT(chunked.kl_mean, one.kl_mean);
}

// On the GPU (skipped without one): the model's device is where the caches,
// the scoring and the comparison run.
TEST(CachePerplexityCuda, RunsOnTheModelsDeviceAsOnTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const Fixture& cpu = pyllama_float64();
  const QuantizerConfig per_token = per_token_config(cpu.model.config(), 4, 0);
  const QuantizerConfig exact = per_token_config(cpu.model.config(), kContext, 0);
  const QuantizerConfig kivi = kivi_config(cpu.model.config());
  for (const AttentionBackend backend : {AttentionBackend::kEager, AttentionBackend::kFused}) {
    // float32: the 16-bit cache is kvforge perplexity on the same device,
    // a configuration that quantizes nothing is the 16-bit cache exactly.
    const Fixture gpu{Transformer::load(testing::pyllama_dir(), {c10::Device(c10::kCUDA), c10::kFloat, backend}),
                      cpu.tokens};
    const PerplexityOptions options = protocol(gpu, 2);
    const PerplexityResult expected = evaluate_perplexity(gpu.model, gpu.tokens, options);
    const QuantizerConfig* exact_only[] = {&exact};
    const CachePerplexityResult got = evaluate_cache_perplexity(gpu.model, gpu.tokens, exact_only, {options, 100});
    EXPECT_EQ(got.perplexity[0].tokens_scored, expected.tokens_scored);
    EXPECT_NEAR(got.perplexity[0].mean_nll, expected.mean_nll, reordering_tolerance(gpu)) << attention_label(backend);
    EXPECT_EQ(got.perplexity[1].mean_nll, got.perplexity[0].mean_nll) << attention_label(backend);
    EXPECT_EQ(got.perplexity[1].kl_mean, 0.0);
    EXPECT_EQ(got.perplexity[1].top1_agreement, 1.0);

    // float64 with a configuration whose chunks are decoding: the CPU's
    // numbers, up to float32 units of the logits (see
    // ChunkedPrefillEqualsTokenByTokenDecodingWhereNoWindowMoves).
    const Fixture gpu64{Transformer::load(testing::pyllama_dir(), {c10::Device(c10::kCUDA), c10::kDouble, backend}),
                        cpu.tokens};
    const PerplexityOptions short_windows = protocol(cpu, 1, kDecodedContext);
    const QuantizerConfig* configs[] = {&per_token};
    const CachePerplexity on_cpu = evaluate_cache_perplexity(cpu.model, cpu.tokens, configs, {short_windows, 48}).perplexity[1];
    const CachePerplexity on_gpu =
        evaluate_cache_perplexity(gpu64.model, gpu64.tokens, configs, {short_windows, 48}).perplexity[1];
    const double tolerance = 2 * kFloat32Unit * max_abs_logit(cpu);
    std::printf("%s: float64 mean NLL cpu %.9f gpu %.9f, KL %.6g %.6g\n", attention_label(backend).c_str(),
                on_cpu.mean_nll, on_gpu.mean_nll, on_cpu.kl_mean, on_gpu.kl_mean);
    EXPECT_NEAR(on_gpu.mean_nll, on_cpu.mean_nll, tolerance);
    EXPECT_NEAR(on_gpu.kl_mean, on_cpu.kl_mean, tolerance);
  }
  // bf16 with the fused attention (the CLI's CUDA default): runs, scores
  // every token, and a 2-bit configuration moves the distributions.
  const Fixture bf16{Transformer::load(testing::pyllama_dir(), {c10::Device(c10::kCUDA), c10::kBFloat16,
                                                                AttentionBackend::kFused}),
                     cpu.tokens};
  const QuantizerConfig* configs[] = {&kivi};
  const CachePerplexityResult got = evaluate_cache_perplexity(bf16.model, bf16.tokens, configs, {protocol(bf16, 2), 64});
  std::printf("bf16 fused: ppl fp16 %.4f kivi %.4f, KL %.4g p99 %.4g p99.9 %.4g, top-1 %.4f\n",
              got.perplexity[0].perplexity, got.perplexity[1].perplexity, got.perplexity[1].kl_mean,
              got.perplexity[1].kl_p99, got.perplexity[1].kl_p999, got.perplexity[1].top1_agreement);
  EXPECT_EQ(got.perplexity[1].tokens_scored, got.perplexity[0].tokens_scored);
  EXPECT_TRUE(std::isfinite(got.perplexity[1].perplexity));
  EXPECT_GT(got.perplexity[1].kl_mean, 0.0);
  EXPECT_LT(got.perplexity[1].top1_agreement, 1.0);
}

}  // namespace
}  // namespace kvforge
