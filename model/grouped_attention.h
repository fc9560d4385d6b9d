#pragma once
// Attention of grouped query heads over their shared KV heads by two batched
// matrix products, without repeating the KV heads: the query heads of a group
// become extra rows of one product per KV head. Used for every step that
// attends over a KV cache (decoding, chunked prefill), where the fused SDPA
// kernels are the wrong tool: on Hopper SDPA picks cuDNN attention, which
// compiles a new plan for every key length, 55 ms per decoding step on an
// H200 (bench/sdpa_decode_probe.py).
#include <ATen/core/Tensor.h>

#include <optional>

namespace kvforge {

// q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D] with Hkv dividing H (query head h
// reads KV head h / (H / Hkv), as transformers' repeat_kv); mask: bool
// [Tq, Tk] (true: attend) or none. The operations of transformers' eager
// attention (scores in q's dtype, softmax in float32, cast back, weighted
// sum), so nothing is converted per step. Returns [B, H, Tq, D].
at::Tensor grouped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& mask, double scale);

}  // namespace kvforge
