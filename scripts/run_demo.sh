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

# On CPU a sample of windows keeps the demo to a few minutes; on a GPU the
# whole file (603 windows) takes seconds.
WINDOWS=()
[ "$DEVICE" = cpu ] && WINDOWS=(--max-windows 16)
echo "== kvforge perplexity ($DEVICE)"
$KV perplexity --model "$MODEL" --data "$HELDOUT" --ctx 2048 --batch 4 --device "$DEVICE" "${WINDOWS[@]}" \
  --json > "$OUT/perplexity.json"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"perplexity: {r['perplexity']:.4f} over {r['windows']} windows ({r['tokens_per_second']:.0f} tokens/s)\")" "$OUT/perplexity.json"

echo "== kvforge generate ($DEVICE)"
$KV generate --model "$MODEL" --prompt $'def fibonacci(n):\n' --max-new 32 --device "$DEVICE" | tee "$OUT/generate.txt"
# Calibration: capture what the cache holds on calibration text (with Fisher
# sensitivity) and on held-out text, fit every method at 2 bits into one
# artifact, and compare them on the held-out captures.
if [ "$DEVICE" = cpu ]; then SAMPLES=4; SEQ=512; else SAMPLES=16; SEQ=2048; fi
echo "== kvforge capture ($DEVICE): $SAMPLES x $SEQ tokens of calib.txt and of heldout.txt"
rm -f "$OUT/calib_acts.h5" "$OUT/heldout_acts.h5" "$OUT/calib_acts.h5.partial" "$OUT/heldout_acts.h5.partial"
$KV capture --model "$MODEL" --data "$SHARED/data/calib.txt" --samples $SAMPLES --seq-len $SEQ --device "$DEVICE" \
  --out "$OUT/calib_acts.h5"
$KV capture --model "$MODEL" --data "$HELDOUT" --samples $((SAMPLES / 2)) --seq-len $SEQ --seed 1 --device "$DEVICE" \
  --fields q,k_pre,k_post,v --out "$OUT/heldout_acts.h5"
$KV inspect "$OUT/calib_acts.h5" | tee "$OUT/acts_statistics.txt" | head -20

echo "== kvforge calibrate: kvquant, kivi, int2-rot, rtn at 2 bits"
$KV calibrate --acts "$OUT/calib_acts.h5" --out "$OUT/artifact.h5" --method kvquant,kivi,int2-rot,rtn --bits 2
echo "== kvforge inspect: the artifact, measured on held-out captures"
$KV inspect "$OUT/artifact.h5" --acts "$OUT/heldout_acts.h5" | tee "$OUT/artifact.txt"
echo "demo outputs in $OUT/"
