#!/usr/bin/env python3
"""Independent reader of a kvforge calibration artifact, written from
docs/artifact.md alone (it shares no code with formats/).

usage: check_artifact.py FILE

Reads schema versions 3, 2 and 1 (a version 1 file's settings are mapped onto
version 2 values as the page's "Reading version 1 files" says; versions 1 and
2 have no rotations). Checks every required attribute, group and dataset
(names, types, shapes, conditional presence) and every validation rule of the
page, then prints one JSON object:
  {"schema_version": 1 | 2 | 3, "num_layers": L, "sources": K, "calibration_tokens": T,
   "configs": [name, ...],                       # in /configs@names order
   "settings": {name: {"method", "bits", "keys_pre_rope", "fisher_weighted", "sink_tokens",
                       "residual_tokens",
                       "keys": {"grouping", "group", "non_uniform", "outlier_fraction",
                                "outlier_rule", "residual_rule", "q_norm"},
                       "values": {...}}},    # version 2 values, also for version 1 files
   "layers": {name: [{"keys": {"clip_ratio", "outlier_tau",
                               "datasets": {dataset: null | {"checksum": c, "elements": [[i, v], ...]}}},
                      "values": {...}}, ...]},   # one per layer
   "effective_bits": {name: [[context, bits], ...]},
   "rotation": {name: null | {"settings": {"keys_form", "values_form", "keys_basis", "values_basis",
                                           "key_centred", "folded", "gradient", "key_kl_weight",
                                           "key_output_weight", "value_output_weight", "learning_rate",
                                           "steps", "last_queries", "fit_samples", "validation_samples"},
                              "layers": [{"keys": null | {"matrix", "angles", "centre": null | fingerprint,
                                                          "basis": [name per head], "learned": [0 | 1 per head],
                                                          "orthogonality": max over heads of ||R^T R - I||_F},
                                          "values": ..., "loss": null | {loss dataset: fingerprint}}, ...]}}}
(rotation: null for an unrotated configuration, "orthogonality" null for pair
angles.) For every float dataset of a tensor group or a rotation group (grid, encode_grid, channel_scale,
channel_offset, outlier_low, outlier_high; null when absent), "checksum" is
the position-weighted float64 sum of v[i] * (1 + i) over the flat row-major
index i, and "elements" are [i, v[i]] at i = 0, 1, n // 2 and n - 1 (each
once, ascending): a permutation of heads, channels or levels changes them.
On the first violation it prints "FILE: OBJECT: problem" to stderr and exits 1.
"""
import json
import math
import re
import sys

import h5py
import numpy as np

SCHEMA = "kvforge.artifact"
VERSIONS = [1, 2, 3]
FIRST_ROTATION_VERSION = 3
FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24
TOLERANCE = 1e-4
METHODS = ["kvquant", "kivi", "int2-rot", "rtn"]
GROUPINGS = {1: ["per_token", "per_channel_tokens", "per_channel_offline"],
             2: ["per_token", "per_channel_tokens", "per_channel_offline", "per_token_all_heads"],
             3: ["per_token", "per_channel_tokens", "per_channel_offline", "per_token_all_heads"]}
OUTLIER_RULES = ["none", "channel_thresholds", "token_top_bottom", "token_tau"]
RESIDUAL_RULES = ["sliding", "block_flush"]
Q_NORMS = ["none", "affine", "iterated"]
KINDS = ["keys", "values"]

MODEL_STRINGS = ["architecture", "rope", "kvo_sha256", "tokenizer_sha256"]
MODEL_INTS = ["num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size"]
SOURCE_STRINGS = ["data_file", "data_sha256", "compute_dtype", "device", "tool_version", "command_line"]
SOURCE_INT64 = ["data_tokens", "samples", "seq_len"]
STATS = ["key_relative_mse", "value_relative_mse", "key_outlier_fraction", "value_outlier_fraction",
         "logit_relative_mse"]
TENSOR_DATASETS = ["grid", "encode_grid", "channel_scale", "channel_offset", "outlier_low", "outlier_high"]
ROTATION_FORMS = ["none", "matrix", "pair_angles"]
BASES = ["identity", "hadamard", "eigen", "random"]
GRADIENTS = ["straight_through", "smoothed"]
ROTATION_FLOATS = ["key_kl_weight", "key_output_weight", "value_output_weight", "learning_rate"]
ROTATION_COUNTS = {"steps": 0, "last_queries": 1, "fit_samples": 0, "validation_samples": 0}  # name: least value
LOSSES = ["loss_key_base", "loss_key_learned", "loss_value_base", "loss_value_learned"]
ROTATION_DATASETS = ["matrix", "angles", "centre"]


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


def choice_attr(obj, name, where, choices):
    value = string_attr(obj, name, where)
    if value not in choices:
        fail(f"{where}@{name}", f"expected one of {choices}, got {value!r}")
    return value


def version_1_rules(t, q_norm):
    """Version 2 values of a version 1 file's tensor settings (the page's mapping table)."""
    if t["outlier_fraction"] == 0:
        t["outlier_rule"] = "none"
    elif t["grouping"] == "per_channel_offline":
        t["outlier_rule"] = "channel_thresholds"
    else:
        t["outlier_rule"] = "token_tau"
    t["residual_rule"] = "sliding"
    t["q_norm"] = "iterated" if q_norm and t["non_uniform"] else "none"


def check_tensor_settings(t, at, residual_tokens):
    """The per-tensor rules of the page's Validation; at(name) names the attribute."""
    grouping, size, fraction, rule = t["grouping"], t["group"], t["outlier_fraction"], t["outlier_rule"]
    runtime = grouping != "per_channel_offline"
    if fraction == 0 and rule != "none":
        fail(at("outlier_rule"), f"expected none without outliers, got {rule}")
    if fraction > 0:
        allowed = {"per_channel_offline": ["channel_thresholds"],
                   "per_token_all_heads": ["token_top_bottom"]}.get(grouping, ["token_top_bottom", "token_tau"])
        if rule not in allowed:
            fail(at("outlier_rule"), f"expected one of {allowed} for {grouping} with outliers, got {rule}")
    if rule in ("token_top_bottom", "token_tau") and not runtime:
        fail(at("outlier_rule"), f"{rule} is for runtime groupings")
    if t["residual_rule"] == "block_flush":
        if residual_tokens <= 0:
            fail(at("residual_rule"), "block_flush needs residual_tokens > 0")
        if grouping == "per_channel_tokens" and residual_tokens % size:
            fail(at("residual_rule"), f"block_flush needs residual_tokens a multiple of the group ({size})")
    if t["q_norm"] != "none" and not t["non_uniform"]:
        fail(at("q_norm"), f"expected none for uniform levels, got {t['q_norm']}")


def check_settings(c, where, head_dim, version):
    s = {}
    s["method"] = choice_attr(c, "method", where, METHODS)
    s["bits"] = int_attr(c, "bits", where)
    if s["bits"] not in (2, 3, 4):
        fail(f"{where}@bits", f"expected 2, 3 or 4, got {s['bits']}")
    for name in ("keys_pre_rope", "fisher_weighted"):
        s[name] = bool_attr(c, name, where)
    version_1_q_norm = bool_attr(c, "q_norm", where) if version == 1 else None
    for name in ("sink_tokens", "residual_tokens"):
        s[name] = int_attr(c, name, where)
        if s[name] < 0:
            fail(f"{where}@{name}", "expected >= 0")
    for kind in KINDS:
        def at(name):
            return f"{where}@{kind}_{name}"
        grouping = choice_attr(c, f"{kind}_grouping", where, GROUPINGS[version])
        size = int_attr(c, f"{kind}_group", where)
        if grouping == "per_token_all_heads":
            if size != 0:
                fail(at("group"), f"expected 0 (unused) for per_token_all_heads, got {size}")
        elif size < (0 if grouping == "per_channel_offline" else 1):
            fail(at("group"), f"out of range for {grouping}: {size}")
        if grouping == "per_token" and size < head_dim and head_dim % size:
            fail(at("group"), f"expected a divisor of head_dim ({head_dim}) or >= head_dim, got {size}")
        fraction = float_attr(c, f"{kind}_outlier_fraction", where, "<f8")
        if not 0 <= fraction < 1:
            fail(at("outlier_fraction"), f"expected a fraction in [0, 1), got {fraction}")
        t = {"grouping": grouping, "group": size,
             "non_uniform": bool_attr(c, f"{kind}_non_uniform", where), "outlier_fraction": fraction}
        if version == 1:
            version_1_rules(t, version_1_q_norm)
        else:
            t["outlier_rule"] = choice_attr(c, f"{kind}_outlier_rule", where, OUTLIER_RULES)
            t["residual_rule"] = choice_attr(c, f"{kind}_residual_rule", where, RESIDUAL_RULES)
            t["q_norm"] = choice_attr(c, f"{kind}_q_norm", where, Q_NORMS)
        check_tensor_settings(t, at, s["residual_tokens"])
        s[kind] = t
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


def levels_dataset(t, name, where, bits):
    levels = float32_dataset(t, name, where, (2 ** bits,))
    if np.any(np.diff(levels.astype(np.float64)) <= 0):
        fail(where, f"expected strictly ascending levels, got {levels.tolist()}")
    return levels


def check_tensor(t, where, kind, settings, model, version):
    """Returns {dataset name: array or None} for TENSOR_DATASETS."""
    s = settings[kind]
    heads = (model["num_kv_heads"], model["head_dim"])
    offline = s["grouping"] == "per_channel_offline"
    thresholds = s["outlier_rule"] == "channel_thresholds"
    present = {
        "grid": s["non_uniform"],
        "encode_grid": s["q_norm"] == "affine",
        "channel_scale": offline,
        "channel_offset": offline,
        "outlier_low": thresholds,
        "outlier_high": thresholds,
    }
    for name in TENSOR_DATASETS:
        if version == 1 and name == "encode_grid":
            continue  # unknown to version 1: ignored
        if not present[name] and name in t:
            fail(f"{where}/{name}", "expected none under these settings")
    clip = float_attr(t, "clip_ratio", where, "<f4")
    if not 0 < clip <= 1:
        fail(f"{where}@clip_ratio", f"expected a ratio in (0, 1], got {clip}")
    if offline and clip != 1:
        fail(f"{where}@clip_ratio", f"expected 1 for per_channel_offline, got {clip}")
    tau = float_attr(t, "outlier_tau", where, "<f4")
    if s["outlier_rule"] == "token_tau":
        if not tau > 0:
            fail(f"{where}@outlier_tau", f"expected > 0 for token_tau, got {tau}")
    elif tau != 0:
        fail(f"{where}@outlier_tau", f"expected 0 where unused, got {tau}")

    arrays = {name: None for name in TENSOR_DATASETS}
    for name in ("grid", "encode_grid"):
        if present[name]:
            arrays[name] = levels_dataset(t, name, f"{where}/{name}", settings["bits"])
    if offline:
        scale = float32_dataset(t, "channel_scale", f"{where}/channel_scale", heads)
        offset = float32_dataset(t, "channel_offset", f"{where}/channel_offset", heads)
        if np.any(scale <= 0):
            fail(f"{where}/channel_scale", f"expected values > 0, element {np.argwhere(scale <= 0)[0].tolist()}")
        if np.all(scale == 1.0):
            fail(f"{where}/channel_scale", "expected fitted scales, got 1.0 everywhere")
        arrays["channel_scale"], arrays["channel_offset"] = scale, offset
    if thresholds:
        low = float32_dataset(t, "outlier_low", f"{where}/outlier_low", heads)
        high = float32_dataset(t, "outlier_high", f"{where}/outlier_high", heads)
        low64, high64 = low.astype(np.float64), high.astype(np.float64)
        if np.any(low64 > high64):
            fail(f"{where}/outlier_low", f"expected low <= high, element {np.argwhere(low64 > high64)[0].tolist()}")
        s64, o64 = arrays["channel_scale"].astype(np.float64), arrays["channel_offset"].astype(np.float64)
        if np.any((low64 - o64) / s64 < -1 - TOLERANCE):
            fail(f"{where}/outlier_low", "expected (low - offset) / scale >= -1")
        if np.any((high64 - o64) / s64 > 1 + TOLERANCE):
            fail(f"{where}/outlier_high", "expected (high - offset) / scale <= 1")
        arrays["outlier_low"], arrays["outlier_high"] = low, high
    return {"clip_ratio": clip, "outlier_tau": tau, "arrays": arrays}


def fingerprint(array):
    """Position-weighted checksum and a few indexed elements of an array (null when absent)."""
    if array is None:
        return None
    flat = array.astype(np.float64).ravel()
    n = flat.size
    indices = sorted({i for i in (0, 1, n // 2, n - 1) if 0 <= i < n})
    return {"checksum": float(np.sum(flat * np.arange(1, n + 1, dtype=np.float64))),
            "elements": [[i, float(flat[i])] for i in indices]}


def orthogonality_tolerance(head_dim):
    """The page's bound for float32-stored orthogonal matrices: twice (2u + u^2) D."""
    u = FLOAT32_UNIT_ROUNDOFF
    return 2 * (2 * u + u * u) * head_dim


def check_rotation_settings(r, where, settings, model):
    s = {}
    for kind in KINDS:
        s[f"{kind}_form"] = choice_attr(r, f"{kind}_form", where, ROTATION_FORMS)
        s[f"{kind}_basis"] = choice_attr(r, f"{kind}_basis", where, BASES)
    s["key_centred"] = bool_attr(r, "key_centred", where)
    s["folded"] = bool_attr(r, "folded", where)
    s["gradient"] = choice_attr(r, "gradient", where, GRADIENTS)
    for name in ROTATION_FLOATS:
        s[name] = float_attr(r, name, where, "<f8")
        if s[name] < 0:
            fail(f"{where}@{name}", f"expected >= 0, got {s[name]}")
    for name, least in ROTATION_COUNTS.items():
        s[name] = int_attr(r, name, where)
        if s[name] < least:
            fail(f"{where}@{name}", f"expected >= {least}, got {s[name]}")
    if s["keys_form"] == "none" and s["values_form"] == "none":
        fail(f"{where}@keys_form", "expected keys_form or values_form other than none")
    if s["values_form"] == "pair_angles":
        fail(f"{where}@values_form", "expected none or matrix for values")
    if s["keys_form"] == "matrix" and settings["keys_pre_rope"]:
        fail(f"{where}@keys_form", "a matrix does not commute with RoPE: not for pre-RoPE keys")
    if s["keys_form"] == "pair_angles" and model["head_dim"] % 2:
        fail(f"{where}@keys_form", "pair_angles needs an even head_dim")
    if s["key_centred"] and s["keys_form"] != "matrix":
        fail(f"{where}@key_centred", "a centre belongs to matrix keys")
    if s["folded"] and s["keys_form"] == "matrix":
        fail(f"{where}@folded", "post-RoPE matrix keys cannot be folded")
    return s


def float64_vector(grp, name, where, length):
    if name not in grp or not isinstance(grp[name], h5py.Dataset):
        fail(where, "missing dataset")
    ds = grp[name]
    if ds.dtype != np.dtype("<f8"):
        fail(where, f"expected float64, got {ds.dtype}")
    if ds.shape != (length,):
        fail(where, f"expected shape ({length},), got {ds.shape}")
    values = ds[()]
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        fail(where, f"expected finite values >= 0, got {values.tolist()}")
    return values


def check_tensor_rotation(t, where, kind, form, rotation, model):
    heads, d = model["num_kv_heads"], model["head_dim"]
    centred = kind == "keys" and rotation["key_centred"]
    present = {"matrix": form == "matrix", "angles": form == "pair_angles", "centre": centred}
    for name in ROTATION_DATASETS:
        if not present[name] and name in t:
            fail(f"{where}/{name}", "expected none under these settings")
    arrays = {name: None for name in ROTATION_DATASETS}
    orthogonality = None
    if form == "matrix":
        matrix = float32_dataset(t, "matrix", f"{where}/matrix", (heads, d, d)).astype(np.float64)
        errors = [float(np.linalg.norm(m.T @ m - np.eye(d))) for m in matrix]
        orthogonality = max(errors)
        if orthogonality > orthogonality_tolerance(d):
            fail(f"{where}/matrix", f"expected orthogonal matrices, ||R^T R - I||_F = {orthogonality}")
        arrays["matrix"] = matrix
    if form == "pair_angles":
        arrays["angles"] = float32_dataset(t, "angles", f"{where}/angles", (heads, d // 2))
    if centred:
        arrays["centre"] = float32_dataset(t, "centre", f"{where}/centre", (heads, d))
    dtype, basis = attribute(t, "basis", where)
    if h5py.check_string_dtype(dtype) is None or np.ndim(basis) != 1 or len(basis) != heads:
        fail(f"{where}@basis", f"expected {heads} names (one per KV head), got {basis!r}")
    basis = [b.decode() if isinstance(b, bytes) else str(b) for b in basis]
    for b in basis:
        if b not in BASES:
            fail(f"{where}@basis", f"expected one of {BASES}, got {b!r}")
    if "learned" not in t or not isinstance(t["learned"], h5py.Dataset):
        fail(f"{where}/learned", "missing dataset")
    learned = t["learned"]
    if learned.dtype != np.dtype("u1") or learned.shape != (heads,):
        fail(f"{where}/learned", f"expected uint8 [{heads}], got {learned.dtype} {learned.shape}")
    learned = [int(v) for v in learned[()]]
    if any(v not in (0, 1) for v in learned):
        fail(f"{where}/learned", f"expected 0 or 1, got {learned}")
    if rotation["steps"] == 0 and any(learned):
        fail(f"{where}/learned", "expected 0 for every head when steps is 0")
    report = {name: fingerprint(arrays[name]) for name in ROTATION_DATASETS}
    report.update({"basis": basis, "learned": learned, "orthogonality": orthogonality})
    return report


def check_layer_rotation(layer, where, rotation, model):
    if "rotation" not in layer:
        fail(f"{where}/rotation", "missing group")
    r = group(layer, "rotation", f"{where}/rotation")
    report = {}
    for kind in KINDS:
        tw = f"{where}/rotation/{kind}"
        form = rotation[f"{kind}_form"]
        if form == "none":
            if kind in r:
                fail(tw, "expected none when the form is none")
            report[kind] = None
        else:
            report[kind] = check_tensor_rotation(group(r, kind, tw), tw, kind, form, rotation, model)
    if any(name in r for name in LOSSES):
        report["loss"] = {name: fingerprint(float64_vector(r, name, f"{where}/rotation/{name}",
                                                           model["num_kv_heads"])) for name in LOSSES}
    else:
        report["loss"] = None
    return report


def check_config(c, where, model, version):
    settings = check_settings(c, where, model["head_dim"], version)
    effective_bits = check_effective_bits(c, f"{where}/effective_bits")
    rotation = None  # a "rotation" group in a version 1 or 2 file is unknown there: ignored
    if version >= FIRST_ROTATION_VERSION and "rotation" in c:
        rotation = check_rotation_settings(group(c, "rotation", f"{where}/rotation"), f"{where}/rotation", settings,
                                           model)
    layers = group(c, "layers", f"{where}/layers")
    exact_children(layers, model["num_layers"], f"{where}/layers")
    tensors = []
    rotation_layers = []
    for i in range(model["num_layers"]):
        lw = f"{where}/layers/{i}"
        layer = group(layers, str(i), lw)
        for name in STATS:
            value = float_attr(layer, name, lw, "<f8")
            if value < 0 or (name.endswith("outlier_fraction") and value > 1):
                fail(f"{lw}@{name}", f"out of range: {value}")
        tensors.append({kind: check_tensor(group(layer, kind, f"{lw}/{kind}"), f"{lw}/{kind}", kind, settings,
                                           model, version) for kind in KINDS})
        if rotation is not None:
            rotation_layers.append(check_layer_rotation(layer, lw, rotation, model))
        elif version >= FIRST_ROTATION_VERSION and "rotation" in layer:
            fail(f"{lw}/rotation", "expected none: the configuration has no rotation")
    for kind in KINDS:
        layer_scales = [tensor[kind]["arrays"]["channel_scale"] for tensor in tensors]
        if layer_scales[0] is None:
            continue
        for b in range(1, len(layer_scales)):
            for a in range(b):
                if np.array_equal(layer_scales[a], layer_scales[b]):
                    fail(f"{where}/layers/{b}/{kind}/channel_scale", f"identical to layer {a}'s")
    report = [{kind: {"clip_ratio": tensor[kind]["clip_ratio"], "outlier_tau": tensor[kind]["outlier_tau"],
                      "datasets": {name: fingerprint(tensor[kind]["arrays"][name]) for name in TENSOR_DATASETS}}
               for kind in KINDS} for tensor in tensors]
    rotation_report = None if rotation is None else {"settings": rotation, "layers": rotation_layers}
    return settings, effective_bits, report, rotation_report


def check(path):
    with h5py.File(path, "r") as f:
        if string_attr(f, "schema", "/") != SCHEMA:
            fail("/@schema", f"expected {SCHEMA}")
        version = int_attr(f, "schema_version", "/")
        if version not in VERSIONS:
            fail("/@schema_version", f"expected one of {VERSIONS}, got {version}")
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
                  "calibration_tokens": calibration_tokens, "configs": names, "settings": {}, "layers": {},
                  "effective_bits": {}, "rotation": {}}
        for name in names:
            settings, effective_bits, layers, rotation = check_config(configs[name], f"/configs/{name}", model,
                                                                      version)
            report["rotation"][name] = rotation
            report["settings"][name] = settings
            report["layers"][name] = layers
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
