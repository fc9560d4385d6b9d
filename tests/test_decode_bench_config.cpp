// The decode-attention benchmark's configurations (bench/decode_bench_config.h):
// every method and bit width it times builds a cache at the benchmark's
// shapes, and int2-rot carries the rotations `kvforge rotate` writes
// (centred dense key matrices and dense value matrices per KV head,
// orthogonal), so that its rows time the query and output rotations.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

#include "bench/decode_bench_config.h"
#include "formats/hf_config.h"
#include "kernels/quantized_kv_cache.h"
#include "model/rope.h"

namespace kvforge {
namespace {

constexpr int64_t kHeads = 32, kKvHeads = 8, kHeadDim = 128;

kernels::ModelDimensions bench_dimensions() {
  kernels::ModelDimensions dims{1, kHeads, kKvHeads, kHeadDim, {}};
  const RopeConfig rope{RopeType::kLlama3, 500000.0, 8.0, 1.0, 4.0, 8192};
  const at::Tensor f = rope_inverse_frequencies(rope, kHeadDim).to(at::kFloat).contiguous();
  dims.rope_inverse_frequencies.assign(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
  return dims;
}

// max |R^T R - I| over the heads of a [kv_heads, D, D] array, in float64.
double orthogonality_error(const Float32Array& matrix) {
  const at::Tensor r = at::tensor(matrix.values, at::kFloat).to(at::kDouble).reshape(matrix.shape);
  const at::Tensor eye = at::eye(r.size(-1), at::kDouble);
  return (at::matmul(r.transpose(-1, -2), r) - eye).abs().max().item<double>();
}

TEST(DecodeBenchConfig, EveryMethodBuildsACacheAtTheBenchmarksShapes) {
  for (const std::string method : {"int2-rot", "rtn", "kivi", "kvquant"}) {
    for (const int bits : {2, 4}) {
      const QuantizerConfig config = decode_bench_config(method, bits, kKvHeads, kHeadDim);
      ASSERT_EQ(config.layers.size(), 1u) << method;
      kernels::CacheOptions options;
      options.max_sequences = 2;
      options.max_context = 1024;
      const kernels::QuantizedKVCache cache(config, bench_dimensions(), options);
      const kernels::DecodeParams params = cache.decode_params(0);
      EXPECT_EQ(params.key_cache.layout.spec.kv_heads, kKvHeads) << method;
      const bool rotated = method == "int2-rot";
      EXPECT_EQ(config.rotation.has_value(), rotated) << method;
      EXPECT_EQ(params.key_rotation.kind == kernels::RotationKind::kMatrix, rotated) << method << " " << bits;
      EXPECT_EQ(params.value_rotation.kind == kernels::RotationKind::kMatrix, rotated) << method << " " << bits;
    }
  }
}

// Matrices drawn orthogonal in float64 and stored in float32: each entry is
// off by at most 2^-24 of itself, so a column pair's dot product (unit
// columns) by at most about 2 * 2^-24 ~ 1.2e-7; 1e-6 leaves room.
TEST(DecodeBenchConfig, Int2RotCarriesOrthogonalCentredKeyAndValueMatricesAndItsWindows) {
  const QuantizerConfig config = decode_bench_config("int2-rot", 2, kKvHeads, kHeadDim);
  ASSERT_TRUE(config.rotation.has_value());
  EXPECT_EQ(config.rotation->keys, RotationForm::kMatrix);
  EXPECT_EQ(config.rotation->values, RotationForm::kMatrix);
  EXPECT_TRUE(config.rotation->key_centred);
  const LayerRotation& rotation = config.layers.front().rotation;
  EXPECT_EQ(rotation.keys.matrix.shape, (std::vector<int64_t>{kKvHeads, kHeadDim, kHeadDim}));
  EXPECT_EQ(rotation.values.matrix.shape, (std::vector<int64_t>{kKvHeads, kHeadDim, kHeadDim}));
  EXPECT_EQ(rotation.keys.centre.shape, (std::vector<int64_t>{kKvHeads, kHeadDim}));
  EXPECT_LT(orthogonality_error(rotation.keys.matrix), 1e-6);
  EXPECT_LT(orthogonality_error(rotation.values.matrix), 1e-6);
  EXPECT_GT((at::tensor(rotation.keys.matrix.values) - at::tensor(rotation.values.matrix.values)).abs().max().item<float>(),
            0.1f);  // two draws, not one matrix twice
  EXPECT_EQ(config.settings.sink_tokens, 64);
  EXPECT_EQ(config.settings.residual_tokens, 256);
}

TEST(DecodeBenchConfig, AnUnknownMethodNamesTheFlag) {
  try {
    decode_bench_config("int3-rot", 2, kKvHeads, kHeadDim);
    FAIL() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--methods int3-rot"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvforge
