#!/usr/bin/env python3
"""Static instruction counts of a decode kernel's step loop, per source line.

Without a GPU the executed instructions cannot be counted, but the step
loop's straight-line code can: every 32-token step runs it once. This reads
one function of `nvdisasm -g -c` output (SASS annotated with source lines;
the kernels are built with -lineinfo), finds the step loop (the innermost
backward branch around the in-loop cp.async wait, `DEPBAR.LE SB0, n` with
n > 0, and every mma of the function, closing before the final wait), and
prints its instruction count, its local loads and stores, and the count
without the lines given as cold (branches a configuration never takes, such
as the outlier corrections for rtn): the hot path's static length, which
moves with the executed count. Cold ranges are source-version specific:
read them off the source being profiled.

Getting the input (cuobjdump and nvdisasm come with the CUDA toolkit, or
the PyPI wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm):
  cuobjdump -xelf all build/kernels/CMakeFiles/kvforge_kernels_cuda.dir/decode_attention.cu.o
  nvdisasm -g -c decode_attention.sm_90.cubin > decode_attention.sass

Usage: bench/sass_step_profile.py SASS MANGLED_FUNCTION [--cold FILE:A-B,...] [--lines]
"""
import collections
import re
import sys


def function_code(lines, name):
    """[(address, instruction, (file, line))] of the function, branch labels resolved to addresses."""
    start = next((i for i, l in enumerate(lines) if l.startswith("//---") and f".text.{name} " in l + " "), None)
    if start is None:
        sys.exit(f"no function {name} in the SASS")
    code, labels, pending, source = [], {}, [], ("?", 0)
    for line in lines[start + 1:]:
        if line.startswith("//---------------------"):
            break
        m = re.match(r'\s*//## File "(.*?)", line (\d+)', line)
        if m:
            source = (m.group(1).split("/")[-1], int(m.group(2)))
            continue
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.search(r"/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;", line)
        if m:
            address = int(m.group(1), 16)
            for label in pending:
                labels[label] = address
            pending = []
            code.append((address, m.group(2), source))
    return code, labels


def branch_target(text, labels):
    m = re.search(r"\((\.L_x_\d+)\)", text)
    if m:
        return labels.get(m.group(1))
    m = re.search(r"0x([0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


def step_loop(code, labels):
    mmas = [a for a, t, _ in code if re.match(r"(@!?U?P\w+\s+)?[IH]MMA", t)]
    waits = [a for a, t, _ in code if re.search(r"DEPBAR\.LE SB0, 0x[1-9]", t)]
    finals = [a for a, t, _ in code if "DEPBAR.LE SB0, 0x0" in t]
    if not mmas or not waits or not finals:
        sys.exit("no mma, in-loop wait or final wait: not a step-loop kernel")
    spans = []
    for address, text, _ in code:
        if "BRA" in text and "BRA.DIV" not in text:
            target = branch_target(text, labels)
            if target is not None and target < address:
                spans.append((target, address))
    inside = [s for s in spans if s[0] <= min(waits) and s[1] >= max(mmas) and s[1] < min(finals)]
    if not inside:
        sys.exit("no backward branch closes around the wait and the mmas")
    return min(inside, key=lambda s: s[1] - s[0])


def main():
    args = sys.argv[1:]
    if len(args) < 2:
        sys.exit(__doc__)
    path, name = args[0], args[1]
    cold = []
    if "--cold" in args:
        for spec in args[args.index("--cold") + 1].split(","):
            file, lines = spec.split(":")
            first, last = map(int, lines.split("-"))
            cold.append((file, first, last))
    code, labels = function_code(open(path).read().split("\n"), name)
    first, last = step_loop(code, labels)
    loop = [(t, s) for a, t, s in code if first <= a <= last]

    def is_cold(source):
        return any(source[0] == f and a <= source[1] <= b for f, a, b in cold)

    hot = [t for t, s in loop if not is_cold(s)]
    locals_ = lambda where, op: sum(1 for t in where if re.search(rf"\b{op}(\.|\s)", t))
    print(f"step loop {first:#x}-{last:#x}: {len(loop)} instructions, LDL {locals_([t for t, _ in loop], 'LDL')}, "
          f"STL {locals_([t for t, _ in loop], 'STL')}; without the cold lines: {len(hot)}, "
          f"LDL {locals_(hot, 'LDL')}, STL {locals_(hot, 'STL')}")
    if "--lines" in args:
        per_line = collections.Counter(s for _, s in loop)
        for (file, line), n in sorted(per_line.items()):
            print(f"{n:5d} {'cold' if is_cold((file, line)) else '    '} {file}:{line}")


if __name__ == "__main__":
    main()
