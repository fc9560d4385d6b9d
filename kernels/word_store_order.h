#pragma once
// The order in which a thread of the general decode kernel stores the
// 16-byte quarters of a dequantized code word into the tile's shared rows.
// The tile's threads hold consecutive words of a row, 64 bytes apart at 2
// bits (32 at 4), so storing each word's quarters in the order 0, 1, 2, 3
// puts the 8 threads of a 16-byte store phase on 2 (4 bits: 4) of the 8
// 16-byte bank groups: a 4-way (2-way) conflict, 3 of every 4 wavefronts
// replays (ncu, kvquant, 2026-12-02). Store i of a thread takes quarter
// (i + rotation) % quarters, the rotation stepping once every 8 / quarters
// words, so that the 8 threads' quarters fall in 8 different groups.
//
// Host-device, so that the CPU tests check the bank groups it gives.
#include "kernels/runtime_layout.h"

namespace kvforge::kernels {

// A word's 16-byte quarters (4 elements each): 4 at 2 bits, 2 at 4 bits.
KVFORGE_HOST_DEVICE constexpr int word_quarters(int bits) { return 32 / bits / 4; }

template <int kBits>
KVFORGE_HOST_DEVICE inline int word_store_rotation(int word_index) {
  constexpr int kQuarters = word_quarters(kBits);
  return (word_index / (8 / kQuarters)) & (kQuarters - 1);
}

// The quarter that store i of word `word_index` writes.
template <int kBits>
KVFORGE_HOST_DEVICE inline int word_store_quarter(int word_index, int i) {
  return (i + word_store_rotation<kBits>(word_index)) & (word_quarters(kBits) - 1);
}

}  // namespace kvforge::kernels
