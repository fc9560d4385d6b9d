// grouped_attention against attention written out per query head, position
// and key in float64 (the definition), and against SDPA over the same cache.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "model/grouped_attention.h"
#include "model/transformer.h"

namespace kvforge {
namespace {

// out[b, h, i] = sum_j softmax_j(q[b,h,i] . k[b,h/g,j] * scale) v[b,h/g,j] over allowed j.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& mask, double scale) {
  const auto qa = q.to(at::kDouble).contiguous(), ka = k.to(at::kDouble).contiguous(),
             va = v.to(at::kDouble).contiguous();
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Hkv = k.size(1), Tk = k.size(2);
  at::Tensor out = at::zeros({B, H, Tq, D}, at::kDouble);
  auto Q = qa.accessor<double, 4>(), K = ka.accessor<double, 4>(), V = va.accessor<double, 4>();
  auto O = out.accessor<double, 4>();
  auto M = mask.accessor<bool, 2>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Tq; ++i) {
        const int64_t kh = h / (H / Hkv);
        std::vector<double> s(static_cast<size_t>(Tk), -std::numeric_limits<double>::infinity());
        double top = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < Tk; ++j) {
          if (!M[i][j]) continue;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += Q[b][h][i][d] * K[b][kh][j][d];
          s[static_cast<size_t>(j)] = dot * scale;
          top = std::max(top, dot * scale);
        }
        double total = 0;
        for (auto& x : s) total += (x = std::exp(x - top));
        for (int64_t j = 0; j < Tk; ++j)
          for (int64_t d = 0; d < D; ++d) O[b][h][i][d] += s[static_cast<size_t>(j)] / total * V[b][kh][j][d];
      }
  return out;
}

struct Case {
  int64_t heads, kv_heads, queries, keys, window;
};

class GroupedAttention : public ::testing::TestWithParam<Case> {};

TEST_P(GroupedAttention, EqualsTheDefinitionInFloat64) {
  const Case c = GetParam();
  at::manual_seed(7);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q = at::randn({2, c.heads, c.queries, 16}, f64);
  const at::Tensor k = at::randn({2, c.kv_heads, c.keys, 16}, f64);
  const at::Tensor v = at::randn({2, c.kv_heads, c.keys, 16}, f64);
  const int64_t start = c.keys - c.queries;  // the queries are the newest positions
  const at::Tensor mask = attention_mask(start, c.queries, c.keys, c.window, c10::Device(c10::kCPU));
  const double scale = 0.25;
  const at::Tensor expected = reference_attention(q, k, v, mask, scale);
  const at::Tensor got = grouped_attention(q, k, v, mask, scale);
  // The softmax runs in float32 (u = 2^-24): rounding a score s to float32
  // moves exp(s - max) by |s - max| u relatively, exp and the normalisation
  // add about 2u each, so every weight is off by at most (4 + 2 max|s|) u
  // relatively and the output, a convex combination of values, by that
  // times max|v|. Everything else is float64.
  const double u = std::ldexp(1.0, -24);
  const double max_score = (at::matmul(q, k.repeat_interleave(c.heads / c.kv_heads, 1).transpose(2, 3)) * scale)
                               .abs().max().item<double>();
  const double bound = (4 + 2 * max_score) * u * v.abs().max().item<double>();
  EXPECT_LT((got - expected).abs().max().item<double>(), bound);
  if (c.window == 0 && c.queries == 1) {  // a decoding step needs no mask
    EXPECT_LT((grouped_attention(q, k, v, std::nullopt, scale) - expected).abs().max().item<double>(), bound);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedAttention,
                         ::testing::Values(Case{4, 2, 1, 37, 0}, Case{8, 1, 1, 5, 0}, Case{4, 4, 3, 20, 0},
                                           Case{6, 2, 5, 33, 8}, Case{4, 2, 1, 40, 16}));

TEST(GroupedAttention, AgreesWithSdpaOnAStridedCacheView) {
  // The cache hands attention a narrowed view of a preallocated buffer.
  at::manual_seed(3);
  const at::Tensor buffer = at::randn({1, 2, 64, 32});
  const at::Tensor k = buffer.narrow(2, 0, 41), v = (buffer * 0.5 + 1).narrow(2, 0, 41);
  const at::Tensor q = at::randn({1, 8, 1, 32});
  const at::Tensor sdpa = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, false, 0.125, true);
  // float32: both sum 41 products and 41 weights; a few ulps of the outputs' size.
  EXPECT_LT((grouped_attention(q, k, v, std::nullopt, 0.125) - sdpa).abs().max().item<double>(), 1e-5);
}

}  // namespace
}  // namespace kvforge
