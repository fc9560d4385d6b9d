#!/usr/bin/env python3
"""The decode-attention baselines the runtime kernels are measured against,
on the GPU machine, at Llama-3-8B's attention shapes (32 query heads on 8 KV
heads of 128): one decoding step (one query token per sequence) over a cache
of `context` tokens for `batch` sequences.

- sdpa_bf16: torch.nn.functional.scaled_dot_product_attention on contiguous
  bf16 K/V [batch, 8, context, 128] with enable_gqa (cuDNN on the H200);
- flashinfer_bf16, flashinfer_fp8: FlashInfer's BatchDecodeWithPagedKVCacheWrapper
  on a paged cache (page 16, NHD) in bf16 and in fp8 e4m3 (when flashinfer
  imports: it is carried to the GPU machine as a wheel, bench/README.md),
  each with its CUDA-core decode kernel and with its tensor-core one
  (use_tensor_cores, which FlashInfer advises for GQA groups of 4 and more:
  the CUDA-core kernel was slower than SDPA at batch 8 and 32 on the H200);
  the column is the faster, and *_tensor_cores says which;
- copy bandwidth: a device-to-device copy of 4 GiB, bytes read plus written
  over time: what "achieved bandwidth" is compared with.

Times are CUDA-event medians of `--repeats` steps after warm-up, at a fixed
context (cuDNN compiles one plan per length: the first call is excluded),
each repeat after a read of 4x the L2's size (as bench/l2_flush.h does for
the runtime kernels: a layer's decode in a server finds none of its bytes in
L2), unless --warm-l2 (the grids before 2026-12-05); "l2_cold" says which.
Writes JSON: {"machine", "torch", "flashinfer", "copy_bandwidth_bytes_per_s",
"rows": [{"context", "batch", "sdpa_time_us", "flashinfer_bf16_time_us",
"flashinfer_fp8_time_us", "flashinfer_bf16_tensor_cores", "flashinfer_fp8_tensor_cores",
"flashinfer_bf16_cuda_cores_time_us", ... "bf16_bytes"}]}.

Usage: python3 bench/decode_baselines.py --out FILE [--contexts 4096,...] [--batches 1,8,32]
"""
import argparse
import json
import os
import statistics

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


class L2Flush:
    """A read of L2_MULTIPLE times the L2's size (clean lines: the timed work
    after it writes back nothing of the flush's), as bench/l2_flush.h."""

    L2_MULTIPLE, MIN_BYTES = 4, 64 << 20

    def __init__(self):
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.l2_bytes = l2
        self.buffer = torch.zeros(max(self.MIN_BYTES, self.L2_MULTIPLE * l2) // 8, dtype=torch.int64, device="cuda")

    def run(self):
        self.buffer.max()


def median_us(step, repeats, flush=None):
    """Median device microseconds of step: each repeat queued behind a busy
    kernel (torch.cuda._sleep, about 0.5 ms), so that the events time the
    device side and not Python's enqueue, as the C++ benchmark does, and
    after `flush` (an L2Flush; None: with whatever L2 holds)."""
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if flush is not None:
            flush.run()
        torch.cuda._sleep(1_000_000)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth(repeats):
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), repeats)
    return 2 * n / (us * 1e-6)


def sdpa_us(context, batch, repeats, flush):
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    step = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    result = median_us(step, repeats, flush)
    del q, k, v
    return result


def flashinfer_us(flashinfer, context, batch, kv_dtype, repeats, tensor_cores, flush):
    pages_per_sequence = (context + PAGE - 1) // PAGE
    pages = pages_per_sequence * batch
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    indptr = torch.arange(0, pages + 1, pages_per_sequence, dtype=torch.int32, device="cuda")
    indices = torch.arange(pages, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), context - (pages_per_sequence - 1) * PAGE, dtype=torch.int32, device="cuda")
    cache = torch.randn(pages, 2, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE, pos_encoding_mode="NONE",
                 q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    result = median_us(lambda: wrapper.run(q, cache), repeats, flush)
    del cache, q, workspace
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", default="4096,8192,16384,32768,65536,131072")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warm-l2", action="store_true",
                        help="time each repeat with whatever L2 holds (the grids before 2026-12-05)")
    args = parser.parse_args()
    flush = None if args.warm_l2 else L2Flush()
    try:
        import flashinfer
        flashinfer_version = flashinfer.__version__
    except Exception as error:  # not installed or not importable: recorded, not fatal
        flashinfer, flashinfer_version = None, f"unavailable: {str(error).splitlines()[0][:200]}"
    report = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": flashinfer_version,
              "copy_bandwidth_bytes_per_s": copy_bandwidth(args.repeats), "l2_cold": flush is not None,
              "l2_flush_bytes": flush.buffer.numel() * 8 if flush is not None else 0, "rows": []}
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            row = {"context": context, "batch": batch,
                   "bf16_bytes": 2 * batch * KV_HEADS * context * HEAD_DIM * 2,
                   "sdpa_time_us": sdpa_us(context, batch, args.repeats, flush)}
            for name, dtype in (("flashinfer_bf16_time_us", torch.bfloat16),
                                ("flashinfer_fp8_time_us", torch.float8_e4m3fn)):
                if flashinfer is None:
                    row[name] = None
                    continue
                variants = {}
                for tensor_cores in (False, True):
                    kind = "tensor_cores" if tensor_cores else "cuda_cores"
                    try:
                        variants[kind] = flashinfer_us(flashinfer, context, batch, dtype, args.repeats, tensor_cores,
                                                       flush)
                    except Exception as error:
                        row[name.replace("_time_us", f"_{kind}_error")] = str(error).splitlines()[0][:200]
                    row[name.replace("_time_us", f"_{kind}_time_us")] = variants.get(kind)
                best = min(variants, key=variants.get) if variants else None
                row[name] = variants[best] if best else None
                row[name.replace("_time_us", "_tensor_cores")] = best == "tensor_cores" if best else None
            torch.cuda.empty_cache()
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            # Rewritten after every row: a call's time limit (FlashInfer's
            # first use compiles its kernels) keeps the rows measured so far.
            write_report(report, args.out)
    write_report(report, args.out)


def write_report(report, path):
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(temporary, path)


if __name__ == "__main__":
    main()
