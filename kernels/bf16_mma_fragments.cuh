#pragma once
// Register-level pieces of the bf16 tensor-core decode (PTX mma.m16n8k16
// with bf16 operands and float32 accumulators; decode_tensor_core_kernel.cuh
// says how codes and queries are laid into the fragments): bf16 hi + lo
// splits, codes as bf16 integers, transposed matrix loads, the mma itself,
// and the online softmax's rescale of C fragments. The exact and int8
// kernels use some of them too.
#include <cuda_bf16.h>

#include <cstdint>

namespace kvforge::kernels::decode_attention_device {

__device__ inline uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// x = hi + lo + O(2^-16 |x|), hi and lo bf16; two halves of a B register.
struct SplitBf16x2 {
  uint32_t hi = 0, lo = 0;
};
__device__ inline SplitBf16x2 split_bf16(float x0, float x1) {
  const __nv_bfloat162 hi = __floats2bfloat162_rn(x0, x1);
  const float r0 = x0 - __low2float(hi), r1 = x1 - __high2float(hi);  // exact in float32
  return {bf16x2_bits(hi), bf16x2_bits(__floats2bfloat162_rn(r0, r1))};
}

// Two codes of `word`, at bits [shift, shift + bits) and [shift + 16, ...),
// as exact bf16 integers (low half the first).
template <int kBits>
__device__ inline uint32_t codes_bf16x2(uint32_t word, int shift) {
  constexpr uint32_t kMask = kBits == 2 ? 0x00030003u : 0x000F000Fu;
  const uint32_t biased = ((word >> shift) & kMask) | 0x43004300u;  // bf16 128 + code
  const __nv_bfloat162 v = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&biased), __floats2bfloat162_rn(128.f, 128.f));
  return bf16x2_bits(v);
}

// ldmatrix.m8n8.x4.trans (the int8 kernel's values, int8_mma_fragments.h
// "values by ldmatrix"; the exact kernel's bf16 value rows): lane l gives
// the shared address of row l % 8 of matrix l / 8.
__device__ inline void load_matrices_transposed(uint32_t (&d)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(address)
               : "memory");
}

__device__ inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The channels (within a 16-channel k step) of B register `which` (0: k 2c,
// 2c+1; 1: k 2c+8, 2c+9) of lane c: see the header comment.
template <int kBits>
__device__ inline void key_channels(int c, int which, int& d0, int& d1) {
  if (kBits == 2) {
    d0 = which == 0 ? 2 * c : 2 * c + 1;
    d1 = d0 + 8;
  } else {
    d0 = which == 0 ? c : 8 + c;
    d1 = d0 + 4;
  }
}

// The key A fragment of k step `step` of tokens g (w_g) and g + 8 (w_g8),
// rows given as their code words.
template <int kBits, int kWords>
__device__ inline void key_fragment(const uint32_t (&w_g)[kWords], const uint32_t (&w_g8)[kWords], int step, int c,
                                    uint32_t (&a)[4]) {
  if (kBits == 2) {
    a[0] = codes_bf16x2<2>(w_g[step], 4 * c);
    a[1] = codes_bf16x2<2>(w_g8[step], 4 * c);
    a[2] = codes_bf16x2<2>(w_g[step], 4 * c + 2);
    a[3] = codes_bf16x2<2>(w_g8[step], 4 * c + 2);
  } else {
    a[0] = codes_bf16x2<4>(w_g[2 * step], 4 * c);
    a[1] = codes_bf16x2<4>(w_g8[2 * step], 4 * c);
    a[2] = codes_bf16x2<4>(w_g[2 * step + 1], 4 * c);
    a[3] = codes_bf16x2<4>(w_g8[2 * step + 1], 4 * c);
  }
}

// The channel (within a 16-channel m tile) of value A row `row` (0..15).
template <int kBits>
__device__ inline int value_channel(int row) {
  if (kBits == 2) return row;
  const int g = row % 8, upper = row / 8;
  return g < 4 ? g + 4 * upper : g + 4 + 4 * upper;
}

// Value codes of m tile `tile` for rows g, g + 8 of one token, as a bf16x2
// (low half row g), from the token's words.
template <int kBits>
__device__ inline uint32_t value_codes(const uint32_t* words, int tile, int g) {
  if (kBits == 2) return codes_bf16x2<2>(words[tile], 2 * g);
  return g < 4 ? codes_bf16x2<4>(words[2 * tile], 4 * g) : codes_bf16x2<4>(words[2 * tile + 1], 4 * (g - 4));
}

__device__ inline float shfl(float x, int lane) { return __shfl_sync(0xffffffffu, x, lane); }

// The online softmax's rescale of C fragments (columns 2c, 2c + 1 in
// registers 0/2 and 1/3) by their heads' alphas.
template <int kTiles>
__device__ inline void rescale_columns(float (&acc)[kTiles][4], const float (&alpha)[2]) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    acc[t][0] *= alpha[0];
    acc[t][1] *= alpha[1];
    acc[t][2] *= alpha[0];
    acc[t][3] *= alpha[1];
  }
}

}  // namespace kvforge::kernels::decode_attention_device
