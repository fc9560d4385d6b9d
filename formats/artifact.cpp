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

// --- object paths, as error messages and docs/artifact.md name them -----------

std::string root_child(const char* name) { return std::string("/") + name; }
std::string config_object(const std::string& config) { return root_child(name::kConfigs) + "/" + config; }
std::string layer_object(const std::string& config, size_t layer) {
  return config_object(config) + "/" + name::kLayers + "/" + std::to_string(layer);
}
std::string tensor_object(const std::string& config, size_t layer, Kind kind) {
  return layer_object(config, layer) + "/" + kind_name(kind);
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

void check_config(const Rules& rules, const QuantizerConfig& config, const ModelFingerprint& model) {
  check_name(rules, config.name);
  const std::string object = config_object(config.name);
  check_settings(rules, object, config.settings);
  check_groups_fit_heads(rules, object, config.settings, model);
  check_effective_bits(rules, object + "/" + name::kEffectiveBits, config.effective_bits);
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
