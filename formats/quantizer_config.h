#pragma once
// The quantizers a calibration fits and the runtime applies: value types only
// (no torch), shared by calib/ (which fits and simulates them), the artifact
// (which stores them) and kernels/ (which run them). docs/artifact.md states
// the arithmetic each field takes part in.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvforge {

enum class QuantMethod {
  kKvquant,  // per-channel pre-RoPE keys, per-token values, non-uniform grids, dense-and-sparse outliers
  kKivi,     // keys per channel in token groups, values per token in channel groups, recent window in 16 bits
  kInt2Rot,  // per-token groups for keys and values, fitted clipping, sink and recent windows in 16 bits
  kRtn,      // per-token round-to-nearest for both, the plain reference
};
std::string_view method_name(QuantMethod method);  // "kvquant", "kivi", "int2-rot", "rtn"
std::optional<QuantMethod> parse_method(std::string_view name);

// How scale and offset are shared within one head's [tokens, head_dim] slab.
enum class Grouping {
  kPerToken,           // one (scale, offset) per token for every `group` consecutive channels, at runtime
  kPerChannelTokens,   // one (scale, offset) per channel for every `group` consecutive tokens, at runtime
  kPerChannelOffline,  // one (scale, offset) per channel, calibrated offline (KVQuant keys)
};
std::string_view grouping_name(Grouping grouping);  // "per_token", "per_channel_tokens", "per_channel_offline"
std::optional<Grouping> parse_grouping(std::string_view name);

// A dense float32 array, row-major.
struct Float32Array {
  std::vector<int64_t> shape;
  std::vector<float> values;
  bool empty() const { return values.empty(); }
  bool operator==(const Float32Array&) const = default;
};

// Settings of one tensor kind (keys or values) of a configuration.
struct TensorQuantizerSettings {
  Grouping grouping = Grouping::kPerToken;
  int64_t group = 128;           // channels (per-token groupings) or tokens (kPerChannelTokens)
  bool non_uniform = false;      // codes index a fitted grid instead of uniform integer levels
  // Dense-and-sparse: this fraction of elements is kept exact in a sparse side
  // store (0: no outliers). kPerChannelOffline: per-channel thresholds fitted
  // offline (KVQuant keys). Runtime groupings: per-token thresholds at
  // runtime, |x - mean_t| > tau * std_t with tau fitted offline (KVQuant
  // values).
  double outlier_fraction = 0.0;
  bool operator==(const TensorQuantizerSettings&) const = default;
};

// Settings shared by every layer of a configuration.
struct QuantizerSettings {
  QuantMethod method = QuantMethod::kRtn;
  int bits = 2;                  // 2, 3 or 4
  bool keys_pre_rope = false;    // keys quantized before RoPE, rotated after dequantization
  TensorQuantizerSettings keys;
  TensorQuantizerSettings values;
  int64_t sink_tokens = 0;       // the first tokens stay in 16 bits
  int64_t residual_tokens = 0;   // the newest tokens stay in 16 bits
  bool fisher_weighted = false;  // grids fitted by Fisher-weighted k-means
  bool q_norm = false;           // grids corrected to keep the mean and spread of the data
  bool operator==(const QuantizerSettings&) const = default;
};

// One layer's fitted parameters for keys or for values.
struct TensorQuantizer {
  // Non-uniform methods: 2^bits ascending levels in the normalized domain,
  // where inliers span [-1, 1]. Empty for uniform integer grids.
  std::vector<float> grid;
  // kPerChannelOffline: [kv_heads, head_dim]; normalized = (x - offset) / scale.
  Float32Array channel_scale;
  Float32Array channel_offset;
  // kPerChannelOffline with outliers: [kv_heads, head_dim] thresholds;
  // x < low or x > high is an outlier (kept exact). Inliers lie in [low, high].
  Float32Array outlier_low;
  Float32Array outlier_high;
  // Runtime groupings with outliers: the multiplier tau (see TensorQuantizerSettings).
  float outlier_tau = 0.0f;
  // Uniform groupings: the (min, max) of each group is multiplied by this
  // ratio before the scale is computed (1: no clipping).
  float clip_ratio = 1.0f;
  bool operator==(const TensorQuantizer&) const = default;
};

// What calibration measured for one layer, on the calibration activations.
struct LayerCalibrationStats {
  double key_relative_mse = 0;    // ||k - k^||^2 / ||k||^2
  double value_relative_mse = 0;
  double key_outlier_fraction = 0;    // fraction of elements kept exact
  double value_outlier_fraction = 0;
  double logit_relative_mse = 0;  // of q.k over causal pairs, keys dequantized (and rotated)
  bool operator==(const LayerCalibrationStats&) const = default;
};

struct LayerQuantizers {
  TensorQuantizer keys;
  TensorQuantizer values;
  LayerCalibrationStats stats;
  bool operator==(const LayerQuantizers&) const = default;
};

// One named configuration of an artifact: a method, its settings and the
// fitted parameters of every layer.
struct QuantizerConfig {
  std::string name;
  QuantizerSettings settings;
  std::vector<LayerQuantizers> layers;
  // Effective bits per cached element (keys and values averaged), counting
  // codes, scales, outliers and 16-bit windows, at these context lengths.
  std::vector<std::pair<int64_t, double>> effective_bits;
  bool operator==(const QuantizerConfig&) const = default;
};

}  // namespace kvforge
