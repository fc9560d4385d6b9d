#!/usr/bin/env python3
"""Independent reader of a kvforge calibration artifact, written from
docs/artifact.md alone (it shares no code with formats/).

usage: check_artifact.py FILE

Checks every required attribute, group and dataset (names, types, shapes,
conditional presence) and every validation rule of the page, then prints one
JSON object:
  {"schema_version": 1, "num_layers": L, "sources": K, "calibration_tokens": T,
   "configs": [name, ...],                       # in /configs@names order
   "methods": {name: method}, "bits": {name: bits},
   "grid_sums": {name: {"keys": [sum per layer] | null, "values": ...}},
   "channel_scale_sums": {name: {"keys": [sum per layer] | null, "values": ...}},
   "effective_bits": {name: [[context, bits], ...]}}
where sums are float64 sums of the float32 values.
On the first violation it prints "FILE: OBJECT: problem" to stderr and exits 1.
"""
import json
import math
import re
import sys

import h5py
import numpy as np

SCHEMA = "kvforge.artifact"
VERSION = 1
TOLERANCE = 1e-4
METHODS = ["kvquant", "kivi", "int2-rot", "rtn"]
GROUPINGS = ["per_token", "per_channel_tokens", "per_channel_offline"]
KINDS = ["keys", "values"]

MODEL_STRINGS = ["architecture", "rope", "kvo_sha256", "tokenizer_sha256"]
MODEL_INTS = ["num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size"]
SOURCE_STRINGS = ["data_file", "data_sha256", "compute_dtype", "device", "tool_version", "command_line"]
SOURCE_INT64 = ["data_tokens", "samples", "seq_len"]
STATS = ["key_relative_mse", "value_relative_mse", "key_outlier_fraction", "value_outlier_fraction",
         "logit_relative_mse"]
TENSOR_DATASETS = ["grid", "channel_scale", "channel_offset", "outlier_low", "outlier_high"]


class Violation(Exception):
    pass


def fail(where, problem):
    raise Violation(f"{where}: {problem}")


def attribute(obj, name, where):
    if name not in obj.attrs:
        fail(f"{where}@{name}", "missing")
    return obj.attrs.get_id(name).dtype, obj.attrs[name]


def string_attr(obj, name, where):
    dtype, value = attribute(obj, name, where)
    if h5py.check_string_dtype(dtype) is None or not isinstance(value, str):
        fail(f"{where}@{name}", f"expected a UTF-8 string, got {dtype}")
    return value


def int_attr(obj, name, where, dtype="<i8"):
    stored, value = attribute(obj, name, where)
    if stored != np.dtype(dtype) or np.ndim(value) != 0:
        fail(f"{where}@{name}", f"expected a scalar {np.dtype(dtype)}, got {stored}")
    return int(value)


def bool_attr(obj, name, where):
    value = int_attr(obj, name, where, "u1")
    if value not in (0, 1):
        fail(f"{where}@{name}", f"expected 0 or 1, got {value}")
    return value == 1


def float_attr(obj, name, where, dtype):
    stored, value = attribute(obj, name, where)
    if stored != np.dtype(dtype) or np.ndim(value) != 0:
        fail(f"{where}@{name}", f"expected a scalar {np.dtype(dtype)}, got {stored}")
    if not math.isfinite(float(value)):
        fail(f"{where}@{name}", f"expected a finite value, got {value}")
    return float(value)


def group(parent, name, where):
    if name not in parent or not isinstance(parent[name], h5py.Group):
        fail(where, "missing group")
    return parent[name]


def exact_children(grp, count, where):
    """grp holds exactly the groups "0" .. str(count - 1)."""
    want = {str(i) for i in range(count)}
    if set(grp.keys()) != want:
        fail(where, f"expected exactly the groups 0..{count - 1}, got {sorted(grp.keys())}")


def float32_dataset(grp, name, where, shape):
    if name not in grp or not isinstance(grp[name], h5py.Dataset):
        fail(where, "missing dataset")
    ds = grp[name]
    if ds.dtype != np.dtype("<f4"):
        fail(where, f"expected float32, got {ds.dtype}")
    if ds.shape != tuple(shape):
        fail(where, f"expected shape {tuple(shape)}, got {ds.shape}")
    values = ds[()]
    bad = np.argwhere(~np.isfinite(values))
    if len(bad):
        fail(where, f"expected finite values, element {bad[0].tolist()} is {values[tuple(bad[0])]}")
    return values


def check_model(f):
    g = group(f, "model", "/model")
    model = {name: string_attr(g, name, "/model") for name in MODEL_STRINGS}
    model.update({name: int_attr(g, name, "/model") for name in MODEL_INTS})
    for name in MODEL_INTS:
        if model[name] <= 0:
            fail(f"/model@{name}", "expected a positive integer")
    if model["num_heads"] % model["num_kv_heads"]:
        fail("/model@num_kv_heads", "expected a divisor of num_heads")
    return model


def check_calibration(f):
    g = group(f, "calibration", "/calibration")
    tokens = int_attr(g, "calibration_tokens", "/calibration")
    if tokens <= 0:
        fail("/calibration@calibration_tokens", "expected > 0")
    string_attr(g, "store_file", "/calibration")
    sources = group(g, "sources", "/calibration/sources")
    count = len(sources)
    if count < 1:
        fail("/calibration/sources", "expected at least one source")
    exact_children(sources, count, "/calibration/sources")
    for k in range(count):
        where = f"/calibration/sources/{k}"
        s = group(sources, str(k), where)
        for name in SOURCE_STRINGS:
            string_attr(s, name, where)
        values = {name: int_attr(s, name, where) for name in SOURCE_INT64}
        int_attr(s, "seed", where, "<u8")
        bool_attr(s, "bos", where)
        if values["data_tokens"] < 0:
            fail(f"{where}@data_tokens", "expected >= 0")
        for name in ("samples", "seq_len"):
            if values[name] <= 0:
                fail(f"{where}@{name}", "expected > 0")
    return tokens, count


def check_settings(c, where, head_dim):
    s = {}
    s["method"] = string_attr(c, "method", where)
    if s["method"] not in METHODS:
        fail(f"{where}@method", f"expected one of {METHODS}, got {s['method']!r}")
    s["bits"] = int_attr(c, "bits", where)
    if s["bits"] not in (2, 3, 4):
        fail(f"{where}@bits", f"expected 2, 3 or 4, got {s['bits']}")
    for name in ("keys_pre_rope", "fisher_weighted", "q_norm"):
        s[name] = bool_attr(c, name, where)
    for name in ("sink_tokens", "residual_tokens"):
        s[name] = int_attr(c, name, where)
        if s[name] < 0:
            fail(f"{where}@{name}", "expected >= 0")
    for kind in KINDS:
        grouping = string_attr(c, f"{kind}_grouping", where)
        if grouping not in GROUPINGS:
            fail(f"{where}@{kind}_grouping", f"expected one of {GROUPINGS}, got {grouping!r}")
        size = int_attr(c, f"{kind}_group", where)
        if size < (0 if grouping == "per_channel_offline" else 1):
            fail(f"{where}@{kind}_group", f"out of range for {grouping}: {size}")
        if grouping == "per_token" and size < head_dim and head_dim % size:
            fail(f"{where}@{kind}_group", f"expected a divisor of head_dim ({head_dim}) or >= head_dim, got {size}")
        fraction = float_attr(c, f"{kind}_outlier_fraction", where, "<f8")
        if not 0 <= fraction < 1:
            fail(f"{where}@{kind}_outlier_fraction", f"expected a fraction in [0, 1), got {fraction}")
        s[kind] = {"grouping": grouping, "group": size,
                   "non_uniform": bool_attr(c, f"{kind}_non_uniform", where), "outlier_fraction": fraction}
    return s


def check_effective_bits(c, where):
    if "effective_bits" not in c or not isinstance(c["effective_bits"], h5py.Dataset):
        fail(where, "missing dataset")
    ds = c["effective_bits"]
    if ds.dtype != np.dtype("<f8"):
        fail(where, f"expected float64, got {ds.dtype}")
    if ds.ndim != 2 or ds.shape[0] < 1 or ds.shape[1] != 2:
        fail(where, f"expected shape [n, 2] with n >= 1, got {ds.shape}")
    rows = ds[()]
    previous = 0
    for j, (context, bits) in enumerate(rows):
        if not (math.isfinite(context) and context == math.floor(context) and context > previous):
            fail(where, f"row {j}: expected a positive integer context above the previous row's, got {context}")
        if not (math.isfinite(bits) and bits > 0):
            fail(where, f"row {j}: expected finite positive bits, got {bits}")
        previous = context
    return [[int(context), float(bits)] for context, bits in rows]


def check_tensor(t, where, kind, settings, model):
    """Returns (grid, channel_scale): arrays or None."""
    s = settings[kind]
    heads = (model["num_kv_heads"], model["head_dim"])
    offline = s["grouping"] == "per_channel_offline"
    present = {
        "grid": s["non_uniform"],
        "channel_scale": offline,
        "channel_offset": offline,
        "outlier_low": offline and s["outlier_fraction"] > 0,
        "outlier_high": offline and s["outlier_fraction"] > 0,
    }
    for name in TENSOR_DATASETS:
        if not present[name] and name in t:
            fail(f"{where}/{name}", "expected none under these settings")
    clip = float_attr(t, "clip_ratio", where, "<f4")
    if not 0 < clip <= 1:
        fail(f"{where}@clip_ratio", f"expected a ratio in (0, 1], got {clip}")
    if offline and clip != 1:
        fail(f"{where}@clip_ratio", f"expected 1 for per_channel_offline, got {clip}")
    tau = float_attr(t, "outlier_tau", where, "<f4")
    if not offline and s["outlier_fraction"] > 0:
        if not tau > 0:
            fail(f"{where}@outlier_tau", f"expected > 0 for runtime groupings with outliers, got {tau}")
    elif tau != 0:
        fail(f"{where}@outlier_tau", f"expected 0 where unused, got {tau}")

    grid = None
    if present["grid"]:
        levels = 2 ** settings["bits"]
        grid = float32_dataset(t, "grid", f"{where}/grid", (levels,))
        steps = np.diff(grid.astype(np.float64))
        if np.any(steps <= 0):
            fail(f"{where}/grid", f"expected strictly ascending levels, got {grid.tolist()}")
    scale = None
    if offline:
        scale = float32_dataset(t, "channel_scale", f"{where}/channel_scale", heads)
        offset = float32_dataset(t, "channel_offset", f"{where}/channel_offset", heads)
        if np.any(scale <= 0):
            fail(f"{where}/channel_scale", f"expected values > 0, element {np.argwhere(scale <= 0)[0].tolist()}")
        if np.all(scale == 1.0):
            fail(f"{where}/channel_scale", "expected fitted scales, got 1.0 everywhere")
    if present["outlier_low"]:
        low = float32_dataset(t, "outlier_low", f"{where}/outlier_low", heads).astype(np.float64)
        high = float32_dataset(t, "outlier_high", f"{where}/outlier_high", heads).astype(np.float64)
        if np.any(low > high):
            fail(f"{where}/outlier_low", f"expected low <= high, element {np.argwhere(low > high)[0].tolist()}")
        if offline:
            s64, o64 = scale.astype(np.float64), offset.astype(np.float64)
            if np.any((low - o64) / s64 < -1 - TOLERANCE):
                fail(f"{where}/outlier_low", "expected (low - offset) / scale >= -1")
            if np.any((high - o64) / s64 > 1 + TOLERANCE):
                fail(f"{where}/outlier_high", "expected (high - offset) / scale <= 1")
    return grid, scale


def check_config(c, where, model):
    settings = check_settings(c, where, model["head_dim"])
    effective_bits = check_effective_bits(c, f"{where}/effective_bits")
    layers = group(c, "layers", f"{where}/layers")
    exact_children(layers, model["num_layers"], f"{where}/layers")
    grids = {kind: [] for kind in KINDS}
    scales = {kind: [] for kind in KINDS}
    for i in range(model["num_layers"]):
        lw = f"{where}/layers/{i}"
        layer = group(layers, str(i), lw)
        for name in STATS:
            value = float_attr(layer, name, lw, "<f8")
            if value < 0 or (name.endswith("outlier_fraction") and value > 1):
                fail(f"{lw}@{name}", f"out of range: {value}")
        for kind in KINDS:
            grid, scale = check_tensor(group(layer, kind, f"{lw}/{kind}"), f"{lw}/{kind}", kind, settings, model)
            grids[kind].append(grid)
            scales[kind].append(scale)
    for kind in KINDS:
        layer_scales = scales[kind]
        if layer_scales[0] is None:
            continue
        for b in range(1, len(layer_scales)):
            for a in range(b):
                if np.array_equal(layer_scales[a], layer_scales[b]):
                    fail(f"{where}/layers/{b}/{kind}/channel_scale", f"identical to layer {a}'s")

    def sums(arrays):
        return None if arrays[0] is None else [float(x.astype(np.float64).sum()) for x in arrays]

    return settings, effective_bits, {k: sums(grids[k]) for k in KINDS}, {k: sums(scales[k]) for k in KINDS}


def check(path):
    with h5py.File(path, "r") as f:
        if string_attr(f, "schema", "/") != SCHEMA:
            fail("/@schema", f"expected {SCHEMA}")
        version = int_attr(f, "schema_version", "/")
        if version != VERSION:
            fail("/@schema_version", f"expected {VERSION}, got {version}")
        if not string_attr(f, "tool_version", "/"):
            fail("/@tool_version", "expected a version")
        if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", string_attr(f, "created_utc", "/")):
            fail("/@created_utc", "expected YYYY-MM-DDTHH:MM:SSZ")
        string_attr(f, "command_line", "/")
        model = check_model(f)
        calibration_tokens, sources = check_calibration(f)

        configs = group(f, "configs", "/configs")
        dtype, names = attribute(configs, "names", "/configs")
        if h5py.check_string_dtype(dtype) is None or np.ndim(names) != 1:
            fail("/configs@names", "expected a 1-D list of strings")
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
        if not names or len(set(names)) != len(names):
            fail("/configs@names", f"expected unique names, at least one, got {names}")
        for name in names:
            if name in ("", ".", "..") or "/" in name:
                fail("/configs@names", f"invalid name {name!r}")
        if set(configs.keys()) != set(names):
            fail("/configs", f"expected exactly the groups {names}, got {sorted(configs.keys())}")

        report = {"schema_version": version, "num_layers": model["num_layers"], "sources": sources,
                  "calibration_tokens": calibration_tokens, "configs": names, "methods": {}, "bits": {},
                  "grid_sums": {}, "channel_scale_sums": {}, "effective_bits": {}}
        for name in names:
            settings, effective_bits, grid_sums, scale_sums = check_config(configs[name], f"/configs/{name}", model)
            report["methods"][name] = settings["method"]
            report["bits"][name] = settings["bits"]
            report["grid_sums"][name] = grid_sums
            report["channel_scale_sums"][name] = scale_sums
            report["effective_bits"][name] = effective_bits
        return report


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        report = check(sys.argv[1])
    except Violation as violation:
        print(f"{sys.argv[1]}: {violation}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
