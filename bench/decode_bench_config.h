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
#include "kernels/quantized_kv_cache.h"

namespace kvforge {

// Llama-3-8B's attention: 32 query heads on 8 KV heads of 128.
inline constexpr int64_t kDecodeBenchHeads = 32, kDecodeBenchKvHeads = 8, kDecodeBenchHeadDim = 128;

// One layer of those shapes with Llama 3's RoPE frequencies (what pre-RoPE
// keys are rotated with).
kernels::ModelDimensions decode_bench_dimensions();

// A configuration at those shapes. `method`: kvquant, kivi, int2-rot or rtn
// (std::invalid_argument naming --methods otherwise); `bits`: 2 or 4. The
// same for the same arguments, whatever was drawn before (torch's CPU
// generator is seeded for the pair, then restored).
QuantizerConfig decode_bench_config(const std::string& method, int bits);

}  // namespace kvforge
