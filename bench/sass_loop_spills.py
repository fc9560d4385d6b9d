#!/usr/bin/env python3
"""Local-memory traffic inside a kernel's main loop, from its SASS.

ptxas's "bytes spill stores/loads" counts every spill of the kernel, also
those in its prologue that run once. What costs time is a local load inside
the per-step loop (the int8 decode's long-scoreboard stalls). This reads the
SASS of one function, takes the longest backward branch as its main loop,
and counts the loop's instructions and its LDL/STL, so that register
pressure can be tuned on a machine without a GPU.

Input: the output of `cuobjdump -sass -fun MANGLED_NAME OBJECT` (cuobjdump
comes with the CUDA toolkit; where it is missing, the PyPI wheel
nvidia-cuda-cuobjdump carries it).

The longest backward branch can be an outer one (a shuffle's divergence
retry around the step loop, as in the int8 decode): --loops lists every
backward branch spanning at least 16 KB of code with its own counts, so
that the step loop can be picked by hand.

The longest backward branch can also be a cold block's retry path (a
shuffle's collective emulation placed after the loop, branching back over
it): --by OPCODE takes instead the backward branch whose span holds the
most instructions of OPCODE (the shortest such span), e.g. --by IMMA for
the int8 decode's step loop.

Usage: bench/sass_loop_spills.py SASS_FILE [--loops | --by OPCODE]
"""
import re
import sys


def instructions(text):
    """[(address, instruction text)] of every SASS line."""
    result = []
    for line in text.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;", line)
        if m:
            result.append((int(m.group(1), 16), m.group(2)))
    return result


def backward_branches(code, divergent=True):
    """[(target, address)] of every branch to a lower address; `divergent`:
    BRA.DIV too (its target is the divergent path's, not a loop head)."""
    result = []
    for address, text in code:
        if "BRA" not in text or (not divergent and "BRA.DIV" in text):
            continue
        m = re.search(r"0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address:
            result.append((int(m.group(1), 16), address))
    return result


def main_loop(code):
    """(first, last) address of the longest backward branch's span, or None."""
    branches = backward_branches(code)
    return max(branches, key=lambda b: b[1] - b[0]) if branches else None


def loop_by_opcode(code, op):
    """(first, last) of the backward branch whose span holds the most `op`
    instructions (the shortest span among those), or None."""
    best = None
    for target, address in backward_branches(code, divergent=False):
        ops = count(op, [t for a, t in code if target <= a <= address])
        key = (ops, -(address - target))
        if ops > 0 and (best is None or key > best[0]):
            best = (key, (target, address))
    return best[1] if best else None


def large_loops(code, span=0x4000):
    """[(first, last)] of every backward branch spanning at least `span` bytes, in address order."""
    return sorted({b for b in backward_branches(code, divergent=False) if b[1] - b[0] >= span})


def count(op, where):
    return sum(1 for text in where if re.search(rf"\b{op}(\.|\s|$)", text))


def main():
    by = len(sys.argv) == 4 and sys.argv[2] == "--by"
    if not (len(sys.argv) == 2 or (len(sys.argv) == 3 and sys.argv[2] == "--loops") or by):
        sys.exit(__doc__)
    code = instructions(open(sys.argv[1]).read())
    if not code:
        sys.exit(f"{sys.argv[1]}: no SASS instructions (expected cuobjdump -sass output)")
    if len(sys.argv) == 3:
        for first, last in large_loops(code):
            inside = [text for address, text in code if first <= address <= last]
            print(f"loop {first:#x}-{last:#x}: {len(inside)} instructions, LDL {count('LDL', inside)}, "
                  f"STL {count('STL', inside)}, LDS {count('LDS', inside)}")
        return
    loop = loop_by_opcode(code, sys.argv[3]) if by else main_loop(code)
    if loop is None:
        sys.exit(f"{sys.argv[1]}: no backward branch" + (f" around {sys.argv[3]}" if by else "") + ", so no loop")
    inside = [text for address, text in code if loop[0] <= address <= loop[1]]
    every = [text for _, text in code]
    print(f"main loop {loop[0]:#x}-{loop[1]:#x}: {len(inside)} instructions, "
          f"LDL {count('LDL', inside)}, STL {count('STL', inside)}; "
          f"whole function: {len(code)} instructions, LDL {count('LDL', every)}, STL {count('STL', every)}")


if __name__ == "__main__":
    main()
