// kernels/tile_entries.h (the general decode kernel's flat list of a tile's
// outlier entries) against the nested loop it replaces: every flat index
// names the row and entry that walking the rows in order and each row's
// entries in order reaches at that step, for rows with no entries, one
// entry, many, all entries in one row, and random mixes; and an all-heads
// row narrowed to one head's entries against selecting them one by one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
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

// Row `indices` (ascending) stored from entry number `first`: every head's
// narrowed range holds exactly the entries whose index / dim is the head,
// and the indices read stay within the row.
template <int kBatch>
void expect_narrowed_to_each_head(const std::vector<uint32_t>& indices, uint32_t first, int heads, uint32_t dim) {
  for (int head = 0; head < heads; ++head) {
    uint32_t begin = first, count = static_cast<uint32_t>(indices.size());
    uint32_t reads = 0;
    kernels::tile_entries::narrow_to_span<kBatch>(begin, count, head * dim, (head + 1) * dim, [&](uint32_t e) {
      EXPECT_GE(e, first);
      EXPECT_LT(e, first + indices.size());
      ++reads;
      return indices[e - first];
    });
    uint32_t expected_begin = first, expected_count = 0;
    bool found = false;
    for (size_t k = 0; k < indices.size(); ++k) {
      if (indices[k] / dim == static_cast<uint32_t>(head)) {
        if (!found) expected_begin = first + static_cast<uint32_t>(k);
        found = true;
        ++expected_count;
      }
    }
    if (!found) {  // an empty range after the entries below the head
      expected_begin = first + static_cast<uint32_t>(std::count_if(
                                   indices.begin(), indices.end(), [&](uint32_t x) { return x < head * dim; }));
    }
    ASSERT_EQ(count, expected_count) << "head " << head << " of a row of " << indices.size();
    ASSERT_EQ(begin, expected_begin) << "head " << head << " of a row of " << indices.size();
    ASSERT_LE(reads, indices.size());
  }
}

TEST(TileEntries, AllHeadsRowsNarrowToEachHeadsEntries) {
  std::mt19937 random(11);
  const int heads = 8;
  const uint32_t dim = 128;
  std::vector<std::vector<uint32_t>> rows = {{}, {0}, {dim - 1, dim}, {heads * dim - 1}, {3 * dim, 3 * dim + 1}};
  std::uniform_int_distribution<uint32_t> index(0, heads * dim - 1), length(0, 40);
  for (int trial = 0; trial < 500; ++trial) {
    std::set<uint32_t> chosen;
    const uint32_t n = trial % 5 == 0 ? 10 : length(random);  // kvquant's fixed top and bottom counts, and any
    while (chosen.size() < n) chosen.insert(trial % 3 == 0 ? index(random) % (2 * dim) : index(random));
    rows.emplace_back(chosen.begin(), chosen.end());
  }
  std::uniform_int_distribution<uint32_t> first(0, 1u << 30);
  for (const auto& row : rows) {
    const uint32_t at = first(random);
    expect_narrowed_to_each_head<8>(row, at, heads, dim);
    expect_narrowed_to_each_head<3>(row, at, heads, dim);
    expect_narrowed_to_each_head<1>(row, at, heads, dim);
  }
}

}  // namespace
}  // namespace kvforge
