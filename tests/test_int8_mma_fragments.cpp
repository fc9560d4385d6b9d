// The 8-bit integer tensor-core decode's operands (kernels/int8_mma_fragments.h)
// on the CPU: every lane's registers as the kernel builds them, replayed
// through an emulation of PTX's mma.m16n8k32 fragment layouts (the PTX ISA's
// "Matrix Fragments for mma.m16n8k32" with 8-bit operands: A rows g, g + 8,
// g, g + 8 and columns 4c + i, 4c + i, 16 + 4c + i, 16 + 4c + i in registers
// 0..3; B column g, rows 4c + i and 16 + 4c + i; C rows g, g, g + 8, g + 8
// and columns 2c, 2c + 1, 2c, 2c + 1), must give the dot products of the
// codes and the operands they stand for: the keys' scores, the values'
// weighted sums, and the parts' error bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/int8_mma_fragments.h"

namespace kvforge {
namespace {

namespace mma = kernels::int8_mma;

using LaneA = std::array<std::array<uint32_t, 4>, 32>;
using LaneB = std::array<std::array<uint32_t, 2>, 32>;
using LaneC = std::array<std::array<int64_t, 4>, 32>;

int byte_of(uint32_t word, int i, bool is_signed) {
  const auto b = static_cast<uint8_t>(word >> (8 * i));
  return is_signed ? static_cast<int8_t>(b) : b;
}

// D += A B from the lanes' registers (A unsigned, B signed or not).
void emulate_m16n8k32(const LaneA& a, const LaneB& b, bool b_signed, LaneC& d) {
  int A[16][32] = {}, B[32][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, c = lane % 4;
    for (int reg = 0; reg < 4; ++reg) {
      for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (reg % 2), col = 4 * c + i + 16 * (reg / 2);
        A[row][col] = byte_of(a[lane][reg], i, false);
      }
    }
    for (int reg = 0; reg < 2; ++reg) {
      for (int i = 0; i < 4; ++i) B[4 * c + i + 16 * reg][g] = byte_of(b[lane][reg], i, b_signed);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, c = lane % 4;
    for (int reg = 0; reg < 4; ++reg) {
      const int row = g + 8 * (reg / 2), col = 2 * c + reg % 2;
      int64_t sum = 0;
      for (int k = 0; k < 32; ++k) sum += static_cast<int64_t>(A[row][k]) * B[k][col];
      d[lane][reg] += sum;
    }
  }
}

// Code rows of `bits` (2 or 4): token t's words, channel d at bits
// bits * (d % per_word) of word d / per_word.
std::vector<std::vector<uint32_t>> random_rows(int tokens, int dim, std::mt19937& random, std::vector<std::vector<int>>& codes,
                                               int bits = 2) {
  const int per_word = 32 / bits;
  std::uniform_int_distribution<int> code(0, (1 << bits) - 1);
  std::vector<std::vector<uint32_t>> rows(static_cast<size_t>(tokens), std::vector<uint32_t>(static_cast<size_t>(dim / per_word)));
  codes.assign(static_cast<size_t>(tokens), std::vector<int>(static_cast<size_t>(dim)));
  for (int t = 0; t < tokens; ++t) {
    for (int d = 0; d < dim; ++d) {
      const int x = code(random);
      codes[t][d] = x;
      rows[t][d / per_word] |= static_cast<uint32_t>(x) << (bits * (d % per_word));
    }
  }
  return rows;
}

// The kernel's key operands by code width: the words a lane column reads,
// the mmas' A and B registers, and the power the Horner sums carry.
int key_first_word(int bits, int dim, int c) { return bits == 2 ? mma::key_first_word(dim, c) : mma::nibble_key_words(dim) * c; }
int key_words(int bits, int dim) { return bits == 2 ? mma::key_words(dim) : mma::nibble_key_words(dim); }
int key_channel(int bits, int dim, int j, int c, int half, int i) {
  return bits == 2 ? mma::key_channel(dim, j, c, half, i) : mma::nibble_key_channel(dim, j, c, half, i);
}
int key_scale(int bits, int dim) { return bits == 2 ? mma::key_plane_scale(dim) : mma::kNibbleKeyScale; }

// A key row block's sums as the kernel forms them: the mmas of rows
// first_row + g and + g + 8 in Horner order (2 bits: the sums times
// key_horner before mma j; 4 bits: times 16 before the first plane-1 mma),
// column g's query parts from query_of_column(g).
template <typename QueryOfColumn>
LaneC key_row_block(const std::vector<std::vector<uint32_t>>& rows, int first_row, int dim, QueryOfColumn query_of_column,
                    int bits = 2) {
  LaneC d{};
  for (int j = 0; j < mma::key_mmas(dim); ++j) {
    const int times = mma::key_horner_factor(bits, dim, j);
    for (auto& lane : d) {
      for (auto& x : lane) x *= times;
    }
    LaneA a{};
    LaneB b{};
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, c = lane % 4;
      const uint32_t* words_g = rows[static_cast<size_t>(first_row + g)].data() + key_first_word(bits, dim, c);
      const uint32_t* words_g8 = rows[static_cast<size_t>(first_row + g + 8)].data() + key_first_word(bits, dim, c);
      for (int which = 0; which < 4; ++which) {
        a[lane][which] = bits == 2 ? mma::key_a_register(dim, words_g, words_g8, j, which)
                                   : mma::nibble_key_a_register(dim, words_g, words_g8, j, which);
      }
      for (int half = 0; half < 2; ++half) b[lane][half] = mma::key_b_register(dim, query_of_column(g), j, c, half, bits);
    }
    emulate_m16n8k32(a, b, true, d);
  }
  return d;
}

TEST(Int8MmaFragments, KeyChannelsOfKAreAPermutation) {
  for (const int bits : {2, 4}) {
    for (const int dim : {64, 128}) {
      // Every channel once over the mmas, halves, lanes and bytes, from the
      // words each lane reads.
      std::vector<int> seen(static_cast<size_t>(dim), 0);
      for (int j = 0; j < mma::key_mmas(dim); ++j) {
        for (int c = 0; c < 4; ++c) {
          for (int half = 0; half < 2; ++half) {
            for (int i = 0; i < 4; ++i) {
              const int channel = key_channel(bits, dim, j, c, half, i);
              ++seen[static_cast<size_t>(channel)];
              const int word = channel * bits / 32;
              EXPECT_GE(word, key_first_word(bits, dim, c));
              EXPECT_LT(word, key_first_word(bits, dim, c) + key_words(bits, dim));
            }
          }
        }
      }
      EXPECT_EQ(seen, std::vector<int>(static_cast<size_t>(dim), 1)) << bits << " bits, head_dim " << dim;
    }
  }
  std::vector<int> rows(16, 0);
  for (int r = 0; r < 16; ++r) ++rows[static_cast<size_t>(mma::value_channel_of_row(r))];
  EXPECT_EQ(rows, std::vector<int>(16, 1));
  for (int k = 0; k < 32; ++k) EXPECT_EQ(mma::value_token_of_k(mma::value_token_of_k(k)), k) << k;
  // The lanes c of one gathering load (k = 16h + 4c + i, i fixed) read
  // token rows 8 words apart at head_dim 128: banks 8c + word, all different.
  for (int i = 0; i < 4; ++i) {
    std::vector<int> banks;
    for (int c = 0; c < 4; ++c) banks.push_back(mma::value_token_of_k(4 * c + i) * 8 % 32);
    std::sort(banks.begin(), banks.end());
    EXPECT_EQ(std::adjacent_find(banks.begin(), banks.end()), banks.end()) << "i " << i;
  }
}

// Scores: 16 tokens (rows) against 8 heads' int8 query parts, head_dim 64
// and 128, one mma per k step of 32 channels.
TEST(Int8MmaFragments, KeyOperandsGiveTheDotProductsOfCodesAndQueries) {
  std::mt19937 random(20261201);
  std::uniform_int_distribution<int> part(-127, 127);
  for (const int bits : {2, 4}) {
    for (const int dim : {64, 128}) {
      std::vector<std::vector<int>> codes;
      const auto rows = random_rows(16, dim, random, codes, bits);
      std::vector<std::vector<int8_t>> query(8, std::vector<int8_t>(static_cast<size_t>(dim)));
      for (auto& head : query) {
        for (auto& x : head) x = static_cast<int8_t>(part(random));
      }
      const LaneC d = key_row_block(rows, 0, dim, [&](int g) { return query[static_cast<size_t>(g)].data(); }, bits);
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, c = lane % 4;
        for (int reg = 0; reg < 4; ++reg) {
          const int token = g + 8 * (reg / 2), head = 2 * c + reg % 2;
          int64_t want = 0;
          for (int ch = 0; ch < dim; ++ch) want += static_cast<int64_t>(codes[token][ch]) * query[head][ch];
          ASSERT_EQ(d[lane][reg], key_scale(bits, dim) * want)
              << bits << " bits, head_dim " << dim << " lane " << lane << " register " << reg;
        }
      }
    }
  }
}

// The lane's A registers of m tile `tile` (k = 16 part + 4c + i holds token
// value_token_of_k(k)), as the kernel gathers them from the tokens' rows.
std::array<uint32_t, 4> value_a(const std::vector<std::vector<uint32_t>>& rows, int tile, int g, int c) {
  std::array<uint32_t, 4> a{};
  for (int part = 0; part < 2; ++part) {
    int token[4];
    for (int i = 0; i < 4; ++i) token[i] = mma::value_token_of_k(16 * part + 4 * c + i);
    const uint32_t gathered = mma::gather_byte(rows[token[0]][tile], rows[token[1]][tile], rows[token[2]][tile],
                                               rows[token[3]][tile], g % 4);
    a[2 * part] = mma::value_a_register(gathered, g, 0);
    a[2 * part + 1] = mma::value_a_register(gathered, g, 1);
  }
  return a;
}

// B register `part` of lane column c from a column's 32 bytes by token: the
// kernel stores token t's byte at k = value_token_of_k(t) and loads the
// lane's four bytes at k = 16 part + 4c.
uint32_t value_b(const std::vector<uint8_t>& by_token, int c, int part) {
  std::vector<uint8_t> by_k(32);
  for (int t = 0; t < 32; ++t) by_k[static_cast<size_t>(mma::value_token_of_k(t))] = by_token[static_cast<size_t>(t)];
  uint32_t bytes = 0;
  for (int i = 0; i < 4; ++i) bytes |= static_cast<uint32_t>(by_k[static_cast<size_t>(16 * part + 4 * c + i)]) << (8 * i);
  return bytes;
}

// m tile `tile`'s sums as the kernel forms them: the 32 tokens' codes
// against column g's 32 weight bytes (by token) from column_bytes(g).
template <typename ColumnBytes>
LaneC value_tile(const std::vector<std::vector<uint32_t>>& rows, int tile, ColumnBytes column_bytes) {
  LaneA a{};
  LaneB b{};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, c = lane % 4;
    a[lane] = value_a(rows, tile, g, c);
    for (int part = 0; part < 2; ++part) b[lane][part] = value_b(column_bytes(g), c, part);
  }
  LaneC d{};
  emulate_m16n8k32(a, b, false, d);
  return d;
}

// Weighted sums: 32 tokens (k) of m tile T's 16 channels (rows) against 8
// heads' uint8 weight parts, head_dim 128.
TEST(Int8MmaFragments, ValueOperandsGiveTheWeightedSumsOfEachChannel) {
  std::mt19937 random(7);
  std::vector<std::vector<int>> codes;
  const auto rows = random_rows(32, 128, random, codes);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<std::vector<uint8_t>> weights(8, std::vector<uint8_t>(32));  // [head][token]
  for (auto& head : weights) {
    for (auto& w : head) w = static_cast<uint8_t>(byte(random));
  }
  for (int tile = 0; tile < 8; ++tile) {
    const LaneC d = value_tile(rows, tile, [&](int g) -> const std::vector<uint8_t>& { return weights[static_cast<size_t>(g)]; });
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, c = lane % 4;
      for (int reg = 0; reg < 4; ++reg) {
        const int row = g + 8 * (reg / 2), head = 2 * c + reg % 2;
        const int channel = 16 * tile + mma::value_channel_of_row(row);
        int64_t want = 0;
        for (int t = 0; t < 32; ++t) want += static_cast<int64_t>(codes[t][channel]) * weights[head][t];
        ASSERT_EQ(d[lane][reg], want << (2 * mma::value_row_log4(row)))
            << "m tile " << tile << " lane " << lane << " register " << reg;
      }
    }
  }
}

// ---- values by ldmatrix (one value group per row)

// Byte k of a token's code row (words little-endian).
uint32_t row_byte(const std::vector<uint32_t>& row, int k) { return (row[static_cast<size_t>(k / 4)] >> (8 * (k % 4))) & 0xFFu; }

// ldmatrix.m8n8.trans, as PTX states it, of the 8 x 8 matrix of 16-bit
// units whose row j is bytes [16 mb, 16 mb + 16) of token first + j's row:
// lane (g, c) receives unit g of rows 2c (low half) and 2c + 1 (high half).
uint32_t ldmatrix_transposed(const std::vector<std::vector<uint32_t>>& rows, int first, int mb, int g, int c) {
  auto unit = [&](int token) {
    const auto& row = rows[static_cast<size_t>(token)];
    return row_byte(row, 16 * mb + 2 * g) | (row_byte(row, 16 * mb + 2 * g + 1) << 8);
  };
  return unit(first + 2 * c) | (unit(first + 2 * c + 1) << 16);
}

TEST(Int8MmaFragments, TransposedTokenOrderIsAPermutationAndItsInverse) {
  std::vector<int> seen(32, 0);
  for (int k = 0; k < 32; ++k) {
    const int t = mma::transposed_token_of_k(k);
    ASSERT_GE(t, 0);
    ASSERT_LT(t, 32);
    ++seen[static_cast<size_t>(t)];
    EXPECT_EQ(mma::transposed_k_of_token(t), k);
  }
  for (const int n : seen) EXPECT_EQ(n, 1);
}

// Every m tile's sums from the lanes' A registers a_of(tile, g, c, half,
// upper) (rows g + 8 upper, k half `half`) and B bytes in the k order
// token_of_k, against the weighted code sums of the channel each row names
// (channel_of(tile, row), its sums times 2^shift_of(tile, row)); the rows
// cover every channel once. 8 heads' random weights.
template <typename AOf, typename TokenOfK, typename ChannelOf, typename ShiftOf>
void expect_value_tiles(const std::vector<std::vector<int>>& codes, int dim, std::mt19937& random, AOf a_of,
                        TokenOfK token_of_k, ChannelOf channel_of, ShiftOf shift_of, const std::string& what) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<std::vector<uint8_t>> weights(8, std::vector<uint8_t>(32));  // [head][token]
  for (auto& head : weights) {
    for (auto& w : head) w = static_cast<uint8_t>(byte(random));
  }
  std::vector<int> channels_seen(static_cast<size_t>(dim), 0);
  for (int tile = 0; tile < dim / 16; ++tile) {
    LaneA a{};
    LaneB b{};
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, c = lane % 4;
      for (int half = 0; half < 2; ++half) {
        for (int upper = 0; upper < 2; ++upper) a[lane][2 * half + upper] = a_of(tile, g, c, half, upper);
        uint32_t bytes = 0;  // column g's weights at k = 16 half + 4c + i
        for (int i = 0; i < 4; ++i) {
          const int t = token_of_k(16 * half + 4 * c + i);
          bytes |= static_cast<uint32_t>(weights[static_cast<size_t>(g)][static_cast<size_t>(t)]) << (8 * i);
        }
        b[lane][half] = bytes;
      }
    }
    LaneC d{};
    emulate_m16n8k32(a, b, false, d);
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, c = lane % 4;
      for (int reg = 0; reg < 4; ++reg) {
        const int row = g + 8 * (reg / 2), head = 2 * c + reg % 2;
        const int channel = channel_of(tile, row);
        ASSERT_LT(channel, dim) << what;
        if (c == 0 && reg % 2 == 0) ++channels_seen[static_cast<size_t>(channel)];
        int64_t want = 0;
        for (int t = 0; t < 32; ++t) want += static_cast<int64_t>(codes[t][channel]) * weights[head][t];
        ASSERT_EQ(d[lane][reg], want << shift_of(tile, row))
            << what << ", head_dim " << dim << " m tile " << tile << " lane " << lane << " register " << reg;
      }
    }
  }
  EXPECT_EQ(channels_seen, std::vector<int>(static_cast<size_t>(dim), 1)) << what << ", head_dim " << dim;
}

// The value A operands by ldmatrix (one byte permute per gathered word, a
// mask per A register), at 2 and 4 bits, and by gathers at 4 bits (2 bits:
// ValueOperandsGiveTheWeightedSumsOfEachChannel).
TEST(Int8MmaFragments, TransposedAndNibbleValueOperandsGiveTheWeightedSumsOfEachChannel) {
  std::mt19937 random(13);
  for (const int dim : {128, 64}) {
    for (const int bits : {2, 4}) {
      std::vector<std::vector<int>> codes;
      const auto rows = random_rows(32, dim, random, codes, bits);
      // ldmatrix: 2 bits, tile 4 mb + 2 beta + q; 4 bits, tile 2 mb + beta.
      const auto transposed_a = [&](int tile, int g, int c, int half, int upper) {
        const int mb = bits == 2 ? tile / 4 : tile / 2, beta = bits == 2 ? (tile / 2) % 2 : tile % 2;
        const uint32_t gathered = mma::transposed_gather(ldmatrix_transposed(rows, 16 * half, mb, g, c),
                                                         ldmatrix_transposed(rows, 16 * half + 8, mb, g, c), beta);
        return bits == 2 ? mma::transposed_value_a_register(gathered, tile, upper)
                         : mma::nibble_transposed_value_a_register(gathered, upper);
      };
      expect_value_tiles(
          codes, dim, random, transposed_a, [](int k) { return mma::transposed_token_of_k(k); },
          [bits](int tile, int row) {
            return bits == 2 ? mma::transposed_value_channel(tile, row) : mma::nibble_transposed_value_channel(tile, row);
          },
          [bits](int tile, int row) {
            return bits == 2 ? 2 * mma::transposed_value_row_log4(tile, row) : 4 * mma::nibble_transposed_value_row_log16(row);
          },
          "ldmatrix, " + std::to_string(bits) + " bits");
      if (bits == 4) {
        // Gathers: word 2T + upper of four tokens' rows, byte g % 4.
        const auto gathered_a = [&](int tile, int g, int c, int half, int upper) {
          uint32_t words[4];
          for (int i = 0; i < 4; ++i) {
            const int token = mma::value_token_of_k(16 * half + 4 * c + i);
            words[i] = rows[static_cast<size_t>(token)][static_cast<size_t>(2 * tile + upper)];
          }
          return mma::nibble_value_a_register(mma::gather_byte(words[0], words[1], words[2], words[3], g % 4), g);
        };
        expect_value_tiles(
            codes, dim, random, gathered_a, [](int k) { return mma::value_token_of_k(k); },
            [](int tile, int row) { return mma::nibble_value_channel_of_row(tile, row); },
            [](int, int row) { return 4 * mma::nibble_value_row_log16(row); }, "gathers, 4 bits");
      }
    }
  }
}

// Packed parts (groups of at most 4 heads), keys: B column n is part
// packed_part(n) of head packed_head(n)'s query, so lane (g, c) holds both
// parts of head c for tokens 16 rb + g and 16 rb + g + 8, and its
// packed_sum(128) is the dot product of the codes with 128 hi + lo of the
// query (times the Horner sums' power of 4).
TEST(Int8MmaFragments, PackedKeyPartsGiveEachLaneBothPartsOfItsHead) {
  for (int head = 0; head < mma::kPackedHeads; ++head) {
    for (int part = 0; part < 2; ++part) {
      const int n = mma::packed_column(head, part);
      ASSERT_EQ(mma::packed_head(n), head);
      ASSERT_EQ(mma::packed_part(n), part);
      // The lane of column n and that of the head's other part.
      ASSERT_EQ(mma::packed_column(head, 1 - part), (4 * n ^ mma::kPartPartnerLaneMask) / 4);
    }
  }
  std::mt19937 random(3);
  std::uniform_int_distribution<int> part(-127, 127);
  for (const int dim : {64, 128}) {
    std::vector<std::vector<int>> codes;
    const auto rows = random_rows(32, dim, random, codes);
    // query[part][head][channel]
    std::vector<std::vector<std::vector<int8_t>>> query(
        2, std::vector<std::vector<int8_t>>(mma::kPackedHeads, std::vector<int8_t>(static_cast<size_t>(dim))));
    for (auto& heads : query) {
      for (auto& head : heads) {
        for (auto& x : head) x = static_cast<int8_t>(part(random));
      }
    }
    for (int rb = 0; rb < 2; ++rb) {
      const LaneC d = key_row_block(rows, 16 * rb, dim, [&](int g) {
        return query[static_cast<size_t>(mma::packed_part(g))][static_cast<size_t>(mma::packed_head(g))].data();
      });
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, c = lane % 4;
        const int registers[4] = {static_cast<int>(d[lane][0]), static_cast<int>(d[lane][1]), static_cast<int>(d[lane][2]),
                                  static_cast<int>(d[lane][3])};
        for (int r = 0; r < 2; ++r) {
          const int token = 16 * rb + g + 8 * r, head = c;
          int64_t want = 0;
          for (int ch = 0; ch < dim; ++ch) {
            want += static_cast<int64_t>(codes[token][ch]) * (128 * query[0][head][ch] + query[1][head][ch]);
          }
          ASSERT_EQ(mma::packed_sum(registers, 2 * r, 128), mma::key_plane_scale(dim) * want)
              << "head_dim " << dim << " row block " << rb << " lane " << lane << " row " << r;
        }
      }
    }
  }
}

// Packed parts, values: B column n is part packed_part(n) of head
// packed_head(n)'s weights; lane (g, c) gets both parts of head c for its
// rows g and g + 8, so 256 hi + lo (the kernel adds the parts' sums as
// floats, the high one's scale times 256) is the weighted sum of the codes.
TEST(Int8MmaFragments, PackedValuePartsGiveEachLaneTheWeightedSumsOfItsHead) {
  std::mt19937 random(5);
  std::vector<std::vector<int>> codes;
  const auto rows = random_rows(32, 128, random, codes);
  std::uniform_int_distribution<int> byte(0, 255);
  // parts[part][head][token]
  std::vector<std::vector<std::vector<uint8_t>>> parts(
      2, std::vector<std::vector<uint8_t>>(mma::kPackedHeads, std::vector<uint8_t>(32)));
  for (auto& heads : parts) {
    for (auto& head : heads) {
      for (auto& w : head) w = static_cast<uint8_t>(byte(random));
    }
  }
  for (int tile = 0; tile < 8; ++tile) {
    const LaneC d = value_tile(rows, tile, [&](int g) -> const std::vector<uint8_t>& {
      return parts[static_cast<size_t>(mma::packed_part(g))][static_cast<size_t>(mma::packed_head(g))];
    });
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, c = lane % 4;
      const int registers[4] = {static_cast<int>(d[lane][0]), static_cast<int>(d[lane][1]), static_cast<int>(d[lane][2]),
                                static_cast<int>(d[lane][3])};
      for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r, head = c;
        const int channel = 16 * tile + mma::value_channel_of_row(row);
        int64_t want = 0;
        for (int t = 0; t < 32; ++t) {
          want += static_cast<int64_t>(codes[t][channel]) * (256 * parts[0][head][t] + parts[1][head][t]);
        }
        ASSERT_EQ(mma::packed_sum(registers, 2 * r, 256), want << (2 * mma::value_row_log4(row)))
            << "m tile " << tile << " lane " << lane << " row " << r;
      }
    }
  }
}

// The kernel's integer conversions by float adds: exact over the ranges it
// uses them for, and rounding as rintf (to nearest, ties to even).
TEST(Int8MmaFragments, FloatAddsConvertSmallIntegersExactly) {
  for (int n = -70000; n <= 70000; ++n) {
    ASSERT_EQ(mma::unbiased_float(mma::kIntegerBiasBits + n), static_cast<float>(n)) << n;
  }
  for (const int n : {-(1 << 22) + 1, (1 << 22) - 1}) {
    ASSERT_EQ(mma::unbiased_float(mma::kIntegerBiasBits + n), static_cast<float>(n)) << n;
  }
  // The packed value sums (32 tokens, codes up to 3 times 4^3, weight parts
  // up to 255) start from the bias in the mma's int32 accumulator.
  const int64_t largest_value_sum = 32 * 192 * 255;
  ASSERT_LT(largest_value_sum, int64_t{1} << 22);
  ASSERT_LT(mma::kIntegerBiasBits + largest_value_sum, int64_t{1} << 31);
  ASSERT_EQ(mma::unbiased_float(mma::kIntegerBiasBits + static_cast<int32_t>(largest_value_sum)),
            static_cast<float>(largest_value_sum));

  std::vector<float> xs = {0.0f, -0.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f, -126.5f, 127.49f,
                           65534.5f, 65535.0f, 65535.49f, 4194303.5f, -4194303.0f};
  std::mt19937 random(23);
  std::uniform_real_distribution<float> uniform(-4194303.0f, 4194303.0f);
  std::uniform_real_distribution<float> small(-200.0f, 200.0f);
  for (int i = 0; i < 100000; ++i) xs.push_back(i % 2 == 0 ? uniform(random) : small(random));
  for (const float x : xs) {
    const int32_t biased = mma::biased_integer(x);
    const auto rounded = static_cast<int32_t>(std::rint(x));
    ASSERT_EQ(biased - mma::kIntegerBiasBits, rounded) << x;
    ASSERT_EQ(mma::unbiased_float(biased), std::rint(x)) << x;
    if (std::fabs(x) < 127.5f) ASSERT_EQ(static_cast<int8_t>(biased), rounded) << x;
    if (x >= 0.0f && x < 65535.5f) ASSERT_EQ(biased & 0xffff, rounded) << x;
  }
}

// The parts' bounds (the kernel's test bound uses them): queries
// |x - s (hi + lo / 128)| <= s / 256, weights |w - u (256 hi + lo)| <= u / 2 (hi, lo uint8),
// plus float32's share: the scale and its inverse round separately (s times
// 1/s is 1 within 2 ulps) and so does the scaled value: 4 u |x|, u = 2^-24.
TEST(Int8MmaFragments, PartsReconstructWithinTheirBounds) {
  std::mt19937 random(11);
  std::normal_distribution<float> normal;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> x(128);
    float largest = 0;
    for (float& v : x) {
      v = normal(random) * std::ldexp(1.0f, trial % 20 - 10);
      largest = std::max(largest, std::fabs(v));
    }
    const float scale = largest / 127.0f, inverse = 127.0f / largest;
    for (float v : x) {
      const mma::SignedParts p = mma::signed_parts(v, inverse);
      const double back = static_cast<double>(scale) * (p.hi + p.lo / 128.0);
      ASSERT_LE(std::fabs(back - v), scale / 256.0 + 0x1p-22 * std::fabs(v)) << v;
      ASSERT_LE(std::abs(static_cast<int>(p.hi)), 127);
    }
    const float weight_max = std::fabs(x[0]) + 1e-30f;
    const float weight_unit = weight_max / mma::kWeightSteps;
    // The kernel's inverse is approximate (65535 times rcp.approx: within 2 ulp): the parts'
    // error may grow by 65535 * 2^-21 of the unit, and 256 hi + lo stays
    // within 65535 (clamped, not wrapped).
    for (const float inverse_error : {1.0f, 1.0f + 0x1p-22f, 1.0f - 0x1p-22f}) {
      const float weight_inverse = mma::kWeightSteps / weight_max * inverse_error;
      for (float v : x) {
        const float w = std::min(std::fabs(v), weight_max);
        const mma::WeightParts p = mma::weight_parts(w, weight_inverse);
        const double back = static_cast<double>(weight_unit) * (256.0 * p.hi + p.lo);
        ASSERT_LE(std::fabs(back - w), weight_unit * (0.5 + 65535.0 * 0x1p-21) + 0x1p-22 * w) << w;
      }
      // The step's largest weight itself, where the inverse's error would
      // carry 256 hi + lo past 65535: it clamps.
      const mma::WeightParts top = mma::weight_parts(weight_max, weight_inverse);
      ASSERT_GE(256 * top.hi + top.lo, 65534);
    }
  }
}

}  // namespace
}  // namespace kvforge
