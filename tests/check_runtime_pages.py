#!/usr/bin/env python3
"""Independent reader of kvforge's runtime KV cache pages, written from
docs/runtime-layout.md alone (sections 1-5 and 6.2; it shares no code with
kernels/).

usage: check_runtime_pages.py DIR

DIR holds manifest.json (written by tests/test_runtime_pages_reader.cpp):
  {"case": name, "max_sequences": N, "page_table": file,
   "sequences": [{"slot": s, "length": T}, ...],
   "tensors": [{"layer", "kind", "kv_heads", "head_dim", "bits", "page_size",
                "grouping", "group", "element", "sink_tokens", "residual_tokens",
                "window_rule", "outliers", "outlier_page_entries",
                "grid", "clip_ratio", "channel_scale", "channel_offset",
                "pages", "exact", "outlier_pages", "outlier_page_table",
                "expected": {"values", "codes", "outliers", "quantized"}}, ...]}
and the raw files it names: the pools of each layer and kind (pages by page
id, the exact store by sequence slot, outlier pages by id, the outlier page
table [max_sequences][stride] of int32), the page table shared by every
layer and kind ([max_sequences][stride] int32), and what the engine's own
readback gave for every token of every sequence, in sequence order
([tokens][kv_heads][head_dim] float32 values, uint8 codes and outlier flags,
[tokens] uint8 quantized flags).

Every token is read back from the bytes as the page says (exact store,
pages, group parameters, level table, dequantization in float32 with one
fma, outlier entries put back) and must equal the expected readback bit for
bit. Prints {"tokens", "quantized", "outliers"} (what it compared) as JSON;
on the first difference prints "DIR: layer L KIND sequence S token T: ..."
to stderr and exits 1.
"""
import json
import os
import sys

import numpy as np

F32, F64 = np.float32, np.float64


class Mismatch(Exception):
    pass


def align16(n):
    return (n + 15) // 16 * 16


# Section 2: element types, little-endian.
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def elements(raw, element):
    """float32 values of consecutive elements in `raw` (bytes or uint8 array)."""
    raw = np.frombuffer(bytes(raw), dtype=np.uint8)
    if element == "fp16":
        return raw.view("<f2").astype(F32)
    if element == "bf16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(F32)
    if element == "fp32":
        return raw.view("<f4").astype(F32)
    raise ValueError("element " + element)


def fma32(b, level, a):
    """float32 fma(b, level, a): b * level + a rounded once to float32.

    b * level is exact in float64 (two 24-bit significands); s = that + a
    rounds once, and e (TwoSum) is what it dropped. Rounding s to float32
    is then the single rounding of the exact sum except where s is exactly
    halfway between two float32 numbers and e != 0: there the exact sum lies
    on e's side of the tie."""
    b, level, a = (np.asarray(x, dtype=F32) for x in (b, level, a))
    p = b.astype(F64) * level.astype(F64)
    a64 = a.astype(F64)
    s = p + a64
    bb = s - p
    e = (p - (s - bb)) + (a64 - bb)
    r = s.astype(F32)
    r64 = r.astype(F64)
    towards = np.where(s > r64, F32(np.inf), F32(-np.inf))
    n = np.nextafter(r, towards)
    mid = (r64 + n.astype(F64)) / 2
    tie = (s != r64) & (s == mid) & (e != 0)
    up = np.sign(e) == np.sign(n.astype(F64) - r64)
    return np.where(tie & up, n, r).astype(F32)


class Tensor:
    """One layer's keys or values: the configuration and the pools."""

    def __init__(self, directory, t, max_sequences):
        self.t = t
        self.name = "layer %d %s" % (t["layer"], t["kind"])
        self.heads, self.dim, self.bits = t["kv_heads"], t["head_dim"], t["bits"]
        self.page_size, self.grouping, self.element = t["page_size"], t["grouping"], t["element"]
        self.e = ELEMENT_BYTES[self.element]
        self.sink, self.residual, self.window_rule = t["sink_tokens"], t["residual_tokens"], t["window_rule"]
        self.outliers = t["outliers"]
        D, H, P, b, e = self.dim, self.heads, self.page_size, self.bits, self.e
        if (D * b) % 32 != 0:
            raise Mismatch("head_dim * bits is not a multiple of 32")
        # Section 3: the page's sections.
        self.row_bytes = D * b // 8
        codes_bytes = H * P * self.row_bytes
        self.group = t["group"]
        if self.grouping == "per_token":
            self.group_channels = min(self.group, D)  # G'
            pairs = H * P * (D // self.group_channels)
        elif self.grouping == "per_token_all_heads":
            pairs = P
        elif self.grouping == "per_channel_tokens":
            self.pairs_per_slot = -(-(H * D) // self.group)  # W = ceil(Hkv D / G)
            pairs = P * self.pairs_per_slot
        elif self.grouping == "per_channel_offline":
            pairs = 0
        else:
            raise Mismatch("grouping " + self.grouping)
        self.params_offset = align16(codes_bytes)
        self.row_pointers_offset = align16(self.params_offset + pairs * 2 * e)
        row_pointer_bytes = 0
        if self.outliers:
            all_heads = self.grouping == "per_token_all_heads"
            self.spans = 1 if all_heads else H
            self.span_size = H * D if all_heads else D
            self.index_bytes = 2 if self.span_size <= 65536 else 4
            self.entries = t["outlier_page_entries"]
            self.outlier_page_bytes = align16(self.entries * (self.index_bytes + e))
            row_pointer_bytes = (P * self.spans + 1) * 4
        self.page_bytes = align16(self.row_pointers_offset + row_pointer_bytes)
        # Section 1: the ring.
        if self.grouping == "per_channel_tokens" and self.window_rule == "sliding":
            self.ring = self.residual + self.group - 1
        else:
            self.ring = self.residual

        def read(key):
            with open(os.path.join(directory, t[key]), "rb") as f:
                return np.frombuffer(f.read(), dtype=np.uint8)

        self.pages = read("pages")
        if self.pages.size % self.page_bytes != 0:
            raise Mismatch("pages: %d bytes, not whole pages of %d" % (self.pages.size, self.page_bytes))
        # Exact store: per slot [Hkv][sink + C][D] elements (head-major).
        self.exact_slot_bytes = H * (self.sink + self.ring) * D * e
        self.exact = read("exact")
        if self.exact.size != max_sequences * self.exact_slot_bytes:
            raise Mismatch("exact store: %d bytes, expected %d slots of %d"
                           % (self.exact.size, max_sequences, self.exact_slot_bytes))
        if self.outliers:
            self.outlier_pages = read("outlier_pages")
            if self.outlier_pages.size % self.outlier_page_bytes != 0:
                raise Mismatch("outlier pages: not whole pages of %d bytes" % self.outlier_page_bytes)
            table = read("outlier_page_table").view("<i4")
            self.outlier_table = table.reshape(max_sequences, -1)
        # Section 5: the level table.
        grid = t["grid"]
        levels = 1 << b
        if grid:
            if len(grid) != levels:
                raise Mismatch("grid of %d levels at %d bits" % (len(grid), b))
            self.levels = np.array(grid, dtype=F32)
        elif self.grouping == "per_channel_offline":
            self.levels = np.array([2.0 * k / (levels - 1) - 1.0 for k in range(levels)], dtype=F64).astype(F32)
        else:
            self.levels = np.arange(levels, dtype=F32)
        self.non_uniform = bool(grid)
        self.clip = F32(t["clip_ratio"])
        if self.grouping == "per_channel_offline":
            self.scale = np.array(t["channel_scale"], dtype=F32).reshape(H, D)
            self.offset = np.array(t["channel_offset"], dtype=F32).reshape(H, D)

    # Section 1: which tokens are read from the pages.
    def quantized_range(self, tokens):
        begin = min(self.sink, tokens)
        if self.window_rule == "block_flush":
            end = begin + (tokens - begin) // self.residual * self.residual
        else:
            end = max(begin, tokens - self.residual)
            if self.grouping == "per_channel_tokens":
                end = begin + (end - begin) // self.group * self.group
        return begin, end

    def page(self, page_id):
        if page_id < 0 or (page_id + 1) * self.page_bytes > self.pages.size:
            raise Mismatch("page id %d outside the pool" % page_id)
        return self.pages[page_id * self.page_bytes:(page_id + 1) * self.page_bytes]

    def exact_row(self, slot, row):
        """[Hkv][D] float32 of exact store row `row` of the sequence's slot."""
        D, e = self.dim, self.e
        base = slot * self.exact_slot_bytes
        rows = self.sink + self.ring
        out = np.empty((self.heads, D), dtype=F32)
        for h in range(self.heads):
            at = base + (h * rows + row) * D * e
            out[h] = elements(self.exact[at:at + D * e], self.element)
        return out

    def codes(self, page, h, i):
        """Channel codes of head h, in-page index i (section 3.1)."""
        at = (h * self.page_size + i) * self.row_bytes
        bits = np.unpackbits(page[at:at + self.row_bytes], bitorder="little").reshape(self.dim, self.bits)
        return (bits.astype(np.int64) << np.arange(self.bits)).sum(axis=1)

    def pair(self, page, index):
        """(min, max) pair number `index` of the page's parameter section."""
        at = self.params_offset + index * 2 * self.e
        v = elements(page[at:at + 2 * self.e], self.element)
        return v[0], v[1]

    def affine(self, low, high):
        """Section 6.2: (a, b) of a runtime group from its stored (min, max)."""
        if low == high:
            return F32(low), F32(0)
        lo = F32(self.clip * low)
        hi = F32(self.clip * high)
        if self.non_uniform:
            return F32(F32(lo + hi) * F32(0.5)), F32(F32(hi - lo) * F32(0.5))
        return lo, F32(F32(hi - lo) / F32((1 << self.bits) - 1))

    def read_quantized(self, page_table, slot, t):
        """(values [Hkv][D], codes, outlier flags) of quantized token t."""
        H, D, P = self.heads, self.dim, self.page_size
        s = t - self.sink
        page = self.page(int(page_table[slot, s // P]))
        i = s % P
        values = np.empty((H, D), dtype=F32)
        codes = np.empty((H, D), dtype=np.int64)
        for h in range(H):
            c = self.codes(page, h, i)
            codes[h] = c
            level = self.levels[c]
            if self.grouping == "per_channel_offline":
                a, b = self.offset[h], self.scale[h]
            elif self.grouping == "per_token":
                G = self.group_channels
                a = np.empty(D, dtype=F32)
                b = np.empty(D, dtype=F32)
                for g in range(D // G):
                    a[g * G:(g + 1) * G], b[g * G:(g + 1) * G] = self.affine(
                        *self.pair(page, (h * P + i) * (D // G) + g))
            elif self.grouping == "per_token_all_heads":
                a, b = self.affine(*self.pair(page, i))
            else:  # per_channel_tokens: the group's pairs striped over its slots
                G, W = self.group, self.pairs_per_slot
                g = s // G
                a = np.empty(D, dtype=F32)
                b = np.empty(D, dtype=F32)
                for d in range(D):
                    sigma = g * G * W + h * D + d
                    pair_page = self.page(int(page_table[slot, sigma // (P * W)]))
                    a[d], b[d] = self.affine(*self.pair(pair_page, sigma % (P * W)))
            values[h] = fma32(b, level, a)
        flags = np.zeros((H, D), dtype=np.uint8)
        if self.outliers:
            self.put_back_outliers(page, slot, i, values, flags)
        return values, codes, flags

    def put_back_outliers(self, page, slot, i, values, flags):
        """Sections 3.3 and 4: the token's CSR rows' entries replace their elements."""
        E, w, e, D = self.entries, self.index_bytes, self.e, self.dim
        pointers = page[self.row_pointers_offset:self.page_bytes].view("<u4")
        for span in range(self.spans):
            r = i * self.spans + span
            for k in range(int(pointers[r]), int(pointers[r + 1])):
                page_id = int(self.outlier_table[slot, k // E])
                if page_id < 0 or (page_id + 1) * self.outlier_page_bytes > self.outlier_pages.size:
                    raise Mismatch("outlier entry %d: outlier page id %d outside the pool" % (k, page_id))
                op = self.outlier_pages[page_id * self.outlier_page_bytes:(page_id + 1) * self.outlier_page_bytes]
                j = k % E
                index = int(op[j * w:(j + 1) * w].view("<u2" if w == 2 else "<u4")[0])
                value = elements(op[E * w + j * e:E * w + (j + 1) * e], self.element)[0]
                if self.spans == 1:
                    h, d = index // D, index % D
                else:
                    h, d = span, index
                if h >= self.heads or d >= D:
                    raise Mismatch("outlier entry %d: index %d outside the span" % (k, index))
                values[h, d] = value
                flags[h, d] = 1


def check(directory):
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    max_sequences = manifest["max_sequences"]
    with open(os.path.join(directory, manifest["page_table"]), "rb") as f:
        page_table = np.frombuffer(f.read(), dtype="<i4").reshape(max_sequences, -1)
    report = {"tokens": 0, "quantized": 0, "outliers": 0}
    for t in manifest["tensors"]:
        tensor = Tensor(directory, t, max_sequences)
        H, D = tensor.heads, tensor.dim

        def expected(key, dtype):
            with open(os.path.join(directory, t["expected"][key]), "rb") as f:
                return np.frombuffer(f.read(), dtype=dtype)

        want_values = expected("values", "<f4").reshape(-1, H, D)
        want_codes = expected("codes", np.uint8).reshape(-1, H, D)
        want_outliers = expected("outliers", np.uint8).reshape(-1, H, D)
        want_quantized = expected("quantized", np.uint8)
        row = 0
        for number, sequence in enumerate(manifest["sequences"]):
            slot, tokens = sequence["slot"], sequence["length"]
            begin, end = tensor.quantized_range(tokens)
            for token in range(tokens):
                where = "%s sequence %d token %d" % (tensor.name, number, token)
                if row >= want_values.shape[0]:
                    raise Mismatch(where + ": beyond the expected readback")
                quantized = begin <= token < end
                try:
                    if quantized:
                        values, codes, flags = tensor.read_quantized(page_table, slot, token)
                    else:
                        ring_row = token if token < tensor.sink else tensor.sink + (token - tensor.sink) % tensor.ring
                        values = tensor.exact_row(slot, ring_row)
                        codes = np.zeros((H, D), dtype=np.int64)
                        flags = np.zeros((H, D), dtype=np.uint8)
                except Mismatch as problem:
                    raise Mismatch("%s: %s" % (where, problem))
                if int(want_quantized[row]) != int(quantized):
                    raise Mismatch("%s: read from the %s, the engine says otherwise"
                                   % (where, "pages" if quantized else "exact store"))
                bad = np.argwhere(codes != want_codes[row])
                if bad.size:
                    h, d = bad[0]
                    raise Mismatch("%s: head %d channel %d code %d, expected %d"
                                   % (where, h, d, codes[h, d], want_codes[row][h, d]))
                bad = np.argwhere(flags != want_outliers[row])
                if bad.size:
                    h, d = bad[0]
                    raise Mismatch("%s: head %d channel %d outlier flag %d, expected %d"
                                   % (where, h, d, flags[h, d], want_outliers[row][h, d]))
                same = values.view(np.uint32) == want_values[row].view(np.uint32)
                bad = np.argwhere(~same)
                if bad.size:
                    h, d = bad[0]
                    raise Mismatch("%s: head %d channel %d value %r, expected %r"
                                   % (where, h, d, float(values[h, d]), float(want_values[row][h, d])))
                report["tokens"] += 1
                report["quantized"] += int(quantized)
                report["outliers"] += int(flags.sum())
                row += 1
        if row != want_values.shape[0]:
            raise Mismatch("%s: %d tokens read, the readback has %d" % (tensor.name, row, want_values.shape[0]))
    return report


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    directory = sys.argv[1]
    try:
        report = check(directory)
    except Mismatch as problem:
        print("%s: %s" % (directory, problem), file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
