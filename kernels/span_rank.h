#pragma once
// token_top_bottom's ranks without comparing every pair (docs/runtime-layout.md
// 6.1 step 4): the append kernel sorts each outlier span's elements ascending
// by (value, index) with a bitonic network (each span padded to a power of two
// with keys above every value), so that an element's count of smaller values
// (ties: lower indices first) is its position in the sorted span, and its
// count of larger ones (ties: lower indices first) follows from its run of
// equal values [begin, end): n - end + position - begin.
//
// Host-device pure functions over plain arrays: the kernel runs each stage's
// compare-exchanges on its threads with a barrier between stages, the CPU test
// runs them in a loop (the exchanges of one stage touch disjoint pairs).
#include <cstdint>
#include <cstring>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels::span_rank {

// An unsigned key in the order of the doubles' comparisons: -0 and +0 equal
// (NaN is not ordered by the reference either).
KVFORGE_HOST_DEVICE inline uint64_t order_key(double v) {
  const double canonical = v == 0.0 ? 0.0 : v;
#if defined(__CUDA_ARCH__)
  const auto bits = static_cast<uint64_t>(__double_as_longlong(canonical));
#else
  uint64_t bits = 0;
  std::memcpy(&bits, &canonical, sizeof(bits));
#endif
  return (bits >> 63) != 0 ? ~bits : bits | (uint64_t{1} << 63);
}

// The spans of one token row: `spans` spans of n elements, element i of the
// row in span i / n, each span sorted in its own `slots_per_span` slots (the
// next power of two).
struct SpanSort {
  uint64_t* keys = nullptr;  // [slots]
  uint32_t* tags = nullptr;  // [slots]: the row index of the slot's element, ~0 for padding
  int n = 0, slots_per_span = 0, slots = 0;
};

KVFORGE_HOST_DEVICE inline int slots_per_span_for(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// Slot x before sorting: its element's key and index, or padding.
KVFORGE_HOST_DEVICE inline void fill_slot(const SpanSort& s, const double* row, int x) {
  const int span = x / s.slots_per_span, at = x % s.slots_per_span;
  const bool real = at < s.n;
  s.keys[x] = real ? order_key(row[span * s.n + at]) : ~uint64_t{0};
  s.tags[x] = real ? static_cast<uint32_t>(span * s.n + at) : ~uint32_t{0};
}

// Slot x's compare-exchange in the stage (size, stride) of the network,
// size = 2, 4, ..., slots_per_span and stride = size / 2, ..., 1: the last
// merge sorts every span ascending; below it the halves alternate, as a
// bitonic merge needs.
KVFORGE_HOST_DEVICE inline void compare_exchange(const SpanSort& s, int size, int stride, int x) {
  const int partner = x ^ stride;
  if (partner <= x) return;
  const bool ascending = size == s.slots_per_span || (x & size) == 0;
  const uint64_t a = s.keys[x], b = s.keys[partner];
  const uint32_t ta = s.tags[x], tb = s.tags[partner];
  const bool greater = a > b || (a == b && ta > tb);
  if (greater == ascending) {
    s.keys[x] = b;
    s.keys[partner] = a;
    s.tags[x] = tb;
    s.tags[partner] = ta;
  }
}

// After sorting: ranks[element] = its position within its span.
KVFORGE_HOST_DEVICE inline void record_rank(const SpanSort& s, int32_t* ranks, int x) {
  if (x % s.slots_per_span < s.n) ranks[s.tags[x]] = x % s.slots_per_span;
}

// Element i of `row` among its span's k largest or k smallest (0 < 2k < n;
// the spans sorted, the ranks recorded).
KVFORGE_HOST_DEVICE inline bool top_or_bottom(const SpanSort& s, const int32_t* ranks, const double* row, int i,
                                              int64_t k) {
  const uint64_t* keys = s.keys + static_cast<int64_t>(i / s.n) * s.slots_per_span;
  const uint64_t key = order_key(row[i]);
  // The run of `key`, [begin, end): its lower and upper bound.
  int begin = 0, end = s.n;
  for (int hi = s.n; begin < hi;) {
    const int mid = (begin + hi) / 2;
    if (keys[mid] < key) {
      begin = mid + 1;
    } else {
      hi = mid;
    }
  }
  for (int lo = begin; lo < end;) {
    const int mid = (lo + end) / 2;
    if (keys[mid] <= key) {
      lo = mid + 1;
    } else {
      end = mid;
    }
  }
  const int position = ranks[i];
  const int smaller = position, larger = s.n - end + position - begin;
  return smaller < k || larger < k;
}

}  // namespace kvforge::kernels::span_rank
