#!/usr/bin/env python3
"""Formats `kvforge rotate --json` held-out comparisons as the markdown rotation
table (bench/rotation_table.sh) and writes the rows as JSON with provenance."""
import argparse
import json
import sys

ORDER = ["none", "identity", "hadamard", "eigen", "random", "learned"]


def mean(values):
    return sum(values) / len(values) if values else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("rotation_json")
    for flag in ("--command", "--commit", "--machine", "--model", "--json-out"):
        parser.add_argument(flag, required=True)
    for flag in ("--calib-windows", "--heldout-windows", "--seq-len", "--rotate-seconds"):
        parser.add_argument(flag, type=int, required=True)
    args = parser.parse_args()
    data = json.load(open(args.rotation_json))
    out = sys.stdout
    out.write(f"# Rotation table: {args.model}\n\n")
    out.write(f"- command: `{args.command}`\n- commit: {args.commit}\n- machine: {args.machine}\n")
    out.write(f"- fitted on {args.calib_windows} windows of calib.txt (a quarter of them held out of the fit for "
              f"early stopping and for keeping each head's learned rotation), measured on {args.heldout_windows} "
              f"windows of heldout.txt, {args.seq_len} tokens each; rotate took {args.rotate_seconds} s\n")
    out.write("- key term: KL(P_fp || P_q) + lambda * relative post-W_O error, keys quantized, values exact; "
              "value term: relative post-W_O error, exact keys, values quantized; per layer the mean over KV heads "
              "of the last 64 queries of each window. Lower is better.\n")
    out.write("- rows: `none` is the configuration as calibrated (no rotation); `identity`, `hadamard` and `eigen` "
              "are fixed bases with the quantizer refitted to the rotated (for identity: centred) data; `learned` is "
              "OptR's rotation kept per head where it beat its base on validation windows.\n\n")
    summary = []
    rows_out = []
    for comparison in data["heldout"]:
        rows = {row["rotation"]: row for row in comparison["rows"]}
        kinds = [k for k in ORDER if k in rows]
        layers = len(rows[kinds[0]]["layers"])
        out.write(f"## {comparison['config']}\n\n")
        header = " | ".join(f"key {k}" for k in kinds) + " | " + " | ".join(f"value {k}" for k in kinds)
        out.write(f"| layer | {header} |\n|---|" + "---|" * (2 * len(kinds)) + "\n")
        means = {("key", k): [] for k in kinds} | {("value", k): [] for k in kinds}
        for layer in range(layers):
            cells = []
            for term in ("key", "value"):
                for kind in kinds:
                    value = mean(rows[kind]["layers"][layer][term])
                    means[(term, kind)].append(value)
                    cells.append(value)
                    rows_out.append({"config": comparison["config"], "rotation": kind, "layer": layer, "term": term,
                                     "mean_over_heads": value, "per_head": rows[kind]["layers"][layer][term]})
            best = {term: min(means[(term, k)][-1] for k in kinds) for term in ("key", "value")}
            formatted = []
            for i, value in enumerate(cells):
                term = "key" if i < len(kinds) else "value"
                text = f"{value:.4g}"
                formatted.append(f"**{text}**" if value == best[term] else text)
            out.write(f"| {layer} | " + " | ".join(formatted) + " |\n")
        out.write("| mean | " + " | ".join(f"{mean(means[(t, k)]):.4g}" for t in ("key", "value") for k in kinds) + " |\n\n")
        for term in ("key", "value"):
            for better, worse in (("learned", "hadamard"), ("learned", "eigen"), ("hadamard", "identity"),
                                  ("learned", "none")):
                if better in kinds and worse in kinds:
                    wins = sum(a < b for a, b in zip(means[(term, better)], means[(term, worse)]))
                    line = (f"{comparison['config']} {term}: {better} < {worse} in {wins} of {layers} layers "
                            f"(mean {mean(means[(term, better)]):.4g} vs {mean(means[(term, worse)]):.4g})")
                    summary.append(line)
    out.write("## Checks\n\n" + "".join(f"- {line}\n" for line in summary))
    json.dump({"command": args.command, "commit": args.commit, "machine": args.machine, "model": args.model,
               "rotate_seconds": args.rotate_seconds, "rows": rows_out, "checks": summary},
              open(args.json_out, "w"), indent=1)


if __name__ == "__main__":
    main()
