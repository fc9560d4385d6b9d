#pragma once
// token_top_bottom by rounds (docs/runtime-layout.md 6.1 step 4) where k is
// small, as kvquant's values have it (1% outliers of 8 x 128 all-heads
// channels: k = 6): each round takes the largest of a span's elements not
// yet taken (value descending, index ascending) and the smallest (value
// ascending, index ascending), so that after k rounds the taken ones are the
// span's k largest and k smallest. The append kernel runs a round as one
// block-wide reduction with one barrier (2k rounds of work instead of the
// bitonic sort's ~55 barriered stages over the padded span, which were half
// of a decoding step's kvquant append: bench/README.md); span_rank.h's
// sort stays for larger k.
//
// Host-device pure functions: the kernel's threads hold the candidates, the
// CPU test folds them in a loop the same way.
#include <cstdint>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels::top_bottom_rounds {

inline constexpr uint32_t kNone = 0xffffffffu;
inline constexpr int kMaxRounds = 32;  // spans * k: beyond, the sort's cost per round is lower
inline constexpr int kMaxSlots = 8;    // one thread's elements of one span, kept in registers

// An element: span_rank::order_key of its value and its index in the token
// row, or none (kNone).
struct Candidate {  // a plain aggregate: the kernel keeps its warps' winners in __shared__ arrays
  uint64_t key;
  uint32_t index;
};

KVFORGE_HOST_DEVICE inline Candidate no_top() { return {0, kNone}; }
KVFORGE_HOST_DEVICE inline Candidate no_bottom() { return {~uint64_t{0}, kNone}; }

// a comes before b among the largest: key descending, then index ascending.
KVFORGE_HOST_DEVICE inline bool before_in_top(Candidate a, Candidate b) {
  if (a.index == kNone) return false;
  if (b.index == kNone) return true;
  return a.key > b.key || (a.key == b.key && a.index < b.index);
}

// a comes before b among the smallest: key ascending, then index ascending.
KVFORGE_HOST_DEVICE inline bool before_in_bottom(Candidate a, Candidate b) {
  if (a.index == kNone) return false;
  if (b.index == kNone) return true;
  return a.key < b.key || (a.key == b.key && a.index < b.index);
}

// Rounds select a row's outliers where each span (n elements, `spans` of
// them) has 0 < 2k < n, the rounds are few and a thread of `threads` holds
// at most kMaxSlots of a span's elements (element `at` of a span: thread
// at % threads, slot at / threads).
KVFORGE_HOST_DEVICE inline bool applies(int64_t n, int64_t spans, int64_t k, int threads) {
  return k > 0 && 2 * k < n && spans * k <= kMaxRounds && n <= static_cast<int64_t>(threads) * kMaxSlots;
}

// One thread's first candidates of a round among the largest and the
// smallest of its elements of the span starting at row index `base` that
// are not taken yet (bit j of *_taken: slot j's element).
template <int kSlots>
KVFORGE_HOST_DEVICE inline void thread_firsts(const uint64_t (&key)[kSlots], int n, int base, int thread, int threads,
                                              uint32_t top_taken, uint32_t bottom_taken, Candidate& top,
                                              Candidate& bottom) {
  top = no_top();
  bottom = no_bottom();
  for (int j = 0; j < kSlots; ++j) {
    const int at = thread + j * threads;
    if (at >= n) break;
    const Candidate here{key[j], static_cast<uint32_t>(base + at)};
    if (((top_taken >> j) & 1u) == 0 && before_in_top(here, top)) top = here;
    if (((bottom_taken >> j) & 1u) == 0 && before_in_bottom(here, bottom)) bottom = here;
  }
}

// The taken-bit of row element `index` (of the span at `base`) for the
// thread that holds it, else 0.
KVFORGE_HOST_DEVICE inline uint32_t taken_bit(uint32_t index, int base, int thread, int threads) {
  const int at = static_cast<int>(index) - base;
  return at % threads == thread ? 1u << (at / threads) : 0u;
}

}  // namespace kvforge::kernels::top_bottom_rounds
