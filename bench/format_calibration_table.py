#!/usr/bin/env python3
"""Formats `kvforge inspect ARTIFACT --acts HELDOUT --json` as the calibration table (markdown).

Configurations named METHOD-Nbit are the published methods (calibrate's defaults),
METHOD-Nbit-SUFFIX kvforge's variants (the suffix names the variant flags), and
NAME-METHOD-Nbit the ablations."""
import argparse
import json
import sys


def mean(values):
    return sum(values) / len(values)


def heldout(layer, key):
    return layer["heldout"][key]


def kind(c):
    base = f"{c['method']}-{c['bits']}bit"
    if c["name"] == base:
        return "paper default"
    if c["name"].startswith(base + "-"):
        return "kvforge variant"
    return "ablation"


def describe(c):
    """The rules that tell a default from its variants, from the first layer's settings."""
    k, v = c["layers"][0]["keys"], c["layers"][0]["values"]
    parts = [f"K {k['grouping']}, window {k['residual_rule']}"]
    if k["outlier_rule"] != "none":
        parts.append(f"K outliers {k['outlier_rule']}")
    parts.append(f"V {v['grouping']}, window {v['residual_rule']}")
    if v["outlier_rule"] != "none":
        parts.append(f"V outliers {v['outlier_rule']}")
    if k["q_norm"] != "none" or v["q_norm"] != "none":
        parts.append(f"Q-Norm {v['q_norm']}")
    if "grid" not in k and "grid" not in v and c["method"] == "kvquant":
        parts.append("uniform levels")
    if c["method"] == "kvquant" and not c["fisher_weighted"] and ("grid" in k or "grid" in v):
        parts.append("plain k-means")
    return "; ".join(parts)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("inspect_json")
    p.add_argument("--command", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--machine", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--calib-data", required=True)
    p.add_argument("--calib-windows", type=int, required=True)
    p.add_argument("--heldout-data", required=True)
    p.add_argument("--heldout-windows", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--json-out")
    a = p.parse_args()
    data = json.load(open(a.inspect_json))
    if "measured_on" not in data:
        sys.exit(f"{a.inspect_json}: expected `inspect --acts HELDOUT --json` output (no measured_on)")
    configs = {c["name"]: c for c in data["configs"]}
    out = []
    w = out.append
    w(f"# Calibration table: {a.model}\n")
    w(f"- command: `{a.command}`")
    w(f"- commit: {a.commit}; machine: {a.machine}")
    w(f"- model: {a.model} ({data['model']})")
    w(f"- calibration: {a.calib_windows} windows x {a.seq_len} tokens of `{a.calib_data}` captured into "
      f"`{data['store_file']}`; the artifact records {data['calibration_tokens']} tokens fitted on")
    w(f"- held-out: {a.heldout_windows} windows x {a.seq_len} tokens of `{a.heldout_data}` (`{data['measured_on']}`); "
      "every measure below is on these held-out captures unless marked calibration")
    w("- measurement: relative MSE `||x - x^||^2 / ||x||^2` of keys and values, averaged over layers; "
      "logit = q.k/sqrt(d) over causal pairs with dequantized (and, pre-RoPE, rotated) keys; "
      "16-bit sink/residual tokens count as exact; outliers = share of the quantized elements kept exact")
    w("- effective bits per cached element (keys and values averaged): codes, scales, outliers (per-token CSR: "
      "16-bit value + index + row pointers), 16-bit windows; *nominal* at the configured outlier fraction "
      "(KVQuant's top/bottom rule: its exact count), *held-out* at the outlier fraction measured on the held-out captures")
    w("- configurations: `METHOD-Nbit` = the published method (calibrate's default); `METHOD-Nbit-SUFFIX` = "
      "a kvforge variant (`-keys-sliding`: KIVI keys with kvforge's sliding window; `-head-scaling-tau`: KVQuant "
      "values scaled per head with kvforge's tau outliers; `-qnorm-iterated`: kvforge's iterated Q-Norm); "
      "`NAME-kvquant-Nbit` = ablations of the KVQuant default\n")
    w("| configuration | kind | rules | K rel. MSE | V rel. MSE | logit rel. MSE | K outliers | V outliers | "
      "eff. bits @2K nominal / held-out | eff. bits @128K nominal / held-out |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for name, c in configs.items():
        layers = c["layers"]
        nominal = {e["context"]: e["bits"] for e in c["effective_bits"]}
        measured = {e["context"]: e["bits"] for e in c["effective_bits_heldout"]}
        row = {
            "method": c["method"], "bits": c["bits"], "kind": kind(c), "rules": describe(c),
            "key": mean([heldout(l, "key_relative_mse") for l in layers]),
            "value": mean([heldout(l, "value_relative_mse") for l in layers]),
            "logit": mean([heldout(l, "logit_relative_mse") for l in layers]),
            "key_outliers": mean([heldout(l, "key_outlier_fraction") for l in layers]),
            "value_outliers": mean([heldout(l, "value_outlier_fraction") for l in layers]),
            "bits_2048": nominal.get(2048), "bits_131072": nominal.get(131072),
            "bits_2048_heldout": measured.get(2048), "bits_131072_heldout": measured.get(131072),
        }
        summary[name] = row
        w(f"| {name} | {row['kind']} | {row['rules']} | {row['key']:.4e} | {row['value']:.4e} | {row['logit']:.4e} | "
          f"{100 * row['key_outliers']:.2f}% | {100 * row['value_outliers']:.2f}% | "
          f"{row['bits_2048']:.3f} / {row['bits_2048_heldout']:.3f} | "
          f"{row['bits_131072']:.3f} / {row['bits_131072_heldout']:.3f} |")

    w("\n## Paper defaults vs kvforge variants (held-out)\n")
    w("| bits | default | variant | K+V MSE default | K+V MSE variant | logit default | logit variant | "
      "eff. bits @128K (held-out) default / variant |")
    w("|---|---|---|---|---|---|---|---|")
    err = lambda r: r["key"] + r["value"]
    for name, row in summary.items():
        if row["kind"] != "kvforge variant":
            continue
        base_name = f"{row['method']}-{row['bits']}bit"
        base = summary.get(base_name)
        if not base:
            continue
        w(f"| {row['bits']} | {base_name} | {name} | {err(base):.4e} | {err(row):.4e} | {base['logit']:.4e} | "
          f"{row['logit']:.4e} | {base['bits_131072_heldout']:.3f} / {row['bits_131072_heldout']:.3f} |")

    w("\n## KVQuant ablations (held-out)\n")
    w("| bits | kvquant K+V MSE | uniform grid K+V MSE | no Fisher: Fisher-weighted? | no outliers K+V MSE | "
      "Fisher non-uniform beats uniform | outliers beat none |")
    w("|---|---|---|---|---|---|---|")
    claims = []
    for bits in (2, 3, 4):
        base = summary.get(f"kvquant-{bits}bit")
        # calibrate names an ablation NAME-kvquant-Nbit, or NAME alone when it fits one width.
        ablation = lambda n: summary.get(f"{n}-kvquant-{bits}bit") or (
            summary[n] if n in summary and summary[n]["bits"] == bits else None)
        uni, nof, noo = ablation("uniform"), ablation("no-fisher"), ablation("no-outliers")
        if not (base and uni and nof and noo):
            continue
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
        json.dump({"command": a.command, "commit": a.commit, "machine": a.machine,
                   "protocol": {"model": a.model, "calibration_data": a.calib_data,
                                "calibration_windows": a.calib_windows, "heldout_data": a.heldout_data,
                                "heldout_windows": a.heldout_windows, "seq_len": a.seq_len,
                                "calibration_tokens": data["calibration_tokens"]},
                   "summary": summary,
                   "claims": [{"bits": b, "fisher_nonuniform_beats_uniform": u, "outliers_beat_none": o}
                              for b, u, o in claims]}, open(a.json_out, "w"), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
