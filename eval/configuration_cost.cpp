#include "eval/configuration_cost.h"

#include <stdexcept>
#include <string>

namespace kvforge {

ConfigurationEvaluation describe_configuration(const QuantizerConfig* config, const ModelConfig& model,
                                               int64_t context, const std::optional<OutlierFractions>& measured) {
  if (context < 1) {
    throw std::invalid_argument("--ctx " + std::to_string(context) + ": expected a context >= 1");
  }
  ConfigurationEvaluation evaluation;
  if (config == nullptr) {
    evaluation.name = kFullPrecisionName;
    evaluation.method = kFullPrecisionName;
    evaluation.bits = 16;
    evaluation.rotated = false;
    evaluation.effective_bits = 16;
  } else {
    if (static_cast<int64_t>(config->layers.size()) != model.num_layers) {
      throw std::invalid_argument("quantizer config " + config->name + ": " + std::to_string(config->layers.size()) +
                                  " layers, the model has " + std::to_string(model.num_layers));
    }
    evaluation.name = config->name;
    evaluation.method = std::string(method_name(config->settings.method));
    evaluation.bits = config->settings.bits;
    evaluation.rotated = config->rotation.has_value();
    evaluation.effective_bits =
        effective_bits(config->settings, model.num_kv_heads, model.head_dim, context, measured);
  }
  evaluation.cache_bytes_per_token = model.kv_bytes_per_token(evaluation.effective_bits);
  return evaluation;
}

}  // namespace kvforge
