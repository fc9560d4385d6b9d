#include "capture/capture_memory.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace kvforge {
namespace {

constexpr int64_t kFloat32 = 4;

// Sizes of one window of T positions of the model, in bytes.
struct Shapes {
  int64_t T, s;                   // positions, bytes per model-dtype element
  int64_t hidden, query, kv, mlp; // one position's row, model dtype
  int64_t q_heads, kv_heads, head_dim, hidden_size, vocab, layers;
  bool window_mask;               // a sliding window shorter than T forces a [T, T] mask
};

Shapes shapes_of(const ModelConfig& c, const CaptureMemoryInputs& in) {
  Shapes x{};
  x.T = in.seq_len;
  x.s = static_cast<int64_t>(c10::elementSize(in.dtype));
  x.hidden = c.hidden_size * x.s;
  x.query = c.num_heads * c.head_dim * x.s;
  x.kv = c.num_kv_heads * c.head_dim * x.s;
  x.mlp = c.intermediate_size * x.s;
  x.q_heads = c.num_heads;
  x.kv_heads = c.num_kv_heads;
  x.head_dim = c.head_dim;
  x.hidden_size = c.hidden_size;
  x.vocab = c.vocab_size;
  x.layers = c.num_layers;
  x.window_mask = std::any_of(c.layer_window.begin(), c.layer_window.end(),
                              [&](int64_t w) { return w > 0 && w < in.seq_len; });
  return x;
}

// Layer input, normalized input (then the residual sum), layer output, and
// RMSNorm's float32 statistics (x in float32, its square).
int64_t common_rows(const Shapes& x) { return x.T * (3 * x.hidden + 2 * x.hidden_size * kFloat32); }

// q before and after RoPE (with RoPE's rotate-half temporary), k and v
// repeated to the query heads, attention output and its transposed copy;
// k_pre, k, v and k's RoPE temporary.
int64_t attention_rows(const Shapes& x) { return x.T * (6 * x.query + 4 * x.kv); }

// gate, silu(gate), up, their product; the down projection.
int64_t mlp_rows(const Shapes& x) { return x.T * (4 * x.mlp + x.hidden); }

// The [heads, T, T] terms of one attention call without a graph. Eager:
// matmul and its scaled copy (2s) or, at the softmax, the scores (s), their
// float32 conversion and float32 probabilities (4 + 4, the conversion absent
// in float32) and the cast back (s); plus the bool mask and its negation.
// Fused (flash / memory-efficient): no scores; a [T, T] mask only when a
// sliding window bites (bool and its additive form).
int64_t attention_square(const Shapes& x, AttentionBackend backend) {
  const int64_t square = x.T * x.T;
  if (backend == AttentionBackend::kFused) return x.window_mask ? square * (1 + x.s) : 0;
  const int64_t per_element = x.s == kFloat32 ? 2 * kFloat32 : x.s + 2 * kFloat32;
  return x.q_heads * square * per_element + 2 * square;
}

// The same with a graph and its backward: the saved float32 probabilities
// and their model-dtype cast (4 + s); in backward the probabilities'
// gradient in the model dtype and float32, softmax's gradient and its
// temporary (s + 4 + 4 + 4), the cast back and the masked gradient (s + s
// counted once more as s: they do not outlive the softmax node) ->
// 16 + 2s per element, plus the saved mask and its negation. Counting all of
// these as live at once overstates float32 (where the casts are no-ops),
// which the measured test bounds (tests/test_capture_memory.cpp).
int64_t attention_square_with_graph(const Shapes& x, AttentionBackend backend) {
  const int64_t square = x.T * x.T;
  if (backend == AttentionBackend::kFused) return x.window_mask ? 2 * square * (1 + x.s) : 0;
  return x.q_heads * square * (16 + 2 * x.s) + 2 * square;
}

// Recorded field copies on the host side of the same memory (CPU): the
// largest field (queries) cloned, converted to float32 and deflated.
int64_t staging(const Shapes& x, const CaptureMemoryInputs& in) {
  if (!in.staging_in_same_memory) return 0;
  return x.T * x.q_heads * x.head_dim * (x.s + 2 * kFloat32);
}

// Fisher fields: the float32 gradients of k_pre and v, squared, and staged.
int64_t fisher_fields(const Shapes& x) { return 2 * x.T * x.kv_heads * x.head_dim * (x.s + 3 * kFloat32); }

}  // namespace

int64_t CaptureMemoryEstimate::peak() const { return weights + std::max({forward, loss_head, layer_backward}); }

int64_t parameter_count(const ModelConfig& c) {
  const int64_t q = c.num_heads * c.head_dim;
  const int64_t kv = c.num_kv_heads * c.head_dim;
  int64_t layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size  // q, k, v, o
                  + 3 * c.hidden_size * c.intermediate_size          // gate, up, down
                  + 2 * c.hidden_size;                               // input and post-attention norms
  if (c.attention_bias) layer += q + 2 * kv;
  if (c.qk_norm) layer += 2 * c.head_dim;
  const int64_t embeddings = c.vocab_size * c.hidden_size * (c.tie_word_embeddings ? 1 : 2);
  return embeddings + c.num_layers * layer + c.hidden_size;
}

CaptureMemoryEstimate estimate_capture_memory(const ModelConfig& config, const CaptureMemoryInputs& in) {
  const Shapes x = shapes_of(config, in);
  CaptureMemoryEstimate estimate;
  estimate.weights = parameter_count(config) * x.s;

  const int64_t inference_layer =
      common_rows(x) + std::max(attention_rows(x) + attention_square(x, in.attention), mlp_rows(x));
  if (!in.fisher) {
    estimate.forward = inference_layer + staging(x, in);
    return estimate;
  }
  // Every layer's input is kept through the whole pass.
  const int64_t saved_inputs = x.layers * x.T * x.hidden;
  estimate.forward = saved_inputs + inference_layer + staging(x, in);

  // The final hidden states and their gradient, then one chunk: logits in
  // the model dtype and float32, log-softmax, the gradients of gather and
  // log-softmax and the cast back (16 + s per logit); the final norm's
  // float32 saves and the chunk's gradient.
  const int64_t chunk = std::min(in.loss_chunk_tokens, x.T - 1);
  estimate.loss_head = saved_inputs + 2 * x.T * x.hidden +
                       chunk * (x.vocab * (4 * kFloat32 + x.s) + 4 * x.hidden_size * kFloat32 + 2 * x.hidden);

  // The top layer's input and the upstream gradient beside the saved inputs;
  // the layer's graph holds all its activations and the backward as much
  // again in gradients.
  const int64_t graph_rows = common_rows(x) + attention_rows(x) + mlp_rows(x);
  estimate.layer_backward = saved_inputs + 2 * x.T * x.hidden + 2 * graph_rows +
                            attention_square_with_graph(x, in.attention) + fisher_fields(x) + staging(x, in);
  return estimate;
}

std::string format_bytes(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return text;
}

}  // namespace kvforge
