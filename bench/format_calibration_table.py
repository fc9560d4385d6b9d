#!/usr/bin/env python3
"""Formats `kvforge inspect ARTIFACT --acts HELDOUT --json` as the calibration table (markdown)."""
import argparse
import json
import sys


def mean(values):
    return sum(values) / len(values)


def heldout(layer, key):
    return layer["heldout"][key]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("inspect_json")
    p.add_argument("--command", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--machine", required=True)
    p.add_argument("--json-out")
    a = p.parse_args()
    data = json.load(open(a.inspect_json))
    configs = {c["name"]: c for c in data["configs"]}
    out = []
    w = out.append
    w("# Calibration table: pyllama-16m\n")
    w(f"- command: `{a.command}`")
    w(f"- commit: {a.commit}; machine: {a.machine}")
    w(f"- fitted on `{data['store_file']}` ({data['calibration_tokens']} tokens of calib.txt), "
      f"measured on `{data['measured_on']}` (captures of heldout.txt)")
    w("- errors are relative MSE on the held-out captures (`||x - x^||^2 / ||x||^2`), averaged over layers; "
      "logit = q.k/sqrt(d) over causal pairs with dequantized (and, pre-RoPE, rotated) keys; "
      "16-bit sink/residual tokens count as exact")
    w("- effective bits per cached element (keys and values averaged): codes, scales, outliers, 16-bit windows\n")
    w("| configuration | method | bits | K rel. MSE | V rel. MSE | logit rel. MSE | K outliers | V outliers | eff. bits @2K | eff. bits @64K |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for name, c in configs.items():
        layers = c["layers"]
        bits = {e["context"]: e["bits"] for e in c["effective_bits"]}
        row = {
            "key": mean([heldout(l, "key_relative_mse") for l in layers]),
            "value": mean([heldout(l, "value_relative_mse") for l in layers]),
            "logit": mean([heldout(l, "logit_relative_mse") for l in layers]),
            "key_outliers": mean([heldout(l, "key_outlier_fraction") for l in layers]),
            "value_outliers": mean([heldout(l, "value_outlier_fraction") for l in layers]),
            "bits_2048": bits.get(2048), "bits_65536": bits.get(65536),
        }
        summary[name] = row
        w(f"| {name} | {c['method']} | {c['bits']} | {row['key']:.4e} | {row['value']:.4e} | {row['logit']:.4e} | "
          f"{100 * row['key_outliers']:.2f}% | {100 * row['value_outliers']:.2f}% | {row['bits_2048']:.3f} | "
          f"{row['bits_65536']:.3f} |")

    w("\n## KVQuant ablations (held-out)\n")
    w("| bits | kvquant K+V MSE | uniform grid K+V MSE | no Fisher: Fisher-weighted? | no outliers K+V MSE | "
      "Fisher non-uniform beats uniform | outliers beat none |")
    w("|---|---|---|---|---|---|---|")
    claims = []
    for bits in (2, 3, 4):
        base = summary.get(f"kvquant-{bits}bit")
        uni = summary.get(f"uniform-kvquant-{bits}bit")
        nof = summary.get(f"no-fisher-kvquant-{bits}bit")
        noo = summary.get(f"no-outliers-kvquant-{bits}bit")
        if not (base and uni and nof and noo):
            continue
        err = lambda r: r["key"] + r["value"]
        beats_uniform = err(base) < err(uni)
        beats_none = err(base) < err(noo)
        claims.append((bits, beats_uniform, beats_none))
        w(f"| {bits} | {err(base):.4e} | {err(uni):.4e} | K+V {err(nof):.4e}, logit {nof['logit']:.4e} "
          f"(Fisher: logit {base['logit']:.4e}) | {err(noo):.4e} | {'yes' if beats_uniform else 'NO'} | "
          f"{'yes' if beats_none else 'NO'} |")

    w("\n## Per layer (held-out; calibration in parentheses)\n")
    for name, c in configs.items():
        w(f"### {name}\n")
        w("| layer | K rel. MSE | V rel. MSE | logit rel. MSE | K outliers | V outliers |")
        w("|---|---|---|---|---|---|")
        for l in c["layers"]:
            h, cal = l["heldout"], l["calibration"]
            w(f"| {l['layer']} | {h['key_relative_mse']:.4e} ({cal['key_relative_mse']:.4e}) | "
              f"{h['value_relative_mse']:.4e} ({cal['value_relative_mse']:.4e}) | "
              f"{h['logit_relative_mse']:.4e} ({cal['logit_relative_mse']:.4e}) | "
              f"{100 * h['key_outlier_fraction']:.3f}% ({100 * cal['key_outlier_fraction']:.3f}%) | "
              f"{100 * h['value_outlier_fraction']:.3f}% ({100 * cal['value_outlier_fraction']:.3f}%) |")
        w("")
    print("\n".join(out))
    if a.json_out:
        json.dump({"command": a.command, "commit": a.commit, "machine": a.machine, "summary": summary,
                   "claims": [{"bits": b, "fisher_nonuniform_beats_uniform": u, "outliers_beat_none": o}
                              for b, u, o in claims]}, open(a.json_out, "w"), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
