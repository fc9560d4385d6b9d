#include "capture/activation_recorder.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <limits>

namespace kvforge {
namespace {

bool wants(const std::vector<ActivationField>& fields, ActivationField field) {
  return std::find(fields.begin(), fields.end(), field) != fields.end();
}

// Forwards the requested forward-pass fields to the sink.
class ForwardFieldObserver final : public AttentionObserver {
 public:
  ForwardFieldObserver(const std::vector<ActivationField>& fields, const ActivationSink& sink)
      : fields_(fields), sink_(sink) {}
  void on_attention(const AttentionTensors& t) override {
    if (wants(fields_, ActivationField::kQueries)) sink_(ActivationField::kQueries, t.layer, t.queries);
    if (wants(fields_, ActivationField::kKeysPreRope)) sink_(ActivationField::kKeysPreRope, t.layer, t.keys_pre_rope);
    if (wants(fields_, ActivationField::kKeysPostRope)) sink_(ActivationField::kKeysPostRope, t.layer, t.keys);
    if (wants(fields_, ActivationField::kValues)) sink_(ActivationField::kValues, t.layer, t.values);
  }

 private:
  const std::vector<ActivationField>& fields_;
  const ActivationSink& sink_;
};

// Keeps the pre-RoPE keys and values of a recomputed layer so that their
// gradients can be read after backward.
class GradientObserver final : public AttentionObserver {
 public:
  void on_attention(const AttentionTensors& t) override {
    keys_pre_rope = t.keys_pre_rope;
    values = t.values;
    keys_pre_rope.retain_grad();
    values.retain_grad();
  }
  at::Tensor keys_pre_rope;
  at::Tensor values;
};

// Accumulates d(loss)/d(final hidden states) into `top.grad()`, a chunk of
// positions at a time; returns the loss.
double backward_through_head(const Transformer& model, const at::Tensor& top, const at::Tensor& ids,
                             int64_t chunk_tokens) {
  const int64_t predictions = ids.size(1) - 1;
  const double count = static_cast<double>(ids.size(0) * predictions);
  double loss = 0;
  for (int64_t first = 0; first < predictions; first += chunk_tokens) {
    const int64_t n = std::min(chunk_tokens, predictions - first);
    const at::Tensor logits = model.logits(model.final_norm(top.narrow(1, first, n)));
    const at::Tensor targets = ids.narrow(1, first + 1, n).unsqueeze(-1);
    const at::Tensor chunk_loss = -at::log_softmax(logits, -1).gather(-1, targets).sum() / count;
    chunk_loss.backward();
    loss += chunk_loss.item<double>();
  }
  return loss;
}

}  // namespace

double record_activations(const Transformer& model, const at::Tensor& input_ids, const RecorderOptions& options,
                          const ActivationSink& sink) {
  const at::Tensor ids = input_ids.to(model.target().device, at::kLong);
  const bool fisher = wants(options.fields, ActivationField::kFisherKeys) ||
                      wants(options.fields, ActivationField::kFisherValues);
  ForwardFieldObserver forward_observer(options.fields, sink);
  if (!fisher) {
    c10::InferenceMode inference;
    model.hidden_states(ids, {.observer = &forward_observer});
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (ids.size(1) < 2) throw std::invalid_argument("Fisher sensitivity needs windows of at least 2 tokens");

  // Forward without a graph, keeping only each layer's input.
  const int64_t layers = model.config().num_layers;
  std::vector<at::Tensor> layer_inputs;
  at::Tensor hidden;
  {
    c10::NoGradGuard no_grad;
    hidden = model.embed(ids);
    for (int64_t layer = 0; layer < layers; ++layer) {
      layer_inputs.push_back(hidden);
      hidden = model.decoder_layer(layer, hidden, 0, nullptr, &forward_observer);
    }
  }
  c10::AutoGradMode grad_mode(true);
  const at::Tensor top = hidden.detach().requires_grad_(true);
  const double loss = backward_through_head(model, top, ids, options.loss_chunk_tokens);
  at::Tensor upstream = top.grad();

  // Backward one layer at a time: recompute it with a graph from its saved
  // input, push the upstream gradient through it.
  for (int64_t layer = layers - 1; layer >= 0; --layer) {
    const at::Tensor input = layer_inputs[static_cast<size_t>(layer)].detach().requires_grad_(true);
    layer_inputs[static_cast<size_t>(layer)] = at::Tensor();
    GradientObserver observer;
    const at::Tensor output = model.decoder_layer(layer, input, 0, nullptr, &observer);
    output.backward(upstream);
    if (wants(options.fields, ActivationField::kFisherKeys)) {
      sink(ActivationField::kFisherKeys, layer, observer.keys_pre_rope.grad().to(at::kFloat).square());
    }
    if (wants(options.fields, ActivationField::kFisherValues)) {
      sink(ActivationField::kFisherValues, layer, observer.values.grad().to(at::kFloat).square());
    }
    upstream = input.grad();
  }
  return loss;
}

}  // namespace kvforge
