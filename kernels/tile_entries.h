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

}  // namespace kvforge::kernels::tile_entries
