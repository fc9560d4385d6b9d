#!/usr/bin/env python3
"""The issue's decode targets read off a decode-attention grid
(bench/results/decode_attention.json, written by kvforge_bench_decode_attention),
as Markdown: for every method, bits and batch at 32K tokens and beyond, the
speedup against bf16 SDPA in the same run (target >= 4x), the fraction of the
measured copy bandwidth (target >= 70%) and the append's rate against the
decode rate it must keep up with (target >= 10x), each marked met or not,
then the ranges per method, bits and batch.

The append's rate is the decode-step column where the grid has it
(append_in_step_over_decode_rate: the added time of a decoding step's append,
fused or as its own launch, against the decode alone; where the step took
no longer than the decode alone, append_in_step_us <= 0 and the bench writes
no rate: the append adds nothing measurable, shown as "none added" and met),
else, in grids without the step's columns, the separate append's
(append_over_decode_rate).

Grids before 6732b3e set the step against a decode alone at the context
while the steps ran 300-1000 tokens past it (no `step_decode_tokens`
column): their steps' rates are biased (mostly low; KIVI's at batch 1
high, its decode at the stale length being slower), said under the table.

Usage: bench/format_decode_targets.py GRID.json [--min-context 32768]
"""
import argparse
import json
import math
from collections import defaultdict

SPEEDUP, BANDWIDTH, APPEND = 4.0, 0.70, 10.0


def append_rate(row):
    """The decode rate over the append's: math.inf where a decoding step's
    append added no time, None where the row has no append columns."""
    if "append_in_step_us" in row:
        added = row["append_in_step_us"]
        if added is not None and added <= 0:
            return math.inf
        return row.get("append_in_step_over_decode_rate")
    return row.get("append_over_decode_rate")


def step_against_stale_decode(rows):
    """Whether the grid's step columns set each step against a decode at
    the context rather than at the steps' own lengths (before 6732b3e)."""
    return any("append_in_step_us" in r and "step_decode_tokens" not in r for r in rows)


def met(value, target):
    return value is not None and value >= target


def formatted(value, fmt):
    return "none added" if value == math.inf else fmt.format(value)


def mark(value, target, fmt):
    if value is None:
        return "-"
    return formatted(value, fmt) + (" ✓" if met(value, target) else "")


def span(values, fmt):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    low, high = formatted(min(values), fmt), formatted(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("grid")
    parser.add_argument("--min-context", type=int, default=32768)
    args = parser.parse_args()
    with open(args.grid) as f:
        grid = json.load(f)
    rows = [r for r in grid["rows"] if r["context"] >= args.min_context]
    cold = all(r.get("l2_cold", False) for r in rows)
    print(f"{grid['machine']}, commit {grid['commit']}, {'cold' if cold else 'warm'} L2, "
          f"copy bandwidth {grid['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; "
          f"targets: {SPEEDUP:g}x bf16 SDPA, {BANDWIDTH:.0%} of the copy bandwidth, append {APPEND:g}x the decode "
          f"rate (✓ met).\n")
    print("| method | bits | batch | context | time us | SDPA us | speedup | bandwidth | append rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    key = lambda r: (r["method"], r["bits"], r["batch"], r["context"])
    for r in sorted(rows, key=key):
        print(f"| {r['method']} | {r['bits']} | {r['batch']} | {r['context'] // 1024}K | {r['time_us']:.1f} | "
              f"{r['sdpa_time_us']:.1f} | {mark(r['speedup_vs_sdpa'], SPEEDUP, '{:.2f}x')} | "
              f"{mark(r['bandwidth_fraction'], BANDWIDTH, '{:.0%}')} | {mark(append_rate(r), APPEND, '{:.1f}x')} |")
    groups = defaultdict(list)
    for r in rows:
        groups[(r["method"], r["bits"], r["batch"])].append(r)
    print("\n| method | bits | batch | speedup | bandwidth | append rate | all three met at |")
    print("|---|---|---|---|---|---|---|")
    for (method, bits, batch), group in sorted(groups.items()):
        met_at = [r["context"] // 1024 for r in sorted(group, key=key)
               if met(r["speedup_vs_sdpa"], SPEEDUP) and met(r["bandwidth_fraction"], BANDWIDTH)
               and met(append_rate(r), APPEND)]
        print(f"| {method} | {bits} | {batch} | {span([r['speedup_vs_sdpa'] for r in group], '{:.2f}x')} | "
              f"{span([r['bandwidth_fraction'] for r in group], '{:.0%}')} | "
              f"{span([append_rate(r) for r in group], '{:.1f}x')} | "
              f"{', '.join(f'{c}K' for c in met_at) if met_at else 'none'} |")
    if step_against_stale_decode(rows):
        print("\nThe append's rates here are biased: this grid set each decoding step against the decode "
              "alone at the context, while its steps ran 300-1000 tokens past it (no step_decode_tokens column; "
              "mostly too low, KIVI's at batch 1 too high; the benchmark measures at the steps' lengths since "
              "6732b3e).")


if __name__ == "__main__":
    main()
