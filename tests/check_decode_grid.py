#!/usr/bin/env python3
"""The committed decode-attention grid (bench/results/decode_attention.json)
against issue 10's contract and against the pages that quote it.

Checks, each a line on failure:
  - provenance: the machine, commit and command that made the grid, and the
    copy bandwidth its fractions are taken against;
  - coverage: Llama-3-8B's attention shapes (32 query heads on 8 KV heads of
    128) at every context from 4K to 128K, batches 1, 8 and 32, 2 and 4 bits,
    every method the artifact has (kvquant, kivi, int2-rot, rtn), each
    (method, bits, batch, context) once;
  - every row has the issue's columns (context, batch, bits, time_us,
    sdpa_time_us, speedup_vs_sdpa, bytes_read, bandwidth_fraction) and
    FlashInfer's bf16 and fp8 times from the same run, as positive numbers;
  - the derived columns follow from the measured ones: speedup_vs_sdpa is
    sdpa_time_us / time_us, bandwidth_fraction is bytes_read / time_us over
    the copy bandwidth (the bench computes them; a hand edit of one number
    shows here);
  - bytes_read counts what every sequence must read: at one context it is
    the batch times one sequence's bytes (kvquant's within its outliers'
    variation), and it grows with the context;
  - README.md's speed table ("Runtime kernels: where the speed targets
    stand") and docs/serving.md's (the H200's, after "The configuration an
    artifact holds decides which kernel decodes it") name the grid's commit
    and machine and quote its 2-bit speedups at 32K and 128K, batch 1 / 8 /
    32, to the digits they print; bench/README.md's "Where the targets
    stand" names the same commit.

Usage: check_decode_grid.py [--grid GRID.json] [--readme README.md] [--bench-readme bench/README.md]
                            [--serving docs/serving.md]
       check_decode_grid.py --self-check   (the checks fail on broken copies)
"""
import argparse
import copy
import json
import math
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GRID = os.path.join(ROOT, "bench", "results", "decode_attention.json")
README = os.path.join(ROOT, "README.md")
BENCH_README = os.path.join(ROOT, "bench", "README.md")
BENCH_HEADING = "### Where the targets stand (the committed grid at "

ISSUE_COLUMNS = ("context", "batch", "bits", "time_us", "sdpa_time_us", "speedup_vs_sdpa", "bytes_read",
                 "bandwidth_fraction")
SAME_RUN_BASELINES = ("flashinfer_bf16_time_us", "flashinfer_fp8_time_us")
METHODS = ("kvquant", "kivi", "int2-rot", "rtn")
CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
BATCHES = (1, 8, 32)
BITS = (2, 4)
README_SECTION = "## Runtime kernels: where the speed targets stand"
SERVING = os.path.join(ROOT, "docs", "serving.md")
SERVING_ANCHOR = "The configuration an artifact holds decides which kernel decodes it"
README_CONTEXTS = (32768, 131072)
# kvquant's sparse outliers: its keys' per-channel thresholds catch a count
# of entries that depends on the bench's random activations, ~0.5% of the
# key elements (~170K at 32K tokens) give or take a few hundred; so one
# sequence's bytes differ between batches by far less than 0.5% (they
# differ by 0.01-0.04% in the committed grid), the other methods' not at all.
VARIABLE_BYTES = {"kvquant": 0.005}
# The derived columns are doubles computed from the same doubles: only the
# last bits of a division and a product can differ.
RELATIVE = 1e-12


def positive_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def close(a, b):
    return abs(a - b) <= RELATIVE * max(abs(a), abs(b))


def row_name(r):
    return f"{r.get('method')} {r.get('bits')}-bit batch {r.get('batch')} context {r.get('context')}"


def check_grid(grid, where):
    errors = []
    for field in ("machine", "commit", "command"):
        if not isinstance(grid.get(field), str) or not grid[field].strip():
            errors.append(f"{where}: field '{field}': expected the non-empty string that names who made the grid")
    bandwidth = grid.get("copy_bandwidth_bytes_per_s")
    if not positive_number(bandwidth):
        errors.append(f"{where}: field 'copy_bandwidth_bytes_per_s': expected the measured copy bandwidth, "
                      f"a positive number, got {bandwidth!r}")
        bandwidth = None
    what = grid.get("what", "")
    if "Llama-3-8B" not in what:
        errors.append(f"{where}: field 'what': expected Llama-3-8B's attention shapes, got {what!r}")
    rows = grid.get("rows")
    if not isinstance(rows, list) or not rows:
        return errors + [f"{where}: field 'rows': expected a non-empty list of rows"]

    seen = {}
    for i, r in enumerate(rows):
        name = f"{where}: rows[{i}] ({row_name(r)})"
        bad = [c for c in ISSUE_COLUMNS + SAME_RUN_BASELINES if not positive_number(r.get(c))]
        if bad:
            errors.append(f"{name}: fields {', '.join(bad)}: expected positive numbers")
            continue
        key = (r.get("method"), r["bits"], r["batch"], r["context"])
        if key in seen:
            errors.append(f"{name}: the same method, bits, batch and context as rows[{seen[key]}]")
        seen[key] = i
        if not close(r["speedup_vs_sdpa"], r["sdpa_time_us"] / r["time_us"]):
            errors.append(f"{name}: field 'speedup_vs_sdpa': expected sdpa_time_us / time_us = "
                          f"{r['sdpa_time_us'] / r['time_us']!r}, got {r['speedup_vs_sdpa']!r}")
        if bandwidth is not None:
            fraction = r["bytes_read"] / (r["time_us"] * 1e-6) / bandwidth
            if not close(r["bandwidth_fraction"], fraction):
                errors.append(f"{name}: field 'bandwidth_fraction': expected bytes_read / time over the copy "
                              f"bandwidth = {fraction!r}, got {r['bandwidth_fraction']!r}")

    for method in METHODS:
        for bits in BITS:
            for batch in BATCHES:
                for context in CONTEXTS:
                    if (method, bits, batch, context) not in seen:
                        errors.append(f"{where}: no row for {method} {bits}-bit batch {batch} context {context} "
                                      f"(the issue's grid: contexts 4K to 128K, batches 1, 8 and 32)")

    # bytes_read: per sequence the same at every batch, more at every longer context.
    per_sequence = {}
    for key, i in seen.items():
        r = rows[i]
        method, bits, batch, context = key
        one = r["bytes_read"] / batch
        earlier = per_sequence.setdefault((method, bits, context), (one, i))
        if abs(one - earlier[0]) > VARIABLE_BYTES.get(method, 0.0) * earlier[0]:
            errors.append(f"{where}: rows[{i}] ({row_name(r)}): field 'bytes_read': expected batch x "
                          f"{earlier[0]:.0f} bytes a sequence (rows[{earlier[1]}]), got {one:.2f} a sequence")
    for method in METHODS:
        for bits in BITS:
            sizes = [(c, per_sequence[(method, bits, c)][0]) for c in CONTEXTS if (method, bits, c) in per_sequence]
            for (c0, b0), (c1, b1) in zip(sizes, sizes[1:]):
                if not b0 < b1:
                    errors.append(f"{where}: {method} {bits}-bit: field 'bytes_read': expected more bytes a "
                                  f"sequence at {c1} tokens than at {c0}, got {b1:.0f} against {b0:.0f}")
    return errors


def quoted_table(text, anchor):
    """The first Markdown table after `anchor` in text, as {method: [(cells of
    32K batch 1, 8, 32), (128K ...)]} (its rows of a configuration, a kernel
    and the two contexts), with the text from the anchor to the table's end;
    None where the anchor or the table is missing."""
    start = text.find(anchor)
    if start < 0:
        return None, ""
    lines = text[start:].splitlines()
    first = next((n for n, line in enumerate(lines) if line.startswith("|")), None)
    if first is None:
        return None, ""
    last = next((n for n in range(first, len(lines)) if not lines[n].startswith("|")), len(lines))
    table = {}
    for line in lines[first:last]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0] or cells[0].startswith("---") or cells[0].startswith("configuration"):
            continue
        method = cells[0].split()[0]
        table[method] = [tuple(x.strip() for x in cell.split("/")) for cell in cells[2:4]]
    return table, "\n".join(lines[:last])


def check_quoted_table(grid, text, where, anchor, grid_named_as):
    """The table after `anchor` quotes the grid's 2-bit speedups to the digits
    it prints; the text before it names the grid as `grid_named_as` (with
    the commit) and names its card."""
    table, section = quoted_table(text, anchor)
    if table is None:
        return [f"{where}: expected a speed table after '{anchor}'"]
    errors = []
    commit, machine = grid.get("commit", ""), grid.get("machine", "")
    if grid_named_as.format(commit=commit) not in section:
        errors.append(f"{where}: the speed table: expected the committed grid named by its commit "
                      f"('{grid_named_as.format(commit=commit)}')")
    card = machine.split()[-1] if machine else ""
    if card and card not in section:
        errors.append(f"{where}: the speed table: expected the grid's machine ({machine})")
    rows = {(r.get("method"), r.get("bits"), r.get("batch"), r.get("context")): r for r in grid.get("rows", [])}
    for method in METHODS:
        if method not in table:
            errors.append(f"{where}: the speed table: expected a row for {method}")
            continue
        for context, cells in zip(README_CONTEXTS, table[method]):
            if len(cells) != len(BATCHES):
                errors.append(f"{where}: the speed table, {method} at {context // 1024}K: expected batch 1 / 8 / 32, "
                              f"got {' / '.join(cells)}")
                continue
            for batch, cell in zip(BATCHES, cells):
                m = re.fullmatch(r"(\d+)\.(\d+)x", cell)
                r = rows.get((method, 2, batch, context))
                if m is None or r is None:
                    errors.append(f"{where}: the speed table, {method} {context // 1024}K batch {batch}: expected "
                                  f"a speedup like 4.0x with a grid row behind it, got {cell!r}")
                    continue
                quoted = f"{r['speedup_vs_sdpa']:.{len(m.group(2))}f}x"
                if quoted != cell:
                    errors.append(f"{where}: the speed table, {method} {context // 1024}K batch {batch}: the grid "
                                  f"says {quoted}, the page {cell}")
    return errors


def check_readme(grid, text, where):
    return check_quoted_table(grid, text, where, README_SECTION, "`bench/results/decode_attention.json`: {commit} on an")


def check_serving(grid, text, where):
    return check_quoted_table(grid, text, where, SERVING_ANCHOR, "(bench/results/decode_attention.json, {commit};")


def check_bench_readme(grid, text, where):
    start = text.find(BENCH_HEADING)
    if start < 0:
        return [f"{where}: expected a heading '{BENCH_HEADING}<commit>, ...)'"]
    named = text[start + len(BENCH_HEADING):].split(",")[0].split(")")[0].strip()
    if named != grid.get("commit"):
        return [f"{where}: '{BENCH_HEADING.strip('# ')}': expected the grid's commit {grid.get('commit')}, got {named}"]
    return []


def edited_cell(text, anchor, method):
    """text with `method`'s 32K batch 8 cell of the table after `anchor`
    changed by one in its last digit, and that cell as it now reads."""
    start = text.find(anchor)
    line_start = text.index(f"| {method} ", start)
    line_end = text.index("\n", line_start)
    line = text[line_start:line_end]
    cells = line.strip().strip("|").split("|")
    values = [v.strip() for v in cells[2].split("/")]
    digits = len(values[1].split(".")[1]) - 1
    values[1] = f"{float(values[1][:-1]) + 10 ** -digits:.{digits}f}x"
    cells[2] = " " + " / ".join(values) + " "
    return text[:line_start] + "|" + "|".join(cells) + "|" + text[line_end:], values[1]


def self_check(grid, text, serving_text):
    """Each broken copy must fail, and by the check meant to catch it."""
    assert not check_grid(grid, "grid") and not check_readme(grid, text, "README"), "the committed files must pass"
    assert not check_serving(grid, serving_text, "serving"), "the committed serving page must pass"
    rows = grid["rows"]
    i = next(i for i, r in enumerate(rows) if r["method"] == "rtn" and r["bits"] == 2 and r["batch"] == 8
             and r["context"] == 32768)

    def broken(edit):
        g = copy.deepcopy(grid)
        edit(g)
        return g

    def time_edited(g):
        g["rows"][i]["time_us"] *= 1.01

    def bytes_edited(g):
        g["rows"][i]["bytes_read"] += 8 * 8
        g["rows"][i]["bandwidth_fraction"] = (g["rows"][i]["bytes_read"] / (g["rows"][i]["time_us"] * 1e-6)
                                              / g["copy_bandwidth_bytes_per_s"])

    def row_dropped(g):
        del g["rows"][i]

    def column_dropped(g):
        del g["rows"][i]["flashinfer_fp8_time_us"]

    def commit_dropped(g):
        g["commit"] = ""

    def speedup_changed(g):
        # A consistent refresh of one number: the README no longer matches.
        r = g["rows"][i]
        r["time_us"] = r["sdpa_time_us"] / 3.5
        r["speedup_vs_sdpa"] = r["sdpa_time_us"] / r["time_us"]
        r["bandwidth_fraction"] = r["bytes_read"] / (r["time_us"] * 1e-6) / g["copy_bandwidth_bytes_per_s"]

    readme_edited, readme_cell = edited_cell(text, README_SECTION, "rtn")
    cases = [("a time edited alone", broken(time_edited), text, "speedup_vs_sdpa"),
             ("bytes read for one batch only", broken(bytes_edited), text, "a sequence"),
             ("a row dropped", broken(row_dropped), text, "no row for rtn 2-bit batch 8 context 32768"),
             ("FlashInfer's fp8 column dropped", broken(column_dropped), text, "flashinfer_fp8_time_us"),
             ("no commit", broken(commit_dropped), text, "field 'commit'"),
             ("the grid refreshed, the README not", broken(speedup_changed), text, "the grid says 3.5x"),
             ("the README's cell edited", grid, readme_edited, f"the page {readme_cell}")]
    for what, g, t, expected in cases:
        errors = check_grid(g, "grid") + check_readme(g, t, "README")
        assert any(expected in e for e in errors), f"{what}: expected an error with {expected!r}, got {errors}"
    serving_edited, serving_cell = edited_cell(serving_text, SERVING_ANCHOR, "kvquant")
    errors = check_serving(grid, serving_edited, "serving")
    assert any(f"the page {serving_cell}" in e for e in errors), f"serving's cell edited: got {errors}"
    print(f"self-check: {len(cases) + 1} broken copies each caught")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", default=GRID)
    parser.add_argument("--readme", default=README)
    parser.add_argument("--bench-readme", default=BENCH_README)
    parser.add_argument("--serving", default=SERVING)
    parser.add_argument("--self-check", action="store_true")
    args = parser.parse_args()
    with open(args.grid) as f:
        grid = json.load(f)
    with open(args.readme) as f:
        text = f.read()
    with open(args.bench_readme) as f:
        bench_text = f.read()
    with open(args.serving) as f:
        serving_text = f.read()
    if args.self_check:
        self_check(grid, text, serving_text)
    errors = (check_grid(grid, args.grid) + check_readme(grid, text, args.readme)
              + check_bench_readme(grid, bench_text, args.bench_readme) + check_serving(grid, serving_text, args.serving))
    for e in errors:
        print(e)
    if errors:
        return 1
    print(f"{args.grid}: {len(grid['rows'])} rows ({grid['machine']}, {grid['commit']}) consistent, "
          f"the README's and docs/serving.md's speed tables quote them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
