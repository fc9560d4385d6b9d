#pragma once
// token_top_bottom's rule counted pair by pair (docs/runtime-layout.md 6.1
// step 4), the oracle of the append's two ways to select it
// (test_span_rank.cpp, test_top_bottom_rounds.cpp): element i of a row of
// spans of n is among its span's k largest when fewer than k elements are
// larger or equal with a lower index, likewise the smallest.
#include <cstdint>
#include <vector>

namespace kvforge::testing {

inline bool top_or_bottom_by_definition(const std::vector<double>& row, int n, int i, int64_t k) {
  const int begin = i / n * n;
  int64_t larger = 0, smaller = 0;
  for (int j = begin; j < begin + n; ++j) {
    const double u = row[j], v = row[i];
    larger += (u > v || (u == v && j < i)) ? 1 : 0;
    smaller += (u < v || (u == v && j < i)) ? 1 : 0;
  }
  return larger < k || smaller < k;
}

}  // namespace kvforge::testing
