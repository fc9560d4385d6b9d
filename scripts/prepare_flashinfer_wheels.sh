#!/usr/bin/env bash
# FlashInfer for the decode baselines (bench/decode_baselines.py) on the GPU
# machine, which has no network: downloads flashinfer-python and the few
# packages its import needs (for the GPU image's python 3.12), and splits the
# 101 MB wheel in two, because one device call carries at most 64 MiB with
# the tree (~13 MiB; part a is 50 MiB, part b with the small wheels 50.3:
# each call fits, ~1 MB to spare):
#   .carry-wheels/a: the wheel's first part and its SHA256;
#   .carry-wheels/b: the second part and the small wheels.
# On the GPU machine, three calls back to back (each while the machine is
# still warm): `GPU_CHECKS_ONLY=stash bash scripts/gpu_checks.sh` with carry
# [".carry-wheels/a"] keeps part a in .stash/, the same with carry
# [".carry/debs"] keeps the -dev packages, then the kernels call with carry
# [".carry-wheels/b"] joins, checks and installs the wheel.
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
rm -rf .carry-wheels && mkdir -p .carry-wheels/a .carry-wheels/b
wheel=$(ls "$work"/flashinfer_python-*.whl)
(cd "$work" && sha256sum "$(basename "$wheel")") > .carry-wheels/a/SHA256
split -b 50M -a 1 "$wheel" "$work/part-"
mv "$work/part-a" .carry-wheels/a/flashinfer.part-a
mv "$work/part-b" .carry-wheels/b/flashinfer.part-b
find "$work" -maxdepth 1 -name '*.whl' ! -name 'flashinfer_python-*' -exec mv {} .carry-wheels/b/ \;
du -sh .carry-wheels/a .carry-wheels/b
