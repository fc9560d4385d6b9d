#!/usr/bin/env python3
"""Independent reader (and writer) of kvforge's runtime KV cache pages,
written from docs/runtime-layout.md alone (sections 1-7; it shares no code
with kernels/).

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

Each tensor also names what append was fed ("input", [tokens][kv_heads]
[head_dim] float32 in sequence order, of "input_element") and what section
6.1 needs besides: "outlier_rule", "outlier_fraction", "outlier_tau",
"outlier_low", "outlier_high", "encode_grid" and "rotation" ({"form": "none"
| "matrix" | "pair_angles", "matrix": file of [kv_heads][D][D] float32,
"centre", "angles"}).

Reading (sections 1-5, 6.2): every token is read back from the bytes as the
page says (exact store, pages, group parameters, level table, dequantization
in float32 with one fma, outlier entries put back) and must equal the
expected readback bit for bit.
Writing (section 6.1): from the inputs, in float64 as the page says (element
rounding, rotation, outliers, groups, codes), every token's stored bytes
are predicted and must be what the pools hold at the page's positions: the
exact rows of the sink and the window, the codes of every token past the
sink whose group is complete (window tokens included), the group (min, max)
pairs and each CSR row's outlier entries (index, value).

Decoding (section 6.3): "decode" holds "num_heads", "keys_pre_rope",
"rope_inverse_frequencies" and, per layer, the files of one query per
sequence and query head ([sequences][num_heads][head_dim] float32, the
sequences in manifest order) and the engine's decode_attention output. From
the tokens it read back, the reader attends in float64 as the page says
(queries rotated by the keys' rotation, RoPE on pre-RoPE keys at each
token's position with the float32 angle, softmax at 1/sqrt(head_dim), query
head g on KV head g / (num_heads / kv_heads), the output rotated back by the
values' rotation); each output must be within 1e-3 of the sequence's largest
|value| of it (the issue's 1e-3; float32 against float64 differs by ~1e-6).

Bytes (section 7): each tensor's "held_bytes" and "read_bytes" (one per
sequence: what the engine counts a sequence holds, and what a decoding step
reads) must equal the page's formulas, from the page sizes worked out here
and the outlier entries found in the pools.

Prints {"tokens", "quantized", "outliers", "exact_rows", "codes", "pairs",
"outlier_entries", "byte_counts", "decoded", "decode_error"} (what it
compared; decode_error: the largest difference over the largest |value|) as
JSON; on the first difference prints "DIR: WHERE: ..." (WHERE as "layer L
KIND sequence S token T") to stderr and exits 1.
"""
import json
import math
import os
import sys
from fractions import Fraction

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


def two_sum(a, b):
    """s = fl(a + b) and the e with a + b = s + e exactly (Knuth's TwoSum)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def fma32(b, level, a):
    """float32 fma(b, level, a): b * level + a rounded once to float32.

    b * level is exact in float64 (two 24-bit significands); s = that + a
    rounds once, and e (TwoSum) is what it dropped. Rounding s to float32
    is then the single rounding of the exact sum except where s is exactly
    halfway between two float32 numbers and e != 0: there the exact sum lies
    on e's side of the tie."""
    b, level, a = (np.asarray(x, dtype=F32) for x in (b, level, a))
    p = b.astype(F64) * level.astype(F64)
    s, e = two_sum(p, a.astype(F64))
    r = s.astype(F32)
    r64 = r.astype(F64)
    towards = np.where(s > r64, F32(np.inf), F32(-np.inf))
    n = np.nextafter(r, towards)
    mid = (r64 + n.astype(F64)) / 2
    tie = (s != r64) & (s == mid) & (e != 0)
    up = np.sign(e) == np.sign(n.astype(F64) - r64)
    return np.where(tie & up, n, r).astype(F32)


# Section 2: one rounding from float64 to the element type, to nearest,
# ties to even, overflow to infinity, subnormals kept.
FORMATS = {"fp16": (11, -14, 65504.0), "bf16": (8, -126, (2 - 2.0 ** -7) * 2.0 ** 127)}


def to_element(x, element):
    x = np.asarray(x, dtype=F64)
    if element == "fp32":
        return x.astype(F32).astype(F64)
    precision, min_exponent, largest = FORMATS[element]
    magnitude = np.abs(x)
    _, exponent = np.frexp(magnitude)  # magnitude = m 2^exponent, m in [0.5, 1)
    binade = np.maximum(exponent - 1, min_exponent)
    quantum = np.ldexp(1.0, binade - (precision - 1))
    rounded = np.rint(magnitude / quantum) * quantum  # exact division by a power of two; rint: half to even
    rounded = np.where(rounded > largest, np.inf, rounded)
    return np.copysign(np.where(magnitude == 0, 0.0, rounded), x)


# float64 fma(a, b, c), rounded once: the exact product (Veltkamp split,
# Dekker product), its sum with c (TwoSum), the two low parts added with
# rounding to odd, then one rounding to nearest (Boldo and Melquiond,
# "Emulation of FMA and correctly rounded sums: proved algorithms using
# rounding to odd", 2008). Checked against exact rationals in self_check().
def split(a):
    c = 134217729.0 * a  # 2^27 + 1
    high = c - (c - a)
    return high, a - high


def fma64(a, b, c):
    a, b, c = (np.asarray(x, dtype=F64) for x in (a, b, c))
    p = a * b
    ah, al = split(a)
    bh, bl = split(b)
    pl = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    th, tl = two_sum(c, p)
    v, e = two_sum(tl, pl)
    even = (v.view(np.int64) & 1) == 0
    v = np.where((e != 0) & even, np.nextafter(v, np.where(e > 0, np.inf, -np.inf)), v)
    return th + v


def self_check():
    rng = np.random.default_rng(7)
    a = rng.standard_normal(4000) * np.exp2(rng.integers(-20, 20, 4000))
    b = rng.standard_normal(4000)
    c = np.where(rng.random(4000) < 0.5, -a * b, rng.standard_normal(4000))  # cancellations too
    got = fma64(a, b, c)
    for i in range(a.size):
        want = float(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])))
        if got[i] != want:
            raise Mismatch("fma64 emulation: fma(%r, %r, %r) = %r, exactly rounded %r" % (a[i], b[i], c[i], got[i], want))


def top_bottom_mask(y, k):
    """The k largest (value descending, index ascending) and the k smallest
    (value ascending, index ascending) of one span; all of it when 2k >= n."""
    n = y.size
    mask = np.zeros(n, dtype=bool)
    if k <= 0:
        return mask
    if 2 * k >= n:
        mask[:] = True
        return mask
    index = np.arange(n)
    mask[np.lexsort((index, -y))[:k]] = True
    mask[np.lexsort((index, y))[:k]] = True
    return mask


def tau_mask(y, tau):
    n = y.size
    mean = np.cumsum(y)[-1] / n  # sums in channel order
    std = np.sqrt(np.cumsum((y - mean) * (y - mean))[-1] / n)
    return np.abs(y - mean) > std * tau


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

        # Section 6.1's constants (section 5).
        self.input_element = t["input_element"]
        self.outlier_rule = t["outlier_rule"]
        if self.outliers and self.outlier_rule == "token_top_bottom":
            n = self.span_size
            f = t["outlier_fraction"]
            self.top_bottom_k = n - int(np.ceil((n - 1) * (1 - f / 2)))
        self.tau = float(F32(t["outlier_tau"]))
        if self.outlier_rule == "channel_thresholds":
            self.low = np.array(t["outlier_low"], dtype=F32).astype(F64).reshape(H, D)
            self.high = np.array(t["outlier_high"], dtype=F32).astype(F64).reshape(H, D)
        encode = t["encode_grid"] or grid
        if grid:
            e64 = np.array(encode, dtype=F32).astype(F64)
            self.midpoints = (e64[:-1] + e64[1:]) / 2
        rotation = t["rotation"]
        self.rotation = rotation["form"]
        if self.rotation == "matrix":
            with open(os.path.join(directory, rotation["matrix"]), "rb") as f:
                self.matrix = np.frombuffer(f.read(), dtype="<f4").astype(F64).reshape(H, D, D)
            centre = rotation.get("centre") or []
            self.centre = (np.array(centre, dtype=F32).astype(F64).reshape(H, D) if centre
                           else np.zeros((H, D), dtype=F64))
        elif self.rotation == "pair_angles":
            angles = np.array(rotation["angles"], dtype=F32).reshape(H, D // 2)
            self.cos = np.array([[math.cos(float(a)) for a in row] for row in angles], dtype=F64)
            self.sin = np.array([[math.sin(float(a)) for a in row] for row in angles], dtype=F64)

    # Section 6.1 steps 1-2: y of every token [T][Hkv][D], float64 element values.
    def stored_rows(self, inputs):
        x = to_element(inputs.astype(F64), self.element)
        if self.rotation == "none":
            return x
        y = np.empty_like(x)
        D = self.dim
        for h in range(self.heads):
            if self.rotation == "matrix":
                acc = np.zeros((x.shape[0], D), dtype=F64)
                for i in range(D):
                    acc = fma64((x[:, h, i] - self.centre[h, i])[:, None], self.matrix[h, i][None, :], acc)
                y[:, h] = acc
            else:
                low, high = x[:, h, :D // 2], x[:, h, D // 2:]
                y[:, h, :D // 2] = fma64(low, self.cos[h], -(high * self.sin[h]))
                y[:, h, D // 2:] = fma64(low, self.sin[h], high * self.cos[h])
        return to_element(y, self.element)

    # Step 4: the token's outliers [Hkv][D].
    def outlier_mask(self, y):
        H, D = self.heads, self.dim
        if not self.outliers:
            return np.zeros((H, D), dtype=bool)
        if self.outlier_rule == "channel_thresholds":
            return (y < self.low) | (y > self.high)
        if self.outlier_rule == "token_top_bottom":
            if self.spans == 1:
                return top_bottom_mask(y.reshape(-1), self.top_bottom_k).reshape(H, D)
            return np.stack([top_bottom_mask(y[h], self.top_bottom_k) for h in range(H)])
        if self.outlier_rule == "token_tau":
            return np.stack([tau_mask(y[h], self.tau) for h in range(H)])
        raise Mismatch("outlier rule " + self.outlier_rule)

    # Step 5: a group's stored pair and its codes.
    def group_pair(self, y, inliers):
        if not inliers.any():
            return 0.0, 0.0
        return float(y[inliers].min()), float(y[inliers].max())

    def level_codes(self, normalized):
        return np.searchsorted(self.midpoints, normalized, side="left")  # #{k : midpoint_k < n}

    def runtime_codes(self, y, pair):
        top = (1 << self.bits) - 1
        clip = float(self.clip)
        lo, hi = pair[0] * clip, pair[1] * clip
        if not hi > lo:
            return np.zeros(y.shape, dtype=np.int64)
        if not self.non_uniform:
            step = (hi - lo) / top
            return np.clip(np.rint((y - lo) / step), 0, top).astype(np.int64)
        return self.level_codes((y - (lo + hi) / 2) / ((hi - lo) / 2))

    def offline_codes(self, y, h):
        top = (1 << self.bits) - 1
        n = (y - self.offset[h].astype(F64)) / self.scale[h].astype(F64)
        if self.non_uniform:
            return self.level_codes(n)
        return np.clip(np.rint((n + 1) * top / 2), 0, top).astype(np.int64)

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

    def row_entries(self, page, slot, i, span):
        """Sections 3.3 and 4: (index, value) of the CSR row of in-page token i
        and span, in order."""
        E, w, e = self.entries, self.index_bytes, self.e
        pointers = page[self.row_pointers_offset:self.page_bytes].view("<u4")
        r = i * self.spans + span
        entries = []
        for k in range(int(pointers[r]), int(pointers[r + 1])):
            page_id = int(self.outlier_table[slot, k // E])
            if page_id < 0 or (page_id + 1) * self.outlier_page_bytes > self.outlier_pages.size:
                raise Mismatch("outlier entry %d: outlier page id %d outside the pool" % (k, page_id))
            op = self.outlier_pages[page_id * self.outlier_page_bytes:(page_id + 1) * self.outlier_page_bytes]
            j = k % E
            index = int(op[j * w:(j + 1) * w].view("<u2" if w == 2 else "<u4")[0])
            entries.append((index, elements(op[E * w + j * e:E * w + (j + 1) * e], self.element)[0]))
        return entries

    def put_back_outliers(self, page, slot, i, values, flags):
        """The token's outlier entries replace their elements."""
        D = self.dim
        for span in range(self.spans):
            for index, value in self.row_entries(page, slot, i, span):
                h, d = (index // D, index % D) if self.spans == 1 else (span, index)
                if h >= self.heads or d >= D:
                    raise Mismatch("outlier index %d outside the span" % index)
                values[h, d] = value
                flags[h, d] = 1


def same_bits(a, b):
    return np.array_equal(np.asarray(a, dtype=F32).view(np.uint32), np.asarray(b, dtype=F32).view(np.uint32))


def check_token_outliers(tensor, page, slot, i, y, mask, where):
    """The token's CSR rows hold exactly its outliers, by ascending index."""
    if not tensor.outliers:
        return 0
    count = 0
    for span in range(tensor.spans):
        if tensor.spans == 1:
            flat = np.flatnonzero(mask.reshape(-1))
            want = [(int(n), float(F32(y.reshape(-1)[n]))) for n in flat]
        else:
            want = [(int(d), float(F32(y[span, d]))) for d in np.flatnonzero(mask[span])]
        got = [(index, float(value)) for index, value in tensor.row_entries(page, slot, i, span)]
        if got != want:
            raise Mismatch("%s: span %d outlier entries %s, predicted %s" % (where, span, got[:6], want[:6]))
        count += len(want)
    return count


def check_writes(tensor, page_table, slot, rows, tokens, name, report):
    """Section 6.1: what append must have stored for the sequence's tokens."""
    H, D, P, sink = tensor.heads, tensor.dim, tensor.page_size, tensor.sink
    begin, end = tensor.quantized_range(tokens)
    for t in range(tokens):
        if begin <= t < end:
            continue
        ring_row = t if t < sink else sink + (t - sink) % tensor.ring
        if not same_bits(tensor.exact_row(slot, ring_row), rows[t]):
            raise Mismatch("%s token %d: exact row %d differs from the token's rotated, rounded input"
                           % (name, t, ring_row))
        report["exact_rows"] += 1

    def place(t):
        s = t - sink
        return tensor.page(int(page_table[slot, s // P])), s % P

    def expect_codes(page, i, h, codes, t):
        stored = tensor.codes(page, h, i)
        if not np.array_equal(stored, codes):
            d = int(np.flatnonzero(stored != codes)[0])
            raise Mismatch("%s token %d: head %d channel %d stored code %d, predicted %d"
                           % (name, t, h, d, stored[d], codes[d]))
        report["codes"] += 1

    def expect_pair(page, index, pair, t):
        stored = tensor.pair(page, index)
        if not same_bits(stored, pair):
            raise Mismatch("%s token %d: pair %d stored (%r, %r), predicted %r"
                           % (name, t, index, float(stored[0]), float(stored[1]), pair))
        report["pairs"] += 1

    if tensor.grouping == "per_channel_tokens":
        G, W = tensor.group, tensor.pairs_per_slot
        groups = max(tokens - sink, 0) // G
        for g in range(groups):
            first = sink + g * G
            y = rows[first:first + G]  # [G][Hkv][D]
            masks = np.stack([tensor.outlier_mask(y[j]) for j in range(G)])
            codes = np.empty(y.shape, dtype=np.int64)
            for h in range(H):
                for d in range(D):
                    pair = tensor.group_pair(y[:, h, d], ~masks[:, h, d])
                    codes[:, h, d] = tensor.runtime_codes(y[:, h, d], pair)
                    sigma = g * G * W + h * D + d
                    pair_page = tensor.page(int(page_table[slot, sigma // (P * W)]))
                    expect_pair(pair_page, sigma % (P * W), pair, first)
            for j in range(G):
                page, i = place(first + j)
                for h in range(H):
                    expect_codes(page, i, h, codes[j, h], first + j)
                report["outlier_entries"] += check_token_outliers(
                    tensor, page, slot, i, y[j], masks[j], "%s token %d" % (name, first + j))
        return
    for t in range(sink, tokens):
        y = rows[t]
        mask = tensor.outlier_mask(y)
        page, i = place(t)
        if tensor.grouping == "per_token_all_heads":
            pair = tensor.group_pair(y, ~mask)
            expect_pair(page, i, pair, t)
        for h in range(H):
            if tensor.grouping == "per_channel_offline":
                codes = tensor.offline_codes(y[h], h)
            elif tensor.grouping == "per_token_all_heads":
                codes = tensor.runtime_codes(y[h], pair)
            else:
                Gc = tensor.group_channels
                codes = np.empty(D, dtype=np.int64)
                for g in range(D // Gc):
                    part = slice(g * Gc, (g + 1) * Gc)
                    group_pair = tensor.group_pair(y[h, part], ~mask[h, part])
                    codes[part] = tensor.runtime_codes(y[h, part], group_pair)
                    expect_pair(page, (h * P + i) * (D // Gc) + g, group_pair, t)
            expect_codes(page, i, h, codes, t)
        report["outlier_entries"] += check_token_outliers(tensor, page, slot, i, y, mask, "%s token %d" % (name, t))


def check_bytes(tensor, tokens, visible, stored, held, read, name):
    """Section 7: bytes_held (whole pages past the sink, the exact slot, whole
    outlier pages, both tables' used entries) and bytes_read (the formula's
    terms) of one sequence with `visible` outlier entries among its
    quantized tokens and `stored` in all."""
    H, D, P, b, e = tensor.heads, tensor.dim, tensor.page_size, tensor.bits, tensor.e
    ceil = lambda x, y: -(-x // y)
    pages = ceil(max(tokens - tensor.sink, 0), P)
    want_held = pages * tensor.page_bytes + tensor.exact_slot_bytes + pages * 4
    if tensor.outliers:
        outlier_pages = ceil(stored, tensor.entries)
        want_held += outlier_pages * tensor.outlier_page_bytes + outlier_pages * 4
    begin, end = tensor.quantized_range(tokens)
    Q = end - begin
    want_read = (tokens - Q) * H * D * e + Q * H * D * b // 8
    if tensor.grouping == "per_token":
        want_read += Q * H * (D // tensor.group_channels) * 2 * e
    elif tensor.grouping == "per_token_all_heads":
        want_read += Q * 2 * e
    elif tensor.grouping == "per_channel_tokens":
        want_read += (Q // tensor.group) * H * D * 2 * e
    want_read += ceil(Q, P) * 4
    if tensor.outliers and Q > 0:
        want_read += (Q * tensor.spans + ceil(Q, P)) * 4 + visible * (tensor.index_bytes + e)
        want_read += ceil(visible, tensor.entries) * 4
    if held != want_held:
        raise Mismatch("%s: holds %d bytes, the page's bytes_held gives %d" % (name, held, want_held))
    if read != want_read:
        raise Mismatch("%s: reads %d bytes a step, the page's bytes_read gives %d" % (name, read, want_read))


def query_rotation(keys, h, q):
    """Section 6.3 step 1: q' = q R of KV head h (float64); no centre."""
    if keys.rotation == "matrix":
        return q @ keys.matrix[h]
    if keys.rotation == "pair_angles":
        half = keys.dim // 2
        low, high = q[..., :half], q[..., half:]
        return np.concatenate([low * keys.cos[h] - high * keys.sin[h], low * keys.sin[h] + high * keys.cos[h]], -1)
    return q


def rope(k, positions, inverse_frequencies):
    """RoPE at each token's position (rows of k [T][D]): the float32 angle
    t * inv_freq, x cos + rotate_half(x) sin."""
    half = k.shape[-1] // 2
    angle = (positions.astype(F32)[:, None] * inverse_frequencies[None, :]).astype(F32).astype(F64)
    c, s = np.cos(angle), np.sin(angle)
    low, high = k[:, :half], k[:, half:]
    return np.concatenate([low * c - high * s, high * c + low * s], -1)


def check_decode(directory, manifest, tensors, read_back, report):
    """Section 6.3 in float64 over the tokens read back, against the engine's outputs."""
    decode = manifest["decode"]
    H = decode["num_heads"]
    inverse_frequencies = np.array(decode["rope_inverse_frequencies"], dtype=F32)
    sequences = manifest["sequences"]
    for layer, files in enumerate(decode["layers"]):
        keys, values = tensors[(layer, "keys")], tensors[(layer, "values")]
        Hkv, D = keys.heads, keys.dim
        with open(os.path.join(directory, files["queries"]), "rb") as f:
            queries = np.frombuffer(f.read(), dtype="<f4").reshape(len(sequences), H, D).astype(F64)
        with open(os.path.join(directory, files["output"]), "rb") as f:
            outputs = np.frombuffer(f.read(), dtype="<f4").reshape(len(sequences), H, D).astype(F64)
        for number in range(len(sequences)):
            k_all = read_back[(layer, "keys")][number].astype(F64)    # [T][Hkv][D], stored basis
            v_all = read_back[(layer, "values")][number].astype(F64)
            tokens = k_all.shape[0]
            largest = np.abs(v_all).max()
            for g in range(H):
                h = g // (H // Hkv)
                k = k_all[:, h]
                if decode["keys_pre_rope"]:
                    k = rope(k, np.arange(tokens), inverse_frequencies)
                q = query_rotation(keys, h, queries[number, g])
                score = (k @ q) / math.sqrt(D)
                p = np.exp(score - score.max())
                o = (p @ v_all[:, h]) / p.sum()
                if values.rotation == "matrix":
                    o = values.matrix[h] @ o  # o' R_v^T
                error = np.abs(o - outputs[number, g]).max() / largest
                report["decode_error"] = max(report["decode_error"], float(error))
                if not error <= 1e-3:
                    raise Mismatch("layer %d sequence %d query head %d: decode_attention differs from the page's "
                                   "attention by %.3g of the largest |value|" % (layer, number, g, error))
                report["decoded"] += 1


def check(directory):
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    max_sequences = manifest["max_sequences"]
    with open(os.path.join(directory, manifest["page_table"]), "rb") as f:
        page_table = np.frombuffer(f.read(), dtype="<i4").reshape(max_sequences, -1)
    report = {"tokens": 0, "quantized": 0, "outliers": 0, "exact_rows": 0, "codes": 0, "pairs": 0,
              "outlier_entries": 0, "byte_counts": 0, "decoded": 0, "decode_error": 0.0}
    tensors, read_back = {}, {}
    for t in manifest["tensors"]:
        tensor = Tensor(directory, t, max_sequences)
        tensors[(t["layer"], t["kind"])] = tensor
        read_back[(t["layer"], t["kind"])] = []
        H, D = tensor.heads, tensor.dim

        def expected(key, dtype):
            with open(os.path.join(directory, t["expected"][key]), "rb") as f:
                return np.frombuffer(f.read(), dtype=dtype)

        want_values = expected("values", "<f4").reshape(-1, H, D)
        want_codes = expected("codes", np.uint8).reshape(-1, H, D)
        want_outliers = expected("outliers", np.uint8).reshape(-1, H, D)
        want_quantized = expected("quantized", np.uint8)
        with open(os.path.join(directory, t["input"]), "rb") as f:
            inputs = np.frombuffer(f.read(), dtype="<f4").reshape(-1, H, D)
        if tensor.input_element != "fp32":
            raise Mismatch("input element " + tensor.input_element)
        first = 0
        for number, sequence in enumerate(manifest["sequences"]):
            tokens = sequence["length"]
            name = "%s sequence %d" % (tensor.name, number)
            rows = tensor.stored_rows(inputs[first:first + tokens])
            before = report["outlier_entries"]
            check_writes(tensor, page_table, sequence["slot"], rows, tokens, name, report)
            stored = report["outlier_entries"] - before
            begin, end = tensor.quantized_range(tokens)
            visible = int(want_outliers[first + begin:first + end].sum())
            check_bytes(tensor, tokens, visible, stored, t["held_bytes"][number], t["read_bytes"][number], name)
            report["byte_counts"] += 2
            first += tokens
        row = 0
        for number, sequence in enumerate(manifest["sequences"]):
            slot, tokens = sequence["slot"], sequence["length"]
            begin, end = tensor.quantized_range(tokens)
            sequence_values = np.zeros((tokens, H, D), dtype=F32)
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
                sequence_values[token] = values
                report["tokens"] += 1
                report["quantized"] += int(quantized)
                report["outliers"] += int(flags.sum())
                row += 1
            read_back[(t["layer"], t["kind"])].append(sequence_values)
        if row != want_values.shape[0]:
            raise Mismatch("%s: %d tokens read, the readback has %d" % (tensor.name, row, want_values.shape[0]))
    check_decode(directory, manifest, tensors, read_back, report)
    return report


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    directory = sys.argv[1]
    try:
        self_check()
        report = check(directory)
    except Mismatch as problem:
        print("%s: %s" % (directory, problem), file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
