#include "rotation/rotation_fit.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <chrono>
#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>
#include <utility>

#include "calib/float32_array.h"
#include "calib/kv_rotation.h"
#include "log/log.h"
#include "model/rope.h"
#include "rotation/orthogonal_basis.h"

namespace kvforge {
namespace {

std::vector<double> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kDouble).contiguous();
  return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

std::vector<bool> to_bools(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kBool).contiguous();
  return std::vector<bool>(c.data_ptr<bool>(), c.data_ptr<bool>() + c.numel());
}

FitOptions refit_options(const QuantizerSettings& settings, const RotationOptions& options) {
  if (options.refit) return *options.refit;
  FitOptions fit;
  fit.method = settings.method;
  fit.bits = settings.bits;
  return fit;
}

RotationForm key_form(const QuantizerSettings& settings) {
  return settings.keys_pre_rope ? RotationForm::kPairAngles : RotationForm::kMatrix;
}

// One layer's rotations as tensors on the data's device: keys [Hkv, D, D]
// (pair angles as their matrices), the keys' centre [Hkv, 1, D] (undefined:
// none) and values [Hkv, D, D].
struct RotationTensors {
  at::Tensor keys, centre, values;
};

// The Fisher sensitivity of rotated data, in the diagonal approximation: for
// x' = x R the Fisher matrix is R^T F R; keeping only its diagonal with F
// itself diagonal gives F'_j = sum_i R_ij^2 F_i (the cross terms of a
// non-diagonal F are not captured).
at::Tensor rotated_fisher(const at::Tensor& fisher, const at::Tensor& matrices) {
  return fisher.defined() ? rotate(fisher, matrices * matrices) : fisher;
}

at::Tensor leading(const at::Tensor& t, const CalibrationSubset& subset) {
  return t.defined() ? t.narrow(0, 0, subset.windows).narrow(2, 0, subset.tokens) : t;
}

// float32 on the data's device: what calib fits on, wherever the fit runs.
at::Tensor fit_precision(const at::Tensor& t) { return t.defined() ? t.to(at::kFloat).contiguous() : t; }

// The rotated activations calib's fit_layer fits to (float32, on the data's
// device), on at most `token_limit` tokens (0: all): x' = (x - c) R, v' = v R, the
// queries q R (attending with rotated keys as with the originals), post-RoPE
// reference keys RoPE(k' ) for pre-RoPE keys.
LayerActivations rotated_activations(const QuantizerSettings& settings, const RotationLayerData& data,
                                     const RotationTensors& rotation, int64_t token_limit, bool logits) {
  const CalibrationSubset subset = calibration_subset(data.windows(), data.keys.size(2), token_limit);
  at::Tensor keys = leading(data.keys, subset);
  if (rotation.centre.defined()) keys = keys - rotation.centre;
  LayerActivations a;
  a.keys = rotate(keys, rotation.keys);
  a.values = rotate(leading(data.values, subset), rotation.values);
  if (settings.fisher_weighted) {
    a.fisher_keys = rotated_fisher(leading(data.fisher_keys, subset), rotation.keys);
    a.fisher_values = rotated_fisher(leading(data.fisher_values, subset), rotation.values);
  }
  if (logits) {
    a.queries = rotate(leading(data.queries, subset), rotation.keys);
    if (data.rope) {
      const RotaryEmbedding rotary(*data.rope, a.keys.size(-1), a.keys.device());
      a.keys_post_rope = RotaryEmbedding::apply(a.keys, rotary.tables(0, a.keys.size(2), a.keys.scalar_type()));
    }
  }
  for (at::Tensor* t : {&a.keys, &a.values, &a.fisher_keys, &a.fisher_values, &a.queries, &a.keys_post_rope}) {
    *t = fit_precision(*t);
  }
  return a;
}

// One tensor's rotated activations and Fisher weights (undefined unless
// Fisher-weighted), as rotated_activations() gives them.
std::pair<at::Tensor, at::Tensor> rotated_tensor(const QuantizerSettings& settings, const RotationLayerData& data,
                                                 bool keys, const RotationTensors& rotation, int64_t token_limit) {
  const CalibrationSubset subset = calibration_subset(data.windows(), data.keys.size(2), token_limit);
  at::Tensor x = leading(keys ? data.keys : data.values, subset);
  if (keys && rotation.centre.defined()) x = x - rotation.centre;
  const at::Tensor& matrices = keys ? rotation.keys : rotation.values;
  at::Tensor fisher;
  if (settings.fisher_weighted) fisher = rotated_fisher(leading(keys ? data.fisher_keys : data.fisher_values, subset), matrices);
  return {fit_precision(rotate(x, matrices)), fit_precision(fisher)};
}

TensorRotation tensor_rotation(RotationForm form, const at::Tensor& matrices, const at::Tensor& angles,
                               const at::Tensor& centre, RotationBasis basis, const std::vector<bool>& learned) {
  TensorRotation rotation;
  if (form == RotationForm::kPairAngles) {
    rotation.angles = float32_array(angles);
  } else {
    rotation.matrix = float32_array(matrices);
  }
  if (centre.defined()) rotation.centre = float32_array(centre.squeeze(1));
  rotation.basis.assign(learned.size(), basis);
  rotation.learned = learned;
  return rotation;
}

// Adam's state for one parameter tensor.
struct Adam {
  at::Tensor first, second;
  int64_t step = 0;

  void update(at::Tensor& parameter, const at::Tensor& gradient, const RotationOptions& o) {
    if (!first.defined()) {
      first = at::zeros_like(parameter);
      second = at::zeros_like(parameter);
    }
    ++step;
    first.mul_(o.adam_beta1).add_(gradient, 1 - o.adam_beta1);
    second.mul_(o.adam_beta2).addcmul_(gradient, gradient, 1 - o.adam_beta2);
    const double first_correction = 1 - std::pow(o.adam_beta1, static_cast<double>(step));
    const double second_correction = 1 - std::pow(o.adam_beta2, static_cast<double>(step));
    const at::Tensor denominator = (second / second_correction).sqrt_().add_(o.adam_epsilon);
    parameter.sub_(first / denominator * (o.learning_rate / first_correction));
  }
};

// Where `keep` [Hkv] is true, a's head, else b's (any trailing shape).
at::Tensor per_head_where(const at::Tensor& keep, const at::Tensor& a, const at::Tensor& b) {
  std::vector<int64_t> shape(static_cast<size_t>(a.dim()), 1);
  shape[0] = keep.size(0);
  return at::where(keep.view(shape), a, b);
}

// A window split's data, its exact attention and the probabilities its
// value error is learned with.
struct Split {
  const RotationLayerData& data;
  AttentionObjective objective;
  at::Tensor learning_probabilities;
};

class LayerFit {
 public:
  LayerFit(const QuantizerSettings& settings, const RotationLayerData& fit, const RotationLayerData& validation,
           const RotationOptions& options)
      : settings_(settings),
        options_(options),
        refit_(refit_options(settings, options)),
        fit_{fit, AttentionObjective(fit, options.last_queries), {}},
        validation_{validation, AttentionObjective(validation, options.last_queries), {}} {
    if (fit.keys.sizes().slice(1) != validation.keys.sizes().slice(1)) {
      throw std::invalid_argument("rotation fit: fit and validation windows differ in heads, tokens or head_dim");
    }
    kv_heads_ = fit.keys.size(1);
    head_dim_ = fit.keys.size(3);
    if (key_form(settings) == RotationForm::kPairAngles && head_dim_ % 2 != 0) {
      throw std::invalid_argument("rotation fit: pair angles need an even head_dim, got " + std::to_string(head_dim_));
    }
    if (key_form(settings) == RotationForm::kMatrix && options.centre_keys) {
      const int64_t sink = settings.sink_tokens < fit.keys.size(2) ? settings.sink_tokens : 0;
      centre_ = fit.keys.narrow(2, sink, fit.keys.size(2) - sink).mean(at::IntArrayRef{0, 2}).unsqueeze(1);
    }
  }

  LayerRotationFit run();

 private:
  at::TensorOptions matrix_options() const { return fit_.data.keys.options(); }

  // The key rotation of a base: pair angles (identity, or random angles) or
  // a matrix.
  at::Tensor key_base_parameter(RotationBasis basis) const;
  at::Tensor key_matrices(const at::Tensor& parameter) const {
    return key_form(settings_) == RotationForm::kPairAngles ? pair_rotation_matrices(parameter) : parameter;
  }
  RotationBasis key_basis_recorded(RotationBasis basis) const {
    return key_form(settings_) == RotationForm::kPairAngles && basis != RotationBasis::kRandom
               ? RotationBasis::kIdentity
               : basis;
  }
  at::Tensor value_base(RotationBasis basis) const {
    return base_matrices(basis, false, fit_.data, fit_.objective.token_mass(), options_.seed + 1);
  }

  LayerQuantizers refit(const RotationTensors& rotation, int64_t token_limit, bool logits) const {
    c10::NoGradGuard no_grad;
    return fit_layer(settings_, rotated_activations(settings_, fit_.data, rotation, token_limit, logits), refit_,
                     logits && fit_.data.rope ? &*fit_.data.rope : nullptr);
  }

  // The quantizer of the tensor being learned alone, refitted to a rotation
  // (no statistics: what learning and choosing need).
  TensorQuantizer refit_tensor(bool keys, const RotationTensors& rotation, int64_t token_limit) const {
    c10::NoGradGuard no_grad;
    const auto [x, fisher] = rotated_tensor(settings_, fit_.data, keys, rotation, token_limit);
    return fit_tensor_quantizer(settings_, keys ? settings_.keys : settings_.values, x, fisher, refit_);
  }

  at::Tensor dequantized_keys(const Split& split, const RotationTensors& r, const LayerQuantizers& q) const {
    return quantize_through_rotation(settings_, settings_.keys, q.keys, split.data.keys, r.keys, r.centre,
                                     options_.gradient);
  }
  at::Tensor key_loss(const Split& split, const RotationTensors& r, const LayerQuantizers& q) const {
    return split.objective.key_terms(dequantized_keys(split, r, q))
        .total(options_.key_kl_weight, options_.key_output_weight);
  }
  at::Tensor value_loss(const Split& split, const RotationTensors& r, const LayerQuantizers& q,
                        const at::Tensor& probabilities) const {
    const at::Tensor values = quantize_through_rotation(settings_, settings_.values, q.values, split.data.values,
                                                        r.values, {}, options_.gradient);
    return split.objective.value_term(values, probabilities) * options_.value_output_weight;
  }
  at::Tensor loss(bool keys, const Split& split, const RotationTensors& r, const LayerQuantizers& q) const {
    return keys ? key_loss(split, r, q) : value_loss(split, r, q, split.learning_probabilities);
  }

  // Validation losses for the record (values under exact probabilities).
  void losses_of(const RotationTensors& r, const LayerQuantizers& q, std::vector<double>& keys,
                 std::vector<double>& values) const {
    c10::NoGradGuard no_grad;
    keys = to_vector(key_loss(validation_, r, q));
    values = to_vector(value_loss(validation_, r, q, validation_.objective.exact_probabilities()));
  }

  BaseRotation evaluate_base(RotationBasis basis, const at::Tensor& key_parameter, const at::Tensor& value_matrices,
                             RotationBasis key_basis) const;

  struct Learned {
    at::Tensor parameter;  // the kept key parameter (angles or matrices) or value matrices
    std::vector<bool> kept;
    int64_t steps = 0;
  };
  // Learns keys (or values) from `base` (a key parameter or value matrices)
  // with the other tensor's rotation in `rotation`; updates `quantizers`
  // (the learned tensor's part) to the refit with the kept rotation.
  Learned learn(bool keys, const at::Tensor& base, RotationTensors& rotation, LayerQuantizers& quantizers) const;

  const QuantizerSettings& settings_;
  const RotationOptions& options_;
  FitOptions refit_;
  Split fit_, validation_;
  int64_t kv_heads_ = 0, head_dim_ = 0;
  at::Tensor centre_;
};

at::Tensor LayerFit::key_base_parameter(RotationBasis basis) const {
  if (key_form(settings_) == RotationForm::kPairAngles) {
    if (basis != RotationBasis::kRandom) return at::zeros({kv_heads_, head_dim_ / 2}, matrix_options());
    // Random angles: uniform on [-pi, pi), seeded, drawn on the CPU (the
    // same on every device).
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed);
    const at::Tensor u = at::rand({kv_heads_, head_dim_ / 2}, generator, at::TensorOptions().dtype(at::kDouble));
    return ((u * 2 - 1) * std::numbers::pi).to(matrix_options());
  }
  return base_matrices(basis, true, fit_.data, fit_.objective.token_mass(), options_.seed);
}

BaseRotation LayerFit::evaluate_base(RotationBasis basis, const at::Tensor& key_parameter,
                                     const at::Tensor& value_matrices, RotationBasis key_basis) const {
  const RotationTensors r{key_matrices(key_parameter), centre_, value_matrices};
  BaseRotation base;
  base.basis = basis;
  base.quantizers = refit(r, 0, options_.logit_statistic);
  std::vector<double> keys, values;
  losses_of(r, base.quantizers, keys, values);
  const std::vector<bool> none(static_cast<size_t>(kv_heads_), false);
  LayerRotation& rotation = base.quantizers.rotation;
  rotation.keys = tensor_rotation(key_form(settings_), r.keys, key_parameter, centre_, key_basis, none);
  rotation.values = tensor_rotation(RotationForm::kMatrix, r.values, {}, {}, basis, none);
  for (int64_t h = 0; h < kv_heads_; ++h) {
    const size_t i = static_cast<size_t>(h);
    rotation.loss.push_back({keys[i], keys[i], values[i], values[i]});
  }
  return base;
}

LayerFit::Learned LayerFit::learn(bool keys, const at::Tensor& base, RotationTensors& rotation,
                                  LayerQuantizers& quantizers) const {
  const auto with = [&](const at::Tensor& parameter) {
    RotationTensors r = rotation;
    (keys ? r.keys : r.values) = keys ? key_matrices(parameter) : parameter;
    return r;
  };
  // R = R_base exp(A - A^T) (matrices), angles = base + delta (pair angles).
  const bool angles = keys && key_form(settings_) == RotationForm::kPairAngles;
  const auto parameter_of = [&](const at::Tensor& a) {
    return angles ? base + a : at::matmul(base, at::linalg_matrix_exp(a - a.transpose(-1, -2)));
  };
  const auto tensor_of = [&](LayerQuantizers& q) -> TensorQuantizer& { return keys ? q.keys : q.values; };

  at::Tensor base_validation;
  {
    c10::NoGradGuard no_grad;
    base_validation = loss(keys, validation_, with(base), quantizers);
  }
  Learned result;
  result.parameter = base;
  result.kept.assign(static_cast<size_t>(kv_heads_), false);
  if (options_.steps <= 0) return result;

  const LayerQuantizers base_quantizers = quantizers;
  LayerQuantizers current = quantizers;
  at::Tensor a = at::zeros(angles ? base.sizes() : at::IntArrayRef{kv_heads_, head_dim_, head_dim_}, base.options());
  a.requires_grad_(true);
  at::Tensor best_a = a.detach().clone(), best_loss = base_validation.clone();
  Adam adam;
  int64_t stale = 0;
  for (int64_t step = 1; step <= options_.steps; ++step) {
    const at::Tensor fit_loss = loss(keys, fit_, with(parameter_of(a)), current).sum();
    a.mutable_grad() = at::Tensor();
    fit_loss.backward();
    {
      c10::NoGradGuard no_grad;
      adam.update(a, a.grad(), options_);
      const at::Tensor parameter = parameter_of(a);
      if (options_.refit_interval > 0 && step % options_.refit_interval == 0) {
        tensor_of(current) = refit_tensor(keys, with(parameter), options_.refit_tokens);
      }
      const at::Tensor validation_loss = loss(keys, validation_, with(parameter), current);
      const at::Tensor improved = validation_loss < best_loss;
      best_a = per_head_where(improved, a, best_a);
      best_loss = at::where(improved, validation_loss, best_loss);
      result.steps = step;
      // The one host synchronization per step: early stopping.
      stale = improved.any().item<bool>() ? 0 : stale + 1;
    }
    if (options_.patience > 0 && stale >= options_.patience) break;
  }
  a.mutable_grad() = at::Tensor();

  c10::NoGradGuard no_grad;
  // The kept matrices once in float64 (exp and the product with the base),
  // so that the stored float32 matrices are orthogonal to their own rounding.
  const at::Tensor learned =
      angles ? parameter_of(best_a)
             : at::matmul(base.to(at::kDouble), at::linalg_matrix_exp((best_a - best_a.transpose(-1, -2)).to(at::kDouble)))
                   .to(base.scalar_type());
  // Keep a head's learned rotation only when, with the quantizer refitted to
  // it on every fit token, its validation loss beats its base's.
  const TensorQuantizer learned_quantizer = refit_tensor(keys, with(learned), 0);
  LayerQuantizers trial = base_quantizers;
  tensor_of(trial) = learned_quantizer;
  const at::Tensor keep = loss(keys, validation_, with(learned), trial) < base_validation;
  result.kept = to_bools(keep);
  result.parameter = per_head_where(keep, learned, base);
  const bool all = keep.all().item<bool>(), any = keep.any().item<bool>();
  if (all) {
    tensor_of(quantizers) = learned_quantizer;
  } else if (any) {
    tensor_of(quantizers) = refit_tensor(keys, with(result.parameter), 0);
  }
  return result;
}

LayerRotationFit LayerFit::run() {
  LayerRotationFit out;
  auto phase_start = std::chrono::steady_clock::now();
  const auto lap = [&phase_start](double& seconds) {
    const auto now = std::chrono::steady_clock::now();
    seconds = std::chrono::duration<double>(now - phase_start).count();
    phase_start = now;
  };
  // 1. The fixed bases.
  for (const RotationBasis basis : options_.fixed_bases) {
    out.bases.push_back(evaluate_base(basis, key_base_parameter(basis), value_base(basis), key_basis_recorded(basis)));
  }
  // 2. The requested bases (reused when one of the fixed ones).
  const RotationBasis key_start = key_basis_recorded(options_.key_basis);
  const at::Tensor key_base = key_base_parameter(options_.key_basis);
  const at::Tensor value_start = value_base(options_.value_basis);
  const BaseRotation* start = nullptr;
  for (const BaseRotation& b : out.bases) {
    if (b.basis == options_.value_basis && b.quantizers.rotation.keys.basis.front() == key_start) start = &b;
  }
  const BaseRotation computed =
      start ? BaseRotation{} : evaluate_base(options_.value_basis, key_base, value_start, key_start);
  if (!start) start = &computed;
  lap(out.seconds.bases);

  // 3. Keys, then values with the learned key rotation in place.
  RotationTensors rotation{key_matrices(key_base), centre_, value_start};
  LayerQuantizers quantizers = start->quantizers;
  const Learned keys = learn(true, key_base, rotation, quantizers);
  lap(out.seconds.keys);
  rotation.keys = key_matrices(keys.parameter);
  {
    c10::NoGradGuard no_grad;
    for (Split* split : {&fit_, &validation_}) {
      split->learning_probabilities =
          options_.value_learning_probabilities == ValueProbabilities::kExactKeys
              ? split->objective.exact_probabilities()
              : split->objective.probabilities(dequantized_keys(*split, rotation, quantizers)).detach();
    }
  }
  const Learned values = learn(false, value_start, rotation, quantizers);
  lap(out.seconds.values);
  rotation.values = values.parameter;

  // 4. The final quantizers and the record.
  out.learned = refit(rotation, 0, options_.logit_statistic);
  std::vector<double> key_final, value_final;
  losses_of(rotation, out.learned, key_final, value_final);
  LayerRotation& record = out.learned.rotation;
  record.keys = tensor_rotation(key_form(settings_), rotation.keys, keys.parameter, centre_, key_start, keys.kept);
  record.values = tensor_rotation(RotationForm::kMatrix, rotation.values, {}, {}, options_.value_basis, values.kept);
  for (int64_t h = 0; h < kv_heads_; ++h) {
    const HeadRotationLoss& base = start->quantizers.rotation.loss[static_cast<size_t>(h)];
    const size_t i = static_cast<size_t>(h);
    record.loss.push_back({base.key_base, key_final[i], base.value_base, value_final[i]});
  }
  out.key_steps = keys.steps;
  out.value_steps = values.steps;
  lap(out.seconds.final);
  return out;
}

}  // namespace

RotationSettings rotation_settings(const QuantizerSettings& settings, const RotationOptions& options) {
  RotationSettings r;
  r.keys = key_form(settings);
  r.values = RotationForm::kMatrix;
  r.key_centred = r.keys == RotationForm::kMatrix && options.centre_keys;
  r.folded = false;
  r.key_basis = options.key_basis;
  r.value_basis = options.value_basis;
  r.key_kl_weight = options.key_kl_weight;
  r.key_output_weight = options.key_output_weight;
  r.value_output_weight = options.value_output_weight;
  r.steps = options.steps;
  r.learning_rate = options.learning_rate;
  r.gradient = options.gradient.mode == GradientMode::kSmoothed ? "smoothed" : "straight_through";
  r.last_queries = options.last_queries;
  return r;
}

at::Tensor quantize_through_rotation(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                                     const TensorQuantizer& quantizer, const at::Tensor& x,
                                     const at::Tensor& matrices, const at::Tensor& centre,
                                     const FakeQuantizeOptions& options) {
  const at::Tensor shifted = centre.defined() ? x - centre : x;
  const at::Tensor quantized = fake_quantize(settings, tensor, quantizer, rotate(shifted, matrices), options).values;
  const at::Tensor back = unrotate(quantized, matrices);
  return centre.defined() ? back + centre : back;
}

at::Tensor base_matrices(RotationBasis basis, bool keys, const RotationLayerData& data, const at::Tensor& token_mass,
                         uint64_t seed) {
  const int64_t kv_heads = data.keys.size(1), dim = data.keys.size(3);
  const at::TensorOptions options = data.keys.options();
  switch (basis) {
    case RotationBasis::kIdentity:
      return at::eye(dim, options).expand({kv_heads, dim, dim}).clone();
    case RotationBasis::kHadamard:
      return hadamard_matrix(dim, options).expand({kv_heads, dim, dim}).clone();
    case RotationBasis::kRandom:
      return random_orthogonal(kv_heads, dim, seed, options);
    case RotationBasis::kEigen: {
      const at::Tensor hadamard = hadamard_matrix(dim, options);  // checks dim before the eigen work
      const at::Tensor eigen =
          keys ? key_eigenbasis(data.queries, kv_heads) : value_eigenbasis(data.values, token_mass);
      return at::matmul(eigen, hadamard);
    }
  }
  throw std::invalid_argument("base_matrices: unknown basis");
}

LayerRotationFit fit_layer_rotation(const QuantizerSettings& settings, const RotationLayerData& fit,
                                    const RotationLayerData& validation, const RotationOptions& options) {
  LayerFit layer(settings, fit, validation, options);
  return layer.run();
}

}  // namespace kvforge
