#!/usr/bin/env python3
"""Compares two `kvforge eval --json` runs of the same probes, configuration by
configuration: the perplexity ratio and every needle probe's answer.

    scripts/compare_eval_runs.py A.json B.json [--ppl-tolerance 0.005] [--allow-margin X]

Made for `kvforge eval --through-kernels` (B) against the simulated cache (A)
on the same flags (issue 9: the two agree on every needle answer and within
0.5% perplexity), but any two runs of the same grid compare.

Configurations are matched by name, needle probes by (context, depth, probe)
(the JSON's needle_probes, schema 2; docs/evaluation-json.md). For each
configuration in both runs it prints the perplexity ratio B/A, the needle
answers that agree out of those matched, and each disagreeing probe with both
answers and both decision margins (the smallest top-1 minus runner-up logit
gap over the answer's steps).

Exit status 1 when a perplexity differs by more than --ppl-tolerance
(relative: |B/A - 1|), or a needle answer differs, unless both of its margins
are below --allow-margin (a near-tie that two float32 arithmetics may break
either way: reported, not failed; default 0: every disagreement fails).
Exit status 2 for input that cannot be compared (unreadable JSON, schema 1
without per-probe answers, a configuration or probe in only one run, a
perplexity in only one run), with one line naming the file and what was
expected. Standard library only.
"""

import argparse
import json
import math
import sys


class InputProblem(Exception):
    """Input that cannot be compared: one line, naming the file."""


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except OSError as error:
        raise InputProblem(f"{path}: cannot read: {error.strerror}")
    except json.JSONDecodeError as error:
        raise InputProblem(f"{path}: not JSON: {error.msg} at line {error.lineno}")
    if not isinstance(document, dict) or not isinstance(document.get("configurations"), list):
        raise InputProblem(f"{path}: configurations: a list (kvforge eval --json), missing")
    if document.get("schema", 0) < 2:
        raise InputProblem(f"{path}: schema: 2 or later (per-probe needle answers), got {document.get('schema')}")
    return document


def number(value):
    """JSON numbers, and the strings kvforge writes for non-finite ones."""
    if isinstance(value, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[value]
    return float(value)


def configurations_by_name(document, path):
    result = {}
    for i, configuration in enumerate(document["configurations"]):
        name = configuration.get("name")
        if not isinstance(name, str):
            raise InputProblem(f"{path}: configurations[{i}].name: a string, missing")
        result[name] = configuration
    return result


def probes_by_key(configuration, path):
    probes = {}
    for p in configuration.get("needle_probes", []):
        key = (p["context"], number(p["depth"]), p["probe"])
        if key in probes:
            raise InputProblem(f"{path}: {configuration['name']}: needle probe {format_key(key)} listed twice")
        probes[key] = p
    return probes


def format_key(key):
    context, depth, probe = key
    return f"context {context} depth {depth:g} probe {probe}"


def compare_configuration(name, a, b, paths, options, out):
    """Prints one configuration's comparison; returns the list of failures."""
    failures = []
    line = f"{name}:"
    pa, pb = a.get("perplexity"), b.get("perplexity")
    if (pa is None) != (pb is None):
        raise InputProblem(f"{paths[0] if pa is None else paths[1]}: {name}: perplexity: measured in the other run, "
                           "missing here")
    if pa is not None:
        x, y = number(pa["perplexity"]), number(pb["perplexity"])
        ratio = y / x if x != 0 else math.nan
        deviation = abs(ratio - 1)
        line += f" perplexity {x:.6g} vs {y:.6g} (ratio {ratio:.6f})"
        if not deviation <= options.ppl_tolerance:  # NaN fails too
            failures.append(f"{name}: perplexity ratio {ratio:.6f} differs by more than {options.ppl_tolerance:g}")
    probes_a, probes_b = probes_by_key(a, paths[0]), probes_by_key(b, paths[1])
    for key in probes_a.keys() ^ probes_b.keys():
        missing = paths[1] if key in probes_a else paths[0]
        raise InputProblem(f"{missing}: {name}: needle probe {format_key(key)}: in the other run, missing here "
                           "(run both with the same needle flags)")
    disagreements = []
    for key in sorted(probes_a):
        x, y = probes_a[key], probes_b[key]
        if x["expected"] != y["expected"]:
            raise InputProblem(f"{paths[1]}: {name}: needle probe {format_key(key)}: expected {y['expected']!r}, "
                               f"the other run's is {x['expected']!r} (different probes: same seed and template?)")
        if x["answer"] != y["answer"] or x["correct"] != y["correct"]:
            disagreements.append((key, x, y))
    agreeing = len(probes_a) - len(disagreements)
    if probes_a:
        line += f"; needles agree {agreeing}/{len(probes_a)}"
    print(line, file=out)
    for key, x, y in disagreements:
        ma, mb = number(x["margin"]), number(y["margin"])
        tie = ma < options.allow_margin and mb < options.allow_margin
        verdict = "near-tie (both margins below --allow-margin), not failed" if tie else "DISAGREE"
        print(f"  {format_key(key)}: expected {x['expected']!r}: A {x['answer']!r} "
              f"({'correct' if x['correct'] else 'wrong'}, margin {ma:.3g}) vs B {y['answer']!r} "
              f"({'correct' if y['correct'] else 'wrong'}, margin {mb:.3g}): {verdict}", file=out)
        if not tie:
            failures.append(f"{name}: needle {format_key(key)}: {x['answer']!r} vs {y['answer']!r}")
    return failures


def compare(paths, options, out):
    documents = [load(p) for p in paths]
    by_name = [configurations_by_name(d, p) for d, p in zip(documents, paths)]
    for i, other in ((0, 1), (1, 0)):
        for name in by_name[i].keys() - by_name[other].keys():
            raise InputProblem(f"{paths[other]}: configuration {name}: in {paths[i]}, missing here")
    print(f"A: {paths[0]} ({documents[0].get('device', '?')}: {documents[0].get('command_line', '')})", file=out)
    print(f"B: {paths[1]} ({documents[1].get('device', '?')}: {documents[1].get('command_line', '')})", file=out)
    failures = []
    for configuration in documents[0]["configurations"]:
        name = configuration["name"]
        failures += compare_configuration(name, configuration, by_name[1][name], paths, options, out)
    return failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="first kvforge eval --json (e.g. the simulated cache)")
    parser.add_argument("b", help="second kvforge eval --json (e.g. --through-kernels)")
    parser.add_argument("--ppl-tolerance", type=float, default=0.005,
                        help="largest |perplexity B/A - 1| that passes (default 0.005)")
    parser.add_argument("--allow-margin", type=float, default=0.0,
                        help="a needle disagreement whose two margins are both below this is reported, not failed "
                             "(default 0)")
    options = parser.parse_args(argv)
    try:
        failures = compare([options.a, options.b], options, sys.stdout)
    except InputProblem as problem:
        print(f"compare_eval_runs: {problem}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError) as error:
        print(f"compare_eval_runs: a field kvforge eval writes is missing or mistyped: {error!r}", file=sys.stderr)
        return 2
    if failures:
        print(f"FAILED: {len(failures)} difference(s): " + "; ".join(failures))
        return 1
    print("agree: every perplexity within tolerance, every needle answer the same")
    return 0


if __name__ == "__main__":
    sys.exit(main())
