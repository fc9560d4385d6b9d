#pragma once
// Fitting a quantizer configuration to calibration activations: what
// `kvforge calibrate` runs per method. The arithmetic the fitted parameters
// take part in is quantize_simulation.h's.
//
// Method defaults (FitOptions fields left unset) are the published methods;
// kvforge's own improvements are named variants (FitOptions overrides,
// `calibrate` flags):
//   kvquant   keys per channel pre-RoPE (kPerChannelOffline) with 1% outliers
//             by offline per-channel thresholds; values scaled per token over
//             all KV heads (kPerTokenAllHeads, v_proj's whole output row)
//             with 1% outliers by kTokenTopBottom (the 0.5% largest and 0.5%
//             smallest of each token's row, a fixed count), as the paper and
//             its reference code; non-uniform grids (one per layer for keys,
//             one for values) by Fisher-weighted k-means; Q-Norm affine (the
//             paper's: k-means boundaries kept, moment-matching map on the
//             dequantized value) at 2 bits only, as the paper's checkpoints
//             use it, none at 3 and 4 bits; sink 1 token; no residual.
//             Variants: value_outlier_rule kTokenTau (kvforge's global tau on
//             mean +- tau std per token and head; it implies per-head value
//             scaling, kPerToken group head_dim), value_grouping kPerToken
//             (per-head scaling), q_norm kIterated (levels moved, iterated).
//   kivi      keys kPerChannelTokens group 32 post-RoPE, kBlockFlush (KIVI's
//             16-bit buffer flushed in blocks of R, so T mod R keys stay
//             exact), values kPerToken group 32 kSliding (the newest R
//             exact), R = 128; nothing fitted (clip ratio 1). Variant:
//             key_residual_rule kSliding (kvforge's former rule).
//   int2-rot  keys and values kPerToken group head_dim, post-RoPE, sink 64,
//             residual 256 sliding; clip ratios fitted per layer (keys and
//             values separately) by grid search over 1.00, 0.99, ..., 0.50.
//   rtn       keys and values kPerToken group head_dim, post-RoPE, no windows.
// Outliers asked of a runtime grouping (outlier_fraction > 0) take
// kTokenTopBottom unless value_outlier_rule says kTokenTau (then keys too).
//
// Fitting uses every calibration position except the sink's (the residual
// window is a matter of recency, not of distribution); the statistics
// (LayerCalibrationStats) simulate whole windows with every setting.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "calib/kmeans1d.h"
#include "formats/activation_store.h"
#include "formats/hf_config.h"
#include "formats/quantizer_config.h"

namespace kvforge {

struct FitOptions {
  std::string name;  // empty: the method's name
  QuantMethod method = QuantMethod::kRtn;
  int bits = 2;  // 1..8
  // Unset: the method's default (above).
  std::optional<double> outlier_fraction;  // keys and values alike; [0, 1)
  std::optional<int64_t> sink_tokens;
  std::optional<int64_t> residual_tokens;
  std::optional<int64_t> key_group;  // ignored for kPerChannelOffline keys (group 0: not applicable)
  std::optional<int64_t> value_group;
  std::optional<bool> fisher;       // Fisher-weighted grids (needs fisher_k / fisher_v)
  std::optional<QNorm> q_norm;      // unset: affine at 2 bits, none at 3 and 4 (non-uniform grids only)
  // Variants of the published defaults (see above).
  std::optional<ResidualRule> key_residual_rule;  // kivi: kBlockFlush (kSliding: variant)
  std::optional<OutlierRule> value_outlier_rule;  // runtime groupings: kTokenTopBottom or kTokenTau
  std::optional<Grouping> value_grouping;         // kvquant: kPerTokenAllHeads (kPerToken: variant)
  std::optional<bool> non_uniform;  // fitted grids instead of uniform levels
  std::optional<bool> clip_search;  // fit clip ratios (runtime groupings only)
  std::vector<double> clip_candidates;  // empty: 1.00, 0.99, ..., 0.50
  // Calibration subset: 0 takes every committed window whole; else at most
  // this many tokens: the first max(1, M / L') windows of L' = min(L, M)
  // leading positions each (positions stay 0-based, so windows stay valid).
  int64_t max_calibration_tokens = 0;
  // Per-token clip search on at most this many token rows (evenly strided
  // over windows, heads and positions).
  int64_t clip_search_rows = 16384;
  std::vector<int64_t> effective_bits_contexts = {2048, 4096, 32768, 65536, 131072};
  KMeans1dOptions kmeans;
};

// The method's defaults with the options' overrides, checked against
// head_dim (std::invalid_argument naming the option otherwise).
QuantizerSettings resolve_settings(const FitOptions& options, int64_t head_dim);

// The calibration subset max_calibration_tokens selects from a store of
// `samples` windows of `seq_len` positions (see FitOptions): what is fitted
// on, and what the artifact records as calibration_tokens.
struct CalibrationSubset {
  int64_t windows = 0;
  int64_t tokens = 0;  // leading positions of each window
  int64_t total() const { return windows * tokens; }
};
CalibrationSubset calibration_subset(int64_t samples, int64_t seq_len, int64_t max_calibration_tokens);

// One layer's calibration activations, float32 [N, heads, T, D], positions
// 0..T-1 of each window.
struct LayerActivations {
  at::Tensor keys;            // in the settings' domain (pre-RoPE when keys_pre_rope)
  at::Tensor values;
  at::Tensor fisher_keys;     // undefined unless Fisher-weighted grids
  at::Tensor fisher_values;
  at::Tensor queries;         // post-RoPE [N, H, T, D]; undefined: no logit statistic
  at::Tensor keys_post_rope;  // the logits' reference keys; undefined: `keys` (post-RoPE settings)
};

// Fits one tensor's quantizer (keys or values: `tensor` is settings.keys or
// settings.values) on x [N, Hkv, T, D], without measuring it. Runs on x's
// device (host-only steps, the k-means and the threshold search, copy what
// they need to the CPU); the parameters are the same on every device up to
// the order of floating-point sums.
TensorQuantizer fit_tensor_quantizer(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                                     const at::Tensor& x, const at::Tensor& fisher, const FitOptions& options);

// Fits one layer and measures it, on the activations' device. `rope`
// rotates dequantized pre-RoPE keys for the logit statistic (needed when
// keys_pre_rope and queries are given).
LayerQuantizers fit_layer(const QuantizerSettings& settings, const LayerActivations& activations,
                          const FitOptions& options, const RopeConfig* rope = nullptr);

// The measures of LayerCalibrationStats for fitted quantizers on any
// activations (calibration or held-out).
LayerCalibrationStats measure_layer(const QuantizerSettings& settings, const LayerQuantizers& quantizers,
                                    const LayerActivations& activations, const RopeConfig* rope);
// The same for a layer of a whole configuration, its rotation applied
// (quantize_dequantize_keys/values): the measures are taken in the model's
// own domain, comparable between rotated and unrotated configurations.
LayerCalibrationStats measure_layer(const QuantizerConfig& config, int64_t layer,
                                    const LayerActivations& activations, const RopeConfig* rope);

// One layer of a store as a configuration needs it: keys in its domain,
// values, Fisher weights when asked, queries (and post-RoPE keys) when the
// store has them; the first `windows` windows, `tokens` leading positions.
LayerActivations read_layer_activations(const ActivationStoreReader& store, const QuantizerSettings& settings,
                                        int64_t layer, int64_t windows, int64_t tokens, bool fisher, bool logits);
// The same over whole windows (at most `max_samples`; all when <= 0), for
// measuring a configuration on another store. InputError for missing fields.
LayerActivations load_layer_activations(const ActivationStoreReader& store, const QuantizerSettings& settings,
                                        int64_t layer, int64_t max_samples = 0);

// Reads the store layer by layer and fits every layer. InputError naming the
// store for a field the method needs that the store lacks, or no samples.
QuantizerConfig fit_quantizers(const ActivationStoreReader& store, const FitOptions& options);

}  // namespace kvforge
