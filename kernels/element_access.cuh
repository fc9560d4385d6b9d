#pragma once
// The decode kernels' loads and stores of elements (fp16, bf16, float32:
// docs/runtime-layout.md section 2) from the cache and the io tensors, and
// of the pages' integers (row pointers, outlier indices).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels::decode_attention_device {

__device__ inline float load_element(ElementType element, const uint8_t* at) {
  switch (element) {
    case ElementType::kFloat16:
      return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(at)));
    case ElementType::kBFloat16:
      return __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(at)) << 16);
    case ElementType::kFloat32:
      break;
  }
  return *reinterpret_cast<const float*>(at);
}

// kCount consecutive elements from `at` into out[0..kCount): in 16-byte
// loads where `at` is 16-byte aligned (an exact row's run of a code word's
// elements is, in a cache from cudaMalloc), else one load per element.
template <int kCount>
__device__ inline void load_elements(ElementType element, const uint8_t* at, float* out) {
  const bool aligned = (reinterpret_cast<uintptr_t>(at) & 15u) == 0;
  if (element == ElementType::kFloat32) {
    if constexpr (kCount % 4 == 0) {
      if (aligned) {
#pragma unroll
        for (int i = 0; i < kCount / 4; ++i) {
          const float4 v = reinterpret_cast<const float4*>(at)[i];
          out[4 * i] = v.x, out[4 * i + 1] = v.y, out[4 * i + 2] = v.z, out[4 * i + 3] = v.w;
        }
        return;
      }
    }
  } else if constexpr (kCount % 8 == 0) {
    if (aligned) {
#pragma unroll
      for (int i = 0; i < kCount / 8; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(at)[i];
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const auto low = static_cast<unsigned short>(words[w] & 0xffffu);
          const auto high = static_cast<unsigned short>(words[w] >> 16);
          if (element == ElementType::kBFloat16) {
            out[8 * i + 2 * w] = __uint_as_float(static_cast<uint32_t>(low) << 16);
            out[8 * i + 2 * w + 1] = __uint_as_float(static_cast<uint32_t>(high) << 16);
          } else {
            out[8 * i + 2 * w] = __half2float(__ushort_as_half(low));
            out[8 * i + 2 * w + 1] = __half2float(__ushort_as_half(high));
          }
        }
      }
      return;
    }
  }
  const int64_t bytes = element_bytes(element);
#pragma unroll
  for (int c = 0; c < kCount; ++c) out[c] = load_element(element, at + c * bytes);
}

// kCount floats (a multiple of 4) to a 16-byte aligned `out` in 16-byte
// stores.
template <int kCount>
__device__ inline void store_floats(float* out, const float (&x)[kCount]) {
  static_assert(kCount % 4 == 0, "whole 16-byte stores");
#pragma unroll
  for (int i = 0; i < kCount / 4; ++i) {
    reinterpret_cast<float4*>(out)[i] = make_float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
  }
}

__device__ inline float load_io(ElementType io, const void* base, int64_t index) {
  return load_element(io, static_cast<const uint8_t*>(base) + index * element_bytes(io));
}

// Rows first_row .. first_row + rows of a [.][D] tensor of `io` elements
// (raw queries, or float32 ones rotated by rotate_group_queries_kernel)
// into out[padded_rows][D] as float32 (16-byte aligned), the rows
// past `rows` zero: the block's threads together, 8 elements a thread and
// round, each round's loads (load_elements: one or two 16-byte loads where
// the rows are 16-byte aligned) issued before its stores. A block of 128
// threads at head_dim 128 so takes one round trip to memory for up to 8
// rows, where one element a thread and iteration took one per element
// (GQA 4: four, ~1.7 us of the int8 kernel's ~11 us that do not scale with
// the context, bench/results/ncu-int8-fixed-cost-h200-2026-12-05.md).
template <int D>
__device__ inline void load_rows(ElementType io, const void* base, int64_t first_row, int rows, int padded_rows,
                                 float* out) {
  static_assert(D % 8 == 0, "rows of whole 8-element chunks");
  const int64_t bytes = element_bytes(io);
  const auto* first = static_cast<const uint8_t*>(base) + first_row * D * bytes;
  for (int i = 8 * static_cast<int>(threadIdx.x); i < padded_rows * D; i += 8 * static_cast<int>(blockDim.x)) {
    float x[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (i < rows * D) load_elements<8>(io, first + i * bytes, x);
    store_floats<8>(out + i, x);
  }
}

// Rounds to nearest, ties to even, once (as the reference's store_element of
// a float widened to double).
__device__ inline void store_io(ElementType io, void* base, int64_t index, float value) {
  switch (io) {
    case ElementType::kFloat16:
      static_cast<__half*>(base)[index] = __float2half_rn(value);
      return;
    case ElementType::kBFloat16:
      static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(value);
      return;
    case ElementType::kFloat32:
      break;
  }
  static_cast<float*>(base)[index] = value;
}

__device__ inline uint32_t load_u32(const uint8_t* at) { return *reinterpret_cast<const uint32_t*>(at); }

__device__ inline uint32_t load_index(const uint8_t* at, int32_t bytes) {
  return bytes == 4 ? load_u32(at) : static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(at));
}

}  // namespace kvforge::kernels::decode_attention_device
