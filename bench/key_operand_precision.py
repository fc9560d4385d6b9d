#!/usr/bin/env python3
"""How precise must a tensor-core key operand be? Attention of one query
over T keys in float64, against the same attention with the keys first
rounded to bf16, to fp16, or split into bf16 hi + lo (hi = bf16(k),
lo = bf16(k - hi): what an A operand of dequantized, RoPE-rotated keys
would hold in a kvquant tensor-core kernel, where the keys are not exact
small integers as rtn's codes are). The runtime's contract is 1e-3 of the
output's largest magnitude (issue 10, tests/test_decode_attention_cuda.cpp).

Keys and values are standard normal times `scale` (a sharper softmax the
larger), with a few keys near the query (needles). Prints one Markdown row
per (context, scale): the largest output error over the largest output
magnitude for each operand form, the worst of `--trials` draws.

Usage: bench/key_operand_precision.py [--contexts 4096,32768] [--scales 1,3] [--trials 5] [--seed 0]
"""
import argparse

import numpy as np


def round_bf16(x):
    """float32 -> bf16 (round to nearest even) -> float32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def attend(keys, query, values):
    scores = keys.astype(np.float64) @ query.astype(np.float64) / np.sqrt(query.size)
    weights = np.exp(scores - scores.max())
    return (weights / weights.sum()) @ values.astype(np.float64)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--scales", default="1,3")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    forms = {
        "bf16": round_bf16,
        "fp16": lambda k: k.astype(np.float16).astype(np.float32),
        "bf16 hi + lo": lambda k: round_bf16(k) + round_bf16(k - round_bf16(k)),
    }
    print("| context | scale | " + " | ".join(forms) + " |")
    print("|---|---|" + "---|" * len(forms))
    for context in (int(c) for c in args.contexts.split(",")):
        for scale in (float(s) for s in args.scales.split(",")):
            errors = [0.0] * len(forms)
            for _ in range(args.trials):
                query = rng.standard_normal(args.head_dim).astype(np.float32) * scale
                keys = rng.standard_normal((context, args.head_dim)).astype(np.float32) * scale
                keys[rng.integers(0, context, 8)] += 0.5 * query
                values = rng.standard_normal((context, args.head_dim)).astype(np.float32)
                exact = attend(keys, query, values)
                for i, f in enumerate(forms.values()):
                    errors[i] = max(errors[i], np.abs(attend(f(keys), query, values) - exact).max() / np.abs(exact).max())
            print(f"| {context} | {scale:g} | " + " | ".join(f"{e:.1e}" for e in errors) + " |")


if __name__ == "__main__":
    main()
