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

#include "formats/kv_rotation.h"

namespace kvforge {

enum class QuantMethod {
  kKvquant,  // per-channel pre-RoPE keys, per-token values, non-uniform grids, dense-and-sparse outliers
  kKivi,     // keys per channel in token groups, values per token in channel groups, recent window in 16 bits
  kInt2Rot,  // per-token groups for keys and values, fitted clipping, sink and recent windows in 16 bits
  kRtn,      // per-token round-to-nearest for both, the plain reference
};
std::string_view method_name(QuantMethod method);  // "kvquant", "kivi", "int2-rot", "rtn"
std::optional<QuantMethod> parse_method(std::string_view name);

// How scale and offset are shared within a layer's cached keys (or values).
enum class Grouping {
  kPerToken,           // one (scale, offset) per token for every `group` consecutive channels of one head, at runtime
  kPerChannelTokens,   // one (scale, offset) per channel for every `group` consecutive tokens, at runtime
  kPerChannelOffline,  // one (scale, offset) per channel, calibrated offline (KVQuant keys)
  // One (scale, offset) per token over all of its channels across every KV
  // head of the layer (Hkv * head_dim elements), at runtime: KVQuant's
  // per-token value scaling, which acts on v_proj's whole output row. `group`
  // is unused (0).
  kPerTokenAllHeads,
};
// "per_token", "per_channel_tokens", "per_channel_offline", "per_token_all_heads"
std::string_view grouping_name(Grouping grouping);
std::optional<Grouping> parse_grouping(std::string_view name);
bool is_runtime_grouping(Grouping grouping);  // every grouping but kPerChannelOffline

// Which of the newest tokens stay in 16 bits (besides the sink).
enum class ResidualRule {
  // The newest `residual_tokens` tokens; older ones are quantized as they
  // leave the window (kPerChannelTokens: when the whole token block has left
  // it, so up to residual + group - 1 stay exact). KIVI's rule for values;
  // kvforge's variant for keys.
  kSliding,
  // KIVI's rule for keys: a 16-bit buffer that is quantized whole when it
  // reaches `residual_tokens` tokens (at prefill: every whole multiple of
  // residual_tokens): (T - sink) mod residual_tokens tokens stay exact.
  // kPerChannelTokens groups then tile each flushed block; residual_tokens
  // must be a multiple of `group`.
  kBlockFlush,
};
std::string_view residual_rule_name(ResidualRule rule);  // "sliding", "block_flush"
std::optional<ResidualRule> parse_residual_rule(std::string_view name);

// How runtime groupings find their outliers (kPerChannelOffline always uses
// its offline per-channel thresholds).
enum class OutlierRule {
  kNone,                // no outliers (outlier_fraction is 0)
  kChannelThresholds,   // kPerChannelOffline: x outside [outlier_low, outlier_high] of its channel (KVQuant keys)
  // Per token, over the span its grouping scales over (one head, or all KV
  // heads for kPerTokenAllHeads): the fraction/2 largest and fraction/2
  // smallest elements, a fixed count per token (KVQuant values; the count
  // rule is in docs/artifact.md).
  kTokenTopBottom,
  // Per token and head: |x - mean_t| > outlier_tau * std_t over the token's
  // head_dim channels (kvforge's variant).
  kTokenTau,
};
std::string_view outlier_rule_name(OutlierRule rule);  // "none", "channel_thresholds", "token_top_bottom", "token_tau"
std::optional<OutlierRule> parse_outlier_rule(std::string_view name);

// Q-Norm: how a non-uniform grid is corrected so that the dequantized data
// keep the mean and standard deviation of the data.
enum class QNorm {
  kNone,
  // KVQuant's: codes are still the nearest k-means level (the k-means
  // boundaries are kept); the dequantized value gets the moment-matching
  // affine map, i.e. `grid` = a * encode_grid + b.
  kAffine,
  // kvforge's variant: the levels themselves are moved and the codes are the
  // nearest moved level, iterated to a fixed point (no encode_grid).
  kIterated,
};
std::string_view q_norm_name(QNorm q_norm);  // "none", "affine", "iterated"
std::optional<QNorm> parse_q_norm(std::string_view name);

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
  int64_t group = 128;           // channels (kPerToken) or tokens (kPerChannelTokens); 0 where unused
  bool non_uniform = false;      // codes index a fitted grid instead of uniform integer levels
  // Dense-and-sparse: about this fraction of elements is kept exact in a
  // sparse side store (0: no outliers), found by `outlier_rule`.
  double outlier_fraction = 0.0;
  OutlierRule outlier_rule = OutlierRule::kNone;  // kNone exactly when outlier_fraction is 0
  ResidualRule residual_rule = ResidualRule::kSliding;
  QNorm q_norm = QNorm::kNone;   // non-uniform grids only
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
  int64_t residual_tokens = 0;   // the newest tokens stay in 16 bits, by each tensor's residual_rule
  bool fisher_weighted = false;  // grids fitted by Fisher-weighted k-means
  bool operator==(const QuantizerSettings&) const = default;
};

// One layer's fitted parameters for keys or for values.
struct TensorQuantizer {
  // Non-uniform methods: 2^bits ascending levels in the normalized domain,
  // where inliers span [-1, 1]: what code k dequantizes to. Empty for
  // uniform integer grids.
  std::vector<float> grid;
  // QNorm::kAffine only: the k-means levels the codes are chosen by (the
  // nearest one, ties to the lower); `grid` is their affine image. Empty:
  // codes are the nearest level of `grid` itself.
  std::vector<float> encode_grid;
  // kPerChannelOffline: [kv_heads, head_dim]; normalized = (x - offset) / scale.
  Float32Array channel_scale;
  Float32Array channel_offset;
  // kPerChannelOffline with outliers: [kv_heads, head_dim] thresholds;
  // x < low or x > high is an outlier (kept exact). Inliers lie in [low, high].
  Float32Array outlier_low;
  Float32Array outlier_high;
  // OutlierRule::kTokenTau: the multiplier tau (see OutlierRule); 0 otherwise.
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

// One layer's rotation of keys or of values (formats/kv_rotation.h states
// the arithmetic). Empty arrays where the configuration's RotationForm does
// not use them.
struct TensorRotation {
  Float32Array matrix;  // kMatrix: [kv_heads, D, D], x' = x R (row vectors)
  Float32Array angles;  // kPairAngles: [kv_heads, D / 2], radians
  Float32Array centre;  // keys, kMatrix with key_centred: [kv_heads, D], k' = (k - c) R
  std::vector<RotationBasis> basis;  // per KV head: the base its rotation started from
  std::vector<bool> learned;         // per KV head: the learned correction was kept (else the base alone)
  bool empty() const { return matrix.empty() && angles.empty(); }
  bool operator==(const TensorRotation&) const = default;
};

struct LayerRotation {
  TensorRotation keys, values;
  std::vector<HeadRotationLoss> loss;  // per KV head, on the validation windows; empty if not measured
  bool operator==(const LayerRotation&) const = default;
};

struct LayerQuantizers {
  TensorQuantizer keys;
  TensorQuantizer values;
  LayerCalibrationStats stats;
  LayerRotation rotation;  // empty unless the configuration has rotation settings
  bool operator==(const LayerQuantizers&) const = default;
};

// One named configuration of an artifact: a method, its settings and the
// fitted parameters of every layer.
struct QuantizerConfig {
  std::string name;
  QuantizerSettings settings;
  std::vector<LayerQuantizers> layers;
  // Learned or fixed rotations of keys and values (kvforge rotate); every
  // layer's `rotation` then holds its matrices or angles. Unset: none.
  std::optional<RotationSettings> rotation;
  // Effective bits per cached element (keys and values averaged), counting
  // codes, scales, outliers and 16-bit windows, at these context lengths.
  std::vector<std::pair<int64_t, double>> effective_bits;
  bool operator==(const QuantizerConfig&) const = default;
};

}  // namespace kvforge
