#include "formats/artifact.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <regex>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "formats/fingerprint_attributes.h"
#include "formats/hdf5_file.h"
#include "formats/input_error.h"
#include "formats/remove_on_failure.h"

namespace kvforge {
namespace {

using hdf5::Dataset;
using hdf5::File;
using hdf5::Group;
using hdf5::Location;

// --- the schema's names: the writer, the reader and the rules all use these -------
// (docs/artifact.md lists them; the model fingerprint's and the capture
// provenance's attribute names are formats/fingerprint_attributes.cpp's).
namespace name {
constexpr const char* kSchemaValue = "kvforge.artifact";
// Root attributes.
constexpr const char* kSchema = "schema";
constexpr const char* kSchemaVersion = "schema_version";
constexpr const char* kToolVersion = "tool_version";
constexpr const char* kCreatedUtc = "created_utc";
constexpr const char* kCommandLine = "command_line";
// Groups.
constexpr const char* kModel = "model";
constexpr const char* kCalibration = "calibration";
constexpr const char* kSources = "sources";
constexpr const char* kConfigs = "configs";
constexpr const char* kLayers = "layers";
constexpr const char* kKeys = "keys";
constexpr const char* kValues = "values";
// /calibration and /calibration/sources/<k>.
constexpr const char* kCalibrationTokens = "calibration_tokens";
constexpr const char* kStoreFile = "store_file";
constexpr const char* kDataTokens = "data_tokens";
constexpr const char* kSamples = "samples";
constexpr const char* kSeqLen = "seq_len";
// /configs.
constexpr const char* kNames = "names";
// /configs/<name>: shared settings.
constexpr const char* kMethod = "method";
constexpr const char* kBits = "bits";
constexpr const char* kKeysPreRope = "keys_pre_rope";
constexpr const char* kSinkTokens = "sink_tokens";
constexpr const char* kResidualTokens = "residual_tokens";
constexpr const char* kFisherWeighted = "fisher_weighted";
constexpr const char* kVersion1QNorm = "q_norm";  // version 1 only: one bool for both tensors
constexpr const char* kEffectiveBits = "effective_bits";
// /configs/<name>: per-tensor settings, stored as "<keys|values>_<name>".
constexpr const char* kGrouping = "grouping";
constexpr const char* kGroup = "group";
constexpr const char* kNonUniform = "non_uniform";
constexpr const char* kOutlierFraction = "outlier_fraction";
constexpr const char* kOutlierRule = "outlier_rule";    // version 2
constexpr const char* kResidualRule = "residual_rule";  // version 2
constexpr const char* kQNorm = "q_norm";                // version 2
// /configs/<name>/layers/<i>/<keys|values>.
constexpr const char* kClipRatio = "clip_ratio";
constexpr const char* kOutlierTau = "outlier_tau";
constexpr const char* kGrid = "grid";
constexpr const char* kEncodeGrid = "encode_grid";  // version 2
constexpr const char* kChannelScale = "channel_scale";
constexpr const char* kChannelOffset = "channel_offset";
constexpr const char* kOutlierLow = "outlier_low";
constexpr const char* kOutlierHigh = "outlier_high";
// Version 3: /configs/<name>/rotation, how the rotations were made; per-kind
// attributes stored as "<keys|values>_<name>" (form, basis).
constexpr const char* kRotation = "rotation";  // also the group /configs/<name>/layers/<i>/rotation
constexpr const char* kForm = "form";
constexpr const char* kBasis = "basis";        // also the per-head names of a tensor's rotation group
constexpr const char* kKeyCentred = "key_centred";
constexpr const char* kFolded = "folded";
constexpr const char* kGradient = "gradient";
// Version 3: /configs/<name>/layers/<i>/rotation/<keys|values>.
constexpr const char* kMatrix = "matrix";
constexpr const char* kAngles = "angles";
constexpr const char* kCentre = "centre";
constexpr const char* kLearned = "learned";
}  // namespace name

// /configs/<name>/layers/<i>: the calibration statistics, all float64.
struct StatField {
  const char* name;
  double LayerCalibrationStats::*member;
  bool fraction;  // in [0, 1], else >= 0
};
constexpr std::array<StatField, 5> kStatFields = {{
    {"key_relative_mse", &LayerCalibrationStats::key_relative_mse, false},
    {"value_relative_mse", &LayerCalibrationStats::value_relative_mse, false},
    {"key_outlier_fraction", &LayerCalibrationStats::key_outlier_fraction, true},
    {"value_outlier_fraction", &LayerCalibrationStats::value_outlier_fraction, true},
    {"logit_relative_mse", &LayerCalibrationStats::logit_relative_mse, false},
}};

// The [Hkv, D] datasets of a tensor group.
struct HeadArrayField {
  const char* name;
  Float32Array TensorQuantizer::*member;
};
constexpr std::array<HeadArrayField, 4> kHeadArrayFields = {{
    {name::kChannelScale, &TensorQuantizer::channel_scale},
    {name::kChannelOffset, &TensorQuantizer::channel_offset},
    {name::kOutlierLow, &TensorQuantizer::outlier_low},
    {name::kOutlierHigh, &TensorQuantizer::outlier_high},
}};

// /configs/<name>/rotation: the fit's provenance, float64 (finite, >= 0) and int64 (>= least).
struct RotationRealField {
  const char* name;
  double RotationSettings::*member;
};
constexpr std::array<RotationRealField, 4> kRotationRealFields = {{
    {"key_kl_weight", &RotationSettings::key_kl_weight},
    {"key_output_weight", &RotationSettings::key_output_weight},
    {"value_output_weight", &RotationSettings::value_output_weight},
    {"learning_rate", &RotationSettings::learning_rate},
}};
struct RotationCountField {
  const char* name;
  int64_t RotationSettings::*member;
  int64_t least;
};
constexpr std::array<RotationCountField, 4> kRotationCountFields = {{
    {"steps", &RotationSettings::steps, 0},
    {"last_queries", &RotationSettings::last_queries, 1},
    {"fit_samples", &RotationSettings::fit_samples, 0},
    {"validation_samples", &RotationSettings::validation_samples, 0},
}};
// The gradients formats/kv_rotation.h names for RotationSettings::gradient.
constexpr std::array<std::string_view, 2> kGradients = {"straight_through", "smoothed"};

// /configs/<name>/layers/<i>/rotation: the per-head validation losses, float64 [Hkv] each.
struct LossField {
  const char* name;
  double HeadRotationLoss::*member;
};
constexpr std::array<LossField, 4> kLossFields = {{
    {"loss_key_base", &HeadRotationLoss::key_base},
    {"loss_key_learned", &HeadRotationLoss::key_learned},
    {"loss_value_base", &HeadRotationLoss::value_base},
    {"loss_value_learned", &HeadRotationLoss::value_learned},
}};

// Every value of each enum, to list the alternatives in messages (the names
// themselves come from formats/quantizer_config.cpp's tables).
constexpr std::array<QuantMethod, 4> kMethods = {QuantMethod::kKvquant, QuantMethod::kKivi, QuantMethod::kInt2Rot,
                                                 QuantMethod::kRtn};
constexpr std::array<Grouping, 4> kGroupings = {Grouping::kPerToken, Grouping::kPerChannelTokens,
                                                Grouping::kPerChannelOffline, Grouping::kPerTokenAllHeads};
constexpr std::array<Grouping, 3> kVersion1Groupings = {Grouping::kPerToken, Grouping::kPerChannelTokens,
                                                        Grouping::kPerChannelOffline};
constexpr std::array<OutlierRule, 4> kOutlierRules = {OutlierRule::kNone, OutlierRule::kChannelThresholds,
                                                      OutlierRule::kTokenTopBottom, OutlierRule::kTokenTau};
constexpr std::array<ResidualRule, 2> kResidualRules = {ResidualRule::kSliding, ResidualRule::kBlockFlush};
constexpr std::array<QNorm, 3> kQNorms = {QNorm::kNone, QNorm::kAffine, QNorm::kIterated};
constexpr std::array<RotationForm, 3> kRotationForms = {RotationForm::kNone, RotationForm::kMatrix,
                                                        RotationForm::kPairAngles};
constexpr std::array<RotationBasis, 4> kBases = {RotationBasis::kIdentity, RotationBasis::kHadamard,
                                                 RotationBasis::kEigen, RotationBasis::kRandom};
// The first version that stores rotations.
constexpr int64_t kFirstRotationVersion = 3;

// Inlier thresholds of per-channel-offline keys may map this far outside
// [-1, 1] through (x - offset) / scale: float32 rounding of fitted values.
constexpr double kThresholdTolerance = 1e-4;
// Contexts are stored as float64; integers up to 2^53 are exact there.
constexpr double kMaxExactInteger = 9007199254740992.0;

enum class Kind { kKeys, kValues };
constexpr std::array<Kind, 2> kKinds = {Kind::kKeys, Kind::kValues};
std::string kind_name(Kind kind) { return kind == Kind::kKeys ? name::kKeys : name::kValues; }

const TensorQuantizerSettings& settings_of(const QuantizerSettings& settings, Kind kind) {
  return kind == Kind::kKeys ? settings.keys : settings.values;
}
TensorQuantizerSettings& settings_of(QuantizerSettings& settings, Kind kind) {
  return kind == Kind::kKeys ? settings.keys : settings.values;
}
const TensorQuantizer& quantizer_of(const LayerQuantizers& layer, Kind kind) {
  return kind == Kind::kKeys ? layer.keys : layer.values;
}
TensorQuantizer& quantizer_of(LayerQuantizers& layer, Kind kind) {
  return kind == Kind::kKeys ? layer.keys : layer.values;
}
RotationForm form_of(const RotationSettings& rotation, Kind kind) {
  return kind == Kind::kKeys ? rotation.keys : rotation.values;
}
RotationForm& form_of(RotationSettings& rotation, Kind kind) {
  return kind == Kind::kKeys ? rotation.keys : rotation.values;
}
RotationBasis& basis_of(RotationSettings& rotation, Kind kind) {
  return kind == Kind::kKeys ? rotation.key_basis : rotation.value_basis;
}
RotationBasis basis_of(const RotationSettings& rotation, Kind kind) {
  return kind == Kind::kKeys ? rotation.key_basis : rotation.value_basis;
}
const TensorRotation& rotation_of(const LayerRotation& layer, Kind kind) {
  return kind == Kind::kKeys ? layer.keys : layer.values;
}
TensorRotation& rotation_of(LayerRotation& layer, Kind kind) { return kind == Kind::kKeys ? layer.keys : layer.values; }

// --- object paths, as error messages and docs/artifact.md name them -----------

std::string root_child(const char* name) { return std::string("/") + name; }
std::string config_object(const std::string& config) { return root_child(name::kConfigs) + "/" + config; }
std::string layer_object(const std::string& config, size_t layer) {
  return config_object(config) + "/" + name::kLayers + "/" + std::to_string(layer);
}
std::string tensor_object(const std::string& config, size_t layer, Kind kind) {
  return layer_object(config, layer) + "/" + kind_name(kind);
}
std::string rotation_object(const std::string& config) { return config_object(config) + "/" + name::kRotation; }
std::string layer_rotation_object(const std::string& config, size_t layer) {
  return layer_object(config, layer) + "/" + name::kRotation;
}
std::string tensor_rotation_object(const std::string& config, size_t layer, Kind kind) {
  return layer_rotation_object(config, layer) + "/" + kind_name(kind);
}
// "/configs/x" + "bits" -> "/configs/x@bits"; "/" + "schema" -> "/@schema".
std::string attribute_object(const std::string& object, const std::string& attribute) {
  return object + "@" + attribute;
}
// "keys_grouping": a per-tensor setting of /configs/<name>.
std::string setting_attribute(Kind kind, const char* name) { return kind_name(kind) + "_" + name; }

// --- text for messages -----------------------------------------------------------

std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", value);
  return text;
}

template <class Dims>
std::string shape_text(const Dims& dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

// "[1, 5]": the index of flat element `flat` of a row-major [rows, columns] array.
std::string element_text(size_t flat, int64_t columns) {
  const auto c = static_cast<size_t>(columns);
  return "[" + std::to_string(flat / c) + ", " + std::to_string(flat % c) + "]";
}

// --- the rules, shared by the writer and the reader ------------------------------

// Throws InputError(file, object, what): what is written or read breaks a rule.
class Rules {
 public:
  explicit Rules(std::string file) : file_(std::move(file)) {}
  [[noreturn]] void fail(const std::string& object, const std::string& what) const {
    throw InputError(file_, object, what);
  }

 private:
  std::string file_;
};

void check_model(const Rules& rules, const ModelFingerprint& model) {
  const std::string object = root_child(name::kModel);
  const std::array<std::pair<const char*, int64_t>, 6> positive = {{
      {"num_layers", model.num_layers},
      {"num_heads", model.num_heads},
      {"num_kv_heads", model.num_kv_heads},
      {"head_dim", model.head_dim},
      {"hidden_size", model.hidden_size},
      {"vocab_size", model.vocab_size},
  }};
  for (const auto& [field, value] : positive) {
    if (value <= 0)
      rules.fail(attribute_object(object, field), "expected a positive integer, got " + std::to_string(value));
  }
  if (model.num_heads % model.num_kv_heads != 0) {
    rules.fail(attribute_object(object, "num_kv_heads"), "expected a divisor of num_heads (" +
                                                             std::to_string(model.num_heads) + "), got " +
                                                             std::to_string(model.num_kv_heads));
  }
}

void check_root(const Rules& rules, const Artifact& artifact) {
  static const std::regex kUtc(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)");
  if (!std::regex_match(artifact.created_utc, kUtc)) {
    rules.fail(attribute_object("/", name::kCreatedUtc),
               "expected YYYY-MM-DDTHH:MM:SSZ, got \"" + artifact.created_utc + "\"");
  }
  if (artifact.tool_version.empty()) {
    rules.fail(attribute_object("/", name::kToolVersion), "expected the kvforge version, got \"\"");
  }
}

void check_calibration(const Rules& rules, const CalibrationProvenance& calibration) {
  const std::string object = root_child(name::kCalibration);
  if (calibration.calibration_tokens <= 0) {
    rules.fail(attribute_object(object, name::kCalibrationTokens),
               "expected a positive integer, got " + std::to_string(calibration.calibration_tokens));
  }
  const std::string sources = object + "/" + name::kSources;
  if (calibration.sources.empty()) rules.fail(sources, "expected at least one source (group 0)");
  for (size_t k = 0; k < calibration.sources.size(); ++k) {
    const CaptureProvenance& source = calibration.sources[k];
    const std::string source_object = sources + "/" + std::to_string(k);
    if (source.data_tokens < 0) {
      rules.fail(attribute_object(source_object, name::kDataTokens), "expected a non-negative integer");
    }
    if (source.samples <= 0) rules.fail(attribute_object(source_object, name::kSamples), "expected a positive integer");
    if (source.seq_len <= 0) rules.fail(attribute_object(source_object, name::kSeqLen), "expected a positive integer");
  }
}

std::string names_object() { return attribute_object(root_child(name::kConfigs), name::kNames); }

void check_name(const Rules& rules, const std::string& config) {
  if (config.empty() || config == "." || config == ".." || config.find('/') != std::string::npos ||
      config.find('\0') != std::string::npos) {
    rules.fail(names_object(),
               "expected configuration names without '/' other than \".\" and \"..\", got \"" + config + "\"");
  }
}

// Whether a tensor with outliers may find them by `rule` under its grouping
// (docs/artifact.md, "Outliers").
bool outlier_rule_fits(OutlierRule rule, Grouping grouping) {
  switch (rule) {
    case OutlierRule::kNone:
      return false;
    case OutlierRule::kChannelThresholds:
      return grouping == Grouping::kPerChannelOffline;
    case OutlierRule::kTokenTopBottom:
      return is_runtime_grouping(grouping);
    case OutlierRule::kTokenTau:
      return is_runtime_grouping(grouping) && grouping != Grouping::kPerTokenAllHeads;
  }
  return false;
}

// The rules outlier_rule_fits accepts for a grouping, for messages.
std::string outlier_rules_for(Grouping grouping) {
  switch (grouping) {
    case Grouping::kPerChannelOffline:
      return std::string(outlier_rule_name(OutlierRule::kChannelThresholds));
    case Grouping::kPerTokenAllHeads:
      return std::string(outlier_rule_name(OutlierRule::kTokenTopBottom));
    default:
      return std::string(outlier_rule_name(OutlierRule::kTokenTopBottom)) + " or " +
             std::string(outlier_rule_name(OutlierRule::kTokenTau));
  }
}

void check_tensor_settings(const Rules& rules, const std::string& object, Kind kind,
                           const QuantizerSettings& settings) {
  const TensorQuantizerSettings& s = settings_of(settings, kind);
  auto at = [&](const char* setting) { return attribute_object(object, setting_attribute(kind, setting)); };
  auto is = [&](const char* setting, std::string_view value) {
    return setting_attribute(kind, setting) + " is " + std::string(value);
  };
  if (!parse_grouping(grouping_name(s.grouping))) rules.fail(at(name::kGrouping), "expected a grouping");
  const std::string grouping = std::string(grouping_name(s.grouping));

  // group: unused (0) by per_token_all_heads, unused (>= 0, kvforge writes 0)
  // by per_channel_offline, a positive count otherwise.
  if (s.grouping == Grouping::kPerTokenAllHeads) {
    if (s.group != 0) {
      rules.fail(at(name::kGroup), "expected 0 (unused: " + grouping + " scales each token over all KV heads), got " +
                                       std::to_string(s.group));
    }
  } else {
    const int64_t least = s.grouping == Grouping::kPerChannelOffline ? 0 : 1;
    if (s.group < least) {
      rules.fail(at(name::kGroup), std::string(least == 0 ? "expected >= 0" : "expected a positive integer") +
                                       ", got " + std::to_string(s.group));
    }
  }

  if (!std::isfinite(s.outlier_fraction) || s.outlier_fraction < 0 || s.outlier_fraction >= 1) {
    rules.fail(at(name::kOutlierFraction), "expected a fraction in [0, 1), got " + number(s.outlier_fraction));
  }

  // Outlier rule: none exactly without outliers; otherwise one its grouping can apply.
  if (!parse_outlier_rule(outlier_rule_name(s.outlier_rule))) rules.fail(at(name::kOutlierRule), "expected a rule");
  const std::string rule = std::string(outlier_rule_name(s.outlier_rule));
  const std::string fraction = is(name::kOutlierFraction, number(s.outlier_fraction));
  if (s.outlier_fraction == 0 && s.outlier_rule != OutlierRule::kNone) {
    rules.fail(at(name::kOutlierRule), "expected " + std::string(outlier_rule_name(OutlierRule::kNone)) + " when " +
                                           fraction + ", got " + rule);
  }
  if (s.outlier_fraction > 0 && !outlier_rule_fits(s.outlier_rule, s.grouping)) {
    rules.fail(at(name::kOutlierRule), "expected " + outlier_rules_for(s.grouping) + " when " + fraction +
                                           " (> 0) and " + is(name::kGrouping, grouping) + ", got " + rule);
  }

  // Residual rule: block_flush flushes whole blocks of residual_tokens,
  // which per_channel_tokens groups must tile.
  if (!parse_residual_rule(residual_rule_name(s.residual_rule))) rules.fail(at(name::kResidualRule), "expected a rule");
  if (s.residual_rule == ResidualRule::kBlockFlush) {
    const std::string block_flush = is(name::kResidualRule, residual_rule_name(s.residual_rule));
    if (settings.residual_tokens <= 0) {
      rules.fail(at(name::kResidualRule), "expected residual_tokens > 0 when " + block_flush + ", got " +
                                              std::to_string(settings.residual_tokens));
    }
    if (s.grouping == Grouping::kPerChannelTokens && settings.residual_tokens % s.group != 0) {
      rules.fail(at(name::kResidualRule), "expected residual_tokens (" + std::to_string(settings.residual_tokens) +
                                              ") a multiple of " + setting_attribute(kind, name::kGroup) + " (" +
                                              std::to_string(s.group) + ") when " + block_flush + " and " +
                                              is(name::kGrouping, grouping));
    }
  }

  // Q-Norm corrects fitted grids only.
  if (!parse_q_norm(q_norm_name(s.q_norm))) rules.fail(at(name::kQNorm), "expected a Q-Norm");
  if (!s.non_uniform && s.q_norm != QNorm::kNone) {
    rules.fail(at(name::kQNorm), "expected " + std::string(q_norm_name(QNorm::kNone)) + " when " +
                                     is(name::kNonUniform, "0") + " (Q-Norm corrects fitted grids), got " +
                                     std::string(q_norm_name(s.q_norm)));
  }
}

void check_settings(const Rules& rules, const std::string& object, const QuantizerSettings& settings) {
  if (!parse_method(method_name(settings.method)))
    rules.fail(attribute_object(object, name::kMethod), "expected a method");
  if (settings.bits < 2 || settings.bits > 4) {
    rules.fail(attribute_object(object, name::kBits), "expected 2, 3 or 4, got " + std::to_string(settings.bits));
  }
  if (settings.sink_tokens < 0) {
    rules.fail(attribute_object(object, name::kSinkTokens),
               "expected >= 0, got " + std::to_string(settings.sink_tokens));
  }
  if (settings.residual_tokens < 0) {
    rules.fail(attribute_object(object, name::kResidualTokens),
               "expected >= 0, got " + std::to_string(settings.residual_tokens));
  }
  for (const Kind kind : kKinds) check_tensor_settings(rules, object, kind, settings);
}

void check_effective_bits(const Rules& rules, const std::string& object,
                          const std::vector<std::pair<int64_t, double>>& effective_bits) {
  if (effective_bits.empty()) rules.fail(object, "expected at least one (context, bits) row");
  for (size_t i = 0; i < effective_bits.size(); ++i) {
    const auto& [context, bits] = effective_bits[i];
    const std::string row = "row " + std::to_string(i);
    if (context <= 0 || static_cast<double>(context) > kMaxExactInteger) {
      rules.fail(object, "expected positive contexts, " + row + " has " + std::to_string(context));
    }
    if (i > 0 && context <= effective_bits[i - 1].first) {
      rules.fail(object, "expected strictly ascending contexts, " + row + " has " + std::to_string(context) +
                             " after " + std::to_string(effective_bits[i - 1].first));
    }
    if (!std::isfinite(bits) || bits <= 0) {
      rules.fail(object, "expected finite positive bits, " + row + " has " + number(bits));
    }
  }
}

// Shape [num_kv_heads, head_dim], as many values, all finite.
void check_head_array(const Rules& rules, const std::string& object, const Float32Array& array,
                      const ModelFingerprint& model, const std::string& required_because) {
  if (array.shape.empty() && array.values.empty()) rules.fail(object, "missing: required " + required_because);
  const std::vector<int64_t> expected = {model.num_kv_heads, model.head_dim};
  if (array.shape != expected) {
    rules.fail(object, "expected shape " + shape_text(expected) + " ([num_kv_heads, head_dim] of /model), got " +
                           shape_text(array.shape));
  }
  if (array.values.size() != static_cast<size_t>(model.num_kv_heads * model.head_dim)) {
    rules.fail(object, "expected " + std::to_string(model.num_kv_heads * model.head_dim) + " values for shape " +
                           shape_text(expected) + ", got " + std::to_string(array.values.size()));
  }
  for (size_t i = 0; i < array.values.size(); ++i) {
    if (!std::isfinite(array.values[i])) {
      rules.fail(object, "expected finite values, element " + element_text(i, model.head_dim) + " is " +
                             number(array.values[i]));
    }
  }
}

void check_absent(const Rules& rules, const std::string& object, bool present, const std::string& why) {
  if (present) rules.fail(object, "expected none: " + why);
}
bool present(const Float32Array& array) { return !array.empty() || !array.shape.empty(); }

// grid and encode_grid: 2^bits finite, strictly ascending levels.
void check_levels(const Rules& rules, const std::string& object, const std::vector<float>& levels, int bits) {
  const size_t count = size_t{1} << bits;
  if (levels.size() != count) {
    rules.fail(object, "expected 2^bits = " + std::to_string(count) + " levels (bits is " + std::to_string(bits) +
                           "), got " + std::to_string(levels.size()));
  }
  for (size_t i = 0; i < count; ++i) {
    if (!std::isfinite(levels[i])) {
      rules.fail(object, "expected finite levels, element [" + std::to_string(i) + "] is " + number(levels[i]));
    }
    if (i > 0 && !(levels[i] > levels[i - 1])) {
      rules.fail(object, "expected strictly ascending levels, element [" + std::to_string(i) + "] (" +
                             number(levels[i]) + ") is not above element [" + std::to_string(i - 1) + "] (" +
                             number(levels[i - 1]) + ")");
    }
  }
}

// Which conditional datasets a tensor group holds under these settings.
struct Expected {
  bool grid, encode_grid, channel, thresholds;
};
Expected expected_datasets(const TensorQuantizerSettings& s) {
  return {.grid = s.non_uniform,
          .encode_grid = s.q_norm == QNorm::kAffine,
          .channel = s.grouping == Grouping::kPerChannelOffline,
          .thresholds = s.outlier_rule == OutlierRule::kChannelThresholds};
}

// Why a conditional dataset must be absent, as the reader and the writer say it.
std::string why_no_grid(Kind kind) {
  return setting_attribute(kind, name::kNonUniform) + " is 0 (uniform integer levels)";
}
std::string why_no_encode_grid(Kind kind, const TensorQuantizerSettings& s) {
  return setting_attribute(kind, name::kQNorm) + " is " + std::string(q_norm_name(s.q_norm)) +
         " (codes are the nearest level of " + name::kGrid + ")";
}
std::string why_no_channel_arrays(Kind kind, const TensorQuantizerSettings& s) {
  return setting_attribute(kind, name::kGrouping) + " is " + std::string(grouping_name(s.grouping)) +
         " (channel scales belong to " + std::string(grouping_name(Grouping::kPerChannelOffline)) + ")";
}
std::string why_no_thresholds(Kind kind, const TensorQuantizerSettings& s) {
  return setting_attribute(kind, name::kOutlierRule) + " is " + std::string(outlier_rule_name(s.outlier_rule)) +
         " (thresholds belong to " + std::string(outlier_rule_name(OutlierRule::kChannelThresholds)) + ")";
}

void check_tensor(const Rules& rules, const std::string& object, Kind kind, const QuantizerSettings& settings,
                  const TensorQuantizer& q, const ModelFingerprint& model) {
  const TensorQuantizerSettings& s = settings_of(settings, kind);
  const Expected expected = expected_datasets(s);
  auto child = [&](const char* dataset) { return object + "/" + dataset; };
  auto when = [&](const char* setting, std::string_view value) {
    return "when " + setting_attribute(kind, setting) + " is " + std::string(value);
  };

  // Levels: grid for non-uniform settings; encode_grid for Q-Norm affine.
  if (expected.grid) {
    check_levels(rules, child(name::kGrid), q.grid, settings.bits);
  } else {
    check_absent(rules, child(name::kGrid), !q.grid.empty(), why_no_grid(kind));
  }
  if (expected.encode_grid) {
    if (q.encode_grid.empty()) {
      rules.fail(child(name::kEncodeGrid), "missing: required " + when(name::kQNorm, q_norm_name(s.q_norm)));
    }
    check_levels(rules, child(name::kEncodeGrid), q.encode_grid, settings.bits);
  } else {
    check_absent(rules, child(name::kEncodeGrid), !q.encode_grid.empty(), why_no_encode_grid(kind, s));
  }

  // Per-channel scales and offsets, fitted offline.
  const std::string scale = child(name::kChannelScale);
  const std::string offset = child(name::kChannelOffset);
  if (expected.channel) {
    const std::string because = when(name::kGrouping, grouping_name(s.grouping));
    check_head_array(rules, scale, q.channel_scale, model, because);
    check_head_array(rules, offset, q.channel_offset, model, because);
    for (size_t i = 0; i < q.channel_scale.values.size(); ++i) {
      if (!(q.channel_scale.values[i] > 0)) {
        rules.fail(scale, "expected values > 0, element " + element_text(i, model.head_dim) + " is " +
                              number(q.channel_scale.values[i]));
      }
    }
    const auto& v = q.channel_scale.values;
    if (std::all_of(v.begin(), v.end(), [](float x) { return x == 1.0f; })) {
      rules.fail(scale, "expected fitted scales, got 1.0 for every channel (never fitted?)");
    }
  } else {
    check_absent(rules, scale, present(q.channel_scale), why_no_channel_arrays(kind, s));
    check_absent(rules, offset, present(q.channel_offset), why_no_channel_arrays(kind, s));
  }

  // Outlier thresholds: channel_thresholds only (per_channel_offline with
  // outliers, so the scales above are there too).
  const std::string low = child(name::kOutlierLow);
  const std::string high = child(name::kOutlierHigh);
  if (expected.thresholds) {
    const std::string because = when(name::kOutlierRule, outlier_rule_name(s.outlier_rule));
    check_head_array(rules, low, q.outlier_low, model, because);
    check_head_array(rules, high, q.outlier_high, model, because);
    for (size_t i = 0; i < q.outlier_low.values.size(); ++i) {
      const double lo = q.outlier_low.values[i];
      const double hi = q.outlier_high.values[i];
      const std::string at = "element " + element_text(i, model.head_dim);
      if (lo > hi) rules.fail(low, "expected low <= high, " + at + " has " + number(lo) + " > " + number(hi));
      const double s_i = q.channel_scale.values[i];
      const double o_i = q.channel_offset.values[i];
      const double lo_n = (lo - o_i) / s_i;
      const double hi_n = (hi - o_i) / s_i;
      if (lo_n < -1 - kThresholdTolerance) {
        rules.fail(low, "expected (low - channel_offset) / channel_scale >= -1 (inliers inside the grid's range), " +
                            at + " maps to " + number(lo_n));
      }
      if (hi_n > 1 + kThresholdTolerance) {
        rules.fail(high, "expected (high - channel_offset) / channel_scale <= 1 (inliers inside the grid's range), " +
                             at + " maps to " + number(hi_n));
      }
    }
  } else {
    check_absent(rules, low, present(q.outlier_low), why_no_thresholds(kind, s));
    check_absent(rules, high, present(q.outlier_high), why_no_thresholds(kind, s));
  }

  // tau: > 0 exactly for token_tau, otherwise unused (0).
  const std::string tau = attribute_object(object, name::kOutlierTau);
  if (!std::isfinite(q.outlier_tau)) rules.fail(tau, "expected a finite value, got " + number(q.outlier_tau));
  if (s.outlier_rule == OutlierRule::kTokenTau) {
    if (!(q.outlier_tau > 0)) {
      rules.fail(tau, "expected > 0 " + when(name::kOutlierRule, outlier_rule_name(s.outlier_rule)) + ", got " +
                          number(q.outlier_tau));
    }
  } else if (q.outlier_tau != 0) {
    rules.fail(tau, "expected 0 (unused: " + setting_attribute(kind, name::kOutlierRule) + " is " +
                        std::string(outlier_rule_name(s.outlier_rule)) + "), got " + number(q.outlier_tau));
  }

  // Clipping: runtime groupings only.
  const std::string clip = attribute_object(object, name::kClipRatio);
  if (!std::isfinite(q.clip_ratio) || q.clip_ratio <= 0 || q.clip_ratio > 1) {
    rules.fail(clip, "expected a ratio in (0, 1], got " + number(q.clip_ratio));
  }
  if (!is_runtime_grouping(s.grouping) && q.clip_ratio != 1.0f) {
    rules.fail(clip, "expected 1 (unused: " + setting_attribute(kind, name::kGrouping) + " is " +
                         std::string(grouping_name(s.grouping)) + ", scales are fitted offline), got " +
                         number(q.clip_ratio));
  }
}

void check_stats(const Rules& rules, const std::string& object, const LayerCalibrationStats& stats) {
  for (const StatField& field : kStatFields) {
    const double value = stats.*field.member;
    if (!std::isfinite(value) || value < 0 || (field.fraction && value > 1)) {
      rules.fail(
          attribute_object(object, field.name),
          std::string("expected a finite value ") + (field.fraction ? "in [0, 1]" : ">= 0") + ", got " + number(value));
    }
  }
}

// Per-token groups tile the head: min(group, head_dim) channels divide head_dim.
void check_groups_fit_heads(const Rules& rules, const std::string& object, const QuantizerSettings& settings,
                            const ModelFingerprint& model) {
  for (const Kind kind : kKinds) {
    const TensorQuantizerSettings& s = settings_of(settings, kind);
    if (s.grouping != Grouping::kPerToken || s.group >= model.head_dim || model.head_dim % s.group == 0) continue;
    rules.fail(attribute_object(object, setting_attribute(kind, name::kGroup)),
               "expected a divisor of head_dim (" + std::to_string(model.head_dim) + ") or >= head_dim, got " +
                   std::to_string(s.group));
  }
}

// --- the rules of rotations (version 3) -----------------------------------------

// A stored matrix is the float32 rounding R~ = R + E of an orthogonal R, with
// |E_ij| <= u |R_ij| (u = 2^-24, round to nearest). Then
// (R~^T R~ - I)_ij = (R^T E + E^T R + E^T E)_ij, and
// |(R^T E)_ij| <= u sum_k |R_ki| |R_kj| <= u (Cauchy-Schwarz over unit
// columns), so every entry is within 2u + u^2 and the Frobenius norm within
// (2u + u^2) D. Allowed: twice that bound, leaving as much again for the
// float32 arithmetic the fit may have computed R in. At D = 128: 3.05e-5;
// what rounding alone typically gives is ~sqrt(D) u = 7e-7.
double orthogonality_tolerance(int64_t head_dim) {
  const double u = std::ldexp(1.0, -24);
  return 2 * (2 * u + u * u) * static_cast<double>(head_dim);
}

// ||R^T R - I||_F in float64 of the D x D row-major matrix at r.
double distance_from_orthogonal(const float* r, int64_t d) {
  const auto n = static_cast<size_t>(d);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i; j < n; ++j) {
      double dot = 0;
      for (size_t k = 0; k < n; ++k) dot += static_cast<double>(r[k * n + i]) * static_cast<double>(r[k * n + j]);
      const double e = dot - (i == j ? 1.0 : 0.0);
      sum += (i == j ? 1 : 2) * e * e;  // the matrix is symmetric: off-diagonal entries twice
    }
  }
  return std::sqrt(sum);
}

std::string form_text(RotationForm form) { return std::string(rotation_form_name(form)); }

void check_rotation_settings(const Rules& rules, const std::string& config_name, const RotationSettings& r,
                             const QuantizerSettings& settings, const ModelFingerprint& model) {
  const std::string object = rotation_object(config_name);
  auto at = [&](const std::string& attribute) { return attribute_object(object, attribute); };
  const std::string keys_form = setting_attribute(Kind::kKeys, name::kForm);
  const std::string values_form = setting_attribute(Kind::kValues, name::kForm);
  for (const Kind kind : kKinds) {
    if (!parse_rotation_form(rotation_form_name(form_of(r, kind)))) {
      rules.fail(at(setting_attribute(kind, name::kForm)), "expected a rotation form");
    }
    if (!parse_basis(basis_name(basis_of(r, kind)))) {
      rules.fail(at(setting_attribute(kind, name::kBasis)), "expected a basis");
    }
  }
  if (r.keys == RotationForm::kNone && r.values == RotationForm::kNone) {
    rules.fail(at(keys_form), "expected " + keys_form + " or " + values_form +
                                  " other than none (a rotation group that rotates nothing)");
  }
  if (r.values == RotationForm::kPairAngles) {
    rules.fail(at(values_form), "expected none or matrix (pair angles are a key form: they commute with RoPE), got " +
                                    form_text(r.values));
  }
  if (r.keys == RotationForm::kMatrix && settings.keys_pre_rope) {
    rules.fail(at(keys_form), "expected none or pair_angles when " + attribute_object(config_object(config_name),
                                                                                       name::kKeysPreRope) +
                                  " is 1 (a full matrix does not commute with RoPE), got matrix");
  }
  if (r.keys == RotationForm::kPairAngles && model.head_dim % 2 != 0) {
    rules.fail(at(keys_form), "expected an even head_dim (/model@head_dim) for pair_angles, got " +
                                  std::to_string(model.head_dim));
  }
  if (r.key_centred && r.keys != RotationForm::kMatrix) {
    rules.fail(at(name::kKeyCentred), "expected 0 when " + keys_form + " is " + form_text(r.keys) +
                                          " (a centre belongs to matrix keys), got 1");
  }
  if (r.folded && r.keys == RotationForm::kMatrix) {
    rules.fail(at(name::kFolded), "expected 0 when " + keys_form +
                                      " is matrix (RoPE lies between W_K and post-RoPE keys: nothing to fold into), "
                                      "got 1");
  }
  for (const RotationRealField& field : kRotationRealFields) {
    const double value = r.*field.member;
    if (!std::isfinite(value) || value < 0) rules.fail(at(field.name), "expected a finite value >= 0, got " + number(value));
  }
  for (const RotationCountField& field : kRotationCountFields) {
    const int64_t value = r.*field.member;
    if (value < field.least) {
      rules.fail(at(field.name), "expected >= " + std::to_string(field.least) + ", got " + std::to_string(value));
    }
  }
  if (std::find(kGradients.begin(), kGradients.end(), r.gradient) == kGradients.end()) {
    rules.fail(at(name::kGradient), "expected " + std::string(kGradients[0]) + " or " + std::string(kGradients[1]) +
                                        ", got \"" + r.gradient + "\"");
  }
}

// Shape `expected`, as many values, all finite; `meaning` explains the shape.
void check_rotation_array(const Rules& rules, const std::string& object, const Float32Array& array,
                          const std::vector<int64_t>& expected, const std::string& meaning,
                          const std::string& required_because) {
  if (!present(array)) rules.fail(object, "missing: required " + required_because);
  if (array.shape != expected) {
    rules.fail(object, "expected shape " + shape_text(expected) + " (" + meaning + "), got " + shape_text(array.shape));
  }
  size_t count = 1;
  for (const int64_t dim : expected) count *= static_cast<size_t>(dim);
  if (array.values.size() != count) {
    rules.fail(object, "expected " + std::to_string(count) + " values for shape " + shape_text(expected) + ", got " +
                           std::to_string(array.values.size()));
  }
  for (size_t i = 0; i < count; ++i) {
    if (!std::isfinite(array.values[i])) {
      size_t rest = i;
      std::vector<size_t> digits(expected.size());
      for (size_t a = expected.size(); a-- > 0;) {
        digits[a] = rest % static_cast<size_t>(expected[a]);
        rest /= static_cast<size_t>(expected[a]);
      }
      rules.fail(object, "expected finite values, element " + shape_text(digits) + " is " + number(array.values[i]));
    }
  }
}

void check_tensor_rotation(const Rules& rules, const std::string& config_name, size_t layer, Kind kind,
                           const RotationSettings& r, const TensorRotation& t, const ModelFingerprint& model) {
  const std::string object = tensor_rotation_object(config_name, layer, kind);
  const RotationForm form = form_of(r, kind);
  const std::string form_attribute =
      attribute_object(rotation_object(config_name), setting_attribute(kind, name::kForm));
  const std::string when = "when " + form_attribute + " is " + form_text(form);
  auto child = [&](const char* dataset) { return object + "/" + dataset; };
  if (form == RotationForm::kNone) {
    check_absent(rules, object, t != TensorRotation{}, form_attribute + " is none");
    return;
  }
  if (t == TensorRotation{}) rules.fail(object, "missing: required " + when);
  const int64_t heads = model.num_kv_heads, d = model.head_dim;

  if (form == RotationForm::kMatrix) {
    check_rotation_array(rules, child(name::kMatrix), t.matrix, {heads, d, d},
                         "[num_kv_heads, head_dim, head_dim] of /model", when);
    const double tolerance = orthogonality_tolerance(d);
    for (int64_t h = 0; h < heads; ++h) {
      const double distance = distance_from_orthogonal(t.matrix.values.data() + h * d * d, d);
      if (!(distance <= tolerance)) {
        rules.fail(child(name::kMatrix), "expected orthogonal matrices (||R^T R - I||_F <= " + number(tolerance) +
                                             ", float32 storage at head_dim " + std::to_string(d) + "), head " +
                                             std::to_string(h) + " has " + number(distance));
      }
    }
  } else {
    check_absent(rules, child(name::kMatrix), present(t.matrix), form_attribute + " is " + form_text(form));
  }
  if (form == RotationForm::kPairAngles) {
    check_rotation_array(rules, child(name::kAngles), t.angles, {heads, d / 2}, "[num_kv_heads, head_dim / 2] of /model",
                         when);
  } else {
    check_absent(rules, child(name::kAngles), present(t.angles), form_attribute + " is " + form_text(form));
  }
  const bool centred = kind == Kind::kKeys && r.key_centred;
  if (centred) {
    check_head_array(rules, child(name::kCentre), t.centre, model,
                     "when " + attribute_object(rotation_object(config_name), name::kKeyCentred) + " is 1");
  } else {
    check_absent(rules, child(name::kCentre), present(t.centre),
                 kind == Kind::kKeys ? attribute_object(rotation_object(config_name), name::kKeyCentred) + " is 0"
                                     : std::string("values have no centre"));
  }

  const std::string basis = attribute_object(object, name::kBasis);
  if (t.basis.size() != static_cast<size_t>(heads)) {
    rules.fail(basis, "expected one name per KV head (" + std::to_string(heads) + ", /model@num_kv_heads), got " +
                          std::to_string(t.basis.size()));
  }
  for (size_t h = 0; h < t.basis.size(); ++h) {
    if (!parse_basis(basis_name(t.basis[h]))) rules.fail(basis, "expected a basis, element [" + std::to_string(h) + "]");
  }
  const std::string learned = child(name::kLearned);
  if (t.learned.size() != static_cast<size_t>(heads)) {
    rules.fail(learned, "expected one flag per KV head (" + std::to_string(heads) + ", /model@num_kv_heads), got " +
                            std::to_string(t.learned.size()));
  }
  if (r.steps == 0) {
    for (size_t h = 0; h < t.learned.size(); ++h) {
      if (t.learned[h]) {
        rules.fail(learned, "expected 0 for every head when " + attribute_object(rotation_object(config_name), "steps") +
                                " is 0 (nothing was learned), element [" + std::to_string(h) + "] is 1");
      }
    }
  }
}

void check_layer_rotation(const Rules& rules, const QuantizerConfig& config, size_t layer,
                          const ModelFingerprint& model) {
  const LayerRotation& rotation = config.layers[layer].rotation;
  const std::string object = layer_rotation_object(config.name, layer);
  if (!config.rotation) {
    check_absent(rules, object, rotation != LayerRotation{},
                 "the configuration has no " + rotation_object(config.name) + " (unrotated)");
    return;
  }
  for (const Kind kind : kKinds) {
    check_tensor_rotation(rules, config.name, layer, kind, *config.rotation, rotation_of(rotation, kind), model);
  }
  if (rotation.loss.empty()) return;
  if (rotation.loss.size() != static_cast<size_t>(model.num_kv_heads)) {
    rules.fail(object + "/" + kLossFields[0].name, "expected one loss per KV head (" +
                                                       std::to_string(model.num_kv_heads) +
                                                       ", /model@num_kv_heads), got " +
                                                       std::to_string(rotation.loss.size()));
  }
  for (const LossField& field : kLossFields) {
    for (size_t h = 0; h < rotation.loss.size(); ++h) {
      const double value = rotation.loss[h].*field.member;
      if (!std::isfinite(value) || value < 0) {
        rules.fail(object + "/" + field.name, "expected finite values >= 0, element [" + std::to_string(h) + "] is " +
                                                  number(value));
      }
    }
  }
}

void check_config(const Rules& rules, const QuantizerConfig& config, const ModelFingerprint& model) {
  check_name(rules, config.name);
  const std::string object = config_object(config.name);
  check_settings(rules, object, config.settings);
  check_groups_fit_heads(rules, object, config.settings, model);
  check_effective_bits(rules, object + "/" + name::kEffectiveBits, config.effective_bits);
  if (config.rotation) check_rotation_settings(rules, config.name, *config.rotation, config.settings, model);
  if (config.layers.size() != static_cast<size_t>(model.num_layers)) {
    rules.fail(object + "/" + name::kLayers, "expected " + std::to_string(model.num_layers) +
                                                 " layers (/model@num_layers), got " +
                                                 std::to_string(config.layers.size()));
  }
  for (size_t layer = 0; layer < config.layers.size(); ++layer) {
    for (const Kind kind : kKinds) {
      check_tensor(rules, tensor_object(config.name, layer, kind), kind, config.settings,
                   quantizer_of(config.layers[layer], kind), model);
    }
    check_stats(rules, layer_object(config.name, layer), config.layers[layer].stats);
    check_layer_rotation(rules, config, layer, model);
  }
  // Scales identical across layers were copied, not fitted.
  for (const Kind kind : kKinds) {
    if (settings_of(config.settings, kind).grouping != Grouping::kPerChannelOffline) continue;
    for (size_t b = 1; b < config.layers.size(); ++b) {
      for (size_t a = 0; a < b; ++a) {
        if (quantizer_of(config.layers[a], kind).channel_scale == quantizer_of(config.layers[b], kind).channel_scale) {
          rules.fail(tensor_object(config.name, b, kind) + "/" + name::kChannelScale,
                     "expected scales fitted to this layer, got the same as layer " + std::to_string(a) +
                         "'s (never fitted?)");
        }
      }
    }
  }
}

void check_artifact(const Rules& rules, const Artifact& artifact) {
  check_root(rules, artifact);
  check_model(rules, artifact.model);
  check_calibration(rules, artifact.calibration);
  if (artifact.configs.empty()) rules.fail(names_object(), "expected at least one configuration");
  std::set<std::string> names;
  for (const auto& config : artifact.configs) {
    if (!names.insert(config.name).second) {
      rules.fail(names_object(), "expected unique names, got \"" + config.name + "\" twice");
    }
  }
  for (const auto& config : artifact.configs) check_config(rules, config, artifact.model);
}

// --- attributes the HDF5 layer has no helper for (floats, booleans) ------------

// A scalar float attribute stored as `file_type` (H5T_IEEE_F32LE / F64LE).
void write_float(Group& group, const std::string& name, double value, hid_t file_type) {
  const Location where(group.where().file(), attribute_object(group.where().name(), name));
  hdf5::DataspaceId space(where.check(H5Screate(H5S_SCALAR), "cannot create"));
  hdf5::AttributeId attribute(where.check(
      H5Acreate2(group.id(), name.c_str(), file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), "cannot create"));
  where.check(H5Awrite(attribute.get(), H5T_NATIVE_DOUBLE, &value), "cannot write");
}

// A scalar float attribute of any float width, as a double.
double read_float(const Group& group, const std::string& name) {
  const Location where(group.where().file(), attribute_object(group.where().name(), name));
  if (!group.has_attribute(name)) where.fail("missing (a required attribute)");
  hdf5::AttributeId attribute(where.check(H5Aopen(group.id(), name.c_str(), H5P_DEFAULT), "cannot open"));
  hdf5::DatatypeId type(where.check(H5Aget_type(attribute.get()), "cannot read its type"));
  if (H5Tget_class(type.get()) != H5T_FLOAT) where.fail("expected a float, got " + hdf5::describe_type(type.get()));
  hdf5::DataspaceId space(where.check(H5Aget_space(attribute.get()), "cannot read its shape"));
  if (H5Sget_simple_extent_npoints(space.get()) != 1) where.fail("expected a single float");
  double value = 0;
  where.check(H5Aread(attribute.get(), H5T_NATIVE_DOUBLE, &value), "cannot read");
  return value;
}

void write_bool(Group& group, const std::string& name, bool value) { group.write_scalar<uint8_t>(name, value ? 1 : 0); }

bool read_bool(const Group& group, const std::string& name) {
  const int64_t value = group.read_integer<int64_t>(name);
  if (value != 0 && value != 1) {
    Location(group.where().file(), attribute_object(group.where().name(), name))
        .fail("expected 0 or 1, got " + std::to_string(value));
  }
  return value == 1;
}

// --- datasets ------------------------------------------------------------------

// The hyperslab of a whole dataset: start at 0, count = shape.
struct Whole {
  std::vector<hsize_t> start, count;
  explicit Whole(const std::vector<int64_t>& shape) {
    for (const int64_t dim : shape) {
      start.push_back(0);
      count.push_back(static_cast<hsize_t>(dim));
    }
  }
};

void write_array(Group& group, const std::string& name, const std::vector<int64_t>& shape, const float* values) {
  const Whole whole(shape);
  group.create_dataset<float>(name, whole.count, {}).write<float>(whole.start, whole.count, values);
}

Float32Array read_array(const Group& group, const std::string& name, const std::vector<int64_t>& shape,
                        const std::string& shape_meaning) {
  const Dataset dataset = group.open_dataset(name);
  if (!dataset.holds<float>()) dataset.where().fail("expected float32, got " + dataset.type_name());
  const std::vector<int64_t> actual = dataset.shape();
  if (actual != shape) {
    dataset.where().fail("expected shape " + shape_text(shape) + " (" + shape_meaning + "), got " + shape_text(actual));
  }
  Float32Array array;
  array.shape = shape;
  int64_t count = 1;
  for (const int64_t dim : shape) count *= dim;
  array.values.resize(static_cast<size_t>(count));
  const Whole whole(shape);
  if (count > 0) dataset.read<float>(whole.start, whole.count, array.values.data());
  return array;
}

// effective_bits: float64 [n, 2] rows of (context, bits).
void write_effective_bits(Group& group, const std::vector<std::pair<int64_t, double>>& rows) {
  const Location where(group.where().file(), group.where().child(name::kEffectiveBits));
  std::vector<double> values;
  for (const auto& [context, bits] : rows) {
    values.push_back(static_cast<double>(context));
    values.push_back(bits);
  }
  const std::array<hsize_t, 2> dims = {rows.size(), 2};
  hdf5::DataspaceId space(where.check(H5Screate_simple(2, dims.data(), nullptr), "cannot create"));
  hdf5::DatasetId dataset(where.check(
      H5Dcreate2(group.id(), name::kEffectiveBits, H5T_IEEE_F64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
      "cannot create"));
  where.check(H5Dwrite(dataset.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), "cannot write");
}

std::vector<std::pair<int64_t, double>> read_effective_bits(const Group& group) {
  const Dataset dataset = group.open_dataset(name::kEffectiveBits);
  const Location& where = dataset.where();
  hdf5::DatatypeId type(where.check(H5Dget_type(dataset.id()), "cannot read its type"));
  if (H5Tget_class(type.get()) != H5T_FLOAT || H5Tget_size(type.get()) != 8) {
    where.fail("expected float64, got " + hdf5::describe_type(type.get()));
  }
  const std::vector<int64_t> shape = dataset.shape();
  if (shape.size() != 2 || shape[0] < 1 || shape[1] != 2) {
    where.fail("expected shape [n, 2] with n >= 1, got " + shape_text(shape));
  }
  std::vector<double> values(static_cast<size_t>(shape[0] * 2));
  where.check(H5Dread(dataset.id(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), "cannot read");
  std::vector<std::pair<int64_t, double>> rows;
  for (size_t i = 0; i < values.size(); i += 2) {
    const double context = values[i];
    if (!(context >= 1 && context <= kMaxExactInteger && context == std::floor(context))) {
      where.fail("expected positive integer contexts in column 0, row " + std::to_string(i / 2) + " has " +
                 number(context));
    }
    rows.emplace_back(static_cast<int64_t>(context), values[i + 1]);
  }
  return rows;
}

// --- groups <-> structs ----------------------------------------------------------

// The attribute names and types of the activation store's /model and /provenance.
void write_calibration(Group& group, const CalibrationProvenance& calibration) {
  group.write_scalar<int64_t>(name::kCalibrationTokens, calibration.calibration_tokens);
  group.write_string(name::kStoreFile, calibration.store_file);
  Group sources = group.create_group(name::kSources);
  for (size_t k = 0; k < calibration.sources.size(); ++k) {
    Group source = sources.create_group(std::to_string(k));
    write_capture_provenance(source, calibration.sources[k]);
  }
}

CalibrationProvenance read_calibration(const Group& group) {
  CalibrationProvenance calibration;
  calibration.calibration_tokens = group.read_integer<int64_t>(name::kCalibrationTokens);
  calibration.store_file = group.read_string(name::kStoreFile);
  const Group sources = group.open_group(name::kSources);
  const int64_t count = sources.child_count();
  if (count < 1) sources.where().fail("expected at least one source (group 0)");
  for (int64_t k = 0; k < count; ++k) {
    calibration.sources.push_back(read_capture_provenance(sources.open_group(std::to_string(k))));
  }
  return calibration;
}

// "a, b, c or d": the names of `values`, for messages.
template <class Enum, size_t N>
std::string alternatives(const std::array<Enum, N>& values, std::string_view (*name_of)(Enum)) {
  std::string text;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) text += i + 1 == N ? " or " : ", ";
    text += name_of(values[i]);
  }
  return text;
}

// A string attribute holding one of `values`' names (as `name_of` writes them).
template <class Enum, size_t N>
Enum read_name(const Group& group, const std::string& attribute, const std::array<Enum, N>& values,
               std::string_view (*name_of)(Enum)) {
  const std::string text = group.read_string(attribute);
  for (const Enum value : values) {
    if (name_of(value) == text) return value;
  }
  Location(group.where().file(), attribute_object(group.where().name(), attribute))
      .fail("expected " + alternatives(values, name_of) + ", got \"" + text + "\"");
}

void write_settings(Group& group, const QuantizerSettings& settings) {
  group.write_string(name::kMethod, std::string(method_name(settings.method)));
  group.write_scalar<int64_t>(name::kBits, settings.bits);
  write_bool(group, name::kKeysPreRope, settings.keys_pre_rope);
  group.write_scalar<int64_t>(name::kSinkTokens, settings.sink_tokens);
  group.write_scalar<int64_t>(name::kResidualTokens, settings.residual_tokens);
  write_bool(group, name::kFisherWeighted, settings.fisher_weighted);
  for (const Kind kind : kKinds) {
    const TensorQuantizerSettings& s = settings_of(settings, kind);
    group.write_string(setting_attribute(kind, name::kGrouping), std::string(grouping_name(s.grouping)));
    group.write_scalar<int64_t>(setting_attribute(kind, name::kGroup), s.group);
    write_bool(group, setting_attribute(kind, name::kNonUniform), s.non_uniform);
    write_float(group, setting_attribute(kind, name::kOutlierFraction), s.outlier_fraction, H5T_IEEE_F64LE);
    group.write_string(setting_attribute(kind, name::kOutlierRule), std::string(outlier_rule_name(s.outlier_rule)));
    group.write_string(setting_attribute(kind, name::kResidualRule), std::string(residual_rule_name(s.residual_rule)));
    group.write_string(setting_attribute(kind, name::kQNorm), std::string(q_norm_name(s.q_norm)));
  }
}

// Version 1 stored no per-tensor rules: it meant kvforge's rules of the
// time, which version 2 names (docs/artifact.md, "Reading version 1 files").
void map_version_1_rules(TensorQuantizerSettings& s, bool q_norm) {
  if (s.outlier_fraction == 0) {
    s.outlier_rule = OutlierRule::kNone;
  } else {
    s.outlier_rule = is_runtime_grouping(s.grouping) ? OutlierRule::kTokenTau : OutlierRule::kChannelThresholds;
  }
  s.residual_rule = ResidualRule::kSliding;
  s.q_norm = q_norm && s.non_uniform ? QNorm::kIterated : QNorm::kNone;
}

QuantizerSettings read_settings(const Group& group, int64_t version) {
  QuantizerSettings settings;
  settings.method = read_name(group, name::kMethod, kMethods, method_name);
  const int64_t bits = group.read_integer<int64_t>(name::kBits);
  if (bits < 2 || bits > 4) {
    Location(group.where().file(), attribute_object(group.where().name(), name::kBits))
        .fail("expected 2, 3 or 4, got " + std::to_string(bits));
  }
  settings.bits = static_cast<int>(bits);
  settings.keys_pre_rope = read_bool(group, name::kKeysPreRope);
  settings.sink_tokens = group.read_integer<int64_t>(name::kSinkTokens);
  settings.residual_tokens = group.read_integer<int64_t>(name::kResidualTokens);
  settings.fisher_weighted = read_bool(group, name::kFisherWeighted);
  const bool version_1_q_norm = version == 1 && read_bool(group, name::kVersion1QNorm);
  for (const Kind kind : kKinds) {
    TensorQuantizerSettings& s = settings_of(settings, kind);
    const std::string grouping = setting_attribute(kind, name::kGrouping);
    s.grouping = version == 1 ? read_name(group, grouping, kVersion1Groupings, grouping_name)
                              : read_name(group, grouping, kGroupings, grouping_name);
    s.group = group.read_integer<int64_t>(setting_attribute(kind, name::kGroup));
    s.non_uniform = read_bool(group, setting_attribute(kind, name::kNonUniform));
    s.outlier_fraction = read_float(group, setting_attribute(kind, name::kOutlierFraction));
    if (version == 1) {
      map_version_1_rules(s, version_1_q_norm);
      continue;
    }
    s.outlier_rule = read_name(group, setting_attribute(kind, name::kOutlierRule), kOutlierRules, outlier_rule_name);
    s.residual_rule =
        read_name(group, setting_attribute(kind, name::kResidualRule), kResidualRules, residual_rule_name);
    s.q_norm = read_name(group, setting_attribute(kind, name::kQNorm), kQNorms, q_norm_name);
  }
  return settings;
}

void write_stats(Group& group, const LayerCalibrationStats& stats) {
  for (const StatField& field : kStatFields) write_float(group, field.name, stats.*field.member, H5T_IEEE_F64LE);
}

LayerCalibrationStats read_stats(const Group& group) {
  LayerCalibrationStats stats;
  for (const StatField& field : kStatFields) stats.*field.member = read_float(group, field.name);
  return stats;
}

void write_levels(Group& group, const char* dataset, const std::vector<float>& levels) {
  if (!levels.empty()) write_array(group, dataset, {static_cast<int64_t>(levels.size())}, levels.data());
}

void write_tensor(Group& group, const TensorQuantizer& q) {
  write_float(group, name::kClipRatio, q.clip_ratio, H5T_IEEE_F32LE);
  write_float(group, name::kOutlierTau, q.outlier_tau, H5T_IEEE_F32LE);
  write_levels(group, name::kGrid, q.grid);
  write_levels(group, name::kEncodeGrid, q.encode_grid);
  for (const HeadArrayField& field : kHeadArrayFields) {
    const Float32Array& array = q.*field.member;
    if (!array.empty()) write_array(group, field.name, array.shape, array.values.data());
  }
}

TensorQuantizer read_tensor(const Group& group, Kind kind, const QuantizerSettings& settings,
                            const ModelFingerprint& model, int64_t version) {
  TensorQuantizer q;
  q.clip_ratio = static_cast<float>(read_float(group, name::kClipRatio));
  q.outlier_tau = static_cast<float>(read_float(group, name::kOutlierTau));
  const TensorQuantizerSettings& s = settings_of(settings, kind);
  const Expected expected = expected_datasets(s);
  auto refuse_present = [&](const char* dataset, const std::string& why) {
    if (group.has_child(dataset)) {
      Location(group.where().file(), group.where().child(dataset)).fail("expected none: " + why);
    }
  };
  const std::vector<int64_t> levels = {int64_t{1} << settings.bits};
  if (expected.grid) {
    q.grid = read_array(group, name::kGrid, levels, "2^bits levels").values;
  } else {
    refuse_present(name::kGrid, why_no_grid(kind));
  }
  if (expected.encode_grid) {
    q.encode_grid = read_array(group, name::kEncodeGrid, levels, "2^bits levels").values;
  } else if (version >= 2) {  // version 1 has no encode_grid; readers ignore datasets they do not know
    refuse_present(name::kEncodeGrid, why_no_encode_grid(kind, s));
  }
  const std::vector<int64_t> heads = {model.num_kv_heads, model.head_dim};
  const std::string heads_meaning = "[num_kv_heads, head_dim] of /model";
  for (const HeadArrayField& field : kHeadArrayFields) {
    const bool channel =
        field.member == &TensorQuantizer::channel_scale || field.member == &TensorQuantizer::channel_offset;
    if (channel ? expected.channel : expected.thresholds) {
      q.*field.member = read_array(group, field.name, heads, heads_meaning);
    } else {
      refuse_present(field.name, channel ? why_no_channel_arrays(kind, s) : why_no_thresholds(kind, s));
    }
  }
  return q;
}

void write_rotation_settings(Group& group, const RotationSettings& r) {
  for (const Kind kind : kKinds) {
    group.write_string(setting_attribute(kind, name::kForm), std::string(rotation_form_name(form_of(r, kind))));
    group.write_string(setting_attribute(kind, name::kBasis), std::string(basis_name(basis_of(r, kind))));
  }
  write_bool(group, name::kKeyCentred, r.key_centred);
  write_bool(group, name::kFolded, r.folded);
  group.write_string(name::kGradient, r.gradient);
  for (const RotationRealField& field : kRotationRealFields) write_float(group, field.name, r.*field.member, H5T_IEEE_F64LE);
  for (const RotationCountField& field : kRotationCountFields) group.write_scalar<int64_t>(field.name, r.*field.member);
}

RotationSettings read_rotation_settings(const Group& group) {
  RotationSettings r;
  for (const Kind kind : kKinds) {
    form_of(r, kind) = read_name(group, setting_attribute(kind, name::kForm), kRotationForms, rotation_form_name);
    basis_of(r, kind) = read_name(group, setting_attribute(kind, name::kBasis), kBases, basis_name);
  }
  r.key_centred = read_bool(group, name::kKeyCentred);
  r.folded = read_bool(group, name::kFolded);
  r.gradient = group.read_string(name::kGradient);
  for (const RotationRealField& field : kRotationRealFields) r.*field.member = read_float(group, field.name);
  for (const RotationCountField& field : kRotationCountFields) {
    r.*field.member = group.read_integer<int64_t>(field.name);
  }
  return r;
}

// A 1-D dataset of T (double or uint8_t).
template <class T>
void write_vector(Group& group, const char* name, const std::vector<T>& values) {
  const std::vector<hsize_t> shape = {values.size()};
  const std::array<hsize_t, 1> start = {0};
  group.create_dataset<T>(name, shape, {}).template write<T>(start, shape, values.data());
}

template <class T>
std::vector<T> read_vector(const Group& group, const char* name, int64_t length, const char* type,
                           const std::string& length_meaning) {
  const Dataset dataset = group.open_dataset(name);
  if (!dataset.holds<T>()) dataset.where().fail(std::string("expected ") + type + ", got " + dataset.type_name());
  const std::vector<int64_t> shape = dataset.shape();
  if (shape != std::vector<int64_t>{length}) {
    dataset.where().fail("expected shape [" + std::to_string(length) + "] (" + length_meaning + "), got " +
                         shape_text(shape));
  }
  std::vector<T> values(static_cast<size_t>(length));
  const std::array<hsize_t, 1> start = {0}, count = {static_cast<hsize_t>(length)};
  if (length > 0) dataset.read<T>(start, count, values.data());
  return values;
}

void write_tensor_rotation(Group& group, const TensorRotation& t) {
  for (const auto& [dataset, array] : {std::pair<const char*, const Float32Array*>{name::kMatrix, &t.matrix},
                                       {name::kAngles, &t.angles},
                                       {name::kCentre, &t.centre}}) {
    if (!array->empty()) write_array(group, dataset, array->shape, array->values.data());
  }
  std::vector<std::string> bases;
  for (const RotationBasis basis : t.basis) bases.emplace_back(basis_name(basis));
  group.write_strings(name::kBasis, bases);
  std::vector<uint8_t> learned;
  for (const bool flag : t.learned) learned.push_back(flag ? 1 : 0);
  write_vector(group, name::kLearned, learned);
}

void refuse_child(const Group& group, const char* name, const std::string& why) {
  if (group.has_child(name)) Location(group.where().file(), group.where().child(name)).fail("expected none: " + why);
}

TensorRotation read_tensor_rotation(const Group& group, const std::string& form_attribute, RotationForm form,
                                    bool centred, const ModelFingerprint& model) {
  TensorRotation t;
  const int64_t heads = model.num_kv_heads, d = model.head_dim;
  const std::string not_this_form = form_attribute + " is " + std::string(rotation_form_name(form));
  if (form == RotationForm::kMatrix) {
    t.matrix = read_array(group, name::kMatrix, {heads, d, d}, "[num_kv_heads, head_dim, head_dim] of /model");
  } else {
    refuse_child(group, name::kMatrix, not_this_form);
  }
  if (form == RotationForm::kPairAngles) {
    t.angles = read_array(group, name::kAngles, {heads, d / 2}, "[num_kv_heads, head_dim / 2] of /model");
  } else {
    refuse_child(group, name::kAngles, not_this_form);
  }
  if (centred) {
    t.centre = read_array(group, name::kCentre, {heads, d}, "[num_kv_heads, head_dim] of /model");
  } else {
    refuse_child(group, name::kCentre, "no centre (key_centred is 0, or values)");
  }
  const Location basis(group.where().file(), attribute_object(group.where().name(), name::kBasis));
  const std::vector<std::string> names = group.read_strings(name::kBasis);
  for (size_t h = 0; h < names.size(); ++h) {
    const std::optional<RotationBasis> parsed = parse_basis(names[h]);
    if (!parsed) {
      basis.fail("expected " + alternatives(kBases, basis_name) + ", element [" + std::to_string(h) + "] is \"" +
                 names[h] + "\"");
    }
    t.basis.push_back(*parsed);
  }
  const std::vector<uint8_t> learned = read_vector<uint8_t>(group, name::kLearned, heads, "uint8", "num_kv_heads of /model");
  for (size_t h = 0; h < learned.size(); ++h) {
    if (learned[h] > 1) {
      Location(group.where().file(), group.where().child(name::kLearned))
          .fail("expected 0 or 1, element [" + std::to_string(h) + "] is " + std::to_string(learned[h]));
    }
    t.learned.push_back(learned[h] == 1);
  }
  return t;
}

void write_layer_rotation(Group& layer, const RotationSettings& r, const LayerRotation& rotation) {
  Group group = layer.create_group(name::kRotation);
  for (const Kind kind : kKinds) {
    if (form_of(r, kind) == RotationForm::kNone) continue;
    Group tensor = group.create_group(kind_name(kind));
    write_tensor_rotation(tensor, rotation_of(rotation, kind));
  }
  if (rotation.loss.empty()) return;
  for (const LossField& field : kLossFields) {
    std::vector<double> values;
    for (const HeadRotationLoss& loss : rotation.loss) values.push_back(loss.*field.member);
    write_vector(group, field.name, values);
  }
}

LayerRotation read_layer_rotation(const Group& group, const std::string& config_name, const RotationSettings& r,
                                  const ModelFingerprint& model) {
  LayerRotation rotation;
  for (const Kind kind : kKinds) {
    const std::string form_attribute =
        attribute_object(rotation_object(config_name), setting_attribute(kind, name::kForm));
    const RotationForm form = form_of(r, kind);
    if (form == RotationForm::kNone) {
      refuse_child(group, kind_name(kind).c_str(), form_attribute + " is none");
      continue;
    }
    rotation_of(rotation, kind) = read_tensor_rotation(group.open_group(kind_name(kind)), form_attribute, form,
                                                       kind == Kind::kKeys && r.key_centred, model);
  }
  // The losses are optional, all four or none.
  const bool any = std::any_of(kLossFields.begin(), kLossFields.end(),
                               [&](const LossField& field) { return group.has_child(field.name); });
  if (!any) return rotation;
  rotation.loss.resize(static_cast<size_t>(model.num_kv_heads));
  for (const LossField& field : kLossFields) {
    const std::vector<double> values =
        read_vector<double>(group, field.name, model.num_kv_heads, "float64", "num_kv_heads of /model");
    for (size_t h = 0; h < values.size(); ++h) rotation.loss[h].*field.member = values[h];
  }
  return rotation;
}

void write_config(Group& group, const QuantizerConfig& config) {
  write_settings(group, config.settings);
  write_effective_bits(group, config.effective_bits);
  Group layers = group.create_group(name::kLayers);
  for (size_t i = 0; i < config.layers.size(); ++i) {
    Group layer = layers.create_group(std::to_string(i));
    write_stats(layer, config.layers[i].stats);
    for (const Kind kind : kKinds) {
      Group tensor = layer.create_group(kind_name(kind));
      write_tensor(tensor, quantizer_of(config.layers[i], kind));
    }
    if (config.rotation) write_layer_rotation(layer, *config.rotation, config.layers[i].rotation);
  }
  if (config.rotation) {
    Group rotation = group.create_group(name::kRotation);
    write_rotation_settings(rotation, *config.rotation);
  }
}

QuantizerConfig read_config(const Rules& rules, const Group& group, const std::string& config_name,
                            const ModelFingerprint& model, int64_t version) {
  QuantizerConfig config;
  config.name = config_name;
  config.settings = read_settings(group, version);
  // Settings first: the datasets' presence and shapes depend on them.
  check_settings(rules, group.where().name(), config.settings);
  check_groups_fit_heads(rules, group.where().name(), config.settings, model);
  config.effective_bits = read_effective_bits(group);
  // Version 3's rotation; a group of that name in an older file is unknown there and ignored.
  if (version >= kFirstRotationVersion && group.has_child(name::kRotation)) {
    config.rotation = read_rotation_settings(group.open_group(name::kRotation));
    check_rotation_settings(rules, config_name, *config.rotation, config.settings, model);
  }
  const Group layers = group.open_group(name::kLayers);
  if (layers.child_count() != model.num_layers) {
    layers.where().fail("expected " + std::to_string(model.num_layers) + " layers (/model@num_layers), got " +
                        std::to_string(layers.child_count()));
  }
  for (int64_t i = 0; i < model.num_layers; ++i) {
    const Group layer = layers.open_group(std::to_string(i));
    LayerQuantizers quantizers;
    quantizers.stats = read_stats(layer);
    for (const Kind kind : kKinds) {
      quantizer_of(quantizers, kind) =
          read_tensor(layer.open_group(kind_name(kind)), kind, config.settings, model, version);
    }
    if (config.rotation) {
      quantizers.rotation = read_layer_rotation(layer.open_group(name::kRotation), config_name, *config.rotation, model);
    } else if (version >= kFirstRotationVersion) {
      refuse_child(layer, name::kRotation,
                   "the configuration has no " + rotation_object(config_name) + " (unrotated)");
    }
    config.layers.push_back(std::move(quantizers));
  }
  return config;
}

// Returns the schema version, kOldestReadableArtifactVersion .. kArtifactVersion.
int64_t read_schema(const Group& root) {
  const std::string schema = root.read_string(name::kSchema);
  if (schema != name::kSchemaValue) {
    Location(root.where().file(), attribute_object("/", name::kSchema))
        .fail(std::string("expected \"") + name::kSchemaValue + "\", got \"" + schema + "\"");
  }
  const int64_t version = root.read_integer<int64_t>(name::kSchemaVersion);
  if (version < kOldestReadableArtifactVersion || version > kArtifactVersion) {
    Location(root.where().file(), attribute_object("/", name::kSchemaVersion))
        .fail("expected " + std::to_string(kOldestReadableArtifactVersion) + " to " + std::to_string(kArtifactVersion) +
              " (the versions this kvforge reads), got " + std::to_string(version));
  }
  return version;
}

}  // namespace

void write_artifact(const std::filesystem::path& path, const Artifact& artifact) {
  hdf5::QuietErrors quiet;
  check_artifact(Rules(path.string()), artifact);
  std::filesystem::path temporary = path;
  temporary += ".tmp";
  RemoveOnFailure cleanup(temporary);
  {
    File file = File::create(temporary);
    Group root = file.root();
    root.write_string(name::kSchema, name::kSchemaValue);
    root.write_scalar<int64_t>(name::kSchemaVersion, kArtifactVersion);
    root.write_string(name::kToolVersion, artifact.tool_version);
    root.write_string(name::kCreatedUtc, artifact.created_utc);
    root.write_string(name::kCommandLine, artifact.command_line);
    Group model = root.create_group(name::kModel);
    write_model_fingerprint(model, artifact.model);
    Group calibration = root.create_group(name::kCalibration);
    write_calibration(calibration, artifact.calibration);
    Group configs = root.create_group(name::kConfigs);
    std::vector<std::string> names;
    for (const auto& config : artifact.configs) names.push_back(config.name);
    configs.write_strings(name::kNames, names);
    for (const auto& config : artifact.configs) {
      Group group = configs.create_group(config.name);
      write_config(group, config);
    }
    file.close();
  }
  // What serving will load is what was meant: read back with every check.
  if (read_artifact(temporary) != artifact) {
    throw std::logic_error(temporary.string() + ": the artifact read back differs from the one written");
  }
  std::filesystem::rename(temporary, path);
  cleanup.release();
}

Artifact read_artifact(const std::filesystem::path& path) {
  hdf5::QuietErrors quiet;
  const Rules rules(path.string());
  const File file = File::open(path, File::Mode::kReadOnly);
  const Group root = file.root();
  const int64_t version = read_schema(root);
  Artifact artifact;
  artifact.tool_version = root.read_string(name::kToolVersion);
  artifact.created_utc = root.read_string(name::kCreatedUtc);
  artifact.command_line = root.read_string(name::kCommandLine);
  artifact.model = read_model_fingerprint(root.open_group(name::kModel));
  check_model(rules, artifact.model);
  artifact.calibration = read_calibration(root.open_group(name::kCalibration));
  const Group configs = root.open_group(name::kConfigs);
  const std::vector<std::string> names = configs.read_strings(name::kNames);
  std::set<std::string> seen;
  for (const auto& config : names) {
    check_name(rules, config);
    if (!seen.insert(config).second) rules.fail(names_object(), "expected unique names, got \"" + config + "\" twice");
  }
  if (configs.child_count() != static_cast<int64_t>(names.size())) {
    rules.fail(root_child(name::kConfigs), "expected exactly the " + std::to_string(names.size()) +
                                               " groups listed in " + names_object() + ", got " +
                                               std::to_string(configs.child_count()));
  }
  for (const auto& config : names) {
    artifact.configs.push_back(read_config(rules, configs.open_group(config), config, artifact.model, version));
  }
  check_artifact(rules, artifact);
  return artifact;
}

void check_artifact_matches(const Artifact& artifact, const ModelFingerprint& model, const std::string& artifact_file) {
  const ModelFingerprint& a = artifact.model;
  const std::array<std::tuple<const char*, std::string, std::string>, 10> items = {{
      {"architecture", a.architecture, model.architecture},
      {"num_layers", std::to_string(a.num_layers), std::to_string(model.num_layers)},
      {"num_heads", std::to_string(a.num_heads), std::to_string(model.num_heads)},
      {"num_kv_heads", std::to_string(a.num_kv_heads), std::to_string(model.num_kv_heads)},
      {"head_dim", std::to_string(a.head_dim), std::to_string(model.head_dim)},
      {"hidden_size", std::to_string(a.hidden_size), std::to_string(model.hidden_size)},
      {"vocab_size", std::to_string(a.vocab_size), std::to_string(model.vocab_size)},
      {"rope", a.rope, model.rope},
      {"kvo_sha256", a.kvo_sha256, model.kvo_sha256},
      {"tokenizer_sha256", a.tokenizer_sha256, model.tokenizer_sha256},
  }};
  // Digests abbreviated as the activation store's messages do.
  auto shown = [](const std::string& name, const std::string& value) {
    constexpr size_t kDigestChars = 12;
    if (value.empty()) return std::string("\"\"");
    if (name.ends_with("sha256") && value.size() > kDigestChars) return value.substr(0, kDigestChars) + "...";
    return value;
  };
  for (const auto& [name, calibrated, given] : items) {
    if (calibrated == given) continue;
    throw InputError(
        artifact_file, std::string("model.") + name,
        "the artifact was calibrated for a model with " + shown(name, calibrated) + ", got " + shown(name, given));
  }
}

}  // namespace kvforge
