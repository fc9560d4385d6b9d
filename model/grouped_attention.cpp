#include "model/grouped_attention.h"

#include <ATen/ATen.h>

#include <limits>
#include <stdexcept>

namespace kvforge {

at::Tensor grouped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& mask, double scale) {
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), head_dim = q.size(3);
  const int64_t kv_heads = k.size(1), keys = k.size(2);
  if (heads % kv_heads != 0) throw std::invalid_argument("grouped_attention: KV heads must divide query heads");
  const int64_t group = heads / kv_heads;
  // [B, Hkv, group * Tq, D]: the group's query heads stacked as rows.
  const at::Tensor rows = q.reshape({batch, kv_heads, group * queries, head_dim});
  at::Tensor scores = at::matmul(rows, k.transpose(2, 3)).mul_(scale);
  if (mask) {
    scores = scores.view({batch, kv_heads, group, queries, keys})
                 .masked_fill(mask->logical_not(), -std::numeric_limits<double>::infinity())
                 .view({batch, kv_heads, group * queries, keys});
  }
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, v).view({batch, heads, queries, head_dim});
}

}  // namespace kvforge
