#pragma once
// Operands of the 8-bit integer tensor-core decode (decode_int8_kernel.cuh)
// for 2-bit codes, as pure functions that host code can run too (the CPU
// test replays them through an emulation of the PTX fragment layouts).
//
// PTX mma.m16n8k32 with 8-bit operands (g = lane / 4, c = lane % 4): A
// registers 0..3 hold rows g, g + 8, g, g + 8 and columns (k) 4c + i,
// 4c + i, 16 + 4c + i, 16 + 4c + i in their bytes i = 0..3; B registers 0
// and 1 hold column g, rows 4c + i and 16 + 4c + i; the int32 C registers
// rows g, g, g + 8, g + 8 and columns 2c, 2c + 1, 2c, 2c + 1.
//
// A 2-bit code row word holds 16 channels, channel d at bits 2d. Masking it
// with 0x03030303 << 2j ("plane" j) leaves channels j, 4 + j, 8 + j and
// 12 + j as the four bytes, each times 4^j: one mask (no shift; the integer
// ALU is the kernel's busiest pipe) gives an A register whose codes carry a
// known power of 4, which the sums take out exactly. The dot products do
// not care which k holds which channel as long as A and B agree. So:
//   keys (A = codes, M = 16 tokens, K = 32 channels, B = the query parts):
//   mma j of head_dim 128 is plane j of all 8 words (lane c's k = 16h +
//   4c + i holds channel 16 (2c + h) + 4i + j, word 2c + h), planes 0 and 2
//   masked from the word, 1 and 3 from the word shifted by 2 (one shift a
//   word for two planes), so that planes 0 and 1 enter times 1 and planes 2
//   and 3 times 16: the sums, times 16 once before mma 2 (key_horner), are
//   16 times the dot product (key_plane_scale); at head_dim 64 mma j takes
//   plane j of the 4 words in k 0-15 and plane j + 2 (the word shifted by
//   4) in k 16-31, both times 4^j (times 4 before mma 1);
//   values (A = V^T codes, M = 16 channels of m tile T, K = 32 tokens in
//   the order value_token_of_k gives, B = the softmax weights times the
//   token scales in the same order): row r holds channel
//   16T + 4 (r % 4) + (r / 4) % 2 + 2 (r / 8), so that rows g and g + 8 of a
//   lane are planes g / 4 and g / 4 + 2 of byte g % 4 of word T; the lane
//   gathers that byte from four tokens' words into one register (three
//   byte permutes) and masks it twice, so row r's sums carry
//   4^value_row_log4(r), which the kernel divides out of the row's output
//   once, at the end.
//
// GQA groups of at most 4 heads leave columns 4-7 of N idle, so there the
// columns carry the other operand's two parts ("packed parts"), interleaved:
// column n holds part n % 2 (0 the high, 1 the low) of head n / 2
// (packed_column). One mma gives both parts' sums, and lane (g, c) holds
// both of head c's (C columns 2c and 2c + 1) for rows g and g + 8, so it
// combines them in its own registers (128 hi + lo for the keys, 256 hi + lo
// for the values): no exchange between lanes, and every lane scores,
// weighs and accumulates one head, c, the same for keys and values.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels::int8_mma {

inline constexpr uint32_t kCodeBytes = 0x03030303u;

// __byte_perm: byte n of the result is byte (selector >> 4n) & 7 of the
// eight bytes {x, y} (x the low four).
KVFORGE_HOST_DEVICE inline uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, selector);
#else
  const uint64_t both = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t result = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t from = (selector >> (4 * n)) & 7u;
    result |= static_cast<uint32_t>((both >> (8 * from)) & 0xFFu) << (8 * n);
  }
  return result;
#endif
}

// ---------------------------------------------------------------- keys

// The mmas of a key row block (one per plane at head_dim 128, two planes
// each at 64), the factor the sums take before mma j (key_horner: head_dim
// 128 times 16 before mma 2, 64 times 4 before mma 1) and the power of 4
// their Horner sum carries over the dot product (16 and 4).
KVFORGE_HOST_DEVICE constexpr int key_mmas(int dim) { return dim / 32; }
KVFORGE_HOST_DEVICE constexpr int key_horner(int dim, int j) { return dim == 128 ? (j == 2 ? 16 : 1) : (j == 1 ? 4 : 1); }
KVFORGE_HOST_DEVICE constexpr int key_plane_scale(int dim) { return dim == 128 ? 16 : 4; }

// The channel that byte i of B register `half` of lane column c holds in
// key mma j (and A's k = 16 half + 4c + i).
KVFORGE_HOST_DEVICE inline int key_channel(int dim, int j, int c, int half, int i) {
  return dim == 128 ? 16 * (2 * c + half) + 4 * i + j : 16 * c + 4 * i + j + 2 * half;
}

// The code words lane column c reads of a row: words 2c, 2c + 1 at head_dim
// 128, word c at 64 (both halves).
KVFORGE_HOST_DEVICE constexpr int key_words(int dim) { return dim == 128 ? 2 : 1; }
KVFORGE_HOST_DEVICE inline int key_first_word(int dim, int c) { return dim == 128 ? 2 * c : c; }

// A register `which` (0..3) of key mma j from the lane's words of its rows
// g and g + 8 (key_first_word onwards): at head_dim 128 the codes times 1
// (j = 0, 1) or 16 (j = 2, 3), at 64 times 4^j.
KVFORGE_HOST_DEVICE inline uint32_t key_a_register(int dim, const uint32_t* words_g, const uint32_t* words_g8, int j,
                                                   int which) {
  const uint32_t* words = which % 2 == 0 ? words_g : words_g8;
  const int half = which / 2;
  if (dim == 128) return (words[half] >> (2 * (j % 2))) & (kCodeBytes << (4 * (j / 2)));
  return (words[0] >> (4 * half)) & (kCodeBytes << (2 * j));
}


// (key_b_register, the B registers at either width, follows the 4-bit
// section.)

// ---------------------------------------------------------------- values

// The token (0..31 of a step) that k holds: k = 16h + 4c + i holds token
// 16h + c + 4i, so that the four lanes c of one gathering load read rows c +
// 4i, 8 words apart at head_dim 128, in four different banks (in token order
// they would be 32 words apart: one bank, four-way conflicts). The map is
// its own inverse (a 4 x 4 transpose within each half), so it also gives the
// k at which token t's weight is stored.
KVFORGE_HOST_DEVICE inline int value_token_of_k(int k) { return 16 * (k / 16) + (k % 16) / 4 + 4 * (k % 4); }

// The channel (0..15 within an m tile) that A row r holds.
KVFORGE_HOST_DEVICE inline int value_channel_of_row(int r) { return 4 * (r % 4) + (r / 4) % 2 + 2 * (r / 8); }

// Byte `byte` of word w of four tokens, token i in byte i.
KVFORGE_HOST_DEVICE inline uint32_t gather_byte(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3, int byte) {
  const uint32_t selector = static_cast<uint32_t>(byte) | (static_cast<uint32_t>(4 + byte) << 4);
  return byte_perm(byte_perm(w0, w1, selector), byte_perm(w2, w3, selector), 0x5410u);
}

// The plane of A row r's channel in its gathered byte: its codes enter the
// mma times 4^value_row_log4(r).
KVFORGE_HOST_DEVICE inline int value_row_log4(int r) { return (r % 8) / 4 + 2 * (r / 8); }

// A registers 0/1 (rows g and g + 8, upper 0/1) of lane row g from the
// gathered byte of four tokens (gather_byte of byte g % 4): the codes of
// channels 4 (g % 4) + g / 4 and 4 (g % 4) + 2 + g / 4 of those tokens,
// times 4^value_row_log4(g + 8 upper).
KVFORGE_HOST_DEVICE inline uint32_t value_a_register(uint32_t gathered, int g, int upper) {
  return gathered & (kCodeBytes << (2 * value_row_log4(g + 8 * upper)));
}

// ---------------------------------------------------------------- values by ldmatrix (one group per row)

// ldmatrix.m8n8.x4.trans loads four 8 x 8 matrices of 16-bit units from
// shared memory, lane l addressing row l % 8 of matrix l / 8, and gives
// lane (g, c) unit g of rows 2c (low half) and 2c + 1 (high half) of each.
// With a step's tokens as the rows and a 16-byte column block mb of their
// code rows as a matrix's 8 units, a lane receives unit g (bytes 2g and
// 2g + 1 of the block: channels 64 mb + 8g .. + 7) of tokens 2c and 2c + 1
// of an octet of tokens, and one byte permute of two octets' registers
// (tokens o + 2c, o + 2c + 1 and o + 8 + 2c, o + 9 + 2c) gives byte beta of
// four tokens in one word; a mask per plane makes an A register of it. No
// lane gathers a byte another lane gathers too (gather_byte's way gathers
// each twice, from four rows' loads and three permutes per word):
//   k = 16h + 4c + i holds token 16h + 2c + i % 2 + 8 (i / 2);
//   m tile T = 4 mb + 2 beta + q, row r: plane 2q + r / 8 of byte beta of
//   unit r % 8 of column block mb, i.e. channel
//   64 mb + 8 (r % 8) + 4 beta + 2q + r / 8, its codes times 4^(2q + r / 8).
// A tile's rows span 64 channels, so this serves values with one group per
// row (a tile's B operand holds one group's weights).

KVFORGE_HOST_DEVICE constexpr int transposed_token_of_k(int k) {
  return 16 * (k / 16) + 2 * ((k % 16) / 4) + k % 2 + 8 * ((k % 4) / 2);
}
KVFORGE_HOST_DEVICE constexpr int transposed_k_of_token(int t) {
  return 16 * (t / 16) + 4 * ((t % 8) / 2) + 2 * ((t % 16) / 8) + t % 2;
}

// Byte beta (0, 1) of unit g of four tokens, from the lane's registers of
// two octets (o and o + 8) of one column block.
KVFORGE_HOST_DEVICE inline uint32_t transposed_gather(uint32_t octet, uint32_t next_octet, int beta) {
  return byte_perm(octet, next_octet, beta == 0 ? 0x6420u : 0x7531u);
}

KVFORGE_HOST_DEVICE constexpr int transposed_value_row_log4(int tile, int row) { return 2 * (tile % 2) + row / 8; }
KVFORGE_HOST_DEVICE constexpr int transposed_value_channel(int tile, int row) {
  return 64 * (tile / 4) + 8 * (row % 8) + 4 * ((tile / 2) % 2) + transposed_value_row_log4(tile, row);
}

// A register of m tile `tile` for rows g (upper 0) or g + 8 (upper 1) from
// the gathered word of its column block, byte and k half.
KVFORGE_HOST_DEVICE inline uint32_t transposed_value_a_register(uint32_t gathered, int tile, int upper) {
  return gathered & (kCodeBytes << (2 * transposed_value_row_log4(tile, 8 * upper)));
}

// ---------------------------------------------------------------- 4-bit codes

// At 4 bits a code row word holds 8 channels, channel d at bits 4d: masking
// it with 0x0F0F0F0F << 4p ("plane" p of 2) leaves channels p, 2 + p, 4 + p
// and 6 + p as its bytes, times 16^p, the same one-mask A registers.
//   keys: lane column c reads its row words w = W c .. W c + W - 1
//   (W = head_dim / 32: one 8- or 16-byte load); mma j takes plane
//   p = j / (W / 2) of words W c + 2m + half (m = j % (W / 2)) in its B
//   register `half`, so that byte i of that register holds channel
//   8 (W c + 2m + half) + 2i + p; the plane-0 sums are times 16 once before
//   the plane-1 mmas (Horner over the two planes): the sums are 16 times the
//   dot product;
//   values by ldmatrix: unit g of column block mb (16 bytes: 32 channels)
//   is channels 32 mb + 4g .. + 3; m tile T = 2 mb + beta, row r: plane
//   r / 8 of byte beta of unit r % 8, channel 32 (T / 2) + 4 (r % 8) +
//   2 (T % 2) + r / 8, times 16^(r / 8); the token order is
//   transposed_token_of_k's;
//   values gathered (groups of 32 channels): m tile T is words 2T and
//   2T + 1; row r: plane (r / 4) % 2 of byte r % 4 of word 2T + r / 8,
//   channel 16T + 8 (r / 8) + 2 (r % 4) + (r / 4) % 2, times
//   16^((r / 4) % 2); a lane gathers byte g % 4 of four tokens' words 2T
//   (row g) and 2T + 1 (row g + 8); the token order is value_token_of_k's.
inline constexpr uint32_t kNibbles = 0x0F0F0F0Fu;

KVFORGE_HOST_DEVICE constexpr int nibble_key_words(int dim) { return dim / 32; }
KVFORGE_HOST_DEVICE constexpr int nibble_key_plane(int dim, int j) { return j / (dim / 64); }
KVFORGE_HOST_DEVICE constexpr int nibble_key_word(int dim, int j, int half) { return 2 * (j % (dim / 64)) + half; }
// The mma before which the sums are times 16 (the first of plane 1).
KVFORGE_HOST_DEVICE constexpr int nibble_key_horner_mma(int dim) { return dim / 64; }
inline constexpr int kNibbleKeyScale = 16;

// The factor a key row block's sums take before mma j at either width (2
// bits: key_horner; 4 bits: 16 before the first plane-1 mma).
KVFORGE_HOST_DEVICE constexpr int key_horner_factor(int bits, int dim, int j) {
  return bits == 2 ? key_horner(dim, j) : (j == nibble_key_horner_mma(dim) ? kNibbleKeyScale : 1);
}

// The channel that byte i of B register `half` of lane column c holds in
// key mma j (and A's k = 16 half + 4c + i).
KVFORGE_HOST_DEVICE inline int nibble_key_channel(int dim, int j, int c, int half, int i) {
  return 8 * (nibble_key_words(dim) * c + nibble_key_word(dim, j, half)) + 2 * i + nibble_key_plane(dim, j);
}

// A register `which` (0..3) of key mma j from the lane's words of its rows
// g and g + 8 (nibble_key_words of each, from word W c): codes times 16^p.
KVFORGE_HOST_DEVICE inline uint32_t nibble_key_a_register(int dim, const uint32_t* words_g, const uint32_t* words_g8, int j,
                                                          int which) {
  const uint32_t* words = which % 2 == 0 ? words_g : words_g8;
  return words[nibble_key_word(dim, j, which / 2)] & (kNibbles << (4 * nibble_key_plane(dim, j)));
}

// B register `half` (0, 1) of lane column c for key mma j at `bits` (2:
// key_channel's order, 4: nibble_key_channel's): bytes i are the query parts
// of those channels (`query` the head's D parts).
KVFORGE_HOST_DEVICE inline uint32_t key_b_register(int dim, const int8_t* query, int j, int c, int half, int bits = 2) {
  uint32_t result = 0;
  for (int i = 0; i < 4; ++i) {
    const int channel = bits == 2 ? key_channel(dim, j, c, half, i) : nibble_key_channel(dim, j, c, half, i);
    result |= static_cast<uint32_t>(static_cast<uint8_t>(query[channel])) << (8 * i);
  }
  return result;
}

KVFORGE_HOST_DEVICE constexpr int nibble_transposed_value_channel(int tile, int row) {
  return 32 * (tile / 2) + 4 * (row % 8) + 2 * (tile % 2) + row / 8;
}
// The power of 16 a row's sums carry: 16^nibble_..._log16.
KVFORGE_HOST_DEVICE constexpr int nibble_transposed_value_row_log16(int row) { return row / 8; }
KVFORGE_HOST_DEVICE inline uint32_t nibble_transposed_value_a_register(uint32_t gathered, int upper) {
  return gathered & (kNibbles << (4 * upper));
}

KVFORGE_HOST_DEVICE constexpr int nibble_value_channel_of_row(int tile, int row) {
  return 16 * tile + 8 * (row / 8) + 2 * (row % 4) + (row / 4) % 2;
}
KVFORGE_HOST_DEVICE constexpr int nibble_value_row_log16(int row) { return (row / 4) % 2; }
// A register of rows g (upper 0) or g + 8 (upper 1) from the byte g % 4 of
// four tokens' word 2T + upper (gather_byte).
KVFORGE_HOST_DEVICE inline uint32_t nibble_value_a_register(uint32_t gathered, int g) {
  return gathered & (kNibbles << (4 * ((g / 4) % 2)));
}

// ---------------------------------------------------------------- integers through float adds

// Hopper converts between int32 and float32, and rounds a float to an
// integer, at 16 per clock per multiprocessor, on the pipe that also runs
// ex2; float adds run at 128. Integers of a known small range go through a
// float add instead: for |n| < 2^22 the float kIntegerBias + n is exact, its
// last place is worth 1 and its bits are kIntegerBiasBits + n; and adding
// kIntegerBias to a float x of that range rounds x to an integer (to
// nearest, ties to even: rintf's and __float2uint_rn's rounding).
inline constexpr float kIntegerBias = 12582912.0f;       // 1.5 * 2^23
inline constexpr int32_t kIntegerBiasBits = 0x4B400000;  // its bits; the low 16 are 0

// kIntegerBiasBits + rint(x), for |x| < 2^22: its low byte is rint(x) as an
// 8-bit two's complement number (|x| < 127.5), its low 16 bits rint(x)
// itself for 0 <= x < 65535.5.
KVFORGE_HOST_DEVICE inline int32_t biased_integer(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(__fadd_rn(x, kIntegerBias));
#else
  const float biased = x + kIntegerBias;
  int32_t bits = 0;
  std::memcpy(&bits, &biased, sizeof bits);
  return bits;
#endif
}

// n from kIntegerBiasBits + n (|n| < 2^22), exactly: the float add that
// replaces an int32-to-float conversion.
KVFORGE_HOST_DEVICE inline float unbiased_float(int32_t biased) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(__int_as_float(biased), kIntegerBias);
#else
  float value = 0.0f;
  std::memcpy(&value, &biased, sizeof value);
  return value - kIntegerBias;
#endif
}

// ---------------------------------------------------------------- parts

// x (|x| <= scale * 127) as scale * (hi + lo / 128) with hi, lo int8: the
// queries' two parts. |x - scale (hi + lo / 128)| <= scale / 256.
struct SignedParts {
  int8_t hi = 0, lo = 0;
};
// Both roundings are float adds (biased_integer's; the second fused into
// the fma with the exact product (scaled - hi) * 128, so it rounds as the
// add of that product would).
KVFORGE_HOST_DEVICE inline SignedParts signed_parts(float x, float inverse_scale) {
  const float scaled = x * inverse_scale;
  const int32_t hi = biased_integer(scaled);
  const float rest = scaled - unbiased_float(hi);  // exact
#if defined(__CUDA_ARCH__)
  const int32_t lo = __float_as_int(__fmaf_rn(rest, 128.0f, kIntegerBias));
#else
  const float biased = std::fma(rest, 128.0f, kIntegerBias);
  int32_t lo = 0;
  std::memcpy(&lo, &biased, sizeof lo);
#endif
  return {static_cast<int8_t>(hi), static_cast<int8_t>(lo)};  // the low bytes
}

// w (0 <= w <= unit * 65535, or slightly above from an approximate
// inverse) as unit * (256 hi + lo) with hi and lo uint8, the bytes of one
// 16-bit fixed-point number: the weights' two parts, both unsigned so that
// one mma type serves both (and packed parts share one mma).
// |w - unit (256 hi + lo)| <= unit / 2 for w <= unit * 65535. One fma,
// w * inverse_unit + kIntegerBias, rounds the exact product to an integer
// (biased_integer's add, fused), and one integer minimum clamps it at 65535
// (also an infinite product, from the inverse of a denormal largest weight);
// the parts are the low bytes.
inline constexpr float kWeightSteps = 65535.0f;  // the largest 256 hi + lo
struct WeightParts {
  uint8_t hi = 0, lo = 0;
};
KVFORGE_HOST_DEVICE inline WeightParts weight_parts(float w, float inverse_unit) {
  constexpr int32_t kLargest = kIntegerBiasBits + 65535;
#if defined(__CUDA_ARCH__)
  const int32_t biased = __float_as_int(__fmaf_rn(w, inverse_unit, kIntegerBias));
  const int32_t q = min(biased, kLargest);
#else
  const float sum = std::fma(w, inverse_unit, kIntegerBias);
  int32_t biased = 0;
  std::memcpy(&biased, &sum, sizeof biased);
  const int32_t q = biased < kLargest ? biased : kLargest;
#endif
  return {static_cast<uint8_t>(q >> 8), static_cast<uint8_t>(q)};
}

// ---------------------------------------------------------------- packed parts

inline constexpr int kPackedHeads = 4;  // the largest GQA group the packed parts serve

// B (and C) column of part `part` (0 the high, 1 the low) of head `head`,
// and back.
KVFORGE_HOST_DEVICE constexpr int packed_column(int head, int part) { return 2 * head + part; }
KVFORGE_HOST_DEVICE constexpr int packed_head(int column) { return column / 2; }
KVFORGE_HOST_DEVICE constexpr int packed_part(int column) { return column % 2; }

// The lane whose B column is the other part of lane l's head: l ^ 4 (g ^ 1).
inline constexpr int kPartPartnerLaneMask = 4;

// Lane (g, c)'s sums of head c from its C registers: row g (first = 0) or
// g + 8 (first = 2), the high part's sum times `high_weight` (128 for the
// keys' signed parts, 256 for the values' unsigned ones) plus the low's.
KVFORGE_HOST_DEVICE constexpr int packed_sum(const int (&d)[4], int first, int high_weight) {
  return high_weight * d[first] + d[first + 1];
}

}  // namespace kvforge::kernels::int8_mma
