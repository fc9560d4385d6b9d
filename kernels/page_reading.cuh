#pragma once
// Where the decode kernels find a token's bytes in the paged cache
// (docs/runtime-layout.md sections 3 and 4), in 32-bit arithmetic worked
// out once per tile or walk: a stored (min, max) pair's affine, a head's
// pairs in a page, an outlier entry's page and slot.
#include <cstdint>

#include "kernels/decode_params.h"
#include "kernels/element_access.cuh"
#include "kernels/fixed_divisor.h"
#include "kernels/pair_affine.h"

namespace kvforge::kernels::decode_attention_device {

// (a, b) of x^ = fma(b, L[code], a) from a stored (min, max) in memory
// (kernels/pair_affine.h).
__device__ inline Affine affine_of_pair(const TensorPageLayout& l, const Dequantization& dq, const uint8_t* pair,
                                        int top) {
  const ElementType element = l.spec.element;
  const float min = load_element(element, pair), max = load_element(element, pair + element_bytes(element));
  return pair_affine(min, max, dq.clip_ratio, dq.non_uniform, top);
}

// Where a token's group pairs lie in its page: base + in_page * token_stride
// + group * group_stride (token_pair_offset's arithmetic in 32 bits, hoisted out of the
// int8 walk and the general tiles). Written out rather than taken as token_pair_offset's differences:
// those 64-bit products cost the kernel 28 more bytes of spills (ptxas).
struct PairPlace {
  int32_t base = 0, token_stride = 0, group_stride = 0;
};
__device__ inline PairPlace pair_place(const TensorPageLayout& l, int head, int pairs_per_head) {
  const auto pair_bytes = static_cast<int32_t>(l.pair_bytes);
  const auto params = static_cast<int32_t>(l.params_offset);
  if (l.spec.grouping == ScaleGrouping::kPerTokenAllHeads) return {params, pair_bytes, 0};
  return {params + head * l.spec.page_size * pairs_per_head * pair_bytes, pairs_per_head * pair_bytes, pair_bytes};
}

// Entry e's place in a sequence's outlier pages: its page (through the
// sequence's outlier page table) and slot (FixedDivisor: not a 64-bit
// division per entry).
struct OutlierPages {
  const int32_t* table = nullptr;
  FixedDivisor per_page;

  __device__ OutlierPages(const PagedTensor& cache, int32_t slot)
      : table(cache.outlier_page_table + slot * cache.outlier_table_stride),
        per_page(static_cast<uint32_t>(cache.layout.spec.outlier_page_entries)) {}
  __device__ const uint8_t* page(const PagedTensor& cache, uint32_t e) const {
    return cache.outlier_pages + static_cast<int64_t>(table[per_page.quotient(e)]) * cache.layout.outlier_page_bytes;
  }
  __device__ uint32_t slot_in_page(uint32_t e) const { return per_page.remainder(e); }
  __device__ uint32_t index(const PagedTensor& cache, uint32_t e) const {
    return load_index(page(cache, e) + outlier_index_offset(cache.layout, slot_in_page(e)),
                      cache.layout.outlier_index_bytes);
  }
};

}  // namespace kvforge::kernels::decode_attention_device
