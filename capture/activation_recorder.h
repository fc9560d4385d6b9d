#pragma once
// What the model puts in its cache, and how much the loss cares: one forward
// pass over a batch of windows hands queries, keys before and after RoPE and
// values to a sink, layer by layer; when Fisher fields are asked for, a
// backward pass follows that recomputes one layer at a time from saved layer
// inputs (activation checkpointing), so memory grows with one layer's
// activations, not the whole model's, and long sequences fit.
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "formats/activation_store.h"
#include "model/transformer.h"

namespace kvforge {

// values: [B, heads, T, head_dim] on the model's device, in the model dtype
// (activations) or float32 (Fisher). Activations arrive in layer order during
// the forward pass, Fisher fields in reverse layer order during the backward.
using ActivationSink = std::function<void(ActivationField field, int64_t layer, const at::Tensor& values)>;

struct RecorderOptions {
  std::vector<ActivationField> fields;
  // Positions whose logits are materialized at once when computing the loss
  // (vocabulary x chunk floats); bounds memory for large vocabularies.
  int64_t loss_chunk_tokens = 1024;
};

// Fisher sensitivity, as KVQuant uses it: the squared gradient of the mean
// next-token cross-entropy over all B x (T - 1) predictions with respect to
// each pre-RoPE key and each value element. Returns that loss (NaN when no
// Fisher field was asked for and so no loss was computed).
double record_activations(const Transformer& model, const at::Tensor& input_ids, const RecorderOptions& options,
                          const ActivationSink& sink);

}  // namespace kvforge
