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
  (d) sequences of different lengths in one call.
Exit code 77 (ctest SKIP_RETURN_CODE) only when python3 has no torch.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("SKIP: python3 has no torch")
    sys.exit(77)

U = 2.0**-24  # float32 unit roundoff


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
        assert relative < 0.5, f"{config}: 2-bit output relative error {relative:.3g}: expected well below 1"


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
    expect_refusal(lambda: cache.append(0, good.double(), good, [s], [3]), "keys", "expected float32")
    expect_refusal(lambda: cache.append(0, good, torch.randn(3, kv, d + 2), [s], [3]), "values", "of shape",
                   f"expected [3, {kv}, {d}]")
    expect_refusal(lambda: cache.append(0, good, good, [s], [2]), "keys", "[sum(tokens), kv_heads, head_dim]")
    expect_refusal(lambda: cache.append(0, good, good, [s, s], [3]), "one count per sequence")
    strided = torch.randn(3, d, kv).transpose(1, 2)
    expect_refusal(lambda: cache.append(0, strided, good, [s], [3]), "keys", "contiguous")
    if torch.cuda.is_available():
        expect_refusal(lambda: cache.append(0, good.cuda(), good, [s], [3]), "keys", "expected the cache's device cpu")
    expect_refusal(lambda: cache.append(0, good, good, [s + 1], [3]), f"sequence {s + 1}", "not an active sequence")
    expect_refusal(lambda: cache.append(model.layers, good, good, [s], [3]), "no such layer")
    expect_refusal(lambda: cache.decode_attention(0, torch.randn(1, h, d), [s]), "holds no tokens")
    cache.append(0, good, good, [s], [3])
    assert cache.length(s, 0) == 3 and cache.length(s, 1) == 0
    expect_refusal(lambda: cache.decode_attention(0, torch.randn(2, h, d), [s]), "queries", "of shape",
                   "[len(sequences), num_heads, head_dim]")
    expect_refusal(lambda: cache.decode_attention(0, torch.randn(1, h, d).half(), [s]), "queries", "float32")
    expect_refusal(lambda: cache.decode_attention(0, torch.randn(1, h, d), [-1]), "sequence -1")
    expect_refusal(lambda: cache.length(s, model.layers), f"no such layer {model.layers}",
                   f"expected 0..{model.layers - 1}")
    print("  (c) bad inputs raise one-line RuntimeErrors naming what was expected")


def main():
    library, binary, model_dir, calib = sys.argv[1:5]
    torch.classes.load_library(library)
    model = Model(model_dir)
    with tempfile.TemporaryDirectory(prefix="kvforge-torch-ops-") as work:
        artifact = build_artifact(binary, model_dir, calib, work)

        def make(config, element):
            return torch.classes.kvforge.QuantizedKVCache(artifact, config, model_dir, "cpu", 16, 4, 1024, element)

        check_exact(make, model, "exact-pre-rope", "fp32", True)
        check_exact(make, model, "exact-post-rope", "fp32", False)
        check_exact(make, model, "exact-pre-rope", "fp16", True)
        check_exact(make, model, "exact-post-rope", "bf16", False)
        check_quantized(make, model, "int2-rot-2bit", *random_case(model), layer=0)
        captured = captured_case(os.path.join(work, "acts.h5"), 2, True, [256, 180])
        if captured is None:
            print("  (b) kvquant-2bit: not checked (python3 has no h5py to read the capture)")
        else:
            check_quantized(make, model, "kvquant-2bit", *captured, layer=2)
        check_refusals(make, model, artifact, model_dir)
    print("PASS")


if __name__ == "__main__":
    main()
