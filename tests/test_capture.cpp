// kvforge capture: recorded activations and Fisher sensitivity against HF
// transformers (forward hooks and autograd, scripts/make_capture_fixtures.py),
// and the capture command's streaming, resume and merge.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <vector>

#include "capture/activation_recorder.h"
#include "capture/capture.h"
#include "formats/activation_store.h"
#include "tests/cpu_kernel_family.h"
#include "tests/low_precision.h"
#include "tests/reference_tensors.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

using testing::fixtures_dir;
using testing::load_reference;
using testing::max_relative_error;

using Recorded = std::map<std::string, at::Tensor>;

Recorded record(const Transformer& model, const at::Tensor& ids, double* loss = nullptr, int64_t chunk = 1024) {
  Recorded recorded;
  RecorderOptions options{all_activation_fields(), chunk};
  const double value = record_activations(model, ids, options, [&](ActivationField field, int64_t layer, const at::Tensor& t) {
    recorded["layers." + std::to_string(layer) + "." + std::string(field_name(field))] = t.detach().to(at::kCPU, at::kFloat);
  });
  if (loss != nullptr) *loss = value;
  return recorded;
}

class RecorderAgainstTransformers : public ::testing::TestWithParam<std::string> {};

TEST_P(RecorderAgainstTransformers, ActivationsAndFisherEqualHooksAndAutograd) {
  const std::string name = GetParam();
  const auto ref = load_reference(fixtures_dir() / "reference" / ("capture_" + name + ".safetensors"));
  const auto model_dir = name == "pyllama" ? testing::pyllama_dir() : fixtures_dir() / "models" / name;
  const Transformer model = Transformer::load(model_dir, {c10::Device(c10::kCPU), c10::kFloat});
  double loss = 0;
  const Recorded recorded = record(model, ref.at("input_ids").to(at::kLong), &loss);
  EXPECT_NEAR(loss, ref.at("loss").item<double>(), 1e-5);
  ASSERT_EQ(recorded.size(), static_cast<size_t>(6 * model.config().num_layers));
  for (const auto& [key, tensor] : recorded) {
    ASSERT_TRUE(ref.count(key)) << key;
    ASSERT_EQ(tensor.sizes(), ref.at(key).sizes()) << key;
    // Squared gradients span many decades; compare them relative to each
    // layer's largest, like the activations.
    EXPECT_LT(max_relative_error(tensor, ref.at(key)), key.find("fisher") != std::string::npos ? 1e-3 : 1e-4) << key;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, RecorderAgainstTransformers,
                         ::testing::Values("llama3", "mistral", "qwen2", "qwen3", "pyllama"));

// The same on a GPU; skipped where there is none.
class CudaRecorderAgainstTransformers : public RecorderAgainstTransformers {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaRecorderAgainstTransformers, ActivationsAndFisherEqualHooksAndAutograd) {
  const std::string name = GetParam();
  const auto ref = load_reference(fixtures_dir() / "reference" / ("capture_" + name + ".safetensors"));
  const auto model_dir = name == "pyllama" ? testing::pyllama_dir() : fixtures_dir() / "models" / name;
  for (const auto backend : {AttentionBackend::kEager, AttentionBackend::kFused}) {
    const Transformer model = Transformer::load(model_dir, {c10::Device(c10::kCUDA), c10::kFloat, backend});
    double loss = 0;
    const Recorded recorded = record(model, ref.at("input_ids").to(at::kLong), &loss);
    EXPECT_NEAR(loss, ref.at("loss").item<double>(), 1e-4);
    for (const auto& [key, tensor] : recorded) {
      EXPECT_LT(max_relative_error(tensor, ref.at(key)), key.find("fisher") != std::string::npos ? 2e-3 : 1e-4)
          << key << " " << attention_label(backend);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, CudaRecorderAgainstTransformers,
                         ::testing::Values("llama3", "mistral", "qwen2", "qwen3", "pyllama"));

// bf16 q, k_pre and v against transformers' fp32 ones, layer by layer,
// within the bf16 error bound accumulated up to that tensor
// (tests/low_precision.cpp derives it; pyllama-16m is a bf16 checkpoint).
// transformers' own bf16 capture depends on the CPU's kernels, so it is no
// reference.
void expect_bf16_capture_within_bounds(const ComputeTarget& target) {
  const auto ref = load_reference(fixtures_dir() / "reference" / "capture_pyllama.safetensors");
  const Transformer model = Transformer::load(testing::pyllama_dir(), target);
  const Recorded recorded = record(model, ref.at("input_ids").to(at::kLong));
  const testing::RoundingCount roundings{model.config(), /*fp32_weights=*/false};
  const double u = testing::unit_roundoff(c10::kBFloat16);
  for (int64_t layer = 0; layer < model.config().num_layers; ++layer) {
    for (const char* field : {"q", "k_pre", "v"}) {
      const std::string key = "layers." + std::to_string(layer) + "." + field;
      const int64_t count = std::string(field) == "q" ? roundings.to_query(layer) : roundings.to_key_or_value(layer);
      const double bound = testing::accumulated_error_bound(count, u);
      const double error = max_relative_error(recorded.at(key), ref.at(key));
      std::cout << key << ": " << error / u << " u, bound " << bound / u << " u\n";
      EXPECT_LT(error, bound) << key;
    }
  }
}

TEST(CudaRecorder, Bf16CaptureEqualsTransformersFp32WithinTheBf16Bound) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  expect_bf16_capture_within_bounds({c10::Device(c10::kCUDA), c10::kBFloat16, AttentionBackend::kFused});
}

TEST(Recorder, Bf16CaptureEqualsTransformersFp32WithinTheBf16Bound) {
  KVFORGE_SKIP_IF_FORCED_CPU_FAMILY_UNAVAILABLE();
  expect_bf16_capture_within_bounds({c10::Device(c10::kCPU), c10::kBFloat16});
}

TEST(Recorder, LossChunkingDoesNotChangeFisher) {
  const auto ref = load_reference(fixtures_dir() / "reference" / "capture_llama3.safetensors");
  const Transformer model = Transformer::load(fixtures_dir() / "models" / "llama3", {c10::Device(c10::kCPU), c10::kFloat});
  const at::Tensor ids = ref.at("input_ids").to(at::kLong);
  double whole = 0, chunked = 0;
  const Recorded a = record(model, ids, &whole, 1024);
  const Recorded b = record(model, ids, &chunked, 5);
  EXPECT_NEAR(whole, chunked, 1e-6);
  for (const auto& [key, tensor] : a) EXPECT_LT(max_relative_error(b.at(key), tensor), 1e-5) << key;
}

TEST(Recorder, FisherIsZeroForTheLastPosition) {
  // The last position's key and value are seen only by the last query, whose
  // output predicts nothing: an analytic zero.
  const Transformer model = Transformer::load(fixtures_dir() / "models" / "llama3", {c10::Device(c10::kCPU), c10::kFloat});
  const Recorded recorded = record(model, at::arange(1, 13, at::kLong).unsqueeze(0));
  const at::Tensor last = recorded.at("layers.0.fisher_k").select(2, -1);
  EXPECT_EQ(last.abs().max().item<double>(), 0.0);
  EXPECT_GT(recorded.at("layers.0.fisher_k").select(2, 0).abs().max().item<double>(), 0.0);
}

TEST(WindowSampler, DeterministicAndInRange) {
  const auto a = sample_window_starts(1000, 100, 50, 7);
  EXPECT_EQ(a, sample_window_starts(1000, 100, 50, 7));
  EXPECT_NE(a, sample_window_starts(1000, 100, 50, 8));
  for (int64_t start : a) {
    EXPECT_GE(start, 0);
    EXPECT_LE(start, 900);
  }
  EXPECT_EQ(sample_window_starts(100, 100, 3, 1), std::vector<int64_t>(3, 0));
  EXPECT_THROW(sample_window_starts(99, 100, 1, 1), std::invalid_argument);
}

// ---- the command ----------------------------------------------------------

std::string quoted(const std::filesystem::path& path) { return "'" + path.string() + "'"; }

std::string capture_args(const std::filesystem::path& out, int samples, int seq_len, int seed = 3) {
  return "capture --quiet --model " + quoted(testing::pyllama_dir()) + " --data " +
         quoted(testing::shared_dir() / "data" / "calib.txt") + " --samples " + std::to_string(samples) +
         " --seq-len " + std::to_string(seq_len) + " --seed " + std::to_string(seed) + " --out " + quoted(out);
}

// Bit for bit; a difference is reported as one line per dataset (how many
// values differ, the first and the largest), not as two printed vectors of
// thousands of floats that bury the rest of the output.
void expect_same_data(const std::filesystem::path& a, const std::filesystem::path& b) {
  const ActivationStoreReader x(a), y(b);
  ASSERT_EQ(x.samples_complete(), y.samples_complete());
  const auto& layout = x.layout();
  for (int64_t sample = 0; sample < x.samples_complete(); ++sample) {
    EXPECT_EQ(x.read_tokens(sample), y.read_tokens(sample)) << "sample " << sample;
    EXPECT_EQ(x.stream_start(sample), y.stream_start(sample)) << "sample " << sample;
    for (int64_t layer = 0; layer < layout.model.num_layers; ++layer) {
      for (const auto field : layout.fields) {
        const std::vector<float> u = x.read(field, layer, sample), v = y.read(field, layer, sample);
        ASSERT_EQ(u.size(), v.size()) << field_name(field) << " layer " << layer << " sample " << sample;
        size_t differing = 0, first = 0, largest = 0;
        for (size_t i = 0; i < u.size(); ++i) {
          if (std::memcmp(&u[i], &v[i], sizeof(float)) == 0) continue;
          if (differing++ == 0) first = largest = i;
          if (std::fabs(u[i] - v[i]) > std::fabs(u[largest] - v[largest])) largest = i;
        }
        EXPECT_EQ(differing, 0u) << field_name(field) << " layer " << layer << " sample " << sample << ": "
                                 << differing << " of " << u.size() << " values differ; first [" << first
                                 << "] " << u[first] << " vs " << v[first] << ", largest [" << largest << "] "
                                 << u[largest] << " vs " << v[largest];
      }
    }
  }
}

TEST(CaptureCommand, StoreHoldsWhatTheRecorderComputes) {
  const auto dir = testing::scratch_dir("capture");
  const auto out = dir / "acts.h5";
  const auto result = testing::run_kvforge(capture_args(out, 2, 48));
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  EXPECT_FALSE(std::filesystem::exists(out.string() + ".partial"));
  const ActivationStoreReader store(out);
  EXPECT_TRUE(store.complete());
  EXPECT_EQ(store.layout().provenance.seq_len, 48);
  EXPECT_EQ(store.layout().model.num_layers, 5);
  EXPECT_EQ(store.layout().model.architecture, "LlamaForCausalLM");
  EXPECT_NE(store.layout().provenance.command_line.find("capture"), std::string::npos);
  const auto tokens = store.read_tokens(1);
  ASSERT_EQ(tokens.size(), 48u);
  EXPECT_EQ(tokens[0], 0);  // <|bos|>

  const Transformer model = Transformer::load(testing::pyllama_dir(), {c10::Device(c10::kCPU), c10::kFloat});
  const at::Tensor ids = at::tensor(at::ArrayRef<int32_t>(tokens), at::kInt).to(at::kLong).unsqueeze(0);
  const Recorded recorded = record(model, ids);
  for (const auto field : all_activation_fields()) {
    const auto stored = store.read(field, 3, 1);
    const at::Tensor expected = recorded.at("layers.3." + std::string(field_name(field)))[0].contiguous();
    ASSERT_EQ(static_cast<int64_t>(stored.size()), expected.numel());
    const at::Tensor actual = at::tensor(at::ArrayRef<float>(stored)).view(expected.sizes());
    EXPECT_TRUE(actual.equal(expected)) << field_name(field);
  }
  EXPECT_EQ(store.read_head(ActivationField::kValues, 2, 1, 0, 2).size(), 2u * 48 * 128);
}

TEST(CaptureCommand, ResumeAfterAKillEqualsAnUninterruptedRun) {
  const auto dir = testing::scratch_dir("resume");
  const auto whole = dir / "whole.h5";
  const auto resumed = dir / "resumed.h5";
  const auto uninterrupted = testing::run_kvforge(capture_args(whole, 4, 32));
  ASSERT_EQ(uninterrupted.exit_code, 0) << uninterrupted.stderr_text;

  const auto killed = testing::run_kvforge(capture_args(resumed, 4, 32), "KVFORGE_ABORT_AFTER_SAMPLES=2");
  EXPECT_EQ(killed.exit_code, 137) << killed.stderr_text;
  EXPECT_FALSE(std::filesystem::exists(resumed));
  ASSERT_TRUE(std::filesystem::exists(resumed.string() + ".partial"));
  EXPECT_EQ(ActivationStoreReader(resumed.string() + ".partial").samples_complete(), 2);

  const auto refused = testing::run_kvforge(capture_args(resumed, 4, 32));
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_NE(refused.stderr_text.find("--resume"), std::string::npos) << refused.stderr_text;

  const auto finished = testing::run_kvforge(capture_args(resumed, 4, 32) + " --resume");
  ASSERT_EQ(finished.exit_code, 0) << finished.stderr_text;
  expect_same_data(whole, resumed);

  // A resume with other settings is refused, naming what differs.
  const auto again = testing::run_kvforge(capture_args(dir / "other.h5", 4, 32), "KVFORGE_ABORT_AFTER_SAMPLES=1");
  EXPECT_EQ(again.exit_code, 137) << again.stderr_text;
  const auto mismatch = testing::run_kvforge(capture_args(dir / "other.h5", 4, 32, 99) + " --resume");
  EXPECT_EQ(mismatch.exit_code, 2);
  EXPECT_NE(mismatch.stderr_text.find("seed"), std::string::npos) << mismatch.stderr_text;
}

TEST(CaptureCommand, PeakMemoryDoesNotGrowWithSamples) {
  const auto dir = testing::scratch_dir("memory");
  const auto few = testing::run_kvforge(capture_args(dir / "few.h5", 2, 256));
  const auto many = testing::run_kvforge(capture_args(dir / "many.h5", 10, 256));
  ASSERT_EQ(few.exit_code, 0) << few.stderr_text;
  ASSERT_EQ(many.exit_code, 0) << many.stderr_text;
  // 5x the samples (each ~30 MB of float32 activations) within noise of the
  // same peak.
  EXPECT_LT(static_cast<double>(many.max_rss_kb), 1.05 * static_cast<double>(few.max_rss_kb) + 16 * 1024)
      << "peak RSS " << few.max_rss_kb << " kB for 2 samples, " << many.max_rss_kb << " kB for 10";
}

TEST(CaptureCommand, MergeConcatenatesStoresOfOneModelAndRefusesOthers) {
  const auto dir = testing::scratch_dir("merge");
  ASSERT_EQ(testing::run_kvforge(capture_args(dir / "a.h5", 2, 32, 1)).exit_code, 0);
  ASSERT_EQ(testing::run_kvforge(capture_args(dir / "b.h5", 1, 32, 2)).exit_code, 0);
  const auto merged = testing::run_kvforge("capture --quiet --merge " + quoted(dir / "a.h5") + " " +
                                           quoted(dir / "b.h5") + " --out " + quoted(dir / "c.h5"));
  ASSERT_EQ(merged.exit_code, 0) << merged.stderr_text;
  const ActivationStoreReader a(dir / "a.h5"), b(dir / "b.h5"), c(dir / "c.h5");
  EXPECT_EQ(c.samples_complete(), 3);
  EXPECT_EQ(c.sources().size(), 2u);
  EXPECT_EQ(c.read_tokens(2), b.read_tokens(0));
  EXPECT_EQ(c.read(ActivationField::kFisherKeys, 4, 1), a.read(ActivationField::kFisherKeys, 4, 1));

  // Another model: pyllama-16m with a different RoPE base.
  const auto other_model = dir / "other-model";
  std::filesystem::create_directories(other_model);
  for (const auto& entry : std::filesystem::directory_iterator(testing::pyllama_dir())) {
    if (entry.path().filename() != "config.json") {
      std::filesystem::create_symlink(entry.path(), other_model / entry.path().filename());
    }
  }
  std::string config = testing::read_file(testing::pyllama_dir() / "config.json");
  for (size_t at = config.find("500000.0"); at != std::string::npos; at = config.find("500000.0", at + 1)) {
    config.replace(at, 8, "100000.0");
  }
  testing::write_file(other_model / "config.json", config);
  const auto other = testing::run_kvforge(
      "capture --quiet --model " + quoted(other_model) + " --data " +
      quoted(testing::shared_dir() / "data" / "calib.txt") + " --samples 1 --seq-len 32 --out " +
      quoted(dir / "d.h5"));
  ASSERT_EQ(other.exit_code, 0) << other.stderr_text;
  const auto refused = testing::run_kvforge("capture --quiet --merge " + quoted(dir / "a.h5") + " " +
                                            quoted(dir / "d.h5") + " --out " + quoted(dir / "e.h5"));
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_NE(refused.stderr_text.find("rope"), std::string::npos) << refused.stderr_text;
  EXPECT_FALSE(std::filesystem::exists(dir / "e.h5"));
}

TEST(CaptureCommand, CudaStoreEqualsCpuStore) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const auto dir = testing::scratch_dir("cuda-capture");
  ASSERT_EQ(testing::run_kvforge(capture_args(dir / "cpu.h5", 2, 64)).exit_code, 0);
  const auto gpu = testing::run_kvforge(capture_args(dir / "gpu.h5", 2, 64) + " --device cuda --dtype fp32");
  ASSERT_EQ(gpu.exit_code, 0) << gpu.stderr_text;
  const ActivationStoreReader cpu_store(dir / "cpu.h5"), gpu_store(dir / "gpu.h5");
  for (int64_t sample = 0; sample < 2; ++sample) {
    ASSERT_EQ(cpu_store.read_tokens(sample), gpu_store.read_tokens(sample));
    for (int64_t layer = 0; layer < 5; ++layer) {
      for (const auto field : all_activation_fields()) {
        const auto a = cpu_store.read(field, layer, sample);
        const auto b = gpu_store.read(field, layer, sample);
        EXPECT_LT(max_relative_error(at::tensor(at::ArrayRef<float>(b)), at::tensor(at::ArrayRef<float>(a))),
                  field == ActivationField::kFisherKeys || field == ActivationField::kFisherValues ? 2e-3 : 1e-4)
            << field_name(field) << " layer " << layer;
      }
    }
  }
}

TEST(CaptureCommand, BadFieldsAreAClearError) {
  const auto dir = testing::scratch_dir("fields");
  const auto result = testing::run_kvforge(capture_args(dir / "x.h5", 1, 16) + " --fields k_pre,keys");
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.stderr_text.find("keys"), std::string::npos) << result.stderr_text;
  EXPECT_FALSE(std::filesystem::exists(dir / "x.h5"));
}

}  // namespace
}  // namespace kvforge
