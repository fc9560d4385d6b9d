#include "eval/simulated_quantized_cache.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "calib/quantize_simulation.h"

namespace kvforge {
namespace {

QuantizerConfig without_windows(QuantizerConfig config) {
  config.settings.sink_tokens = 0;
  config.settings.residual_tokens = 0;
  config.settings.keys.residual_rule = ResidualRule::kSliding;
  config.settings.values.residual_rule = ResidualRule::kSliding;
  return config;
}

}  // namespace

SimulatedQuantizedCache::SimulatedQuantizedCache(const ModelConfig& model, QuantizerConfig config,
                                                 const RotaryEmbedding& rope, int64_t batch, int64_t capacity,
                                                 c10::Device device, c10::ScalarType dtype)
    : config_(std::move(config)), stream_config_(without_windows(config_)), rope_(rope), batch_(batch),
      capacity_(capacity) {
  if (static_cast<int64_t>(config_.layers.size()) != model.num_layers) {
    throw std::invalid_argument("quantizer config " + config_.name + ": " + std::to_string(config_.layers.size()) +
                                " layers, the model has " + std::to_string(model.num_layers));
  }
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  const std::vector<int64_t> shape{batch, model.num_kv_heads, capacity, model.head_dim};
  for (int64_t layer = 0; layer < model.num_layers; ++layer) {
    Layer state;
    state.keys = at::empty(shape, options);
    if (config_.settings.keys_pre_rope) state.keys_pre_rope = at::empty(shape, options);
    state.values = at::empty(shape, options);
    state.read_keys = at::empty(shape, options);
    state.read_values = at::empty(shape, options);
    layers_.push_back(std::move(state));
  }
  clear();
}

void SimulatedQuantizedCache::clear() {
  length_ = 0;
  for (Layer& state : layers_) {
    state.keys_quantized_end = state.values_quantized_end = config_.settings.sink_tokens;
  }
}

CachedKeysValues SimulatedQuantizedCache::append(const NewKeysValues& block) {
  const int64_t tokens = block.keys.size(2);
  if (block.position_start != length_) {
    throw std::invalid_argument("simulated quantized cache: a block at position " +
                                std::to_string(block.position_start) + " appended to a cache of length " +
                                std::to_string(length_));
  }
  if (length_ + tokens > capacity_) {
    throw std::length_error("simulated quantized cache full: " + std::to_string(length_) + " + " +
                            std::to_string(tokens) + " tokens exceed capacity " + std::to_string(capacity_));
  }
  Layer& state = layers_.at(static_cast<size_t>(block.layer));
  state.keys.narrow(2, length_, tokens).copy_(block.keys);
  state.read_keys.narrow(2, length_, tokens).copy_(block.keys);
  if (state.keys_pre_rope.defined()) state.keys_pre_rope.narrow(2, length_, tokens).copy_(block.keys_pre_rope);
  state.values.narrow(2, length_, tokens).copy_(block.values);
  state.read_values.narrow(2, length_, tokens).copy_(block.values);
  const int64_t end = length_ + tokens;
  quantize_new_keys(block.layer, state, end);
  quantize_new_values(block.layer, state, end);
  return {state.read_keys.narrow(2, 0, end), state.read_values.narrow(2, 0, end)};
}

// The window of `end` tokens quantizes [begin, q); tokens [quantized_end, q)
// are new to it. They are whole groups (quantized_tokens() moves q by whole
// groups from the sink), quantized on their own with stream_config_.
void SimulatedQuantizedCache::quantize_new_keys(int64_t layer, Layer& state, int64_t end) {
  const TokenSpan span = quantized_tokens(config_.settings, config_.settings.keys, end);
  const int64_t from = std::max(state.keys_quantized_end, span.begin);
  if (span.end <= from) return;
  const int64_t count = span.end - from;
  if (config_.settings.keys_pre_rope) {
    const at::Tensor dequantized =
        quantize_dequantize_keys(stream_config_, layer, state.keys_pre_rope.narrow(2, from, count)).dequantized;
    const RopeTables tables = rope_.tables(from, count, dequantized.scalar_type());
    state.read_keys.narrow(2, from, count).copy_(RotaryEmbedding::apply(dequantized, tables));
  } else {
    state.read_keys.narrow(2, from, count)
        .copy_(quantize_dequantize_keys(stream_config_, layer, state.keys.narrow(2, from, count)).dequantized);
  }
  state.keys_quantized_end = span.end;
}

void SimulatedQuantizedCache::quantize_new_values(int64_t layer, Layer& state, int64_t end) {
  const TokenSpan span = quantized_tokens(config_.settings, config_.settings.values, end);
  const int64_t from = std::max(state.values_quantized_end, span.begin);
  if (span.end <= from) return;
  const int64_t count = span.end - from;
  state.read_values.narrow(2, from, count)
      .copy_(quantize_dequantize_values(stream_config_, layer, state.values.narrow(2, from, count)).dequantized);
  state.values_quantized_end = span.end;
}

void SimulatedQuantizedCache::commit(int64_t tokens) { length_ += tokens; }

}  // namespace kvforge
