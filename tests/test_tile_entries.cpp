// kernels/tile_entries.h (the general decode kernel's flat list of a tile's
// outlier entries) against the nested loop it replaces: every flat index
// names the row and entry that walking the rows in order and each row's
// entries in order reaches at that step, for rows with no entries, one
// entry, many, all entries in one row, and random mixes.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/tile_entries.h"

namespace kvforge {
namespace {

constexpr int kRows = 32;

void expect_flat_list_walks_the_rows(const std::vector<uint32_t>& begins, const std::vector<uint32_t>& counts) {
  std::vector<uint32_t> ends(kRows);
  uint32_t through = 0;
  for (int j = 0; j < kRows; ++j) ends[j] = through += counts[j];
  uint32_t f = 0;
  for (int j = 0; j < kRows; ++j) {
    for (uint32_t k = 0; k < counts[j]; ++k, ++f) {
      const int row = kernels::tile_entries::row_of<kRows>(ends.data(), f);
      ASSERT_EQ(row, j) << "flat index " << f;
      ASSERT_EQ(kernels::tile_entries::entry_of(begins.data(), ends.data(), row, f), begins[j] + k) << "flat index " << f;
    }
  }
  EXPECT_EQ(f, ends[kRows - 1]);
}

TEST(TileEntries, FlatIndicesWalkTheRowsInOrder) {
  std::mt19937 random(5);
  std::uniform_int_distribution<uint32_t> begin(0, 1u << 30);
  std::vector<std::vector<uint32_t>> shapes;
  shapes.push_back(std::vector<uint32_t>(kRows, 0));  // no entries at all
  shapes.push_back(std::vector<uint32_t>(kRows, 1));
  for (const int only : {0, 13, kRows - 1}) {
    std::vector<uint32_t> c(kRows, 0);
    c[only] = 77;
    shapes.push_back(c);
  }
  std::uniform_int_distribution<uint32_t> sparse(0, 3), dense(0, 40);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<uint32_t> c(kRows);
    for (auto& x : c) x = trial % 2 ? (sparse(random) == 0 ? dense(random) : 0) : dense(random);
    shapes.push_back(c);
  }
  for (const auto& counts : shapes) {
    std::vector<uint32_t> begins(kRows);
    for (auto& b : begins) b = begin(random);
    expect_flat_list_walks_the_rows(begins, counts);
  }
}

}  // namespace
}  // namespace kvforge
