#!/usr/bin/env python3
"""The PyTorch op library (kernels/torch_ops.cpp) end to end on the CPU.

Usage: test_torch_ops.py LIBRARY KVFORGE_BINARY MODEL_DIR CALIB_TXT

Builds an artifact with the kvforge binary (capture 2 x 256 tokens of calib.txt,
calibrate kvquant and int2-rot at 2 bits, plus configurations whose sink is longer
than any context here, so that they quantize nothing), loads the library with
torch.classes.load_library and checks
  (a) an exact configuration's decode_attention against float64 attention over the
      same keys (RoPE applied here for pre-RoPE keys) and values (GQA), within the
      float32 bound derived in `float32_attention_bound`;
  (b) 2-bit configurations give finite outputs that differ from exact attention
      and stay close to it;
  (c) bad inputs raise RuntimeError naming what was expected;
  (d) sequences of different lengths in one call;
  (e) float16 and bfloat16 keys, values and queries: on values exactly representable in
      the dtype, the cache holds what float32 copies of the same values store (decoding
      either cache with float32 queries gives the same float32 output, bit for bit), and
      the output, of the queries' dtype, is the float32 output rounded once to it: within
      half an ulp of the dtype (and equal to torch's own rounding);
  (f) on a GPU (skipped when torch.cuda.is_available() is false or the library was built
      without the CUDA kernels): a 'cuda' cache and a 'cpu' cache fed the same prefill
      chunks and single tokens of several sequences of different lengths, with a sequence
      removed and its slot reused, in float32, float16 and bfloat16: the same lengths and
      decode outputs within 1e-3 of the values' magnitude (issue 10) plus the io rounding;
  (g) decode_step (an append and the decode over it in one call) against append then
      decode_attention on a second cache of the same device: the same lengths and outputs,
      bit for bit, on the cpu and (where (f) runs) on cuda, with synchronous and
      asynchronous appends.
Exit code 77 (ctest SKIP_RETURN_CODE) only when python3 has no torch.

Diagnosable when it crashes: stdout is line-buffered (ctest's pipe would otherwise hold
every line back until exit, and a crash loses them), faulthandler prints the Python
stack of a segfault or abort on stderr, and each part, each CUDA call of (f) included,
says what it starts with the seconds since the start, so the last line of a crashed
run names the step it died in.
"""
import faulthandler
import json
import math
import os
import subprocess
import sys
import tempfile
import time

faulthandler.enable()  # before torch: a segfault anywhere after this prints the Python stack
sys.stdout.reconfigure(line_buffering=True)
START = time.monotonic()


def step(text):
    """One line naming what starts now, flushed before it starts."""
    print(f"[{time.monotonic() - START:7.1f} s] {text}", flush=True)


step(f"python {sys.version.split()[0]} at {sys.executable}: importing torch")
try:
    import torch
except ImportError:
    print("SKIP: python3 has no torch")
    sys.exit(77)

U = 2.0**-24  # float32 unit roundoff

# The op's input and output dtypes; per dtype, the cache element type used with it
# and the unit roundoff of the dtype (half its ulp relative to the value: 2^-(p) for p
# significant bits), its mantissa bits and smallest normal exponent.
DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
IO_UNIT = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}
MIN_NORMAL_EXPONENT = {torch.float16: -14, torch.bfloat16: -126}


def half_ulp(x, dtype):
    """Half the spacing of `dtype` numbers at each |x| (float64): the largest error of
    rounding x to nearest in dtype (subnormals: the fixed subnormal spacing)."""
    _, exponent = torch.frexp(x.double().abs())  # |x| = m 2^e, m in [0.5, 1): binade 2^(e - 1)
    binade = torch.clamp(exponent - 1, min=MIN_NORMAL_EXPONENT[dtype])
    binade = torch.where(x == 0, torch.full_like(binade, MIN_NORMAL_EXPONENT[dtype]), binade)
    return torch.ldexp(torch.full_like(x.double(), 0.5), (binade - MANTISSA_BITS[dtype]).double())


def run(binary, *args):
    result = subprocess.run([binary, *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"kvforge {args[0]} failed ({result.returncode}): {result.stderr.strip()}")


def build_artifact(binary, model_dir, calib, work):
    store = os.path.join(work, "acts.h5")
    artifact = os.path.join(work, "artifact.h5")
    run(binary, "capture", "--quiet", "--model", model_dir, "--data", calib, "--samples", "2", "--seq-len", "256",
        "--out", store)
    run(binary, "calibrate", "--quiet", "--acts", store, "--out", artifact, "--method", "kvquant,int2-rot", "--bits", "2")
    # A sink longer than any context of the exact checks (<= 120 tokens; calibrate
    # needs windows longer than the sink): every token stays exact.
    # kvquant keeps keys pre-RoPE, rtn post-RoPE: both paths of the keys.
    run(binary, "calibrate", "--quiet", "--append", "--acts", store, "--out", artifact, "--method", "kvquant",
        "--bits", "2", "--sink", "128", "--name", "exact-pre-rope")
    run(binary, "calibrate", "--quiet", "--append", "--acts", store, "--out", artifact, "--method", "rtn",
        "--bits", "2", "--sink", "128", "--name", "exact-post-rope")
    return artifact


class Model:
    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        self.layers = config["num_hidden_layers"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.heads
        rope = config.get("rope_parameters") or {}
        assert rope.get("rope_type", "default") == "default", "this test computes default RoPE only"
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        # Hugging Face's default RoPE: float32 inverse frequencies, float32
        # position x frequency products (docs/runtime-layout.md 6.3).
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(torch.float32) / self.head_dim
        self.inverse_frequencies = 1.0 / (theta**exponents)

    def rope(self, keys):
        """keys [T, kv_heads, D] float64 pre-RoPE -> post-RoPE at positions 0..T-1 (float64)."""
        positions = torch.arange(keys.shape[0], dtype=torch.float32)
        angle = (positions[:, None] * self.inverse_frequencies[None, :]).to(torch.float64)  # float32 product
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
        half = self.head_dim // 2
        low, high = keys[..., :half], keys[..., half:]
        return torch.cat([low * cos - high * sin, high * cos + low * sin], dim=-1)


def exact_attention(model, query, keys, values, pre_rope):
    """float64 attention of one query [heads, D] over keys, values [T, kv_heads, D]; also the
    largest sum_i |q_i k_i| * scale over tokens and heads (for the bound)."""
    keys = keys.double()
    if pre_rope:
        keys = model.rope(keys)
    group = model.heads // model.kv_heads
    k = keys.repeat_interleave(group, dim=1)  # [T, heads, D]
    v = values.double().repeat_interleave(group, dim=1)
    q = query.double()
    scale = 1.0 / math.sqrt(model.head_dim)
    scores = torch.einsum("hd,thd->ht", q, k) * scale
    weights = torch.softmax(scores, dim=-1)
    magnitude = torch.einsum("hd,thd->ht", q.abs(), k.abs()).max().item() * scale
    return torch.einsum("ht,thd->hd", weights, v), magnitude


def float32_attention_bound(model, tokens, score_magnitude, value_magnitude, pre_rope):
    """What float32 decode_attention may differ from float64 attention over the same exact tokens.

    Each score q.k * scale sums D products in float32 (any order: <= D u sum|q k|), times a
    scale rounded to float32 (u) and the product (u); pre-RoPE keys get float32 RoPE first
    (the angle is the same float32 product as the reference's; cosf, sinf, two products and a
    sum: <= 5 u |k| per channel pair). So each score is off by at most
    ds = (D + 8) u max_t sum|q k| scale. exp() of a score shifted by the running maximum
    adds 2 u relative, the normaliser's sum of T terms T u, the split merge's rescaling 4 u,
    so each weight is off by at most (2 ds + (T + 8) u) of itself; the weighted sum of T
    values adds T u max|v|. Hence |o - o64| <= max|v| (2 ds + (2 T + 8) u)."""
    ds = (model.head_dim + 8 + (5 if pre_rope else 0)) * U * score_magnitude
    return value_magnitude * (2 * ds + (2 * tokens + 8) * U)


def random_tokens(generator, model, lengths):
    rows = sum(lengths)
    keys = torch.randn(rows, model.kv_heads, model.head_dim, generator=generator)
    values = torch.randn(rows, model.kv_heads, model.head_dim, generator=generator)
    return keys, values


def fill(cache, layer, keys, values, lengths, chunks):
    """Appends each sequence's rows in `chunks` steps over one batch per step (a prefill and
    decoding steps); returns the sequence ids."""
    sequences = [cache.add_sequence() for _ in lengths]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    done = [0] * len(lengths)
    for step in range(chunks):
        tokens = []
        rows_k, rows_v = [], []
        for i, length in enumerate(lengths):
            end = length if step == chunks - 1 else min(length, (step + 1) * max(1, length // chunks))
            n = end - done[i]
            tokens.append(n)
            rows_k.append(keys[starts[i] + done[i]:starts[i] + end])
            rows_v.append(values[starts[i] + done[i]:starts[i] + end])
            done[i] = end
        cache.append(layer, torch.cat(rows_k).contiguous(), torch.cat(rows_v).contiguous(), sequences, tokens)
    for s, length in zip(sequences, lengths):
        assert cache.length(s, layer) == length, (cache.length(s, layer), length)
    return sequences


def check_exact(make, model, config, element, pre_rope_expected):
    """(a) and (d): a configuration that quantizes nothing attends like float64 over the
    same tokens (rounded to the element type first), for sequences of different lengths."""
    cache = make(config, element)
    assert cache.keys_pre_rope() == pre_rope_expected, config
    generator = torch.Generator().manual_seed(7)
    lengths = [37, 5, 120, 1]
    keys, values = random_tokens(generator, model, lengths)
    layer = model.layers - 1
    sequences = fill(cache, layer, keys, values, lengths, chunks=3)
    queries = torch.randn(len(lengths), model.heads, model.head_dim, generator=generator)
    output = cache.decode_attention(layer, queries, sequences)
    assert output.shape == queries.shape and output.dtype == torch.float32
    rounding = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[element]
    start = 0
    worst = 0.0
    for i, length in enumerate(lengths):
        k = keys[start:start + length].to(rounding)
        v = values[start:start + length].to(rounding)
        start += length
        want, magnitude = exact_attention(model, queries[i], k, v, cache.keys_pre_rope())
        bound = float32_attention_bound(model, length, magnitude, v.double().abs().max().item(), cache.keys_pre_rope())
        error = (output[i].double() - want).abs().max().item()
        assert error <= bound, f"{config}/{element}: sequence of {length} tokens off by {error:.3g} > bound {bound:.3g}"
        worst = max(worst, error / bound)
    print(f"  (a,d) {config} {element}: lengths {lengths}, worst error {worst:.2e} of the float32 bound")
    # A sequence removed and a new one added: the slot is reused, empty.
    cache.remove_sequence(sequences[0])
    again = cache.add_sequence()
    assert cache.length(again, layer) == 0


def check_quantized(make, model, config, keys, values, queries, lengths, layer):
    """(b): a 2-bit configuration is close to exact attention but not equal to it."""
    cache = make(config, "fp16")
    sequences = fill(cache, layer, keys, values, lengths, chunks=2)
    output = cache.decode_attention(layer, queries, sequences)
    assert torch.isfinite(output).all(), config
    start = 0
    for i, length in enumerate(lengths):
        k = keys[start:start + length].half()
        v = values[start:start + length].half()
        start += length
        want, _ = exact_attention(model, queries[i], k, v, cache.keys_pre_rope())
        relative = ((output[i].double() - want).norm() / want.norm()).item()
        print(f"  (b) {config}: {length} tokens, relative error {relative:.3f}")
        assert relative > 1e-4, f"{config}: 2-bit output equals exact attention (relative error {relative:.3g})"
        # A smoke bound, not a precision one (test_runtime_kernels_cpu checks
        # the arithmetic): the all-zero output's relative error is exactly 1
        # and a mixed-up layout lands near it or beyond; 2 bits on random
        # queries and a 2 x 256-token calibration measure 0.2-0.5.
        assert relative < 0.9, f"{config}: 2-bit output relative error {relative:.3g}: expected well below 1"


def exact_inputs(model):
    """Gaussian tokens of sequences of different lengths, shorter than the exact
    configurations' sink, and a query per sequence."""
    generator = torch.Generator().manual_seed(5)
    lengths = [37, 5, 120, 1]
    keys, values = random_tokens(generator, model, lengths)
    queries = torch.randn(len(lengths), model.heads, model.head_dim, generator=generator)
    return keys, values, queries, lengths


def random_case(model):
    """Gaussian tokens, longer than int2-rot's sink and window (64 + 256): most are quantized."""
    generator = torch.Generator().manual_seed(11)
    lengths = [700, 400]
    keys, values = random_tokens(generator, model, lengths)
    queries = torch.randn(len(lengths), model.heads, model.head_dim, generator=generator)
    return keys, values, queries, lengths


def captured_case(store, layer, pre_rope, lengths):
    """The model's own keys, values and last queries from the capture (kvquant's per-channel
    scales and thresholds only fit the model's activations); None without h5py."""
    try:
        import h5py
    except ImportError:
        return None
    with h5py.File(store, "r") as f:
        group = f[f"layers/{layer}"]
        k = torch.from_numpy(group["k_pre" if pre_rope else "k_post"][...])  # [samples, kv_heads, T, D]
        v = torch.from_numpy(group["v"][...])
        q = torch.from_numpy(group["q"][...])  # [samples, heads, T, D], post-RoPE
    keys = torch.cat([k[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)]).contiguous()
    values = torch.cat([v[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)]).contiguous()
    queries = torch.stack([q[i, :, n - 1] for i, n in enumerate(lengths)]).contiguous()
    return keys, values, queries, lengths


def schedule(lengths, singles):
    """Per step, the tokens each sequence appends: its first length - singles tokens in two
    prefill chunks, then single tokens (0 for a sequence that is done)."""
    steps = []
    prefill = [max(0, n - singles) for n in lengths]
    steps.append([p // 2 for p in prefill])
    steps.append([p - p // 2 for p in prefill])
    for step in range(singles):
        steps.append([1 if step < n - p else 0 for n, p in zip(lengths, prefill)])
    assert [sum(column) for column in zip(*steps)] == list(lengths), (steps, lengths)
    return steps


def step_rows(keys, values, starts, done, tokens, entries):
    """The next tokens[i] rows of each sequence i of `entries` (rows starts[i] + done[i] ...), in
    entry order: contiguous keys and values for one call."""
    def rows(x):
        return torch.cat([x[starts[i] + done[i]:starts[i] + done[i] + tokens[i]] for i in entries]).contiguous()
    return rows(keys), rows(values)


def append_step(cache, layer, keys, values, sequences, starts, done, tokens):
    """Appends tokens[i] rows of each sequence (rows starts[i] + done[i] ...) in one call."""
    rows_k, rows_v = step_rows(keys, values, starts, done, tokens, range(len(tokens)))
    for i, n in enumerate(tokens):
        done[i] += n
    cache.append(layer, rows_k, rows_v, sequences, tokens)


def check_dtypes(make, model, config, keys, values, queries, lengths, layer):
    """(e): float16 / bfloat16 rows and queries against float32 copies of the same values."""
    for dtype in (torch.float16, torch.bfloat16):
        element = DTYPES[dtype]
        k16, v16, q16 = keys.to(dtype), values.to(dtype), queries.to(dtype)
        k32, v32, q32 = k16.float(), v16.float(), q16.float()  # exact: the same values
        narrow, wide = make(config, element), make(config, element)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        ids = {}
        for cache, k, v in ((narrow, k16, v16), (wide, k32, v32)):
            ids[cache] = [cache.add_sequence() for _ in lengths]
            done = [0] * len(lengths)
            for tokens in schedule(lengths, 3):
                append_step(cache, layer, k, v, ids[cache], starts, done, tokens)
            for s, n in zip(ids[cache], lengths):
                assert cache.length(s, layer) == n
        out16 = narrow.decode_attention(layer, q16, ids[narrow])
        out32 = wide.decode_attention(layer, q32, ids[wide])
        assert out16.dtype == dtype and out16.shape == queries.shape, (out16.dtype, out16.shape)
        assert out32.dtype == torch.float32
        assert torch.isfinite(out32).all(), config
        # The same cache bytes: either cache attends alike to float32 queries, bit for bit,
        # and alike to 16-bit ones.
        assert torch.equal(narrow.decode_attention(layer, q32, ids[narrow]), out32), \
            f"{config}/{element}: a cache fed {dtype} rows attends unlike one fed their float32 values"
        assert torch.equal(wide.decode_attention(layer, q16, ids[wide]), out16), config
        # One rounding of the float32 output to the io type.
        error = (out16.double() - out32.double()).abs()
        bound = half_ulp(out32, dtype)
        assert (error <= bound).all(), \
            f"{config}/{element}: output off its float32 value by {error.max().item():.3g} > half an ulp"
        assert torch.equal(out16, out32.to(dtype)), f"{config}/{element}: not the float32 output rounded to nearest"
        print(f"  (e) {config} {element}: lengths {lengths}, output within half an ulp of the float32 one "
              f"(worst {(error / bound.clamp(min=1e-300)).max().item():.2f} of it)")


# A cuda cache held until the interpreter exits (check_cuda fills it).
KEPT_UNTIL_EXIT = []


def check_cuda_first_calls(cache, make_on, model, case):
    """(f), first: each public method once on a new cuda cache, a line before each call, so
    that a crash names the call. One float32 token of an exact configuration: attention over
    one token is its value (weight exp(0) / exp(0) = 1), stored rounded to float16; the
    kernel's float32 arithmetic on it (the weight, the split merge's rescaling by
    exp(0) = 1) may round at most a few times: |o - v| <= 4 u |v|. Then a CUDA error (a
    device that does not exist) is a one-line RuntimeError, not a crash."""
    config, _, keys, values, queries, _, layer = case
    group = model.heads // model.kv_heads
    step(f"(f0) {config} on {cache.device()}: add_sequence")
    s = cache.add_sequence()
    step("(f0) moving one token to cuda (torch's first CUDA tensors)")
    k, v = keys[:1].contiguous().cuda(), values[:1].contiguous().cuda()
    q = queries[:1].contiguous().cuda()
    step("(f0) append of one float32 token on cuda")
    cache.append(layer, k, v, [s], [1])
    step("(f0) length")
    assert cache.length(s, layer) == 1, cache.length(s, layer)
    step("(f0) decode_attention on cuda")
    out = cache.decode_attention(layer, q, [s])
    assert out.device.type == "cuda" and out.dtype == torch.float32 and out.shape == q.shape, (out.device, out.shape)
    step("(f0) copying the output to the cpu")
    want = values[:1].half().double().repeat_interleave(group, dim=1)  # [1, heads, D]
    error = (out.cpu().double() - want).abs()
    assert (error <= 4 * U * want.abs()).all(), f"(f0) one token: output off its value by {error.max().item():.3g}"
    step("(f0) an empty decode_attention and an empty append on cuda")
    assert cache.decode_attention(layer, q[:0], []).shape == (0, model.heads, model.head_dim)
    cache.append(layer, k[:0], v[:0], [], [])
    step("(f0) remove_sequence")
    cache.remove_sequence(s)
    count = torch.cuda.device_count()
    step(f"(f0) a cache on cuda:{count}, a device this process does not see")
    expect_refusal(lambda: make_on(f"cuda:{count}", config, "fp16"), f"device 'cuda:{count}'",
                   f"{count} CUDA device")
    print(f"  (f0) {config}: add_sequence, append, length, decode_attention (one token: its value), "
          f"remove_sequence on {cache.device()}; cuda:{count} refused")


def check_cuda(make_on, model, cases):
    """(f): a 'cuda' cache against a 'cpu' cache fed the same inputs through the same public
    methods. `cases`: (config, exact, keys, values, queries, lengths, layer); `exact`: the
    configuration quantizes nothing.

    The tolerance: both compute the same float32 attention over the same cache bytes (the
    CUDA append stores the CPU reference's bytes, test_append_cuda), in different orders;
    issue 10 allows 1e-3 of the values' magnitude M >= max_t ||v'_t|| (v' the dequantized
    values of the sequence's tokens). Exact configurations store the values rounded to the
    element type: M = max_t ||v_t|| (1 + 2^-8). A quantized value lies in its group's
    [min, max] (in the rotated basis for rotated configurations), so |v'_i| <= ||v_t|| and
    M = sqrt(D) max_t ||v_t|| (1 + 2^-8). Both outputs are then rounded to the io type,
    each by at most half an ulp, io_unit |o| <= io_unit M: |cuda - cpu| <= (1e-3 + 2 io_unit) M."""
    if not torch.cuda.is_available():
        print("  (f) SKIP: torch.cuda.is_available() is false")
        return
    step(f"(f) {torch.cuda.device_count()} CUDA device(s): constructing the first cuda cache")
    try:
        first = make_on("cuda", cases[0][0], "fp16")
    except RuntimeError as e:
        if "built without the CUDA kernels" in str(e):
            print("  (f) SKIP: the library was built without the CUDA kernels")
            return
        raise
    check_cuda_first_calls(first, make_on, model, cases[0])
    del first
    for config, exact, keys, values, queries, lengths, layer in cases:
        for dtype, element in DTYPES.items():
            if dtype == torch.float32:
                element = "fp16"  # float32 inputs into the serving element type
            # bfloat16 inputs go through asynchronous appends on the cuda cache: its
            # inputs are temporaries torch may reuse as soon as append returns.
            asynchronous = dtype == torch.bfloat16
            mode = " (asynchronous appends)" if asynchronous else ""
            step(f"(f) {config} {DTYPES[dtype]} (element {element}){mode}: constructing a cuda and a cpu cache")
            gpu, cpu = make_on("cuda", config, element, asynchronous), make_on("cpu", config, element)
            assert gpu.device() == "cuda:0" and cpu.device() == "cpu", (gpu.device(), cpu.device())
            assert gpu.asynchronous_append() == asynchronous and not cpu.asynchronous_append()
            k, v, q = keys.to(dtype), values.to(dtype), queries.to(dtype)
            rows = {gpu: (k.cuda(), v.cuda()), cpu: (k, v)}
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            ids = {gpu: [gpu.add_sequence() for _ in lengths], cpu: [cpu.add_sequence() for _ in lengths]}
            assert ids[gpu] == ids[cpu], ids
            done = {gpu: [0] * len(lengths), cpu: [0] * len(lengths)}
            worst = 0.0

            def compare(active, rows_of, what):
                nonlocal worst
                want = cpu.decode_attention(layer, q[:len(active)].contiguous(), [ids[cpu][i] for i in active])
                step(f"(f)   decode_attention on cuda of sequences {active} {what}")
                got = gpu.decode_attention(layer, q[:len(active)].contiguous().cuda(), [ids[gpu][i] for i in active])
                assert got.device.type == "cuda" and got.dtype == dtype and got.shape == want.shape
                got = got.cpu()
                assert torch.isfinite(want).all() and torch.isfinite(got).all(), f"{config}/{what}"
                for j, i in enumerate(active):
                    rows = rows_of(i).double()  # [T, kv_heads, D]
                    norm = rows.norm(dim=-1).max().item() * (1 + 2.0**-8)
                    magnitude = norm if exact else math.sqrt(model.head_dim) * norm
                    error = (got[j].double() - want[j].double()).abs().max().item()
                    bound = (1e-3 + 2 * IO_UNIT[dtype]) * magnitude
                    assert error <= bound, (f"{config}/{DTYPES[dtype]} {what}: sequence {i} off the CPU cache by "
                                            f"{error:.3g} > {bound:.3g}")
                    worst = max(worst, error / bound)

            def held_rows(i):
                return v[starts[i]:starts[i] + done[cpu][i]]

            for tokens in schedule(lengths, 3):
                step(f"(f)   append of {tokens} tokens ({DTYPES[dtype]}) to both caches")
                for cache in (gpu, cpu):
                    append_step(cache, layer, *rows[cache], ids[cache], starts, done[cache], tokens)
                for a, b in zip(ids[gpu], ids[cpu]):
                    assert gpu.length(a, layer) == cpu.length(b, layer), (gpu.length(a, layer), cpu.length(b, layer))
                active = [i for i in range(len(lengths)) if done[cpu][i] > 0]
                if active and tokens != [0] * len(tokens):
                    compare(active, held_rows, f"after appending {tokens}")
            # The first sequence removed and its slot reused by a new, shorter one.
            step("(f)   remove_sequence, add_sequence (the slot reused) and an append to it")
            gpu.remove_sequence(ids[gpu][0])
            cpu.remove_sequence(ids[cpu][0])
            ids[gpu][0], ids[cpu][0] = gpu.add_sequence(), cpu.add_sequence()
            assert gpu.length(ids[gpu][0], layer) == 0 and cpu.length(ids[cpu][0], layer) == 0
            fresh = max(1, lengths[0] // 2)
            for cache in (gpu, cpu):
                rows_k, rows_v = rows[cache]
                cache.append(layer, rows_k[-fresh:].contiguous(), rows_v[-fresh:].contiguous(), [ids[cache][0]],
                             [fresh])
            assert gpu.length(ids[gpu][0], layer) == fresh == cpu.length(ids[cpu][0], layer)

            def rows_after_reuse(i):
                return v[-fresh:] if i == 0 else held_rows(i)

            compare(list(range(len(lengths))), rows_after_reuse, "after a removed slot was reused")
            gpu.synchronize()
            print(f"  (f) {config} {DTYPES[dtype]} (element {element}){mode}: lengths {lengths}, cuda within "
                  f"{worst:.2e} of the bound of the cpu cache")
            if not KEPT_UNTIL_EXIT:
                # Destruction at interpreter exit: a cache held by a module-level name
                # frees its device memory while the interpreter shuts down.
                KEPT_UNTIL_EXIT.append(gpu)
            step("(f)   destroying the caches")
            del gpu, cpu, ids, rows, compare


def check_decode_step(make_on, device, config, keys, values, queries, lengths, layer, asynchronous):
    """(g): decode_step against append then decode_attention, bit for bit."""
    step(f"(g) decode_step on {device}, {config}{' (asynchronous appends)' if asynchronous else ''}")
    stepped, plain = make_on(device, config, "fp16", asynchronous), make_on(device, config, "fp16", asynchronous)
    k, v, q = keys.to(device), values.to(device), queries.to(device)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ids = {cache: [cache.add_sequence() for _ in lengths] for cache in (stepped, plain)}
    done = [0] * len(lengths)
    compared = 0
    for tokens in schedule(lengths, 3):
        active = [i for i, n in enumerate(tokens) if done[i] + n > 0]
        rows_k, rows_v = step_rows(k, v, starts, done, tokens, active)
        counts = [tokens[i] for i in active]
        query = q[:len(active)].contiguous()
        plain.append(layer, rows_k, rows_v, [ids[plain][i] for i in active], counts)
        want = plain.decode_attention(layer, query, [ids[plain][i] for i in active])
        got = stepped.decode_step(layer, rows_k, rows_v, query, [ids[stepped][i] for i in active], counts)
        assert got.device == want.device and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), f"{config} on {device}: decode_step differs after appending {tokens}"
        for i in active:
            done[i] += tokens[i]
        for a, b in zip(ids[stepped], ids[plain]):
            assert stepped.length(a, layer) == plain.length(b, layer)
        compared += 1
    stepped.synchronize()
    # The caches go before the tensors their asynchronous appends read (the op
    # library once made torch record an event on a cache's stream when such a
    # tensor died: a segfault once the cache was gone).
    del stepped, plain
    print(f"  (g) {config} on {device}{' (asynchronous appends)' if asynchronous else ''}: {compared} steps, "
          f"lengths {lengths}, equal bit for bit")


def expect_refusal(call, *words):
    try:
        call()
    except RuntimeError as e:
        text = str(e).splitlines()[0]
        for word in words:
            assert word in text, f"the refusal '{text}' should name '{word}'"
        return
    raise AssertionError(f"accepted; expected a RuntimeError naming {words}")


def check_refusals(make, model, artifact, model_dir):
    """(c): one-line RuntimeErrors naming what was expected."""
    Cache = torch.classes.kvforge.QuantizedKVCache
    expect_refusal(lambda: Cache(artifact, "nope", model_dir, "cpu", 16, 4, 256, "fp16"), "/configs/nope",
                   "exact-pre-rope")
    expect_refusal(lambda: Cache(artifact, "kvquant-2bit", model_dir, "tpu", 16, 4, 256, "fp16"), "device 'tpu'",
                   "expected cpu")
    expect_refusal(lambda: Cache(artifact, "kvquant-2bit", model_dir, "cpu", 16, 4, 256, "fp8"), "element 'fp8'")
    expect_refusal(lambda: Cache(artifact, "kvquant-2bit", model_dir, "cpu", 0, 4, 256, "fp16"), "page_size")
    expect_refusal(lambda: Cache(artifact + ".missing", "kvquant-2bit", model_dir, "cpu", 16, 4, 256, "fp16"),
                   ".missing")

    cache = make("kvquant-2bit", "fp16")
    s = cache.add_sequence()
    kv, d, h = model.kv_heads, model.head_dim, model.heads
    good = torch.randn(3, kv, d)
    expect_refusal(lambda: cache.append(0, good.double(), good, [s], [3]), "keys", "of dtype Double",
                   "expected float32, float16 or bfloat16")
    expect_refusal(lambda: cache.append(0, good.half(), good, [s], [3]), "values of dtype Float",
                   "with keys of dtype Half", "expected the keys' dtype")
    expect_refusal(lambda: cache.append(0, good, good.bfloat16(), [s], [3]), "values of dtype BFloat16",
                   "with keys of dtype Float", "expected the keys' dtype")
    expect_refusal(lambda: cache.append(0, good, torch.randn(3, kv, d + 2), [s], [3]), "values", "of shape",
                   f"expected [3, {kv}, {d}]")
    expect_refusal(lambda: cache.append(0, good, good, [s], [2]), "keys", "[sum(tokens), kv_heads, head_dim]")
    expect_refusal(lambda: cache.append(0, good, good, [s, s], [3]), "one count per sequence")
    strided = torch.randn(3, d, kv).transpose(1, 2)
    expect_refusal(lambda: cache.append(0, strided, good, [s], [3]), "keys", "contiguous")
    expect_refusal(lambda: cache.decode_step(0, good, good, torch.randn(2, h, d), [s], [3]), "decode_step",
                   "queries", f"expected [1, {h}, {d}]")
    expect_refusal(lambda: cache.decode_step(0, good, good, torch.randn(1, h, d), [s], [2]), "decode_step", "keys",
                   "[sum(tokens), kv_heads, head_dim]")
    expect_refusal(lambda: cache.decode_step(0, good[:0], good[:0], torch.randn(1, h, d), [s], [0]), "decode_step",
                   "holds no tokens")
    assert cache.length(s, 0) == 0, "a refused decode_step appended"
    if torch.cuda.is_available():
        expect_refusal(lambda: cache.append(0, good.cuda(), good, [s], [3]), "keys", "expected the cache's device cpu")
    expect_refusal(lambda: cache.append(0, good, good, [s + 1], [3]), f"sequence {s + 1}", "not an active sequence")
    expect_refusal(lambda: cache.append(model.layers, good, good, [s], [3]), "no such layer")
    expect_refusal(lambda: cache.decode_attention(0, torch.randn(1, h, d), [s]), "holds no tokens")
    cache.append(0, good, good, [s], [3])
    assert cache.length(s, 0) == 3 and cache.length(s, 1) == 0
    # Empty batches are no-ops (an empty decode once read the longest of no lengths: a segfault).
    assert cache.decode_attention(0, torch.randn(0, h, d), []).shape == (0, h, d)
    cache.append(0, torch.randn(0, kv, d), torch.randn(0, kv, d), [], [])
    assert cache.length(s, 0) == 3
    expect_refusal(lambda: cache.decode_attention(0, torch.randn(2, h, d), [s]), "queries", "of shape",
                   "[len(sequences), num_heads, head_dim]")
    expect_refusal(lambda: cache.decode_attention(0, torch.randn(1, h, d).double(), [s]), "queries",
                   "of dtype Double", "expected float32, float16 or bfloat16")
    expect_refusal(lambda: cache.decode_attention(0, torch.randn(1, h, d), [-1]), "sequence -1")
    expect_refusal(lambda: cache.length(s, model.layers), f"no such layer {model.layers}",
                   f"expected 0..{model.layers - 1}")
    print("  (c) bad inputs raise one-line RuntimeErrors naming what was expected")


def mapped_cuda_runtimes():
    """The CUDA runtime files mapped into this process (one expected: torch's, which the
    library's libcudart.so.13 resolves to; a static runtime would not show here)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "libcudart" in line})
    except OSError:
        return ["(no /proc/self/maps)"]


def main():
    library, binary, model_dir, calib = sys.argv[1:5]
    step(f"torch {torch.__version__} (CUDA {torch.version.cuda}): loading {library}")
    torch.classes.load_library(library)
    step(f"loaded; CUDA runtimes mapped: {mapped_cuda_runtimes() or 'none'}")
    model = Model(model_dir)
    with tempfile.TemporaryDirectory(prefix="kvforge-torch-ops-") as work:
        step("building the artifact (kvforge capture and calibrate)")
        artifact = build_artifact(binary, model_dir, calib, work)

        def make_on(device, config, element, asynchronous=False):
            if not asynchronous:  # the constructor's default
                return torch.classes.kvforge.QuantizedKVCache(artifact, config, model_dir, device, 16, 4, 1024,
                                                              element)
            return torch.classes.kvforge.QuantizedKVCache(artifact, config, model_dir, device, 16, 4, 1024, element,
                                                          True)

        def make(config, element):
            return make_on("cpu", config, element)

        step("(a,d) exact configurations on the cpu against float64 attention")
        check_exact(make, model, "exact-pre-rope", "fp32", True)
        check_exact(make, model, "exact-post-rope", "fp32", False)
        check_exact(make, model, "exact-pre-rope", "fp16", True)
        check_exact(make, model, "exact-post-rope", "bf16", False)
        step("(a) an exact configuration through asynchronous appends on the cpu")
        check_exact(lambda config, element: make_on("cpu", config, element, True), model, "exact-post-rope", "fp32",
                    False)
        step("(b) 2-bit configurations on the cpu")
        check_quantized(make, model, "int2-rot-2bit", *random_case(model), layer=0)
        captured = captured_case(os.path.join(work, "acts.h5"), 2, True, [256, 180])
        if captured is None:
            print("  (b) kvquant-2bit: not checked (python3 has no h5py to read the capture)")
        else:
            check_quantized(make, model, "kvquant-2bit", *captured, layer=2)
        step("(e) float16 and bfloat16 inputs on the cpu")
        exact_case = exact_inputs(model)
        check_dtypes(make, model, "exact-pre-rope", *exact_case, layer=1)
        check_dtypes(make, model, "int2-rot-2bit", *random_case(model), layer=0)
        cases = [("exact-pre-rope", True, *exact_case, 1), ("exact-post-rope", True, *exact_case, 3),
                 ("int2-rot-2bit", False, *random_case(model), 0)]
        if captured is not None:
            check_dtypes(make, model, "kvquant-2bit", *captured, layer=2)
            cases.append(("kvquant-2bit", False, *captured, 2))
        step("(f) a cuda cache against a cpu cache")
        check_cuda(make_on, model, cases)
        step("(g) decode_step against append then decode_attention")
        devices = ["cpu"]
        if torch.cuda.is_available():
            try:
                make_on("cuda", "int2-rot-2bit", "fp16")
                devices.append("cuda")
            except RuntimeError as e:
                if "built without the CUDA kernels" not in str(e):
                    raise
        for device in devices:
            for asynchronous in (False, True):
                check_decode_step(make_on, device, "int2-rot-2bit", *random_case(model), 0, asynchronous)
                if captured is not None:
                    check_decode_step(make_on, device, "kvquant-2bit", *captured, 2, asynchronous)
        step("(c) refusals")
        check_refusals(make, model, artifact, model_dir)
    print("PASS")
    if KEPT_UNTIL_EXIT:
        step("exiting with a cuda cache alive (its memory is freed at interpreter exit)")


if __name__ == "__main__":
    main()
