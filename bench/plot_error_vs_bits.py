#!/usr/bin/env python3
"""Held-out error against effective bits, one line per method (its 2, 3 and 4-bit configurations).

Reads the JSON that format_calibration_table.py writes (--json-out) and draws two panels: the K+V relative MSE
and the attention-logit relative MSE on the held-out captures, each against the effective bits per cached element
at the chosen context, counted at the outlier fraction measured on the held-out captures. Comparing methods at
equal effective bits is the honest comparison: outliers cost bits, and a 16-bit window costs more at short
contexts. Usage: plot_error_vs_bits.py TABLE.json --out PLOT.png [--context 131072] [--title TEXT]
"""
import argparse
import json
import re
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def family(name):
    """kvquant-2bit -> kvquant; kivi-3bit-keys-sliding -> kivi-keys-sliding; no-outliers-kvquant-3bit -> no-outliers-kvquant."""
    return re.sub(r"-\d+bit", "", name)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("table_json")
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--title", default="")
    a = p.parse_args()
    table = json.load(open(a.table_json))
    rows = table["summary"]
    field = f"bits_{a.context}_heldout"
    lines = defaultdict(list)
    kinds = {}
    for name, r in rows.items():
        if field not in r:
            raise SystemExit(f"{a.table_json}: summary.{name}.{field}: missing (contexts in the table: 2048, 131072)")
        lines[family(name)].append((r[field], r["key"] + r["value"], r["logit"], r["bits"]))
        kinds[family(name)] = r["kind"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.4))
    for ax, column, label in ((axes[0], 1, "K+V relative MSE (held-out)"), (axes[1], 2, "logit relative MSE (held-out)")):
        colors = plt.get_cmap("tab20").colors  # more methods than the default cycle's 10 colours
        for index, (fam, points) in enumerate(sorted(lines.items())):
            points.sort()
            variant = kinds[fam] != "paper default"
            ax.plot([p[0] for p in points], [p[column] for p in points], marker="o", linestyle="--" if variant else "-",
                    color=colors[(2 * index) % 20 + index // 10],
                    markerfacecolor="none" if variant else None, label=fam)
            for p in points:
                ax.annotate(f"{p[3]}b", (p[0], p[column]), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.set_xlabel(f"effective bits per cached element at {a.context} tokens (held-out outlier fraction)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4)
    proto = table.get("protocol", {})
    fig.suptitle(a.title or (
        f"{proto.get('model', '')}: held-out error against effective bits (solid: paper defaults; dashed: kvforge "
        f"variants and ablations)\nfitted on {proto.get('calibration_windows')} x {proto.get('seq_len')} tokens of "
        f"{proto.get('calibration_data')}, measured on {proto.get('heldout_windows')} x {proto.get('seq_len')} tokens "
        f"of {proto.get('heldout_data')}; commit {table.get('commit', '?')}"), fontsize=10)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
