#include "eval/evaluation_json.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "formats/input_error.h"
#include "formats/json_error_text.h"

namespace kvforge {
namespace {

using nlohmann::json;

// JSON numbers cannot be NaN or infinite; nlohmann would write null and
// lose which one it was, so those three travel as strings.
json number_to_json(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  return value;
}

json perplexity_to_json(const CachePerplexity& p) {
  return {{"windows", p.windows},
          {"tokens_scored", p.tokens_scored},
          {"mean_nll", number_to_json(p.mean_nll)},
          {"nll_stderr", number_to_json(p.nll_stderr)},
          {"perplexity", number_to_json(p.perplexity)},
          {"kl_mean", number_to_json(p.kl_mean)},
          {"kl_p99", number_to_json(p.kl_p99)},
          {"kl_p999", number_to_json(p.kl_p999)},
          {"top1_agreement", number_to_json(p.top1_agreement)}};
}

json configuration_to_json(const ConfigurationEvaluation& c) {
  json attention = json::array();
  for (const LayerAttentionError& layer : c.attention) {
    attention.push_back({{"layer", layer.layer},
                         {"key_kl", number_to_json(layer.key_kl)},
                         {"key_output", number_to_json(layer.key_output)},
                         {"value_output", number_to_json(layer.value_output)}});
  }
  json needles = json::array();
  for (const NeedleCell& cell : c.needles) {
    needles.push_back({{"context", cell.context},
                       {"depth", number_to_json(cell.depth)},
                       {"probes", cell.probes},
                       {"correct", cell.correct}});
  }
  json needle_probes = json::array();
  for (const NeedleAnswer& a : c.needle_answers) {
    needle_probes.push_back({{"context", a.context},
                             {"depth", number_to_json(a.depth)},
                             {"probe", a.probe},
                             {"expected", a.expected},
                             {"answer", a.answer},
                             {"correct", a.correct},
                             {"margin", number_to_json(a.margin)}});
  }
  json tasks = json::array();
  for (const TaskAnswer& task : c.tasks) {
    tasks.push_back({{"id", task.id}, {"answer", task.answer}, {"exact", task.exact}, {"contains", task.contains}});
  }
  return {{"name", c.name},
          {"method", c.method},
          {"bits", c.bits},
          {"rotated", c.rotated},
          {"effective_bits", number_to_json(c.effective_bits)},
          {"cache_bytes_per_token", number_to_json(c.cache_bytes_per_token)},
          {"seconds", number_to_json(c.seconds)},
          {"perplexity", c.perplexity ? perplexity_to_json(*c.perplexity) : json(nullptr)},
          {"attention", std::move(attention)},
          {"needles", std::move(needles)},
          {"needle_probes", std::move(needle_probes)},
          {"tasks", std::move(tasks)},
          {"needle_accuracy", number_to_json(c.needle_accuracy())},
          {"task_accuracy", number_to_json(c.task_accuracy())},
          {"mean_attention_error", number_to_json(c.mean_attention_error())}};
}

// One JSON object being read, with its path from the document's root, so
// that every error names the field it is about.
class ObjectReader {
 public:
  ObjectReader(const json& object, std::string path, const std::string& source)
      : object_(object), path_(std::move(path)), source_(source) {
    if (!object_.is_object()) fail(path_, "an object, got " + quote_json(object_));
  }

  std::string text(const char* key) const {
    const json& value = field(key);
    if (!value.is_string()) fail(child(key), "a string, got " + quote_json(value));
    return value.get<std::string>();
  }

  bool boolean(const char* key) const {
    const json& value = field(key);
    if (!value.is_boolean()) fail(child(key), "true or false, got " + quote_json(value));
    return value.get<bool>();
  }

  int64_t integer(const char* key) const {
    const json& value = field(key);
    if (!value.is_number_integer()) fail(child(key), "an integer, got " + quote_json(value));
    return value.get<int64_t>();
  }

  int64_t count(const char* key) const {
    const int64_t value = integer(key);
    if (value < 0) fail(child(key), "a count >= 0, got " + std::to_string(value));
    return value;
  }

  double number(const char* key) const {
    const json& value = field(key);
    if (value.is_number()) return value.get<double>();
    if (value == "NaN") return std::numeric_limits<double>::quiet_NaN();
    if (value == "Infinity") return std::numeric_limits<double>::infinity();
    if (value == "-Infinity") return -std::numeric_limits<double>::infinity();
    fail(child(key), "a number (or \"NaN\", \"Infinity\", \"-Infinity\"), got " + quote_json(value));
  }

  // The array under `key`, each element read as an object by `read_one`.
  template <typename Read>
  auto objects(const char* key, Read read_one) const {
    const json& value = field(key);
    if (!value.is_array()) fail(child(key), "an array, got " + quote_json(value));
    std::vector<decltype(read_one(std::declval<const ObjectReader&>()))> result;
    result.reserve(value.size());
    for (std::size_t i = 0; i < value.size(); ++i) {
      result.push_back(read_one(ObjectReader(value[i], child(key) + "[" + std::to_string(i) + "]", source_)));
    }
    return result;
  }

  bool is_null(const char* key) const { return field(key).is_null(); }
  bool has(const char* key) const { return object_.contains(key); }
  ObjectReader object(const char* key) const { return ObjectReader(field(key), child(key), source_); }

  [[noreturn]] void fail(const std::string& path, const std::string& expected) const {
    throw InputError(source_, path, expected);
  }
  const std::string& path() const { return path_; }

 private:
  std::string child(const char* key) const { return path_.empty() ? key : path_ + "." + key; }

  const json& field(const char* key) const {
    const auto found = object_.find(key);
    if (found == object_.end()) fail(child(key), "a required field, missing");
    return *found;
  }

  const json& object_;
  std::string path_;
  const std::string& source_;
};

CachePerplexity perplexity_from_json(const ObjectReader& in) {
  CachePerplexity p;
  p.windows = in.count("windows");
  p.tokens_scored = in.count("tokens_scored");
  p.mean_nll = in.number("mean_nll");
  p.nll_stderr = in.number("nll_stderr");
  p.perplexity = in.number("perplexity");
  p.kl_mean = in.number("kl_mean");
  p.kl_p99 = in.number("kl_p99");
  p.kl_p999 = in.number("kl_p999");
  p.top1_agreement = in.number("top1_agreement");
  return p;
}

LayerAttentionError attention_from_json(const ObjectReader& in) {
  return {in.count("layer"), in.number("key_kl"), in.number("key_output"), in.number("value_output")};
}

NeedleCell needle_from_json(const ObjectReader& in) {
  NeedleCell cell{in.count("context"), in.number("depth"), in.count("probes"), in.count("correct")};
  if (cell.correct > cell.probes) {
    in.fail(in.path() + ".correct", "at most probes (" + std::to_string(cell.probes) + "), got " +
                                        std::to_string(cell.correct));
  }
  return cell;
}

NeedleAnswer needle_answer_from_json(const ObjectReader& in) {
  NeedleAnswer a;
  a.context = in.count("context");
  a.depth = in.number("depth");
  a.probe = in.count("probe");
  a.expected = in.text("expected");
  a.answer = in.text("answer");
  a.correct = in.boolean("correct");
  a.margin = in.number("margin");
  return a;
}

TaskAnswer task_from_json(const ObjectReader& in) {
  return {in.text("id"), in.text("answer"), in.boolean("exact"), in.boolean("contains")};
}

// schema: the document's (1 has no needle_probes).
ConfigurationEvaluation configuration_from_json(const ObjectReader& in, int64_t schema) {
  ConfigurationEvaluation c;
  c.name = in.text("name");
  c.method = in.text("method");
  const int64_t bits = in.integer("bits");
  if (bits < 1 || bits > 32) in.fail(in.path() + ".bits", "1 to 32, got " + std::to_string(bits));
  c.bits = static_cast<int>(bits);
  c.rotated = in.boolean("rotated");
  c.effective_bits = in.number("effective_bits");
  c.cache_bytes_per_token = in.number("cache_bytes_per_token");
  c.seconds = in.number("seconds");
  if (!in.is_null("perplexity")) c.perplexity = perplexity_from_json(in.object("perplexity"));
  c.attention = in.objects("attention", attention_from_json);
  c.needles = in.objects("needles", needle_from_json);
  if (schema >= 2) c.needle_answers = in.objects("needle_probes", needle_answer_from_json);
  c.tasks = in.objects("tasks", task_from_json);
  return c;
}

}  // namespace

json evaluation_to_json(const Evaluation& evaluation) {
  json configurations = json::array();
  for (const ConfigurationEvaluation& c : evaluation.configurations) configurations.push_back(configuration_to_json(c));
  return {{"schema", kEvaluationJsonSchema},
          {"model", evaluation.model},
          {"artifact", evaluation.artifact},
          {"data", evaluation.data},
          {"command_line", evaluation.command_line},
          {"device", evaluation.device},
          {"date", evaluation.date},
          {"context", evaluation.context},
          {"chunk", evaluation.chunk},
          {"configurations", std::move(configurations)}};
}

Evaluation evaluation_from_json(const json& document, const std::string& source) {
  const ObjectReader in(document, "", source);
  const int64_t schema = in.integer("schema");
  if (schema < 1 || schema > kEvaluationJsonSchema) {
    in.fail("schema", "1 to " + std::to_string(kEvaluationJsonSchema) + " (this kvforge's evaluation formats), got " +
                          std::to_string(schema));
  }
  Evaluation evaluation;
  evaluation.model = in.text("model");
  evaluation.artifact = in.text("artifact");
  evaluation.data = in.text("data");
  evaluation.command_line = in.text("command_line");
  evaluation.device = in.text("device");
  evaluation.date = in.text("date");
  evaluation.context = in.count("context");
  evaluation.chunk = in.count("chunk");
  evaluation.configurations =
      in.objects("configurations", [schema](const ObjectReader& c) { return configuration_from_json(c, schema); });
  if (evaluation.configurations.empty()) {
    in.fail("configurations", std::string("at least the 16-bit configuration \"") + kFullPrecisionName + "\", got none");
  }
  if (evaluation.configurations.front().name != kFullPrecisionName) {
    in.fail("configurations[0].name", std::string("\"") + kFullPrecisionName + "\" (the 16-bit cache comes first), got " +
                                          quote_json(evaluation.configurations.front().name));
  }
  return evaluation;
}

Evaluation read_evaluation_json(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path.string(), "", "a readable evaluation JSON file (kvforge eval --json)");
  std::ostringstream bytes;
  bytes << in.rdbuf();
  json document;
  try {
    document = json::parse(bytes.str());
  } catch (const json::parse_error& error) {
    throw InputError(path.string(), "", "valid JSON: " + parse_error_text(error));
  }
  return evaluation_from_json(document, path.string());
}

}  // namespace kvforge
