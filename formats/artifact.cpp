#include "formats/artifact.h"

#include "formats/fingerprint_attributes.h"
#include "formats/remove_on_failure.h"

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

#include "formats/hdf5_file.h"
#include "formats/input_error.h"

namespace kvforge {
namespace {

using hdf5::Dataset;
using hdf5::File;
using hdf5::Group;
using hdf5::Location;

constexpr const char* kSchema = "kvforge.artifact";
// Inlier thresholds of per-channel-offline keys may map this far outside
// [-1, 1] through (x - offset) / scale: float32 rounding of fitted values.
constexpr double kThresholdTolerance = 1e-4;
// Contexts are stored as float64; integers up to 2^53 are exact there.
constexpr double kMaxExactInteger = 9007199254740992.0;

enum class Kind { kKeys, kValues };
constexpr std::array<Kind, 2> kKinds = {Kind::kKeys, Kind::kValues};
std::string kind_name(Kind kind) { return kind == Kind::kKeys ? "keys" : "values"; }

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

std::string config_object(const std::string& name) { return "/configs/" + name; }
std::string layer_object(const std::string& name, size_t layer) {
  return config_object(name) + "/layers/" + std::to_string(layer);
}
std::string tensor_object(const std::string& name, size_t layer, Kind kind) {
  return layer_object(name, layer) + "/" + kind_name(kind);
}
// "/configs/x" + "bits" -> "/configs/x@bits"; "/" + "schema" -> "/@schema".
std::string attribute_object(const std::string& object, const std::string& attribute) {
  return object + "@" + attribute;
}
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
  const std::array<std::pair<const char*, int64_t>, 6> positive = {{
      {"num_layers", model.num_layers},
      {"num_heads", model.num_heads},
      {"num_kv_heads", model.num_kv_heads},
      {"head_dim", model.head_dim},
      {"hidden_size", model.hidden_size},
      {"vocab_size", model.vocab_size},
  }};
  for (const auto& [name, value] : positive) {
    if (value <= 0)
      rules.fail(attribute_object("/model", name), "expected a positive integer, got " + std::to_string(value));
  }
  if (model.num_heads % model.num_kv_heads != 0) {
    rules.fail("/model@num_kv_heads", "expected a divisor of num_heads (" + std::to_string(model.num_heads) +
                                          "), got " + std::to_string(model.num_kv_heads));
  }
}

void check_root(const Rules& rules, const Artifact& artifact) {
  static const std::regex kUtc(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)");
  if (!std::regex_match(artifact.created_utc, kUtc)) {
    rules.fail("/@created_utc", "expected YYYY-MM-DDTHH:MM:SSZ, got \"" + artifact.created_utc + "\"");
  }
  if (artifact.tool_version.empty()) rules.fail("/@tool_version", "expected the kvforge version, got \"\"");
}

void check_calibration(const Rules& rules, const CalibrationProvenance& calibration) {
  if (calibration.calibration_tokens <= 0) {
    rules.fail("/calibration@calibration_tokens",
               "expected a positive integer, got " + std::to_string(calibration.calibration_tokens));
  }
  if (calibration.sources.empty()) rules.fail("/calibration/sources", "expected at least one source (group 0)");
  for (size_t k = 0; k < calibration.sources.size(); ++k) {
    const CaptureProvenance& source = calibration.sources[k];
    const std::string object = "/calibration/sources/" + std::to_string(k);
    if (source.data_tokens < 0) rules.fail(object + "@data_tokens", "expected a non-negative integer");
    if (source.samples <= 0) rules.fail(object + "@samples", "expected a positive integer");
    if (source.seq_len <= 0) rules.fail(object + "@seq_len", "expected a positive integer");
  }
}

void check_name(const Rules& rules, const std::string& name) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\0') != std::string::npos) {
    rules.fail("/configs@names",
               "expected configuration names without '/' other than \".\" and \"..\", got \"" + name + "\"");
  }
}

void check_settings(const Rules& rules, const std::string& object, const QuantizerSettings& settings) {
  if (!parse_method(method_name(settings.method))) rules.fail(attribute_object(object, "method"), "expected a method");
  if (settings.bits < 2 || settings.bits > 4) {
    rules.fail(attribute_object(object, "bits"), "expected 2, 3 or 4, got " + std::to_string(settings.bits));
  }
  for (const Kind kind : kKinds) {
    const TensorQuantizerSettings& s = settings_of(settings, kind);
    if (!parse_grouping(grouping_name(s.grouping))) {
      rules.fail(attribute_object(object, setting_attribute(kind, "grouping")), "expected a grouping");
    }
    // Unused by per_channel_offline (kvforge writes 0 there).
    const int64_t least = s.grouping == Grouping::kPerChannelOffline ? 0 : 1;
    if (s.group < least) {
      rules.fail(attribute_object(object, setting_attribute(kind, "group")),
                 std::string(least == 0 ? "expected >= 0" : "expected a positive integer") + ", got " +
                     std::to_string(s.group));
    }
    if (!std::isfinite(s.outlier_fraction) || s.outlier_fraction < 0 || s.outlier_fraction >= 1) {
      rules.fail(attribute_object(object, setting_attribute(kind, "outlier_fraction")),
                 "expected a fraction in [0, 1), got " + number(s.outlier_fraction));
    }
  }
  if (settings.sink_tokens < 0) {
    rules.fail(attribute_object(object, "sink_tokens"), "expected >= 0, got " + std::to_string(settings.sink_tokens));
  }
  if (settings.residual_tokens < 0) {
    rules.fail(attribute_object(object, "residual_tokens"),
               "expected >= 0, got " + std::to_string(settings.residual_tokens));
  }
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

void check_tensor(const Rules& rules, const std::string& object, Kind kind, const QuantizerSettings& settings,
                  const TensorQuantizer& q, const ModelFingerprint& model) {
  const TensorQuantizerSettings& s = settings_of(settings, kind);
  const std::string prefix = kind_name(kind) + "_";
  const bool offline = s.grouping == Grouping::kPerChannelOffline;
  const std::string grouping = prefix + "grouping is " + std::string(grouping_name(s.grouping));

  // Grid: 2^bits strictly ascending finite levels, only for non-uniform settings.
  const std::string grid = object + "/grid";
  if (s.non_uniform) {
    const size_t levels = size_t{1} << settings.bits;
    if (q.grid.size() != levels) {
      rules.fail(grid, "expected 2^bits = " + std::to_string(levels) + " levels (bits is " +
                           std::to_string(settings.bits) + "), got " + std::to_string(q.grid.size()));
    }
    for (size_t i = 0; i < levels; ++i) {
      if (!std::isfinite(q.grid[i])) {
        rules.fail(grid, "expected finite levels, element [" + std::to_string(i) + "] is " + number(q.grid[i]));
      }
      if (i > 0 && !(q.grid[i] > q.grid[i - 1])) {
        rules.fail(grid, "expected strictly ascending levels, element [" + std::to_string(i) + "] (" +
                             number(q.grid[i]) + ") is not above element [" + std::to_string(i - 1) + "] (" +
                             number(q.grid[i - 1]) + ")");
      }
    }
  } else {
    check_absent(rules, grid, !q.grid.empty(), prefix + "non_uniform is 0 (uniform integer levels)");
  }

  // Per-channel scales and offsets, fitted offline.
  const std::string scale = object + "/channel_scale";
  const std::string offset = object + "/channel_offset";
  if (offline) {
    const std::string because = "when " + grouping;
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
    const std::string why = grouping + " (channel scales belong to per_channel_offline)";
    check_absent(rules, scale, !q.channel_scale.empty() || !q.channel_scale.shape.empty(), why);
    check_absent(rules, offset, !q.channel_offset.empty() || !q.channel_offset.shape.empty(), why);
  }

  // Outlier thresholds: offline per-channel groupings with outliers only;
  // runtime groupings find outliers per token (outlier_tau).
  const std::string low = object + "/outlier_low";
  const std::string high = object + "/outlier_high";
  const bool thresholds = offline && s.outlier_fraction > 0;
  const bool runtime_outliers = !offline && s.outlier_fraction > 0;
  if (thresholds) {
    const std::string because = "when " + std::string(kind == Kind::kKeys ? "keys" : "values") +
                                "_outlier_fraction is " + number(s.outlier_fraction) + " (> 0) with per_channel_offline";
    check_head_array(rules, low, q.outlier_low, model, because);
    check_head_array(rules, high, q.outlier_high, model, because);
    for (size_t i = 0; i < q.outlier_low.values.size(); ++i) {
      const double lo = q.outlier_low.values[i];
      const double hi = q.outlier_high.values[i];
      const std::string at = "element " + element_text(i, model.head_dim);
      if (lo > hi) rules.fail(low, "expected low <= high, " + at + " has " + number(lo) + " > " + number(hi));
      if (!offline) continue;
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
    const std::string why = s.outlier_fraction > 0
                                ? std::string("outliers of runtime groupings are found per token (outlier_tau)")
                                : std::string("the outlier fraction is 0");
    check_absent(rules, low, !q.outlier_low.empty() || !q.outlier_low.shape.empty(), why);
    check_absent(rules, high, !q.outlier_high.empty() || !q.outlier_high.shape.empty(), why);
  }

  // tau: runtime groupings with outliers only.
  const std::string tau = attribute_object(object, "outlier_tau");
  if (!std::isfinite(q.outlier_tau)) rules.fail(tau, "expected a finite value, got " + number(q.outlier_tau));
  if (runtime_outliers) {
    if (!(q.outlier_tau > 0)) {
      rules.fail(tau, "expected > 0 when the outlier fraction is " + number(s.outlier_fraction) + ", got " +
                          number(q.outlier_tau));
    }
  } else if (q.outlier_tau != 0) {
    rules.fail(tau,
               "expected 0 (unused: " +
                   std::string(thresholds ? "per_channel_offline uses outlier_low/high" : "the outlier fraction is 0") +
                   "), got " + number(q.outlier_tau));
  }

  // Clipping: runtime groupings only.
  const std::string clip = attribute_object(object, "clip_ratio");
  if (!std::isfinite(q.clip_ratio) || q.clip_ratio <= 0 || q.clip_ratio > 1) {
    rules.fail(clip, "expected a ratio in (0, 1], got " + number(q.clip_ratio));
  }
  if (offline && q.clip_ratio != 1.0f) {
    rules.fail(clip, "expected 1 (unused: " + grouping + ", scales are fitted offline), got " + number(q.clip_ratio));
  }
}

void check_stats(const Rules& rules, const std::string& object, const LayerCalibrationStats& stats) {
  const std::array<std::tuple<const char*, double, bool>, 5> items = {{
      {"key_relative_mse", stats.key_relative_mse, false},
      {"value_relative_mse", stats.value_relative_mse, false},
      {"key_outlier_fraction", stats.key_outlier_fraction, true},
      {"value_outlier_fraction", stats.value_outlier_fraction, true},
      {"logit_relative_mse", stats.logit_relative_mse, false},
  }};
  for (const auto& [name, value, fraction] : items) {
    if (!std::isfinite(value) || value < 0 || (fraction && value > 1)) {
      rules.fail(attribute_object(object, name), std::string("expected a finite value ") +
                                                     (fraction ? "in [0, 1]" : ">= 0") + ", got " + number(value));
    }
  }
}

// Per-token groups tile the head: min(group, head_dim) channels divide head_dim.
void check_groups_fit_heads(const Rules& rules, const std::string& object, const QuantizerSettings& settings,
                            const ModelFingerprint& model) {
  for (const Kind kind : kKinds) {
    const TensorQuantizerSettings& s = settings_of(settings, kind);
    if (s.grouping != Grouping::kPerToken || s.group >= model.head_dim || model.head_dim % s.group == 0) continue;
    rules.fail(attribute_object(object, setting_attribute(kind, "group")),
               "expected a divisor of head_dim (" + std::to_string(model.head_dim) + ") or >= head_dim, got " +
                   std::to_string(s.group));
  }
}

void check_config(const Rules& rules, const QuantizerConfig& config, const ModelFingerprint& model) {
  check_name(rules, config.name);
  const std::string object = config_object(config.name);
  check_settings(rules, object, config.settings);
  check_groups_fit_heads(rules, object, config.settings, model);
  check_effective_bits(rules, object + "/effective_bits", config.effective_bits);
  if (config.layers.size() != static_cast<size_t>(model.num_layers)) {
    rules.fail(object + "/layers", "expected " + std::to_string(model.num_layers) +
                                       " layers (/model@num_layers), got " + std::to_string(config.layers.size()));
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
          rules.fail(tensor_object(config.name, b, kind) + "/channel_scale",
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
  if (artifact.configs.empty()) rules.fail("/configs@names", "expected at least one configuration");
  std::set<std::string> names;
  for (const auto& config : artifact.configs) {
    if (!names.insert(config.name).second) {
      rules.fail("/configs@names", "expected unique names, got \"" + config.name + "\" twice");
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
  const Location where(group.where().file(), group.where().child("effective_bits"));
  std::vector<double> values;
  for (const auto& [context, bits] : rows) {
    values.push_back(static_cast<double>(context));
    values.push_back(bits);
  }
  const std::array<hsize_t, 2> dims = {rows.size(), 2};
  hdf5::DataspaceId space(where.check(H5Screate_simple(2, dims.data(), nullptr), "cannot create"));
  hdf5::DatasetId dataset(where.check(
      H5Dcreate2(group.id(), "effective_bits", H5T_IEEE_F64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
      "cannot create"));
  where.check(H5Dwrite(dataset.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), "cannot write");
}

std::vector<std::pair<int64_t, double>> read_effective_bits(const Group& group) {
  const Dataset dataset = group.open_dataset("effective_bits");
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
  group.write_scalar<int64_t>("calibration_tokens", calibration.calibration_tokens);
  group.write_string("store_file", calibration.store_file);
  Group sources = group.create_group("sources");
  for (size_t k = 0; k < calibration.sources.size(); ++k) {
    Group source = sources.create_group(std::to_string(k));
    write_capture_provenance(source, calibration.sources[k]);
  }
}

CalibrationProvenance read_calibration(const Group& group) {
  CalibrationProvenance calibration;
  calibration.calibration_tokens = group.read_integer<int64_t>("calibration_tokens");
  calibration.store_file = group.read_string("store_file");
  const Group sources = group.open_group("sources");
  const int64_t count = sources.child_count();
  if (count < 1) sources.where().fail("expected at least one source (group 0)");
  for (int64_t k = 0; k < count; ++k) {
    calibration.sources.push_back(read_capture_provenance(sources.open_group(std::to_string(k))));
  }
  return calibration;
}

void write_settings(Group& group, const QuantizerSettings& settings) {
  group.write_string("method", std::string(method_name(settings.method)));
  group.write_scalar<int64_t>("bits", settings.bits);
  write_bool(group, "keys_pre_rope", settings.keys_pre_rope);
  group.write_scalar<int64_t>("sink_tokens", settings.sink_tokens);
  group.write_scalar<int64_t>("residual_tokens", settings.residual_tokens);
  write_bool(group, "fisher_weighted", settings.fisher_weighted);
  write_bool(group, "q_norm", settings.keys.q_norm != QNorm::kNone || settings.values.q_norm != QNorm::kNone);
  for (const Kind kind : kKinds) {
    const TensorQuantizerSettings& s = settings_of(settings, kind);
    group.write_string(setting_attribute(kind, "grouping"), std::string(grouping_name(s.grouping)));
    group.write_scalar<int64_t>(setting_attribute(kind, "group"), s.group);
    write_bool(group, setting_attribute(kind, "non_uniform"), s.non_uniform);
    write_float(group, setting_attribute(kind, "outlier_fraction"), s.outlier_fraction, H5T_IEEE_F64LE);
  }
}

QuantizerSettings read_settings(const Group& group) {
  QuantizerSettings settings;
  auto fail = [&](const std::string& name, const std::string& what) {
    Location(group.where().file(), attribute_object(group.where().name(), name)).fail(what);
  };
  const std::string method = group.read_string("method");
  const auto parsed_method = parse_method(method);
  if (!parsed_method) fail("method", "expected kvquant, kivi, int2-rot or rtn, got \"" + method + "\"");
  settings.method = *parsed_method;
  const int64_t bits = group.read_integer<int64_t>("bits");
  if (bits < 2 || bits > 4) fail("bits", "expected 2, 3 or 4, got " + std::to_string(bits));
  settings.bits = static_cast<int>(bits);
  settings.keys_pre_rope = read_bool(group, "keys_pre_rope");
  settings.sink_tokens = group.read_integer<int64_t>("sink_tokens");
  settings.residual_tokens = group.read_integer<int64_t>("residual_tokens");
  settings.fisher_weighted = read_bool(group, "fisher_weighted");
  const QNorm q_norm = read_bool(group, "q_norm") ? QNorm::kIterated : QNorm::kNone;
  for (const Kind kind : kKinds) {
    TensorQuantizerSettings& s = settings_of(settings, kind);
    const std::string grouping_attribute = setting_attribute(kind, "grouping");
    const std::string grouping = group.read_string(grouping_attribute);
    const auto parsed_grouping = parse_grouping(grouping);
    if (!parsed_grouping) {
      fail(grouping_attribute,
           "expected per_token, per_channel_tokens or per_channel_offline, got \"" + grouping + "\"");
    }
    s.grouping = *parsed_grouping;
    s.group = group.read_integer<int64_t>(setting_attribute(kind, "group"));
    s.non_uniform = read_bool(group, setting_attribute(kind, "non_uniform"));
    s.outlier_fraction = read_float(group, setting_attribute(kind, "outlier_fraction"));
    s.q_norm = s.non_uniform ? q_norm : QNorm::kNone;
  }
  return settings;
}

void write_stats(Group& group, const LayerCalibrationStats& stats) {
  write_float(group, "key_relative_mse", stats.key_relative_mse, H5T_IEEE_F64LE);
  write_float(group, "value_relative_mse", stats.value_relative_mse, H5T_IEEE_F64LE);
  write_float(group, "key_outlier_fraction", stats.key_outlier_fraction, H5T_IEEE_F64LE);
  write_float(group, "value_outlier_fraction", stats.value_outlier_fraction, H5T_IEEE_F64LE);
  write_float(group, "logit_relative_mse", stats.logit_relative_mse, H5T_IEEE_F64LE);
}

LayerCalibrationStats read_stats(const Group& group) {
  LayerCalibrationStats stats;
  stats.key_relative_mse = read_float(group, "key_relative_mse");
  stats.value_relative_mse = read_float(group, "value_relative_mse");
  stats.key_outlier_fraction = read_float(group, "key_outlier_fraction");
  stats.value_outlier_fraction = read_float(group, "value_outlier_fraction");
  stats.logit_relative_mse = read_float(group, "logit_relative_mse");
  return stats;
}

// Which datasets a tensor group holds under these settings.
struct Expected {
  bool grid, channel, thresholds;
};
Expected expected_datasets(const QuantizerSettings& settings, Kind kind) {
  const TensorQuantizerSettings& s = settings_of(settings, kind);
  const bool offline = s.grouping == Grouping::kPerChannelOffline;
  return {s.non_uniform, offline, offline && s.outlier_fraction > 0};
}

void write_tensor(Group& group, const TensorQuantizer& q) {
  write_float(group, "clip_ratio", q.clip_ratio, H5T_IEEE_F32LE);
  write_float(group, "outlier_tau", q.outlier_tau, H5T_IEEE_F32LE);
  if (!q.grid.empty()) write_array(group, "grid", {static_cast<int64_t>(q.grid.size())}, q.grid.data());
  const std::array<std::pair<const char*, const Float32Array*>, 4> arrays = {{
      {"channel_scale", &q.channel_scale},
      {"channel_offset", &q.channel_offset},
      {"outlier_low", &q.outlier_low},
      {"outlier_high", &q.outlier_high},
  }};
  for (const auto& [name, array] : arrays) {
    if (!array->empty()) write_array(group, name, array->shape, array->values.data());
  }
}

TensorQuantizer read_tensor(const Group& group, Kind kind, const QuantizerSettings& settings,
                            const ModelFingerprint& model) {
  TensorQuantizer q;
  q.clip_ratio = static_cast<float>(read_float(group, "clip_ratio"));
  q.outlier_tau = static_cast<float>(read_float(group, "outlier_tau"));
  const Expected expected = expected_datasets(settings, kind);
  const std::string prefix = kind_name(kind) + "_";
  auto refuse_present = [&](const char* name, const std::string& why) {
    if (group.has_child(name)) Location(group.where().file(), group.where().child(name)).fail("expected none: " + why);
  };
  if (expected.grid) {
    const std::vector<int64_t> shape = {int64_t{1} << settings.bits};
    q.grid = read_array(group, "grid", shape, "2^bits levels").values;
  } else {
    refuse_present("grid", prefix + "non_uniform is 0 (uniform integer levels)");
  }
  const std::vector<int64_t> heads = {model.num_kv_heads, model.head_dim};
  const std::string heads_meaning = "[num_kv_heads, head_dim] of /model";
  const std::string grouping =
      prefix + "grouping is " + std::string(grouping_name(settings_of(settings, kind).grouping));
  if (expected.channel) {
    q.channel_scale = read_array(group, "channel_scale", heads, heads_meaning);
    q.channel_offset = read_array(group, "channel_offset", heads, heads_meaning);
  } else {
    refuse_present("channel_scale", grouping + " (channel scales belong to per_channel_offline)");
    refuse_present("channel_offset", grouping + " (channel scales belong to per_channel_offline)");
  }
  if (expected.thresholds) {
    q.outlier_low = read_array(group, "outlier_low", heads, heads_meaning);
    q.outlier_high = read_array(group, "outlier_high", heads, heads_meaning);
  } else {
    const std::string why = kind == Kind::kKeys ? "keys_outlier_fraction is 0"
                                                : "values outliers are found per token at runtime (outlier_tau)";
    refuse_present("outlier_low", why);
    refuse_present("outlier_high", why);
  }
  return q;
}

void write_config(Group& group, const QuantizerConfig& config) {
  write_settings(group, config.settings);
  write_effective_bits(group, config.effective_bits);
  Group layers = group.create_group("layers");
  for (size_t i = 0; i < config.layers.size(); ++i) {
    Group layer = layers.create_group(std::to_string(i));
    write_stats(layer, config.layers[i].stats);
    for (const Kind kind : kKinds) {
      Group tensor = layer.create_group(kind_name(kind));
      write_tensor(tensor, quantizer_of(config.layers[i], kind));
    }
  }
}

QuantizerConfig read_config(const Rules& rules, const Group& group, const std::string& name,
                            const ModelFingerprint& model) {
  QuantizerConfig config;
  config.name = name;
  config.settings = read_settings(group);
  // Settings first: the datasets' presence and shapes depend on them.
  check_settings(rules, group.where().name(), config.settings);
  check_groups_fit_heads(rules, group.where().name(), config.settings, model);
  config.effective_bits = read_effective_bits(group);
  const Group layers = group.open_group("layers");
  if (layers.child_count() != model.num_layers) {
    layers.where().fail("expected " + std::to_string(model.num_layers) + " layers (/model@num_layers), got " +
                        std::to_string(layers.child_count()));
  }
  for (int64_t i = 0; i < model.num_layers; ++i) {
    const Group layer = layers.open_group(std::to_string(i));
    LayerQuantizers quantizers;
    quantizers.stats = read_stats(layer);
    for (const Kind kind : kKinds) {
      quantizer_of(quantizers, kind) = read_tensor(layer.open_group(kind_name(kind)), kind, config.settings, model);
    }
    config.layers.push_back(std::move(quantizers));
  }
  return config;
}

void check_schema(const Group& root) {
  const Location schema_where(root.where().file(), "/@schema");
  const std::string schema = root.read_string("schema");
  if (schema != kSchema) schema_where.fail(std::string("expected \"") + kSchema + "\", got \"" + schema + "\"");
  const int64_t version = root.read_integer<int64_t>("schema_version");
  if (version != kArtifactVersion) {
    Location(root.where().file(), "/@schema_version")
        .fail("expected " + std::to_string(kArtifactVersion) + " (the version this kvforge reads), got " +
              std::to_string(version));
  }
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
    root.write_string("schema", kSchema);
    root.write_scalar<int64_t>("schema_version", kArtifactVersion);
    root.write_string("tool_version", artifact.tool_version);
    root.write_string("created_utc", artifact.created_utc);
    root.write_string("command_line", artifact.command_line);
    Group model = root.create_group("model");
    write_model_fingerprint(model, artifact.model);
    Group calibration = root.create_group("calibration");
    write_calibration(calibration, artifact.calibration);
    Group configs = root.create_group("configs");
    std::vector<std::string> names;
    for (const auto& config : artifact.configs) names.push_back(config.name);
    configs.write_strings("names", names);
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
  check_schema(root);
  Artifact artifact;
  artifact.tool_version = root.read_string("tool_version");
  artifact.created_utc = root.read_string("created_utc");
  artifact.command_line = root.read_string("command_line");
  artifact.model = read_model_fingerprint(root.open_group("model"));
  check_model(rules, artifact.model);
  artifact.calibration = read_calibration(root.open_group("calibration"));
  const Group configs = root.open_group("configs");
  const std::vector<std::string> names = configs.read_strings("names");
  std::set<std::string> seen;
  for (const auto& name : names) {
    check_name(rules, name);
    if (!seen.insert(name).second) rules.fail("/configs@names", "expected unique names, got \"" + name + "\" twice");
  }
  if (configs.child_count() != static_cast<int64_t>(names.size())) {
    rules.fail("/configs", "expected exactly the " + std::to_string(names.size()) +
                               " groups listed in /configs@names, got " + std::to_string(configs.child_count()));
  }
  for (const auto& name : names) {
    artifact.configs.push_back(read_config(rules, configs.open_group(name), name, artifact.model));
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
