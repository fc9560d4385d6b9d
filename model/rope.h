#pragma once
// Rotary position embeddings as Hugging Face computes them: inverse
// frequencies per RoPE type (default, linear, llama3) in float32, cos/sin
// tables from float32 position x frequency products, cast to the model dtype.
// On the CPU the tables are correctly rounded (float64 cos/sin of the float32
// angle, rounded once), so they are the same on every processor.
#include <ATen/core/Tensor.h>

#include "formats/hf_config.h"

namespace kvforge {

// [head_dim / 2] float32 on the CPU.
at::Tensor rope_inverse_frequencies(const RopeConfig& rope, int64_t head_dim);

struct RopeTables {
  at::Tensor cos;  // [T, head_dim], model dtype
  at::Tensor sin;
};

class RotaryEmbedding {
 public:
  RotaryEmbedding(const RopeConfig& rope, int64_t head_dim, c10::Device device);
  // Tables for positions [start, start + length); on the CPU correctly
  // rounded, on a GPU as ATen's cos/sin compute them there.
  RopeTables tables(int64_t start, int64_t length, c10::ScalarType dtype) const;
  // x: [B, heads, T, head_dim]; returns x*cos + rotate_half(x)*sin.
  static at::Tensor apply(const at::Tensor& x, const RopeTables& tables);
  // The inverse: rotates by -angle. Turns post-RoPE keys back into pre-RoPE.
  static at::Tensor invert(const at::Tensor& x, const RopeTables& tables);

 private:
  at::Tensor inv_freq_;  // [head_dim / 2] float32 on device
};

}  // namespace kvforge
