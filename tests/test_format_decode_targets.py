#!/usr/bin/env python3
"""bench/format_decode_targets.py on a synthetic grid: the append's rate is
the decoding step's (append_in_step_over_decode_rate) where the grid has
the step's columns; a step that took no longer than the decode alone
(append_in_step_us <= 0, no rate written) added nothing and meets the 10x
target ("none added"), not the separate launch's rate in its place; a step
that added time but has no rate is unknown, not met; grids without the
step's columns fall back to the separate append's rate; grids whose steps
met a decode at the context (no step_decode_tokens) are said to be
biased."""
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "format_decode_targets.py")
spec = importlib.util.spec_from_file_location("format_decode_targets", SCRIPT)
targets = importlib.util.module_from_spec(spec)
spec.loader.exec_module(targets)

failures = []


def expect(what, actual, expected):
    if actual != expected:
        failures.append(f"{what}: expected {expected!r}, got {actual!r}")


def row(method, batch, **columns):
    base = {"method": method, "bits": 2, "batch": batch, "context": 32768, "time_us": 90.0, "sdpa_time_us": 40.0,
            "speedup_vs_sdpa": 40.0 / 90.0, "bandwidth_fraction": 0.07}
    base.update(columns)
    return base


# A step's append that added 3 us to a 72 us decode: 24x.
fused = row("rtn", 1, append_in_step_us=3.0, append_in_step_over_decode_rate=24.0, append_over_decode_rate=5.0)
# A step shorter than the decode alone (KIVI's at 057ccb0): no rate written, nothing added.
nothing = row("kivi", 1, append_in_step_us=-3.7, append_in_step_over_decode_rate=None, append_over_decode_rate=10.3)
# Added time but no rate: unknown.
unknown = row("kivi", 8, append_in_step_us=2.0, append_in_step_over_decode_rate=None, append_over_decode_rate=30.0)
# A grid from before the step's columns.
old = row("kvquant", 1, append_over_decode_rate=4.4)

expect("the step's rate", targets.append_rate(fused), 24.0)
expect("a step that added nothing", targets.append_rate(nothing), math.inf)
expect("a step that added nothing is met", targets.met(targets.append_rate(nothing), targets.APPEND), True)
expect("its mark", targets.mark(targets.append_rate(nothing), targets.APPEND, "{:.1f}x"), "none added ✓")
expect("a step with added time and no rate", targets.append_rate(unknown), None)
expect("its mark", targets.mark(targets.append_rate(unknown), targets.APPEND, "{:.1f}x"), "-")
expect("a grid without the step's columns", targets.append_rate(old), 4.4)
expect("a span with a step that added nothing", targets.span([24.0, math.inf, None], "{:.1f}x"), "24.0x-none added")

# Step columns without step_decode_tokens: the decode alone at the context
# (before 6732b3e), so the rates are biased; with it, at the steps'
# lengths; no step columns at all, nothing to say.
expect("a grid whose steps met a stale decode", targets.step_against_stale_decode([fused, old]), True)
at_lengths = dict(fused, step_decode_tokens=33502)
expect("a grid whose steps met the decode at their lengths", targets.step_against_stale_decode([at_lengths, old]),
       False)
expect("a grid without step columns", targets.step_against_stale_decode([old]), False)

# The whole script on a grid of these rows: the per-row marks and the ranges.
with tempfile.TemporaryDirectory() as tmp:
    grid = os.path.join(tmp, "grid.json")
    with open(grid, "w") as f:
        json.dump({"machine": "synthetic", "commit": "0000000", "copy_bandwidth_bytes_per_s": 3.0e12,
                   "rows": [fused, nothing, unknown, old]}, f)
    out = subprocess.run([sys.executable, SCRIPT, grid], capture_output=True, text=True)
    expect("exit status", out.returncode, 0)
    lines = out.stdout.splitlines()
    kivi_b1 = [l for l in lines if l.startswith("| kivi | 2 | 1 | 32K |")]
    expect("kivi batch 1's row", len(kivi_b1) == 1 and kivi_b1[0].endswith("| none added ✓ |"), True)
    kivi_b8 = [l for l in lines if l.startswith("| kivi | 2 | 8 | 32K |")]
    expect("kivi batch 8's row", len(kivi_b8) == 1 and kivi_b8[0].endswith("| - |"), True)
    expect("the note on a stale decode", any(l.startswith("The append's rates here are biased") for l in lines),
           True)
    with open(grid, "w") as f:
        json.dump({"machine": "synthetic", "commit": "0000000", "copy_bandwidth_bytes_per_s": 3.0e12,
                   "rows": [at_lengths, old]}, f)
    out = subprocess.run([sys.executable, SCRIPT, grid], capture_output=True, text=True)
    expect("no note where the steps met the decode at their lengths",
           any("are biased" in l for l in out.stdout.splitlines()), False)

if failures:
    print("\n".join(failures))
    sys.exit(1)
print("format_decode_targets: the append's rate from the step's columns, none added where the step added no time")
