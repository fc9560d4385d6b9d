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
#include "calib/kv_rotation.h"
#include "kernels/quantized_kv_cache.h"

namespace kvforge {
namespace {

constexpr int64_t kKvHeads = kDecodeBenchKvHeads, kHeadDim = kDecodeBenchHeadDim;

// calib's orthogonality_error (the largest Frobenius norm of R^T R - I over
// the heads) of a stored [kv_heads, D, D] array.
double stored_orthogonality_error(const Float32Array& matrix) {
  return orthogonality_error(at::tensor(matrix.values, at::kFloat).reshape(matrix.shape));
}

TEST(DecodeBenchConfig, EveryMethodBuildsACacheAtTheBenchmarksShapes) {
  for (const std::string method : {"int2-rot", "rtn", "kivi", "kvquant"}) {
    for (const int bits : {2, 4}) {
      const QuantizerConfig config = decode_bench_config(method, bits);
      ASSERT_EQ(config.layers.size(), 1u) << method;
      kernels::CacheOptions options;
      options.max_sequences = 2;
      options.max_context = 1024;
      const kernels::QuantizedKVCache cache(config, decode_bench_dimensions(), options);
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
// columns) by at most about 2 * 2^-24 ~ 1.2e-7, and the D x D error's
// Frobenius norm by D times that, 1.5e-5 at D = 128; 2e-5 leaves room.
TEST(DecodeBenchConfig, Int2RotCarriesOrthogonalCentredKeyAndValueMatricesAndItsWindows) {
  const QuantizerConfig config = decode_bench_config("int2-rot", 2);
  ASSERT_TRUE(config.rotation.has_value());
  EXPECT_EQ(config.rotation->keys, RotationForm::kMatrix);
  EXPECT_EQ(config.rotation->values, RotationForm::kMatrix);
  EXPECT_TRUE(config.rotation->key_centred);
  const LayerRotation& rotation = config.layers.front().rotation;
  EXPECT_EQ(rotation.keys.matrix.shape, (std::vector<int64_t>{kKvHeads, kHeadDim, kHeadDim}));
  EXPECT_EQ(rotation.values.matrix.shape, (std::vector<int64_t>{kKvHeads, kHeadDim, kHeadDim}));
  EXPECT_EQ(rotation.keys.centre.shape, (std::vector<int64_t>{kKvHeads, kHeadDim}));
  EXPECT_LT(stored_orthogonality_error(rotation.keys.matrix), 2e-5);
  EXPECT_LT(stored_orthogonality_error(rotation.values.matrix), 2e-5);
  EXPECT_GT((at::tensor(rotation.keys.matrix.values) - at::tensor(rotation.values.matrix.values)).abs().max().item<float>(),
            0.1f);  // two draws, not one matrix twice
  EXPECT_EQ(config.settings.sink_tokens, 64);
  EXPECT_EQ(config.settings.residual_tokens, 256);
}

// The grid fits eight configurations in a row, a targeted run one or two:
// each must be the one its method and bits name, so that their rows compare.
TEST(DecodeBenchConfig, AConfigurationDependsOnItsMethodAndBitsAloneAndLeavesTheGeneratorAsItWas) {
  const QuantizerConfig first = decode_bench_config("kvquant", 2);
  at::randn({1000});  // whatever the benchmark drew in between
  (void)decode_bench_config("rtn", 4);
  EXPECT_TRUE(decode_bench_config("kvquant", 2) == first);
  EXPECT_FALSE(decode_bench_config("kvquant", 4) == first);
  at::manual_seed(7);
  const at::Tensor expected = at::randn({4});
  at::manual_seed(7);
  (void)decode_bench_config("kivi", 2);
  EXPECT_TRUE(at::equal(at::randn({4}), expected)) << "the caller's generator state moved";
}

TEST(DecodeBenchConfig, AnUnknownMethodNamesTheFlag) {
  try {
    decode_bench_config("int3-rot", 2);
    FAIL() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--methods int3-rot"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvforge
