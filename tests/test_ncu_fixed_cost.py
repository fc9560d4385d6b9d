#!/usr/bin/env python3
"""bench/ncu_fixed_cost.py on synthetic Nsight Compute source pages: one
kernel profiled at three contexts, loaded at a different address each time.
A prologue instruction costs the same at every context (its samples are
all intercept), a step-loop instruction costs in proportion to the context
(intercept 0), and an epilogue instruction inlined from a helper is listed
under the helper's line and under the kernel file's call: the fit must
match each instruction across the profiles by its offset, give the exact
intercepts (the data lie on lines), file the helper's instruction under the
kernel file's line, and turn samples into microseconds from the durations."""
import gzip
import os
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "ncu_fixed_cost.py")
# ncu's own header: the CUDA line's source, then (SASS rows) the instruction's.
HEADER = ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "# Samples", "Instructions Executed", "Thread Instructions Executed"]


def csv_row(cells):
    return ",".join(f'"{c}"' for c in cells) + "\n"


def page(base, context):
    """The source page of one profile: per instruction (offset, samples, executed)."""
    k = context // 1024
    prologue = (0x00, 40, 2048)            # fixed: 40 samples, 2048 executions
    loop = (0x10, 3 * k, 512 * k)          # 3 samples and 512 executions per 1K tokens
    epilogue = (0x20, 10 + k // 4, 2048)   # 10 fixed, 1 per 4K tokens
    sass = {o: (s, e) for o, s, e in (prologue, loop, epilogue)}

    def sass_row(offset, text):
        s, e = sass[offset]
        return csv_row(["", "", f"0x{base + offset:x}", f"      {text}", s, s, s, e, 32 * e])

    def line_row(number, source):
        return csv_row([number, source, "-", "-", 0, 0, 0, 0, 0])

    out = [csv_row(["Function Name", "decode_kernel"])]
    out.append(csv_row(["File Path", "/src/kernels/decode_kernel.cuh"]))
    out.append(csv_row(HEADER))
    out.append(line_row(10, "load the queries"))
    out.append(sass_row(0x00, "LDG.E R2, desc[UR4][R2.64]"))
    out.append(line_row(20, "the step loop"))
    out.append(sass_row(0x10, "IMMA.16832.U8.S8 R4, R8.ROW, R12.COL, R4"))
    out.append(line_row(30, "write_state(...)"))
    out.append(sass_row(0x20, "STG.E [R6.64], R7"))
    out.append(csv_row(["File Path", "/src/kernels/helpers.cuh"]))
    out.append(csv_row(HEADER))
    out.append(line_row(99, "store the state"))
    out.append(sass_row(0x20, "STG.E [R6.64], R7"))
    return "".join(out)


def main():
    contexts = {4096: 0x7f0000001000, 8192: 0x7f5500002000, 32768: 0x7faa00003000}
    durations = {4096: 10.0, 8192: 12.0, 32768: 24.0}  # 8 us + 0.5 us per 1K tokens
    with tempfile.TemporaryDirectory() as folder:
        args = []
        for context, base in contexts.items():
            path = os.path.join(folder, f"c{context}.csv.gz")
            with gzip.open(path, "wt") as f:
                f.write(page(base, context))
            args.append(f"{context}={path}")
        for context, us in durations.items():
            args += ["--duration", f"{context}={us}"]
        out = subprocess.run([sys.executable, SCRIPT, *args, "--file", "decode_kernel.cuh"],
                             capture_output=True, text=True, check=True).stdout
    failures = []
    # Totals: 4K has 40 + 12 + 11 samples; the intercepts 40 + 0 + 10 = 50.
    expected = [
        "| 4096 | 63 | 6144 | 10.00 |",
        "intercept (no tokens): 50 samples, 79% of 4096's; 4096 warp instructions, 67% of 4096's",
        "duration: 8.00 us + 0.500 us per 1K (1,024) tokens",
        "| 40 |",                                  # the prologue's line first
        "`decode_kernel.cuh:10`: `load the queries`",
        "`decode_kernel.cuh:30`: `write_state(...)`",  # the helper's instruction under the kernel's line
    ]
    for e in expected:
        if e not in out:
            failures.append(f"missing {e!r}")
    if "helpers.cuh:99" in out:
        failures.append("the helper's line listed instead of the kernel file's")
    if "| 0 | 0.00 | 0 | `decode_kernel.cuh:20`: `the step loop` |" not in out:
        failures.append("the step loop's line not listed with a zero intercept")
    # Microseconds: all durations over all samples (46 us over 63 + 76 + 154 samples).
    per_sample = 46.0 / (63 + 76 + 154)
    if f"{40 * per_sample:.2f}" not in out:
        failures.append(f"the prologue's intercept in us ({40 * per_sample:.2f}) not printed")
    for f in failures:
        print("FAILED:", f)
    if failures:
        print(out)
        sys.exit(1)
    print("test_ncu_fixed_cost: passed")


if __name__ == "__main__":
    main()
