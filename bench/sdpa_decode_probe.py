#!/usr/bin/env python3
# Run on the GPU machine: python3 bench/sdpa_decode_probe.py. Result of 2026-11-30 on an H200 (torch 2.11.0+cu130,
# cuDNN 9.19): default SDPA 55.5 ms per decoding step with a new key length each step (it dispatches to
# cuDNN attention, 98.6% of the time in _cudnn_attention_forward building plans), 0.025 ms at a repeated length.
# Which SDPA backend does a decode step (q len 1, growing cache view, GQA) take on this GPU, and what does each cost?
import time, torch
from torch.nn.attention import sdpa_kernel, SDPBackend
torch.manual_seed(0)
dev = "cuda"
cap = 4096
K = torch.randn(1, 2, cap, 128, device=dev, dtype=torch.bfloat16)
V = torch.randn_like(K)
q = torch.randn(1, 4, 1, 128, device=dev, dtype=torch.bfloat16)
def run(backends, label, lengths=None):
    # fresh lengths for every backend, so no plan cached by an earlier run is reused
    global next_start
    lengths = lengths or range(next_start, next_start + 200)
    next_start += 200
    try:
        ctx = lambda: sdpa_kernel(backends) if backends else torch.enable_grad()
        with ctx():
            torch.cuda.synchronize(); t = time.perf_counter()
            for L in lengths:
                o = torch.nn.functional.scaled_dot_product_attention(q, K[:, :, :L], V[:, :, :L], enable_gqa=True)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / len(lengths)
        print(f"{label:>10}: {dt*1e3:8.3f} ms/step (new length each step)")
        with ctx():
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(200):
                o = torch.nn.functional.scaled_dot_product_attention(q, K[:, :, :300], V[:, :, :300], enable_gqa=True)
            torch.cuda.synchronize()
            print(f"{label:>10}: {(time.perf_counter()-t)/200*1e3:8.3f} ms/step (same length)")
    except Exception as e:
        print(f"{label:>10}: fails: {str(e).splitlines()[0][:150]}")
next_start = 200
print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
run(None, "default")
for b in [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]:
    run([b], b.name)
# What the default picks: profile one step
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for L in range(500, 505):
        torch.nn.functional.scaled_dot_product_attention(q, K[:, :, :L], V[:, :, :L], enable_gqa=True)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8))
