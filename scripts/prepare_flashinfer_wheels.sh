#!/usr/bin/env bash
# FlashInfer for the decode baselines (bench/decode_baselines.py) on the GPU
# machine, which has no network: downloads flashinfer-python and the few
# packages its import needs (for the GPU image's python 3.12), and splits the
# 101 MB wheel in three, because one device call carries at most 64 MiB with
# the tree (~14 MiB; each part ~34 MB, the last with the small wheels ~38):
#   .carry-wheels/a: the wheel's first part, its SHA256 and PARTS (3);
#   .carry-wheels/b: the second part;
#   .carry-wheels/c: the third part and the small wheels.
# On the GPU machine every gpu_checks.sh call keeps the parts it carries in
# .stash/ and the one that completes the set installs the wheel; the grid's
# three calls back to back (each while the machine is still warm):
# `GPU_CHECKS_ONLY=stash` with carry [".carry-wheels/a", ".carry/debs"], the
# build with [".carry-wheels/b"], the grid with [".carry-wheels/c"] and
# SKIP_BUILD=1.
# Usage: scripts/prepare_flashinfer_wheels.sh [VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-0.7.4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work" "flashinfer-python==$VERSION"
# What `import flashinfer` needs beyond torch and numpy (the rest of its
# requirements are imported only by features the baselines do not use).
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d "$work" "apache-tvm-ffi>=0.1.11,<0.2"
python3 -m pip download -q --no-deps -d "$work" einops tabulate nvidia-ml-py packaging click tqdm
rm -rf .carry-wheels && mkdir -p .carry-wheels/a .carry-wheels/b .carry-wheels/c
wheel=$(ls "$work"/flashinfer_python-*.whl)
(cd "$work" && sha256sum "$(basename "$wheel")") > .carry-wheels/a/SHA256
split -n 3 -a 1 "$wheel" "$work/part-"
echo 3 > .carry-wheels/a/PARTS
for part in a b c; do mv "$work/part-$part" .carry-wheels/$part/flashinfer.part-$part; done
find "$work" -maxdepth 1 -name '*.whl' ! -name 'flashinfer_python-*' -exec mv {} .carry-wheels/c/ \;
du -sh .carry-wheels/a .carry-wheels/b .carry-wheels/c
