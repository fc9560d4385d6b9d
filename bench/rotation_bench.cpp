// Wall time of `kvforge rotate`'s fit (rotation/rotation_fit.h) on a model of
// Llama-3-8B shapes (32 layers, 32 query / 8 KV heads of 128, hidden 4096)
// over 16 windows of 2048 captured tokens (issue 8's target: every layer
// and head in under 10 minutes on one H200). Captures are synthetic (the
// fit's cost does not depend on the values): queries and keys with a few
// large channels, as real keys have, values and o_proj Gaussian.
//
// The baseline, measured in the same run on the same layers: the fixed bases
// alone (steps 0: every base's quantizer refitted and measured, nothing
// learned), so the report shows what learning adds.
//
//   kvforge_bench_rotation [--device cuda] [--layers 32] [--windows 16] [--tokens 2048]
//                          [--steps 80] [--method int2-rot] [--budget 420] [--out FILE]
//
// --budget stops after the layer that crosses it (seconds of learning); the
// report then gives the layers measured and the projection to all layers.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <vector>

#include "bench/device_timer.h"
#include "bench/llama3_shapes.h"
#include "calib/quantizer_fit.h"
#include "model/device.h"
#include "rotation/rotation_fit.h"

namespace kvforge {
namespace {

// One layer's synthetic captures: 4 of every 128 key and query channels 8x
// larger (the outlier channels per-token INT2 suffers from).
RotationLayerData synthetic_layer(const ModelConfig& model, int64_t windows, int64_t tokens, bool pre_rope,
                                  const c10::Device& device, uint64_t seed) {
  at::manual_seed(seed);
  const auto options = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor channel_scale = at::ones({model.head_dim}, options);
  channel_scale.index_fill_(0, at::arange(0, model.head_dim, 32, options.dtype(at::kLong)), 8.0);
  RotationLayerData data;
  data.queries = at::randn({windows, model.num_heads, tokens, model.head_dim}, options) * channel_scale;
  data.keys = at::randn({windows, model.num_kv_heads, tokens, model.head_dim}, options) * channel_scale;
  data.values = at::randn({windows, model.num_kv_heads, tokens, model.head_dim}, options);
  data.o_proj = at::randn({model.hidden_size, model.num_heads * model.head_dim}, options) * 0.02;
  if (pre_rope) data.rope = model.rope;
  return data;
}

int run(int argc, char** argv) {
  CLI::App app{"kvforge rotate's fit on Llama-3-8B shapes, against the fixed bases alone"};
  std::string device_text = "cuda", method_text = "int2-rot", out;
  int64_t layers = 32, windows = 16, tokens = 2048, steps = 80;
  double budget = 420;
  bool no_logit_statistic = false;
  app.add_option("--device", device_text);
  app.add_option("--layers", layers);
  app.add_option("--windows", windows);
  app.add_option("--tokens", tokens);
  app.add_option("--steps", steps);
  app.add_option("--method", method_text);
  app.add_option("--budget", budget, "Seconds of learning after which no further layer starts");
  app.add_option("--out", out, "JSON report");
  app.add_flag("--no-logit-statistic", no_logit_statistic, "Skip the refitted quantizers' logit statistic");
  CLI11_PARSE(app, argc, argv);

  const c10::Device device = parse_device(device_text);
  const ModelConfig model = llama3_8b_shapes(layers);
  FitOptions fit;
  fit.method = *parse_method(method_text);
  fit.bits = 2;
  const QuantizerSettings settings = resolve_settings(fit, model.head_dim);
  RotationOptions options;
  options.device = device;
  options.steps = steps;
  options.logit_statistic = !no_logit_statistic;
  RotationOptions bases_only = options;
  bases_only.steps = 0;
  const int64_t validation = std::max<int64_t>(1, windows / 4);

  nlohmann::json rows = nlohmann::json::array();
  double learned_total = 0, bases_total = 0;
  int64_t measured = 0;
  for (int64_t layer = 0; layer < layers && learned_total < budget; ++layer) {
    const RotationLayerData data = synthetic_layer(model, windows, tokens, settings.keys_pre_rope, device, layer);
    const RotationLayerData fit_windows = data.windows_slice(0, windows - validation);
    const RotationLayerData validation_windows = data.windows_slice(windows - validation, validation);
    LayerRotationFit learned, fixed;
    const double base_seconds =
        seconds_of(device, [&] { fixed = fit_layer_rotation(settings, fit_windows, validation_windows, bases_only); });
    const double learn_seconds =
        seconds_of(device, [&] { learned = fit_layer_rotation(settings, fit_windows, validation_windows, options); });
    learned_total += learn_seconds;
    bases_total += base_seconds;
    ++measured;
    int64_t heads_learned = 0;
    double key_base = 0, key_learned = 0;
    for (size_t h = 0; h < learned.learned.rotation.loss.size(); ++h) {
      heads_learned += learned.learned.rotation.keys.learned.at(h) ? 1 : 0;
      key_base += learned.learned.rotation.loss[h].key_base;
      key_learned += learned.learned.rotation.loss[h].key_learned;
    }
    rows.push_back({{"layer", layer},
                    {"seconds", learn_seconds},
                    {"bases_only_seconds", base_seconds},
                    {"key_steps", learned.key_steps},
                    {"value_steps", learned.value_steps},
                    {"key_heads_learned", heads_learned},
                    {"key_loss_base", key_base},
                    {"key_loss_learned", key_learned},
                    {"phase_seconds",
                     {{"bases", learned.seconds.bases},
                      {"keys", learned.seconds.keys},
                      {"values", learned.seconds.values},
                      {"final", learned.seconds.final}}}});
    std::cerr << "layer " << layer << ": " << learn_seconds << " s learning (" << learned.key_steps << " key, "
              << learned.value_steps << " value steps; phases: bases " << learned.seconds.bases << " s, keys "
              << learned.seconds.keys << " s, values " << learned.seconds.values << " s, final "
              << learned.seconds.final << " s), bases alone " << base_seconds << " s\n";
  }
  const double projected = learned_total / static_cast<double>(measured) * static_cast<double>(layers);
  nlohmann::json report = {
      {"what", "kvforge rotate fit wall time, Llama-3-8B shapes, synthetic captures"},
      {"device", device.str()},
      {"method", method_text},
      {"layers", layers},
      {"kv_heads", model.num_kv_heads},
      {"head_dim", model.head_dim},
      {"windows", windows},
      {"tokens_per_window", tokens},
      {"fit_windows", windows - validation},
      {"validation_windows", validation},
      {"steps", steps},
      {"layers_measured", measured},
      {"learning_seconds_measured", learned_total},
      {"bases_only_seconds_measured", bases_total},
      {"learning_over_bases_only", learned_total / bases_total},
      {"projected_seconds_all_layers", projected},
      {"target_seconds", 600},
      {"rows", rows}};
  std::cout << report.dump(1) << "\n";
  if (!out.empty()) std::ofstream(out) << report.dump(1) << "\n";
  return 0;
}

}  // namespace
}  // namespace kvforge

int main(int argc, char** argv) {
  try {
    return kvforge::run(argc, argv);
  } catch (const std::exception& error) {
    std::cerr << "kvforge_bench_rotation: " << error.what() << "\n";
    return 1;
  }
}
