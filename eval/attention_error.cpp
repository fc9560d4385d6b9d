#include "eval/attention_error.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvforge {
namespace {

double mean(const std::vector<double>& values) {
  double sum = 0;
  for (const double value : values) sum += value;
  return sum / static_cast<double>(values.size());
}

}  // namespace

std::vector<LayerAttentionError> mean_over_kv_heads(const std::vector<LayerAttentionTerms>& terms) {
  std::vector<LayerAttentionError> errors;
  for (size_t layer = 0; layer < terms.size(); ++layer) {
    const LayerAttentionTerms& t = terms[layer];
    const size_t heads = t.key_kl.size();
    if (heads == 0 || t.key_output.size() != heads || t.value.size() != heads) {
      throw std::invalid_argument("attention error: layer " + std::to_string(layer) +
                                  ": expected key_kl, key_output and value for the same KV heads (at least one)");
    }
    errors.push_back({static_cast<int64_t>(layer), mean(t.key_kl), mean(t.key_output), mean(t.value)});
  }
  return errors;
}

std::vector<LayerAttentionError> measure_attention_error(const ActivationStoreReader& store,
                                                         const std::filesystem::path& model_dir,
                                                         const QuantizerConfig* config,
                                                         const AttentionTermOptions& options) {
  if (config != nullptr) return mean_over_kv_heads(measure_attention_terms(store, model_dir, *config, options));
  int64_t layers = store.layout().model.num_layers;
  if (options.max_layers > 0) layers = std::min(layers, options.max_layers);
  std::vector<LayerAttentionError> errors;
  for (int64_t layer = 0; layer < layers; ++layer) errors.push_back({layer, 0, 0, 0});
  return errors;
}

}  // namespace kvforge
