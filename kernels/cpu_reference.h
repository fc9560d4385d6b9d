#pragma once
// The CPU reference of the runtime kernels over decode_params.h's structs:
// what the CUDA kernels must reproduce (codes, group parameters and outlier
// rows bit for bit; attention within 1e-3) and what the CPU test suite
// checks against calib's float64 oracle. docs/runtime-layout.md states the
// semantics; in short:
//   append: every new token is converted to the element type, rotated (in
//     float64, then rounded to the element type again), and quantized as soon
//     as its group is complete (per-token groupings on arrival, a
//     per_channel_tokens group when its G-th token arrives): codes, group
//     (min, max) and outlier rows go to the pages, tokens of the sink to the
//     exact store, and every token past the sink also to the sequence's ring
//     of window tokens, from which attention reads it while it is in the
//     window.
//   decode_attention: one query per sequence over all its tokens: sink and
//     window tokens exact, the others dequantized with the outliers put back,
//     RoPE for pre-RoPE keys, queries rotated by the key rotation and outputs
//     back by the value rotation; softmax in float32 split over the context
//     (flash-decoding) and the splits merged.
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/decode_params.h"

namespace kvforge::kernels {

// The byte ranges a decoding step read (merged), to compare with
// bytes_read() of runtime_layout.h: what a kernel must load at least.
class ReadTally {
 public:
  void add(const void* address, int64_t bytes);
  int64_t distinct_bytes() const;
  void clear() { ranges_.clear(); }

 private:
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges_;  // [begin, end)
};

// Quantize-on-append. Sets the tensor's OutlierAllocator::exhausted and
// returns early when an outlier page was needed and none was free (the
// sequences of the batch are then inconsistent and must be dropped).
void append_reference(const AppendParams& params);

// Fills params.output.
void decode_attention_reference(const DecodeParams& params);

// Token `token` of a sequence with `tokens` cached, as attention reads it,
// in the stored basis (rotated; pre-RoPE keys before RoPE).
struct TokenReadout {
  bool quantized = false;         // read from the pages (else from the exact store)
  std::vector<float> values;      // [kv_heads * D]
  std::vector<uint8_t> codes;     // [kv_heads * D], zero unless quantized
  std::vector<uint8_t> outliers;  // [kv_heads * D], 1 where the outlier store gave the value
};
TokenReadout read_token_reference(const PagedTensor& cache, const Dequantization& dequantization, int32_t slot,
                                  const int32_t* page_table_row, int64_t tokens, int64_t token);

}  // namespace kvforge::kernels
