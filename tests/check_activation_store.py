#!/usr/bin/env python3
"""Independent reader of a kvforge activation store, written from
docs/activation-store.md alone (it shares no code with formats/).

usage: check_activation_store.py FILE

Checks every required attribute, group and dataset (names, types, shapes,
chunks, filters) and prints one JSON object:
  {"samples_complete": N, "sources": K,
   "sums": {"tokens": S, "stream_start": S, "layers/0/q": S, ...},
   "weighted_sums": {"tokens": W, ...}}
where each sum is the float64 sum of the dataset over the committed samples
and each weighted sum is sum_i weight(i) * x_i over the same values, i the
row-major index in the dataset ([sample, head, token, channel]), with
weight(i) = ((i * 2654435761) mod 2^32 + 1) / 2^32: distinct for every i
below 2^32 (the multiplier is odd), so that values in the wrong sample,
head, token or channel change it, which a plain sum would not notice.
On the first violation it prints "FILE: OBJECT: problem" to stderr and exits 1.
Memory stays at one sample of one dataset.
"""
import json
import re
import sys

import h5py
import numpy as np

SCHEMA = "kvforge.activations"
VERSION = 1
FIELDS = ["q", "k_pre", "k_post", "v", "fisher_k", "fisher_v"]
MAX_CHUNK_BYTES = 4 << 20

MODEL_STRINGS = ["architecture", "rope", "kvo_sha256", "tokenizer_sha256"]
MODEL_INTS = ["num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size"]
PROVENANCE_STRINGS = ["data_file", "data_sha256", "compute_dtype", "device", "tool_version", "command_line"]
PROVENANCE_INT64 = ["data_tokens", "samples", "seq_len"]


HASH_MULTIPLIER = np.uint64(2654435761)
HASH_MASK = np.uint64(0xFFFFFFFF)


def position_weights(first, count):
    """weight(i) for i in [first, first + count): exact in float64."""
    index = np.arange(first, first + count, dtype=np.uint64)
    return (((index * HASH_MULTIPLIER) & HASH_MASK).astype(np.float64) + 1.0) / 2.0**32


def checksums(rows):
    """(sum, weighted sum) over the rows (numpy arrays, one per sample) in order."""
    total, weighted, first = 0.0, 0.0, 0
    for row in rows:
        values = np.asarray(row, dtype=np.float64).ravel()
        total += float(values.sum())
        weighted += float(np.dot(position_weights(first, values.size), values))
        first += values.size
    return total, weighted


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


def check_model(group):
    model = {name: string_attr(group, name, "/model") for name in MODEL_STRINGS}
    model.update({name: int_attr(group, name, "/model") for name in MODEL_INTS})
    for name in MODEL_INTS:
        if model[name] <= 0:
            fail(f"/model@{name}", "expected a positive integer")
    if model["num_heads"] % model["num_kv_heads"]:
        fail("/model@num_kv_heads", "expected a divisor of num_heads")
    return model


def check_provenance(group, where):
    prov = {name: string_attr(group, name, where) for name in PROVENANCE_STRINGS}
    prov.update({name: int_attr(group, name, where) for name in PROVENANCE_INT64})
    prov["seed"] = int_attr(group, "seed", where, "<u8")
    prov["bos"] = int_attr(group, "bos", where, "u1")
    if prov["bos"] not in (0, 1):
        fail(f"{where}@bos", "expected 0 or 1")
    if prov["samples"] <= 0 or prov["seq_len"] <= 0:
        fail(where, "expected positive samples and seq_len")
    return prov


def check_dataset(f, path, dtype, shape, chunks=None, level=None):
    if path not in f or not isinstance(f[path], h5py.Dataset):
        fail(path, "missing dataset")
    ds = f[path]
    if ds.dtype != np.dtype(dtype):
        fail(path, f"expected {np.dtype(dtype)}, got {ds.dtype}")
    if ds.shape != tuple(shape):
        fail(path, f"expected shape {tuple(shape)}, got {ds.shape}")
    if chunks is not None:
        if ds.chunks != tuple(chunks):
            fail(path, f"expected chunks {tuple(chunks)}, got {ds.chunks}")
        want = ("gzip", level, True) if level > 0 else (None, None, False)
        got = (ds.compression, ds.compression_opts, ds.shuffle)
        if got != want:
            fail(path, f"expected (compression, level, shuffle) {want}, got {got}")
    return ds


def check_sources(f, total_samples):
    if "sources" not in f:
        return 1
    group = f["sources"]
    count = len(group)
    first = 0
    for i in range(count):
        where = f"/sources/{i}"
        if str(i) not in group:
            fail(where, "missing (sources are numbered 0..n-1)")
        source = group[str(i)]
        prov = check_provenance(source, where)
        if int_attr(source, "first_sample", where) != first:
            fail(f"{where}@first_sample", f"expected {first}")
        first += prov["samples"]
    if count == 0 or first != total_samples:
        fail("/sources", f"expected samples adding up to {total_samples}, got {first}")
    return count


def check(path):
    with h5py.File(path, "r") as f:
        if string_attr(f, "schema", "/") != SCHEMA:
            fail("/@schema", f"expected {SCHEMA}")
        if int_attr(f, "schema_version", "/") != VERSION:
            fail("/@schema_version", f"expected {VERSION}")
        if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", string_attr(f, "created_utc", "/")):
            fail("/@created_utc", "expected YYYY-MM-DDTHH:MM:SSZ")
        string_attr(f, "tool_version", "/")
        string_attr(f, "command_line", "/")
        dtype, fields = attribute(f, "fields", "/")
        fields = [str(name) for name in np.atleast_1d(fields)]
        if h5py.check_string_dtype(dtype) is None or np.ndim(f.attrs["fields"]) != 1:
            fail("/@fields", "expected a 1-D list of strings")
        if not fields or len(set(fields)) != len(fields) or any(name not in FIELDS for name in fields):
            fail("/@fields", f"expected distinct names among {FIELDS}, got {fields}")
        level = int_attr(f, "compression_level", "/")
        if not 0 <= level <= 9:
            fail("/@compression_level", "expected 0..9")

        model = check_model(f["model"] if "model" in f else fail("/model", "missing"))
        prov = check_provenance(f["provenance"] if "provenance" in f else fail("/provenance", "missing"), "/provenance")
        samples, seq_len, head_dim = prov["samples"], prov["seq_len"], model["head_dim"]
        done = int_attr(f, "samples_complete", "/")
        if not 0 <= done <= samples:
            fail("/@samples_complete", f"expected 0..{samples}")

        sums, weighted = {}, {}
        tokens = check_dataset(f, "tokens", "<i4", (samples, seq_len))
        starts = check_dataset(f, "stream_start", "<i8", (samples,))
        sums["tokens"], weighted["tokens"] = checksums(tokens[s] for s in range(done))
        sums["stream_start"], weighted["stream_start"] = checksums([starts[:done]])
        chunk_len = min(seq_len, max(1, MAX_CHUNK_BYTES // (4 * head_dim)))
        for layer in range(model["num_layers"]):
            for name in fields:
                heads = model["num_heads"] if name == "q" else model["num_kv_heads"]
                path_in_file = f"layers/{layer}/{name}"
                ds = check_dataset(f, path_in_file, "<f4", (samples, heads, seq_len, head_dim),
                                   (1, 1, chunk_len, head_dim), level)
                # Sample by sample; float64 so tiny Fisher values are summed exactly enough.
                sums[path_in_file], weighted[path_in_file] = checksums(ds[s] for s in range(done))
        return {"samples_complete": done, "sources": check_sources(f, samples), "sums": sums,
                "weighted_sums": weighted}


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
