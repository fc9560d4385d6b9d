#!/usr/bin/env python3
"""The per-configuration table of a `kvforge run` (or `kvforge eval --json`)
evaluation as Markdown: bits, effective bits, bytes per token, perplexity,
KL, top-1, needle accuracy, post-W_O attention error.

Usage: bench/format_run_table.py EVAL.json [--title TEXT]
"""
import argparse
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("evaluation")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    with open(args.evaluation) as f:
        e = json.load(f)
    if args.title:
        print(f"### {args.title}\n")
    print(f"`{e['command_line']}` on {e['device']}, {e['date']}; perplexity windows of {e['context']} "
          f"positions fed {e['chunk']} at a time.\n")
    print("| config | bits | eff. bits | bytes/token | ppl | ppl vs fp16 | KL mean | KL p99 | top-1 | needle | attn error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    fp16 = e["configurations"][0]["perplexity"]["perplexity"]
    for c in e["configurations"]:
        p = c["perplexity"]
        needles = sum(n["correct"] for n in c["needles"]), sum(n["probes"] for n in c["needles"])
        needle = f"{needles[0] / needles[1]:.3f} ({needles[0]}/{needles[1]})" if needles[1] else "-"
        attention = (sum(l["key_output"] + l["value_output"] for l in c["attention"]) / len(c["attention"])
                     if c["attention"] else None)
        print(f"| {c['name']} | {c['bits']} | {c['effective_bits']:.3f} | {c['cache_bytes_per_token']:.1f} | "
              f"{p['perplexity']:.3f} | {100 * (p['perplexity'] / fp16 - 1):+.2f}% | {p['kl_mean']:.4f} | "
              f"{p['kl_p99']:.3f} | {100 * p['top1_agreement']:.2f}% | {needle} | "
              f"{'-' if attention is None else f'{attention:.4f}'} |")


if __name__ == "__main__":
    main()
