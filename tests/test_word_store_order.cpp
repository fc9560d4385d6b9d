// The general decode kernel's store order of a dequantized word's 16-byte
// quarters (kernels/word_store_order.h): every quarter once per word, and
// the 8 threads of a 16-byte store phase (consecutive words of one tile
// row) on 8 different 16-byte bank groups at each store, where the plain
// order 0, 1, 2, 3 would put them on 2 (2 bits) or 4 (4 bits).
#include <gtest/gtest.h>

#include <set>

#include "kernels/word_store_order.h"

namespace kvforge {
namespace {

namespace k = kernels;

// The bank group (16-byte unit modulo 8) of store i of the thread holding
// word w of a row that starts on a 128-byte line.
template <int kBits>
int bank_group(int w, int i, bool rotated) {
  const int quarters = k::word_quarters(kBits);
  const int quarter = rotated ? k::word_store_quarter<kBits>(w, i) : i;
  return (w * quarters + quarter) % 8;
}

template <int kBits>
void expect_conflict_free(int words_per_row) {
  for (int w = 0; w < words_per_row; ++w) {
    std::set<int> quarters;
    for (int i = 0; i < k::word_quarters(kBits); ++i) quarters.insert(k::word_store_quarter<kBits>(w, i));
    EXPECT_EQ(static_cast<int>(quarters.size()), k::word_quarters(kBits)) << kBits << " bits, word " << w;
  }
  for (int phase = 0; phase + 8 <= words_per_row; phase += 8) {
    for (int i = 0; i < k::word_quarters(kBits); ++i) {
      std::set<int> rotated, plain;
      for (int w = phase; w < phase + 8; ++w) {
        rotated.insert(bank_group<kBits>(w, i, true));
        plain.insert(bank_group<kBits>(w, i, false));
      }
      EXPECT_EQ(rotated.size(), 8u) << kBits << " bits, words " << phase << "-" << phase + 7 << ", store " << i;
      EXPECT_EQ(plain.size(), static_cast<size_t>(8 / k::word_quarters(kBits)))
          << "the plain order's conflict, which the rotation removes";
    }
  }
}

TEST(WordStoreOrder, EightConsecutiveWordsStoreToEightBankGroups) {
  expect_conflict_free<2>(8);   // head_dim 128: 8 words of 16 codes a row
  expect_conflict_free<2>(16);  // head_dim 256
  expect_conflict_free<4>(16);  // head_dim 128 at 4 bits: 16 words of 8 codes
  expect_conflict_free<4>(32);
}

}  // namespace
}  // namespace kvforge
