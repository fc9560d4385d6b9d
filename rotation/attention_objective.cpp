#include "rotation/attention_objective.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "model/cpu_vector_math.h"
#include "model/rope.h"

namespace kvforge {
namespace {

at::Tensor slice_or_undefined(const at::Tensor& t, int64_t first, int64_t count) {
  return t.defined() ? t.narrow(0, first, count) : t;
}

at::Tensor to_or_undefined(const at::Tensor& t, const at::Device& device, at::ScalarType dtype) {
  return t.defined() ? t.to(device, dtype) : t;
}

void check_data(const RotationLayerData& data) {
  const auto fail = [](const std::string& what) { throw std::invalid_argument("rotation layer data: " + what); };
  if (!data.keys.defined() || data.keys.dim() != 4) fail("keys: expected [N, Hkv, T, D]");
  if (!data.values.defined() || data.values.sizes() != data.keys.sizes()) fail("values: expected the keys' shape");
  const int64_t n = data.keys.size(0), kv_heads = data.keys.size(1), tokens = data.keys.size(2),
                dim = data.keys.size(3);
  if (!data.queries.defined() || data.queries.dim() != 4 || data.queries.size(0) != n ||
      data.queries.size(2) != tokens || data.queries.size(3) != dim || data.queries.size(1) % kv_heads != 0) {
    fail("queries: expected [N, H, T, D] with H a multiple of the keys' " + std::to_string(kv_heads) + " heads");
  }
  if (!data.o_proj.defined() || data.o_proj.dim() != 2 || data.o_proj.size(1) != data.queries.size(1) * dim) {
    fail("o_proj: expected [hidden, " + std::to_string(data.queries.size(1) * dim) + "]");
  }
}

}  // namespace

at::Tensor KeyTerms::total(double kl_weight, double output_weight) const {
  return kl * kl_weight + output * output_weight;
}

RotationLayerData RotationLayerData::windows_slice(int64_t first, int64_t count) const {
  RotationLayerData slice = *this;
  slice.queries = slice_or_undefined(queries, first, count);
  slice.keys = slice_or_undefined(keys, first, count);
  slice.values = slice_or_undefined(values, first, count);
  slice.fisher_keys = slice_or_undefined(fisher_keys, first, count);
  slice.fisher_values = slice_or_undefined(fisher_values, first, count);
  return slice;
}

RotationLayerData RotationLayerData::to(const at::Device& device, at::ScalarType dtype) const {
  RotationLayerData moved = *this;
  for (at::Tensor* t : {&moved.queries, &moved.keys, &moved.values, &moved.o_proj, &moved.fisher_keys,
                        &moved.fisher_values}) {
    *t = to_or_undefined(*t, device, dtype);
  }
  return moved;
}

AttentionObjective::AttentionObjective(const RotationLayerData& data, int64_t last_queries) {
  check_data(data);
  prepare_cpu_vector_math();  // the probabilities' exp
  const int64_t n = data.keys.size(0), kv_heads = data.keys.size(1), tokens = data.keys.size(2),
                dim = data.keys.size(3), heads = data.queries.size(1), group = heads / kv_heads;
  query_count_ = last_queries > 0 && last_queries < tokens ? last_queries : tokens;
  const int64_t first_query = tokens - query_count_;
  const at::TensorOptions options = data.keys.options();
  queries_ = data.queries.narrow(2, first_query, query_count_).reshape({n, kv_heads, group, query_count_, dim}) /
             std::sqrt(static_cast<double>(dim));
  values_ = data.values.unsqueeze(2);
  // Columns of KV head h's query heads are the contiguous block h*G*D ... (h+1)*G*D.
  o_proj_ = data.o_proj.to(options.dtype()).reshape({-1, kv_heads, group * dim}).permute({1, 2, 0});
  const at::Tensor query_positions = at::arange(first_query, tokens, options.dtype(at::kLong)).unsqueeze(1);
  causal_ = at::arange(tokens, options.dtype(at::kLong)).unsqueeze(0) <= query_positions;
  if (data.rope) {
    const RotaryEmbedding rotary(*data.rope, dim, data.keys.device());
    const RopeTables tables = rotary.tables(0, tokens, data.keys.scalar_type());
    rope_cos_ = tables.cos;
    rope_sin_ = tables.sin;
  }
  exact_log_probabilities_ = log_probabilities(data.keys).detach();
  exact_probabilities_ = exact_log_probabilities_.exp();
  exact_outputs_ = at::matmul(exact_probabilities_, values_);
  exact_energy_ = output_energy(exact_outputs_);
}

at::Tensor AttentionObjective::post_rope(const at::Tensor& keys) const {
  if (!rope_cos_.defined()) return keys;
  return RotaryEmbedding::apply(keys, RopeTables{rope_cos_, rope_sin_});
}

at::Tensor AttentionObjective::log_probabilities(const at::Tensor& keys) const {
  const at::Tensor logits = at::matmul(queries_, post_rope(keys).unsqueeze(2).transpose(-1, -2));
  return at::log_softmax(logits.masked_fill(causal_.logical_not(), -std::numeric_limits<double>::infinity()), -1);
}

at::Tensor AttentionObjective::probabilities(const at::Tensor& keys) const { return log_probabilities(keys).exp(); }

at::Tensor AttentionObjective::output_energy(const at::Tensor& outputs) const {
  // [N, Hkv, G, Lq, D] -> [N, Hkv, Lq, G * D]: the group's heads side by side,
  // as o_proj's input columns are laid out.
  const int64_t n = outputs.size(0), kv_heads = outputs.size(1), group = outputs.size(2), rows = outputs.size(3),
                dim = outputs.size(4);
  const at::Tensor concatenated = outputs.permute({0, 1, 3, 2, 4}).reshape({n, kv_heads, rows, group * dim});
  return at::matmul(concatenated, o_proj_).square().sum(at::IntArrayRef{0, 2, 3});
}

KeyTerms AttentionObjective::key_terms(const at::Tensor& keys) const {
  const at::Tensor log_q = log_probabilities(keys);
  // Masked (future) keys have P = 0 on both sides: their terms are 0, not
  // 0 * (-inf - -inf).
  const at::Tensor difference = (exact_log_probabilities_ - log_q).masked_fill(causal_.logical_not(), 0);
  KeyTerms terms;
  terms.kl = (exact_probabilities_ * difference).sum(-1).mean(at::IntArrayRef{0, 2, 3});
  const at::Tensor outputs = at::matmul(log_q.exp(), values_);
  terms.output = output_energy(outputs - exact_outputs_) / exact_energy_;
  return terms;
}

at::Tensor AttentionObjective::value_term(const at::Tensor& values, const at::Tensor& probabilities) const {
  const at::Tensor error = at::matmul(probabilities, (values.unsqueeze(2) - values_));
  const at::Tensor reference = probabilities.is_same(exact_probabilities_)
                                   ? exact_energy_
                                   : output_energy(at::matmul(probabilities, values_));
  return output_energy(error) / reference;
}

at::Tensor AttentionObjective::token_mass() const { return exact_probabilities_.sum(at::IntArrayRef{2, 3}); }

}  // namespace kvforge
