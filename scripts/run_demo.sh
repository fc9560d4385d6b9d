#!/usr/bin/env bash
# The main job end to end on the shared model: set up, build, then run
# kvforge on ../shared/models/pyllama-16m and the held-out text.
# Usage: scripts/run_demo.sh [--device cpu|cuda]
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cpu
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --device=*) DEVICE=${1#*=}; shift ;;
    *) echo "usage: $0 [--device cpu|cuda]" >&2; exit 2 ;;
  esac
done
SHARED=${KVFORGE_SHARED:-../shared}
MODEL=$SHARED/models/pyllama-16m
HELDOUT=$SHARED/data/heldout.txt
OUT=${KVFORGE_DEMO_OUT:-out/demo}

BUILD_DIR=${BUILD_DIR:-build}
[ -n "${KVFORGE_SKIP_SETUP:-}" ] || scripts/setup.sh "$BUILD_DIR"
KV=$BUILD_DIR/tools/kvforge
mkdir -p "$OUT"

echo "== kvforge info"
$KV info --model "$MODEL" | tee "$OUT/info.txt"

# The main job: capture calibration and held-out text, calibrate kvquant,
# kivi, int2-rot and rtn at 2 bits, learn rotations for int2-rot and
# kvquant, and evaluate every configuration beside the 16-bit cache
# (perplexity, KL, top-1, needles, post-W_O error): the artifact, the report,
# the evaluation's JSON and the log land in $OUT. On CPU the captures and the
# evaluation are sampled (8 x 512 tokens; windows of 512; needles up to 1024
# tokens): about 5 minutes on 2 cores; on a GPU 16 x 2048 and windows of 2048.
echo "== kvforge run ($DEVICE)"
$KV run --model "$MODEL" --calib "$SHARED/data/calib.txt" --heldout "$HELDOUT" --device "$DEVICE" --out "$OUT" \
  | tee "$OUT/table.txt"
echo "demo outputs in $OUT/: artifact.h5, report.html (open it in a browser), eval.json, run.log, table.txt"
