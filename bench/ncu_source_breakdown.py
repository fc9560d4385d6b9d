#!/usr/bin/env python3
"""Where a kernel's instructions go, from Nsight Compute's source page.

Input: the CSV of `ncu -i REPORT --page source --csv --print-source cuda,sass`
(scripts/gpu_checks.sh writes it as ncu_source_<method>.csv.gz; gzipped or
not). Each source file's section lists its CUDA lines, each followed by the
SASS instructions compiled from it, with "Instructions Executed" (warp level)
and "Warp Stall Sampling (All Samples)".

Prints, as markdown tables:
  - warp instructions by SASS opcode, in total and per work unit when
    --units N is given (the tensor-core decode: batch x tokens x KV heads /
    16 tiles);
  - the CUDA lines with the most executed instructions, with their share of
    the stall samples;
  - with --shared, the CUDA lines with the most shared-memory wavefronts
    ("L1 Wavefronts Shared", and of them "... Excessive": bank-conflict
    replays), per unit.
An instruction inlined from a helper is listed under its line in every
source file of the call chain (the helper's and the caller's): the opcode
counts take each address once, the line shares overlap.

Usage: bench/ncu_source_breakdown.py FILE [--units N] [--lines 20] [--opcodes 16] [--shared]
"""
import argparse
import collections
import csv
import gzip
import io


def read_rows(path):
    raw = gzip.open(path, "rb").read() if path.endswith(".gz") else open(path, "rb").read()
    return list(csv.reader(io.StringIO(raw.decode("utf-8", "replace"))))


def source_rows(rows):
    """(file, column index by header name, row) for each data row of the source page, in order."""
    file, column = None, {}
    for r in rows:
        if not r:
            continue
        if r[0] == "File Path":
            file = r[1].split("/")[-1]
        elif r[0] == "Line No":
            column = {name: i for i, name in enumerate(r)}
        elif r[0] != "Function Name" and len(r) >= 8:
            yield file, column, r


def sass_rows(rows):
    """(file, CUDA line row, SASS row) for each SASS instruction row, under the CUDA line listed
    before it and that line's file (an instruction inlined from a helper comes once per source
    file of its call chain). A row's columns: r[0] line number, r[1] source, r[2] address, r[3]
    SASS, r[4] stall samples, r[7] warp instructions executed."""
    file, line = None, None
    for row_file, _, r in source_rows(rows):
        if r[0] != "" and r[2] == "-":
            file, line = row_file, r
        elif r[0] == "" and r[2].startswith("0x"):
            yield file, line, r


def count(cell):
    """A numeric cell as an int (ncu writes '-' or '' where it has none)."""
    return int(cell) if cell.isdigit() else 0


def breakdown(rows):
    """(per CUDA line: [instructions, samples, file, line, source]), (per opcode: instructions)."""
    lines, by_address = [], {}
    for file, _, r in source_rows(rows):
        if r[0] != "" and r[2] == "-" and r[7].isdigit():  # a CUDA line (its SASS rows follow)
            lines.append([int(r[7]), count(r[4]), file, r[0], r[1].strip()])
    for _, _, r in sass_rows(rows):
        if r[7].isdigit():
            text = r[3].strip()
            if text.startswith("@"):  # a predicate
                text = text.split(None, 1)[1]
            by_address[r[2]] = (text.split()[0].split(".")[0], int(r[7]))
    opcodes = collections.Counter()
    for opcode, executed in by_address.values():
        opcodes[opcode] += executed
    return lines, opcodes


def shared_wavefronts(rows):
    """Per CUDA line: [wavefronts, excessive, file, line, source], from the columns the header names."""
    def number(r, column, name):
        try:
            return float(r[column[name]])
        except (KeyError, IndexError, ValueError):
            return 0.0
    return [[number(r, column, "L1 Wavefronts Shared"), number(r, column, "L1 Wavefronts Shared Excessive"), file, r[0],
             r[1].strip()]
            for file, column, r in source_rows(rows) if r[0] != "" and r[2] == "-"]


def cell(text):
    return text.replace("|", "\\|")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--units", type=float, default=0, help="divide instruction counts by this (e.g. tiles)")
    parser.add_argument("--lines", type=int, default=20)
    parser.add_argument("--opcodes", type=int, default=16)
    parser.add_argument("--shared", action="store_true", help="also the lines' shared-memory wavefronts")
    args = parser.parse_args()
    rows = read_rows(args.csv)
    lines, opcodes = breakdown(rows)
    total = sum(opcodes.values())
    line_total = sum(l[0] for l in lines) or 1
    samples = sum(l[1] for l in lines) or 1
    unit = f" per unit ({args.units:g})" if args.units else ""
    print(f"| opcode | warp instructions{unit} | share |")
    print("|---|---|---|")
    for op, n in opcodes.most_common(args.opcodes):
        value = f"{n / args.units:.1f}" if args.units else str(n)
        print(f"| {op} | {value} | {100 * n / total:.1f}% |")
    print(f"\ntotal: {total} warp instructions" + (f", {total / args.units:.1f} per unit" if args.units else ""))
    print("\n| instructions | stall samples | line |")
    print("|---|---|---|")
    for executed, sampled, file, line, source in sorted(lines, reverse=True)[: args.lines]:
        print(f"| {100 * executed / line_total:.1f}% | {100 * sampled / samples:.1f}% | "
              f"`{file}:{line}`: `{cell(source[:110])}` |")
    if args.shared:
        per = args.units or 1
        waves = shared_wavefronts(rows)
        print(f"\nshared wavefronts: {sum(w[0] for w in waves) / per:.1f}"
              f"{' per unit' if args.units else ''}, excessive {sum(w[1] for w in waves) / per:.1f}")
        print("\n| wavefronts | excessive | line |")
        print("|---|---|---|")
        for total_waves, excessive, file, line, source in sorted(waves, reverse=True)[: args.lines]:
            if total_waves > 0:
                print(f"| {total_waves / per:.1f} | {excessive / per:.1f} | `{file}:{line}`: `{cell(source[:110])}` |")


if __name__ == "__main__":
    main()
