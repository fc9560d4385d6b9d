#!/usr/bin/env python3
"""bench/sass_loop_spills.py on a synthetic SASS listing: a step loop of
IMMA instructions with a local load, and after it a cold retry path whose
backward branch spans more code than the loop. The plain run takes the
longest backward branch (the retry path); --by IMMA takes the loop."""
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "sass_loop_spills.py")


def line(address, text):
    return f"        /*{address:04x}*/                   {text} ;   /* 0x000000 */\n"


def listing():
    out = []
    a = 0x0000
    for text in ["MOV R1, c[0x0][0x28]", "STL [R1], R2"]:
        out.append(line(a, text))
        a += 0x10
    loop_head = a
    for text in ["IMMA.16832.U8.U8 R4, R8.ROW, R12.COL, R4", "LDL R6, [R1]",
                 "IMMA.16832.U8.U8 R16, R8.ROW, R12.COL, R16", "ISETP.NE.AND P0, PT, R2, RZ, PT"]:
        out.append(line(a, text))
        a += 0x10
    out.append(line(a, f"@P0 BRA 0x{loop_head:x}"))
    a += 0x10
    out.append(line(a, "EXIT"))
    a += 0x10
    for _ in range(12):  # the cold retry path after the loop
        out.append(line(a, "SHFL.IDX P2, R28, R33, R38, R36"))
        a += 0x10
    out.append(line(a, "BRA 0x10"))  # back over the loop, to just after the prologue's first instruction
    return "".join(out)


def run(*args):
    with tempfile.NamedTemporaryFile("w", suffix=".sass", delete=False) as f:
        f.write(listing())
        path = f.name
    try:
        return subprocess.run([sys.executable, SCRIPT, path, *args], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)


def main():
    longest = run()
    by_imma = run("--by", "IMMA")
    failures = []
    # Longest branch: 0x10 to the retry path's branch (20 instructions, the STL and the LDL inside).
    if "main loop 0x10-0x140: 20 instructions, LDL 1, STL 1" not in longest:
        failures.append(f"longest backward branch: {longest.strip()}")
    # The IMMA loop: its 5 instructions, its one local load, no store.
    if "main loop 0x20-0x60: 5 instructions, LDL 1, STL 0" not in by_imma:
        failures.append(f"--by IMMA: {by_imma.strip()}")
    for f in failures:
        print("FAILED:", f)
    if failures:
        sys.exit(1)
    print("ok: the longest branch and the IMMA loop found")


if __name__ == "__main__":
    main()
