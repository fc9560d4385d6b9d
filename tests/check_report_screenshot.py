#!/usr/bin/env python3
"""Decodes a PNG screenshot with the standard library alone and prints what
the report test checks, as JSON:
  {"width", "height", "distinct_colors",
   "colors": {"#rrggbb": {"count", "x_min", "x_max", "y_min", "y_max",
                          "bands": {"k": pixels in rows 50k..50k+49}}},
   "busy_rows": rows whose pixels are not all one colour}
for the colours named on the command line (exact RGB matches; an absent
colour has count 0). Usage: check_report_screenshot.py SHOT.png [#rrggbb ...]
Only what Chromium writes is supported: 8-bit RGB or RGBA, not interlaced.
"""
import json
import struct
import sys
import zlib


def read_png(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        sys.exit(f"{path}: not a PNG file")
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    width, height, depth, color_type, _, _, interlace = header
    if depth != 8 or color_type not in (2, 6) or interlace != 0:
        sys.exit(f"{path}: unsupported PNG (bit depth {depth}, colour type {color_type}, interlace {interlace})")
    bpp = 3 if color_type == 2 else 4
    raw = zlib.decompress(b"".join(idat))
    stride = width * bpp
    rows, prior = [], bytes(stride)
    low7 = int.from_bytes(b"\x7f" * stride, "big")
    high1 = int.from_bytes(b"\x80" * stride, "big")
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], raw[start + 1:start + 1 + stride]
        if kind == 0:
            row = line
        elif kind == 2:
            # Bytewise (line + prior) mod 256 on one big integer: add the low
            # 7 bits of each byte, then put the top bits back without carry.
            a, b = int.from_bytes(line, "big"), int.from_bytes(prior, "big")
            row = (((a & low7) + (b & low7)) ^ ((a ^ b) & high1)).to_bytes(stride, "big")
        else:
            out = bytearray(stride)
            for i in range(stride):
                left = out[i - bpp] if i >= bpp else 0
                up = prior[i]
                if kind == 1:
                    predicted = left
                elif kind == 3:
                    predicted = (left + up) >> 1
                elif kind == 4:
                    corner = prior[i - bpp] if i >= bpp else 0
                    p = left + up - corner
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                    predicted = left if pa <= pb and pa <= pc else (up if pb <= pc else corner)
                else:
                    sys.exit(f"{path}: bad filter type {kind} in row {y}")
                out[i] = (line[i] + predicted) & 0xFF
            row = bytes(out)
        rows.append(row)
        prior = row
    return width, height, bpp, rows


def main():
    path, wanted = sys.argv[1], sys.argv[2:]
    width, height, bpp, rows = read_png(path)
    distinct = set()
    busy_rows = 0
    for row in rows:
        pixels = {row[i:i + 3] for i in range(0, len(row), bpp)}
        distinct |= pixels
        busy_rows += len(pixels) > 1
    colors = {}
    for name in wanted:
        target = bytes.fromhex(name.lstrip("#")) + (b"\xff" if bpp == 4 else b"")
        found = {"count": 0, "x_min": None, "x_max": None, "y_min": None, "y_max": None, "bands": {}}
        for y, row in enumerate(rows):
            i = row.find(target)
            while i != -1:
                if i % bpp == 0:
                    x = i // bpp
                    found["count"] += 1
                    found["x_min"] = x if found["x_min"] is None else min(found["x_min"], x)
                    found["x_max"] = x if found["x_max"] is None else max(found["x_max"], x)
                    found["y_min"] = y if found["y_min"] is None else found["y_min"]
                    found["y_max"] = y
                    band = str(y // 50)
                    found["bands"][band] = found["bands"].get(band, 0) + 1
                i = row.find(target, i + 1)
        colors[name] = found
    print(json.dumps({"width": width, "height": height, "distinct_colors": len(distinct), "colors": colors,
                      "busy_rows": busy_rows}))


if __name__ == "__main__":
    main()
