#pragma once
// The outlier entries of a decode tile's token rows as one flat list (the
// general decode kernel puts them back with every thread of the block over
// the list): row j holds `count_j` entries from `begin_j`, `ends` is the
// inclusive prefix of the counts, and flat index f is entry
// begin_j + f - ends[j - 1] of the first row j with ends[j] > f.
//
// Host-device pure functions over plain arrays, so that the CPU tests check
// the mapping the kernel uses.
#include <cstdint>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels::tile_entries {

// The first row j < kRows with ends[j] > f, for f < ends[kRows - 1]
// (kRows a power of two; ends non-decreasing): a binary search.
template <int kRows>
KVFORGE_HOST_DEVICE inline int row_of(const uint32_t* ends, uint32_t f) {
  static_assert(kRows > 0 && (kRows & (kRows - 1)) == 0, "a power of two rows");
  int j = 0;
#pragma unroll
  for (int step = kRows / 2; step > 0; step /= 2) {
    if (ends[j + step - 1] <= f) j += step;
  }
  return j;
}

// Flat index f's entry number (its row's first entry plus its place in the row).
KVFORGE_HOST_DEVICE inline uint32_t entry_of(const uint32_t* begins, const uint32_t* ends, int row, uint32_t f) {
  return begins[row] + (f - (row > 0 ? ends[row - 1] : 0u));
}

// An all-heads row's entries [begin, begin + count) narrowed to one head's:
// those whose index lies in [lo, hi) (= [head D, (head + 1) D)). A row's
// indices ascend (docs/runtime-layout.md), so the head's entries follow the
// `below` entries under lo. index_of(e) reads entry e's index; the indices
// are read kBatch at a time (in the kernel, their loads in flight together)
// until one reaches hi. Without it every block of a KV head read every
// head's entries of its tokens and dropped all but 1 / kv_heads of them.
template <int kBatch, typename IndexOf>
KVFORGE_HOST_DEVICE inline void narrow_to_span(uint32_t& begin, uint32_t& count, uint32_t lo, uint32_t hi,
                                               IndexOf index_of) {
  uint32_t below = 0, within = 0;
  const uint32_t end = begin + count;
  for (uint32_t first = begin; first < end; first += kBatch) {
    uint32_t index[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) index[k] = first + k < end ? index_of(first + k) : hi;  // past the row: >= hi
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      below += index[k] < lo ? 1u : 0u;
      within += index[k] >= lo && index[k] < hi ? 1u : 0u;
    }
    if (index[kBatch - 1] >= hi) break;  // ascending: the rest lie beyond the span
  }
  begin += below;
  count = within;
}

}  // namespace kvforge::kernels::tile_entries
