#!/usr/bin/env python3
"""What a kernel spends whatever its walk's length: the fixed cost per line.

Input: Nsight Compute's source page (the CSV of `ncu -i REPORT --page source
--csv --print-source cuda,sass`, gzipped or not; scripts/gpu_checks.sh
writes ncu_source_<name>.csv.gz) of the same kernel profiled at several
contexts, e.g. with PROFILE_CONTEXTS="4096 8192 32768". Each SASS
instruction is matched across the profiles by its offset from the
function's first instruction (the same binary loads at another address in
each run), and its stall samples and executions are fitted by least squares
as a + b * context: `a`, the intercept, is what the instruction costs a
launch that walks no tokens (its prologue, its epilogue, its first
latencies), `b` what each token adds.

Prints, as markdown: per profile the samples and warp instructions with the
fit's intercept and its share; with --duration CONTEXT=US for every profile,
the intercept in microseconds (samples are taken at a fixed interval, so a
kernel's samples over its duration convert them); then the CUDA lines with
the largest intercepts (an instruction inlined from a helper counts under
its first listed line, the one in --file where it has one there).

Usage: bench/ncu_fixed_cost.py CONTEXT=CSV [CONTEXT=CSV ...] [--duration CONTEXT=US ...]
       [--file decode_int8_kernel.cuh] [--lines 30]
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ncu_source_breakdown  # noqa: E402  (the CSV's rows)


def instructions(path, prefer_file):
    """{offset: [samples, executed, sass, (file, line, source)]} of the profile's one function."""
    by_address, where = {}, collections.defaultdict(list)
    for file, line, r in ncu_source_breakdown.sass_rows(ncu_source_breakdown.read_rows(path)):
        address = int(r[2], 16)
        by_address[address] = [ncu_source_breakdown.count(r[4]), ncu_source_breakdown.count(r[7]), r[3].strip()]
        where[address].append(None if line is None else (file, line[0], line[1].strip()))
    if not by_address:
        raise SystemExit(f"{path}: no SASS rows (expected ncu's source page with --print-source cuda,sass)")
    base = min(by_address)
    out = {}
    for address, (samples, executed, sass) in by_address.items():
        places = where[address]
        preferred = [p for p in places if p is not None and p[0] == prefer_file]
        place = preferred[0] if preferred else next((p for p in places if p is not None), ("?", "?", ""))
        out[address - base] = [samples, executed, sass, place]
    return out


def fit(xs, ys):
    """Least-squares intercept and slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def pairs(values, what):
    out = {}
    for v in values:
        key, sep, value = v.partition("=")
        if not sep:
            raise SystemExit(f"{what} {v!r}: expected CONTEXT=VALUE")
        out[int(key)] = value
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("profiles", nargs="+", help="CONTEXT=CSV, one per profiled context")
    parser.add_argument("--duration", action="append", default=[], help="CONTEXT=US: the kernel's duration there")
    parser.add_argument("--file", default="decode_int8_kernel.cuh", help="the kernel's own source file")
    parser.add_argument("--lines", type=int, default=30)
    args = parser.parse_args()
    paths = pairs(args.profiles, "profile")
    if len(paths) < 2:
        raise SystemExit("at least two contexts are needed for a line through them")
    durations = {k: float(v) for k, v in pairs(args.duration, "--duration").items()}
    contexts = sorted(paths)
    profiles = {c: instructions(paths[c], args.file) for c in contexts}
    offsets = sorted(set().union(*profiles.values()))
    per_line = collections.defaultdict(lambda: [0.0, 0.0, ""])
    total = {c: [0, 0] for c in contexts}
    fixed_samples = fixed_executed = 0.0
    for offset in offsets:
        rows = [profiles[c].get(offset) for c in contexts]
        samples = [r[0] if r else 0 for r in rows]
        executed = [r[1] if r else 0 for r in rows]
        for c, s, e in zip(contexts, samples, executed):
            total[c][0] += s
            total[c][1] += e
        a_samples, _ = fit(contexts, samples)
        a_executed, _ = fit(contexts, executed)
        fixed_samples += a_samples
        fixed_executed += a_executed
        place = next(r for r in rows if r)[3]
        key = (place[0], place[1])
        per_line[key][0] += a_samples
        per_line[key][1] += a_executed
        per_line[key][2] = place[2]
    print("| context | stall samples | warp instructions | duration us |")
    print("|---|---|---|---|")
    for c in contexts:
        d = f"{durations[c]:.2f}" if c in durations else ""
        print(f"| {c} | {total[c][0]} | {total[c][1]} | {d} |")
    first = contexts[0]
    print(f"\nintercept (no tokens): {fixed_samples:.0f} samples, {100 * fixed_samples / total[first][0]:.0f}% of "
          f"{first}'s; {fixed_executed:.0f} warp instructions, {100 * fixed_executed / total[first][1]:.0f}% of {first}'s")
    us_per_sample = None
    if all(c in durations for c in contexts):
        us_per_sample = sum(durations[c] for c in contexts) / sum(total[c][0] for c in contexts)
        a_us, b_us = fit(contexts, [durations[c] for c in contexts])
        print(f"duration: {a_us:.2f} us + {1024 * b_us:.3f} us per 1K (1,024) tokens; the samples' intercept at "
              f"{us_per_sample:.4f} us a sample: {fixed_samples * us_per_sample:.2f} us")
    print("\n| intercept samples | us | warp instructions | line |")
    print("|---|---|---|---|")
    for (file, line), (s, e, source) in sorted(per_line.items(), key=lambda kv: -kv[1][0])[: args.lines]:
        us = f"{s * us_per_sample:.2f}" if us_per_sample else ""
        text = source[:100].replace("|", "\\|")
        print(f"| {s:.0f} | {us} | {e:.0f} | `{file}:{line}`: `{text}` |")


if __name__ == "__main__":
    main()
