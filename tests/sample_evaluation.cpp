#include "tests/sample_evaluation.h"

#include <cmath>

namespace kvforge::testing {
namespace {

// The grid every configuration is probed on; `correct(context_index,
// depth_index)` of 4 probes per cell.
template <typename Correct>
std::vector<NeedleCell> needle_grid(Correct correct) {
  std::vector<NeedleCell> cells;
  const int64_t contexts[] = {256, 512, 1024};
  const double depths[] = {0, 0.25, 0.5, 0.75, 1};
  for (int c = 0; c < 3; ++c) {
    for (int d = 0; d < 5; ++d) cells.push_back({contexts[c], depths[d], 4, correct(c, d)});
  }
  return cells;
}

std::vector<LayerAttentionError> attention(double key_scale, double value_scale) {
  std::vector<LayerAttentionError> layers;
  for (int64_t layer = 0; layer < 5; ++layer) {
    const double growth = 1 + 0.25 * static_cast<double>(layer);
    layers.push_back({layer, 0.01 * key_scale * growth, 0.05 * key_scale * growth, 0.04 * value_scale / growth});
  }
  return layers;
}

ConfigurationEvaluation configuration(std::string name, std::string method, bool rotated, double effective_bits,
                                      double perplexity, double kl_mean, double top1) {
  ConfigurationEvaluation c;
  c.name = std::move(name);
  c.method = std::move(method);
  c.bits = c.method == "fp16" ? 16 : 2;
  c.rotated = rotated;
  c.effective_bits = effective_bits;
  c.cache_bytes_per_token = 5 * 2 * 2 * 128 * effective_bits / 8;  // layers x (K, V) x KV heads x head_dim
  c.perplexity = CachePerplexity{8,         4088,          std::log(perplexity), 0.021, perplexity,
                                 kl_mean,   kl_mean * 9.5, kl_mean * 21,         top1};
  c.seconds = 1.5;
  return c;
}

}  // namespace

Evaluation sample_evaluation() {
  Evaluation e;
  e.model = "/work/shared/models/pyllama-16m";
  e.artifact = "out/demo/artifact.h5";
  e.data = "/work/shared/data/heldout.txt";
  e.command_line =
      "kvforge eval --model /work/shared/models/pyllama-16m --artifact out/demo/artifact.h5 --data "
      "/work/shared/data/heldout.txt --ctx 512 --chunk 128 --gate 'needle>=0.98*fp16,ppl<=1.03*fp16'";
  e.device = "cpu";
  e.date = "2025-06-01T12:00:00Z";
  e.context = 512;
  e.chunk = 128;

  ConfigurationEvaluation fp16 = configuration(kFullPrecisionName, "fp16", false, 16, 20.5, 0, 1);
  fp16.perplexity->kl_p99 = fp16.perplexity->kl_p999 = 0;
  fp16.attention = attention(0, 0);
  fp16.needles = needle_grid([](int, int) { return 4; });
  fp16.tasks = {{"capital", "Paris", true, true}, {"2", "The answer is 42", false, true}, {"color", "red", false, false}};

  ConfigurationEvaluation kvquant = configuration("kvquant-2bit", "kvquant", true, 2.31, 21.02, 0.048, 0.931);
  kvquant.attention = attention(0.8, 0.7);
  kvquant.needles = needle_grid([](int c, int d) { return c == 2 && d == 2 ? 3 : 4; });
  kvquant.tasks = fp16.tasks;

  ConfigurationEvaluation kivi = configuration("kivi-2bit", "kivi", false, 2.63, 21.9, 0.083, 0.902);
  kivi.attention = attention(1.3, 1.1);
  kivi.needles = needle_grid([](int c, int d) { return static_cast<int64_t>(std::max(0, 4 - c - (d == 2 ? 1 : 0))); });
  kivi.tasks = {{"capital", "Lyon", false, false}, {"2", "The answer is 42", false, true}, {"color", "red", false, false}};

  ConfigurationEvaluation rtn = configuration("rtn-2bit", "rtn", false, 2.5, 27.4, 0.31, 0.78);
  rtn.attention = attention(3.2, 2.4);
  rtn.needles = needle_grid([](int c, int d) { return static_cast<int64_t>(std::max(0, 3 - c - d / 2)); });
  rtn.tasks = {{"capital", "Paris, France", false, true}, {"2", "4", false, false}, {"color", "blue", true, true}};

  // Two probes' answers per configuration (the JSON's per-probe records;
  // the cells above stand for the whole grid).
  fp16.needle_answers = {{256, 0, 0, "k3x9q\"", "k3x9q\"", true, 2.75}, {1024, 0.5, 3, "ab12cd\"", "ab12cd\"", true, 0.5}};
  kvquant.needle_answers = fp16.needle_answers;
  kvquant.needle_answers[1] = {1024, 0.5, 3, "ab12cd\"", "ab1", false, 3.0e-6};
  kivi.needle_answers = kvquant.needle_answers;
  rtn.needle_answers = {{256, 0, 0, "k3x9q\"", "x", false, 1.25}, {1024, 0.5, 3, "ab12cd\"", "q", false, 0.125}};

  e.configurations = {fp16, kvquant, kivi, rtn};
  return e;
}

}  // namespace kvforge::testing
