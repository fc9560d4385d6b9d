// rotation/attention_objective.h against a float64 brute force (explicit
// loops over windows, heads and queries, softmax and W_O by hand) with GQA
// and causality, its exactness at zero error, the objective's gradient
// through the learned parametrization against finite differences, and pair
// angles commuting with RoPE.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "calib/kv_rotation.h"
#include "model/rope.h"
#include "rotation/attention_objective.h"

namespace kvforge {
namespace {

const at::TensorOptions kDouble = at::TensorOptions().dtype(at::kDouble);

RotationLayerData small_case(int64_t n, int64_t heads, int64_t kv_heads, int64_t tokens, int64_t dim, int64_t hidden,
                             uint64_t seed) {
  at::manual_seed(seed);
  RotationLayerData data;
  data.queries = at::randn({n, heads, tokens, dim}, kDouble) * 1.5;
  data.keys = at::randn({n, kv_heads, tokens, dim}, kDouble) * 1.5;
  data.values = at::randn({n, kv_heads, tokens, dim}, kDouble);
  data.o_proj = at::randn({hidden, heads * dim}, kDouble);
  return data;
}

struct BruteForce {
  std::vector<double> kl, output, value_exact, value_quantized;  // per KV head
};

// Everything by hand in float64. keys_post: exact post-RoPE keys; keys_hat_post:
// the dequantized ones; values_hat: dequantized values.
BruteForce brute_force(const RotationLayerData& d, const at::Tensor& keys_post, const at::Tensor& keys_hat_post,
                       const at::Tensor& values_hat, int64_t last_queries) {
  const int64_t n = d.keys.size(0), kv_heads = d.keys.size(1), tokens = d.keys.size(2), dim = d.keys.size(3),
                heads = d.queries.size(1), group = heads / kv_heads, hidden = d.o_proj.size(0);
  const auto q = d.queries.accessor<double, 4>();
  const auto k = keys_post.accessor<double, 4>();
  const auto kh = keys_hat_post.accessor<double, 4>();
  const auto v = d.values.accessor<double, 4>();
  const auto vh = values_hat.accessor<double, 4>();
  const auto w = d.o_proj.accessor<double, 2>();
  const double scale = 1 / std::sqrt(static_cast<double>(dim));
  const auto softmax = [&](auto keys, int64_t b, int64_t head, int64_t t) {
    const int64_t kv = head / group;
    std::vector<double> p(static_cast<size_t>(t + 1));
    double top = -1e300, sum = 0;
    for (int64_t j = 0; j <= t; ++j) {  // causal: keys 0..t
      double s = 0;
      for (int64_t c = 0; c < dim; ++c) s += q[b][head][t][c] * keys[b][kv][j][c];
      p[static_cast<size_t>(j)] = s * scale;
      top = std::max(top, s * scale);
    }
    for (double& x : p) sum += (x = std::exp(x - top));
    for (double& x : p) x /= sum;
    return p;
  };
  BruteForce r;
  for (int64_t h = 0; h < kv_heads; ++h) {
    double kl = 0, out_err = 0, out_ref = 0, val_err = 0, val_q_err = 0, val_q_ref = 0;
    int64_t rows = 0;
    for (int64_t b = 0; b < n; ++b) {
      for (int64_t t = tokens - last_queries; t < tokens; ++t) {
        std::vector<double> y(hidden, 0), y_hat(hidden, 0), y_v(hidden, 0), y_vq(hidden, 0), y_q(hidden, 0);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = h * group + g;
          const std::vector<double> p = softmax(k, b, head, t), ph = softmax(kh, b, head, t);
          for (int64_t j = 0; j <= t; ++j) kl += p[j] * std::log(p[j] / ph[j]);
          ++rows;
          for (int64_t c = 0; c < dim; ++c) {
            double o = 0, oh = 0, ov = 0, ovq = 0, oq = 0;
            for (int64_t j = 0; j <= t; ++j) {
              o += p[j] * v[b][h][j][c];
              oh += ph[j] * v[b][h][j][c];
              ov += p[j] * (vh[b][h][j][c] - v[b][h][j][c]);
              ovq += ph[j] * (vh[b][h][j][c] - v[b][h][j][c]);
              oq += ph[j] * v[b][h][j][c];
            }
            for (int64_t m = 0; m < hidden; ++m) {  // W_O,g^T: columns head*D + c
              const double wc = w[m][head * dim + c];
              y[m] += o * wc;
              y_hat[m] += oh * wc;
              y_v[m] += ov * wc;
              y_vq[m] += ovq * wc;
              y_q[m] += oq * wc;
            }
          }
        }
        for (int64_t m = 0; m < hidden; ++m) {
          out_err += (y_hat[m] - y[m]) * (y_hat[m] - y[m]);
          out_ref += y[m] * y[m];
          val_err += y_v[m] * y_v[m];
          val_q_err += y_vq[m] * y_vq[m];
          val_q_ref += y_q[m] * y_q[m];
        }
      }
    }
    r.kl.push_back(kl / static_cast<double>(rows));
    r.output.push_back(out_err / out_ref);
    r.value_exact.push_back(val_err / out_ref);
    r.value_quantized.push_back(val_q_err / val_q_ref);
  }
  return r;
}

void expect_matches(const at::Tensor& actual, const std::vector<double>& expected, const char* what) {
  ASSERT_EQ(actual.numel(), static_cast<int64_t>(expected.size()));
  for (size_t i = 0; i < expected.size(); ++i) {
    // float64 sums of a few hundred terms in another order: ~1e-14 relative.
    EXPECT_NEAR(actual[static_cast<int64_t>(i)].item<double>(), expected[i], 1e-11 * std::abs(expected[i]) + 1e-300)
        << what << " head " << i;
  }
}

void check_against_brute_force(const RotationLayerData& data, int64_t last_queries) {
  at::manual_seed(17);
  const at::Tensor keys_hat = data.keys + at::randn_like(data.keys) * 0.3;
  const at::Tensor values_hat = data.values + at::randn_like(data.values) * 0.2;
  const AttentionObjective objective(data, last_queries);
  const KeyTerms terms = objective.key_terms(keys_hat);
  at::Tensor keys_post = data.keys, keys_hat_post = keys_hat;
  if (data.rope) {
    const RotaryEmbedding rotary(*data.rope, data.keys.size(3), c10::Device(c10::kCPU));
    const RopeTables tables = rotary.tables(0, data.keys.size(2), at::kDouble);
    keys_post = RotaryEmbedding::apply(data.keys, tables);
    keys_hat_post = RotaryEmbedding::apply(keys_hat, tables);
  }
  const int64_t queries = last_queries > 0 ? last_queries : data.keys.size(2);  // 0: every position
  const BruteForce expected = brute_force(data, keys_post, keys_hat_post, values_hat, queries);
  expect_matches(terms.kl, expected.kl, "KL");
  expect_matches(terms.output, expected.output, "output");
  expect_matches(objective.value_term(values_hat, objective.exact_probabilities()), expected.value_exact, "value");
  expect_matches(objective.value_term(values_hat, objective.probabilities(keys_hat)), expected.value_quantized,
                 "value (quantized-key probabilities)");
}

TEST(RotationObjective, MatchesFloat64BruteForceWithGqaAndCausality) {
  // H = 4 query heads on Hkv = 2, the last 3 of 7 positions attend (so the
  // causal mask cuts keys 5 and 6 for two of them).
  check_against_brute_force(small_case(2, 4, 2, 7, 4, 6, 1), 3);
  check_against_brute_force(small_case(1, 2, 2, 5, 4, 3, 2), 0);  // every query, MHA
}

TEST(RotationObjective, PreRopeKeysAreRotatedByRope) {
  RotationLayerData data = small_case(2, 4, 2, 9, 8, 5, 3);
  data.rope = RopeConfig{};
  data.rope->theta = 100.0;
  check_against_brute_force(data, 4);
}

TEST(RotationObjective, ExactKeysAndValuesGiveZero) {
  const RotationLayerData data = small_case(2, 4, 2, 7, 4, 6, 4);
  const AttentionObjective objective(data, 5);
  const KeyTerms terms = objective.key_terms(data.keys.clone());
  EXPECT_LT(terms.kl.abs().max().item<double>(), 1e-15);
  EXPECT_LT(terms.output.max().item<double>(), 1e-28);
  EXPECT_LT(objective.value_term(data.values.clone(), objective.exact_probabilities()).max().item<double>(), 1e-28);
  // A constant shift of every key changes no probability.
  const at::Tensor shifted = data.keys + at::randn({1, 2, 1, 4}, kDouble);
  EXPECT_LT(objective.key_terms(shifted).output.max().item<double>(), 1e-25);
}

// The objective is smooth in the rotation when the "quantizer" is: a fixed
// smooth map f(x) = x + 0.3 tanh(2x) in the rotated domain stands in for it,
// so that autograd's gradient wrt A of the key and value terms through
// R = R0 exp(A - A^T), rotate / unrotate, RoPE and the objective can be
// compared with central finite differences in float64.
TEST(RotationObjective, GradientWrtTheGeneratorMatchesFiniteDifferences) {
  RotationLayerData data = small_case(2, 4, 2, 6, 4, 5, 6);
  data.rope = RopeConfig{};
  const AttentionObjective objective(data, 3);
  at::manual_seed(8);
  const at::Tensor base = std::get<0>(at::linalg_qr(at::randn({2, 4, 4}, kDouble)));
  const auto loss = [&](const at::Tensor& a) {
    const at::Tensor r = at::matmul(base, at::linalg_matrix_exp(a - a.transpose(-1, -2)));
    const auto distort = [&](const at::Tensor& x) {
      const at::Tensor y = rotate(x, r);
      return unrotate(y + 0.3 * at::tanh(2 * y), r);
    };
    return objective.key_terms(distort(data.keys)).total(1.0, 0.7).sum() +
           objective.value_term(distort(data.values), objective.exact_probabilities()).sum();
  };
  const at::Tensor a = (at::randn({2, 4, 4}, kDouble) * 0.2).requires_grad_();
  loss(a).backward();
  const at::Tensor gradient = a.grad().clone();
  const double h = 1e-6;
  double worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    at::Tensor plus = a.detach().clone(), minus = a.detach().clone();
    plus.view({-1})[i] += h;
    minus.view({-1})[i] -= h;
    const double fd = (loss(plus).item<double>() - loss(minus).item<double>()) / (2 * h);
    // Central differences: O(h^2) truncation and O(eps / h) rounding, ~1e-9 here.
    worst = std::max(worst, std::abs(fd - gradient.view({-1})[i].item<double>()));
  }
  EXPECT_LT(worst, 1e-7 * std::max(1.0, gradient.abs().max().item<double>()));
  EXPECT_GT(gradient.abs().max().item<double>(), 1e-3);  // not a vacuous comparison
}

// RoPE(q R).RoPE(k R) = RoPE(q).RoPE(k) for pair angles (the form of
// pre-RoPE keys), with model/rope.h's RoPE on random float64 data.
TEST(RotationObjective, PairAnglesCommuteWithRope) {
  at::manual_seed(9);
  const int64_t heads = 2, tokens = 11, dim = 16;
  const at::Tensor q = at::randn({1, heads, tokens, dim}, kDouble), k = at::randn({1, heads, tokens, dim}, kDouble);
  const at::Tensor angles = (at::rand({heads, dim / 2}, kDouble) * 2 - 1) * 3.14;
  const at::Tensor r = pair_rotation_matrices(angles);
  RopeConfig rope;
  const RotaryEmbedding rotary(rope, dim, c10::Device(c10::kCPU));
  const RopeTables tables = rotary.tables(0, tokens, at::kDouble);
  const at::Tensor plain = at::matmul(RotaryEmbedding::apply(q, tables), RotaryEmbedding::apply(k, tables).transpose(-1, -2));
  const at::Tensor rotated = at::matmul(RotaryEmbedding::apply(rotate(q, r), tables),
                                        RotaryEmbedding::apply(rotate(k, r), tables).transpose(-1, -2));
  EXPECT_LT((rotated - plain).abs().max().item<double>(), 1e-12 * plain.abs().max().item<double>() * dim);
  // And RoPE(x R) = RoPE(x) R itself.
  EXPECT_LT((RotaryEmbedding::apply(rotate(k, r), tables) - rotate(RotaryEmbedding::apply(k, tables), r))
                .abs().max().item<double>(), 1e-13);
  EXPECT_GT((rotate(k, r) - k).abs().max().item<double>(), 0.1);  // the rotation does something
}

}  // namespace
}  // namespace kvforge

namespace kvforge {
namespace {

// The objective on the GPU in float32 against the float64 brute force: the
// logits are float32 dot products of D = 4 terms (relative error ~ D u,
// u = 2^-24 ~ 6e-8) and every term sums at most a few hundred float32
// products; 1e-4 relative (~1000 u) bounds both with a margin, far below
// the differences the terms are used to tell apart.
TEST(RotationObjective, CudaFloat32MatchesTheFloat64BruteForce) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const RotationLayerData data = small_case(2, 4, 2, 7, 4, 6, 1);
  at::manual_seed(17);
  const at::Tensor keys_hat = data.keys + at::randn_like(data.keys) * 0.3;
  const at::Tensor values_hat = data.values + at::randn_like(data.values) * 0.2;
  const BruteForce expected = brute_force(data, data.keys, keys_hat, values_hat, 3);
  const RotationLayerData gpu = data.to(at::Device(at::kCUDA), at::kFloat);
  const AttentionObjective objective(gpu, 3);
  const at::Tensor k = keys_hat.to(at::kCUDA, at::kFloat), v = values_hat.to(at::kCUDA, at::kFloat);
  const KeyTerms terms = objective.key_terms(k);
  ASSERT_TRUE(terms.kl.is_cuda());
  const auto close = [](const at::Tensor& actual, const std::vector<double>& want, const char* what) {
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(actual[static_cast<int64_t>(i)].item<double>(), want[i], 1e-4 * std::abs(want[i]) + 1e-7)
          << what << " head " << i;
    }
  };
  close(terms.kl.cpu(), expected.kl, "KL");
  close(terms.output.cpu(), expected.output, "output");
  close(objective.value_term(v, objective.exact_probabilities()).cpu(), expected.value_exact, "value");
  close(objective.value_term(v, objective.probabilities(k)).cpu(), expected.value_quantized, "value (quantized keys)");
}

}  // namespace
}  // namespace kvforge
