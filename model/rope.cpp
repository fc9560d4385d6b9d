#include "model/rope.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <numbers>

namespace kvforge {

at::Tensor rope_inverse_frequencies(const RopeConfig& rope, int64_t head_dim) {
  // Same float32 arithmetic as transformers' _compute_default_rope_parameters.
  const auto exponents =
      at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) /
      static_cast<double>(head_dim);
  at::Tensor inv_freq = 1.0 / at::pow(rope.theta, exponents);
  switch (rope.type) {
    case RopeType::kDefault: return inv_freq;
    case RopeType::kLinear: return inv_freq / rope.factor;
    case RopeType::kLlama3: {
      // Llama 3.1: long wavelengths are divided by `factor`, short ones kept,
      // and the band in between interpolated smoothly.
      const double old_context = static_cast<double>(rope.original_max_position_embeddings);
      const double low_freq_wavelen = old_context / rope.low_freq_factor;
      const double high_freq_wavelen = old_context / rope.high_freq_factor;
      const at::Tensor wavelen = 2 * std::numbers::pi / inv_freq;
      at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq);
      const at::Tensor smooth = (old_context / wavelen - rope.low_freq_factor) /
                                (rope.high_freq_factor - rope.low_freq_factor);
      const at::Tensor smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled;
      const at::Tensor medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
      return at::where(medium, smoothed, scaled);
    }
  }
  return inv_freq;
}

RotaryEmbedding::RotaryEmbedding(const RopeConfig& rope, int64_t head_dim, c10::Device device)
    : inv_freq_(rope_inverse_frequencies(rope, head_dim).to(device)) {}

namespace {

// On the CPU, cos and sin of each float32 angle in float64, rounded once: the
// correctly rounded table, the same on every processor, where ATen's cos/sin
// (MKL's vector math) are within an ulp, and a process's first call to them
// can be far off (model/cpu_vector_math.h: this table, positions 16 and up,
// in one capture of a hundred on a loaded 2-core machine).
RopeTables cpu_tables(const at::Tensor& inv_freq, int64_t start, int64_t length, c10::ScalarType dtype) {
  const at::Tensor frequencies = inv_freq.contiguous();
  const float* inverse = frequencies.data_ptr<float>();
  const int64_t half = frequencies.numel();
  at::Tensor cos = at::empty({length, 2 * half}, at::kFloat);
  at::Tensor sin = at::empty({length, 2 * half}, at::kFloat);
  float* c = cos.data_ptr<float>();
  float* s = sin.data_ptr<float>();
  at::parallel_for(0, length, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float position = static_cast<float>(start + t);
      for (int64_t i = 0; i < half; ++i) {
        const double angle = position * inverse[i];  // the float32 product, as HF's fp32 matmul
        const int64_t at = t * 2 * half + i;
        c[at] = c[at + half] = static_cast<float>(std::cos(angle));
        s[at] = s[at + half] = static_cast<float>(std::sin(angle));
      }
    }
  });
  return {cos.to(dtype), sin.to(dtype)};
}

}  // namespace

RopeTables RotaryEmbedding::tables(int64_t start, int64_t length, c10::ScalarType dtype) const {
  if (inv_freq_.is_cpu()) return cpu_tables(inv_freq_, start, length, dtype);
  const auto positions =
      at::arange(start, start + length, at::TensorOptions().dtype(at::kLong).device(inv_freq_.device()))
          .to(at::kFloat);
  const at::Tensor freqs = at::outer(positions, inv_freq_);  // float32, as HF's fp32 matmul
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}

namespace {
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}
}  // namespace

at::Tensor RotaryEmbedding::apply(const at::Tensor& x, const RopeTables& tables) {
  return x * tables.cos + rotate_half(x) * tables.sin;
}

at::Tensor RotaryEmbedding::invert(const at::Tensor& x, const RopeTables& tables) {
  return x * tables.cos - rotate_half(x) * tables.sin;
}

}  // namespace kvforge
