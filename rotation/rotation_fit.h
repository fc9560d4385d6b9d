#pragma once
// Learning one layer's key and value rotations (`kvforge rotate`, OptR):
// orthogonal matrices per KV head, R = R_base * matrix_exp(A - A^T) with A
// learned by Adam from 0 (exactly orthogonal at every step), that minimize
// attention_objective.h's terms through the configuration's quantizer
// (calib/differentiable_quantizer.h), keys first, then values with the
// learned key rotation in place. Keys the quantizer sees before RoPE
// (settings.keys_pre_rope, KVQuant) rotate by pair angles instead
// (RotationForm::kPairAngles, which commute with RoPE), learned from 0.
//
// Per tensor (keys, then values) and layer:
//   1. every fixed base (identity, Hadamard, OSCAR eigen; random on request)
//      gets its quantizer refitted (calib's fit_layer on the rotated fit
//      windows) and its validation loss measured;
//   2. from the requested base, `steps` Adam steps on the fit windows'
//      loss, the quantizer refitted (detached, on at most refit_tokens
//      tokens) every refit_interval steps, the validation loss measured
//      after every step; each head keeps its best step, and learning stops
//      when no head improved for `patience` steps;
//   3. the quantizer is refitted on the whole fit windows with the learned
//      rotation, and each head keeps the learned rotation only when its
//      validation loss is below its base's (TensorRotation::learned);
//   4. the final quantizers are refitted with the kept rotations.
// Losses (the per-KV-head vectors, all heads batched in one tensor op):
//   keys:   key_kl_weight * KL + key_output_weight * relative post-W_O error
//           (values exact);
//   values: value_output_weight * relative post-W_O error of the values,
//           with the probabilities of `value_learning_probabilities` while
//           learning and choosing (default: keys quantized under their
//           learned rotation), of exact keys in the reported
//           HeadRotationLoss (the decomposition into key- and value-induced
//           error).
// Keys of the kMatrix form are centred first (k' = (k - c) R, c the mean
// key of the fit windows past the sink), which changes no attention
// probability.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "calib/differentiable_quantizer.h"
#include "calib/quantizer_fit.h"
#include "formats/quantizer_config.h"
#include "rotation/attention_objective.h"

namespace kvforge {

// Which attention probabilities weigh the value error.
enum class ValueProbabilities {
  kExactKeys,      // exact keys: the value-induced error alone (the reported decomposition)
  kQuantizedKeys,  // keys quantized under the (learned) key rotation: what values are learned with
};

struct RotationOptions {
  RotationBasis key_basis = RotationBasis::kHadamard;  // ignored for pair angles (identity unless kRandom)
  RotationBasis value_basis = RotationBasis::kHadamard;
  // Fixed bases measured and returned besides the learned rotation
  // (LayerRotationFit::bases); the requested bases need not be among them.
  std::vector<RotationBasis> fixed_bases = {RotationBasis::kIdentity, RotationBasis::kHadamard, RotationBasis::kEigen};
  bool centre_keys = true;  // kMatrix keys only
  int64_t steps = 80;       // Adam steps per tensor and layer (0: the bases only, learned == false)
  double learning_rate = 1e-2;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double key_kl_weight = 1.0;
  double key_output_weight = 1.0;  // lambda
  double value_output_weight = 1.0;
  int64_t last_queries = 64;        // queries per window the objective attends with
  double validation_fraction = 0.25;  // of the windows, the last ones (model_rotation.h)
  FakeQuantizeOptions gradient;     // straight-through or smoothed
  ValueProbabilities value_learning_probabilities = ValueProbabilities::kQuantizedKeys;
  int64_t refit_interval = 10;      // steps between detached quantizer refits while learning (0: never)
  int64_t refit_tokens = 8192;      // tokens those refits fit on (0: every fit token)
  int64_t patience = 10;            // steps without a better validation loss on any head before stopping
  uint64_t seed = 0;                // random bases
  c10::Device device = c10::Device(c10::kCPU);
  at::ScalarType dtype = at::kFloat;  // float32 (float64 for tests)
  std::optional<FitOptions> refit;  // the quantizer fit; unset: the method's defaults (calib/quantizer_fit.h)
  bool logit_statistic = true;      // LayerCalibrationStats::logit_relative_mse of the refitted quantizers
};

// The rotation settings a configuration made with `options` records.
RotationSettings rotation_settings(const QuantizerSettings& settings, const RotationOptions& options);

// x~ = fake_quantize((x - c) R) R^T + c: x [N, Hkv, T, D] quantized in the
// rotated domain and brought back, differentiable in x and R. `centre`
// [Hkv, 1, D] may be undefined.
at::Tensor quantize_through_rotation(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                                     const TensorQuantizer& quantizer, const at::Tensor& x,
                                     const at::Tensor& matrices, const at::Tensor& centre,
                                     const FakeQuantizeOptions& options = {});

// The rotation of a fixed base for one layer, [Hkv, D, D] in x's dtype and
// device: `keys` selects OSCAR's key (query covariance of `data.queries`)
// or value (score-weighted by `token_mass`) eigenbasis, composed with
// Hadamard (R = E H).
at::Tensor base_matrices(RotationBasis basis, bool keys, const RotationLayerData& data, const at::Tensor& token_mass,
                         uint64_t seed);

// One fixed base of a layer: the quantizers refitted to it and its rotation
// (every head learned == false; loss: base == learned).
struct BaseRotation {
  RotationBasis basis = RotationBasis::kIdentity;
  LayerQuantizers quantizers;
};

struct LayerRotationFit {
  LayerQuantizers learned;          // quantizers, stats, rotation (kept per head) and per-head validation losses
  std::vector<BaseRotation> bases;  // options.fixed_bases in order
  int64_t key_steps = 0, value_steps = 0;  // Adam steps run before early stopping
  // Wall time of the phases (each ends in a host synchronization): the
  // fixed bases, learning keys, learning values, the final refit.
  struct PhaseSeconds {
    double bases = 0, keys = 0, values = 0, final = 0;
  } seconds;
};

// fit and validation: the same layer's windows, split by the caller, on
// options.device in options.dtype. std::invalid_argument for inconsistent
// data (naming it) and for a Hadamard-based basis when head_dim is not a
// power of 2.
LayerRotationFit fit_layer_rotation(const QuantizerSettings& settings, const RotationLayerData& fit,
                                    const RotationLayerData& validation, const RotationOptions& options);

}  // namespace kvforge
