#pragma once
// The quantizer configurations kvforge_bench_decode_attention times: one
// layer per method and bits, fitted by calib on random activations with a
// few outlier channels (the benchmark measures bytes and time, not
// quality). int2-rot carries the per-head rotations `kvforge rotate` writes
// (centred post-RoPE keys and values, each a dense matrix per KV head):
// random orthogonal ones here, which cost the kernels what learned ones do
// (the queries rotated in the split kernels, the output rotated back in the
// merge).
#include <cstdint>
#include <string>

#include "formats/quantizer_config.h"

namespace kvforge {

// `method`: kvquant, kivi, int2-rot or rtn (std::invalid_argument naming
// --methods otherwise); `bits`: 2 or 4.
QuantizerConfig decode_bench_config(const std::string& method, int bits, int64_t kv_heads, int64_t head_dim);

}  // namespace kvforge
