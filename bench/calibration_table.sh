#!/usr/bin/env bash
# The calibration table: every method at 2, 3 and 4 bits on pyllama-16m,
# fitted on captures of calib.txt and measured on captures of heldout.txt,
# with the KVQuant ablations (uniform grid, no Fisher weighting, no
# outliers). Writes bench/results/calibration-pyllama-16m.{md,json}.
# Usage: bench/calibration_table.sh   (env: SAMPLES, SEQ, HELDOUT_SAMPLES, DEVICE, KV, KVFORGE_SHARED)
set -euo pipefail
cd "$(dirname "$0")/.."
KV=${KV:-build/tools/kvforge}
SHARED=${KVFORGE_SHARED:-../shared}
MODEL=$SHARED/models/pyllama-16m
WORK=${WORK:-out/calibration-table}
SAMPLES=${SAMPLES:-16}
SEQ=${SEQ:-2048}
HELDOUT_SAMPLES=${HELDOUT_SAMPLES:-8}
DEVICE=${DEVICE:-cpu}
mkdir -p "$WORK" bench/results

[ -f "$WORK/calib.h5" ] || $KV capture --model "$MODEL" --data "$SHARED/data/calib.txt" --samples "$SAMPLES" \
  --seq-len "$SEQ" --seed 0 --device "$DEVICE" --out "$WORK/calib.h5"
[ -f "$WORK/heldout.h5" ] || $KV capture --model "$MODEL" --data "$SHARED/data/heldout.txt" --samples "$HELDOUT_SAMPLES" \
  --seq-len "$SEQ" --seed 1 --device "$DEVICE" --fields q,k_pre,k_post,v --out "$WORK/heldout.h5"

ART=$WORK/artifact.h5
rm -f "$ART"
$KV calibrate --acts "$WORK/calib.h5" --out "$ART" --method kvquant,kivi,int2-rot,rtn --bits 2,3,4
$KV calibrate --acts "$WORK/calib.h5" --out "$ART" --append --method kvquant --bits 2,3,4 --name uniform --uniform
$KV calibrate --acts "$WORK/calib.h5" --out "$ART" --append --method kvquant --bits 2,3,4 --name no-fisher --no-fisher
$KV calibrate --acts "$WORK/calib.h5" --out "$ART" --append --method kvquant --bits 2,3,4 --name no-outliers --outliers 0
$KV inspect "$ART" --acts "$WORK/heldout.h5" --json > "$WORK/inspect.json"

python3 bench/format_calibration_table.py "$WORK/inspect.json" \
  --command "bench/calibration_table.sh (SAMPLES=$SAMPLES SEQ=$SEQ HELDOUT_SAMPLES=$HELDOUT_SAMPLES DEVICE=$DEVICE)" \
  --commit "$(git rev-parse --short HEAD)" --machine "$(nproc) cores, $(uname -m), $DEVICE" \
  --json-out bench/results/calibration-pyllama-16m.json > bench/results/calibration-pyllama-16m.md
echo "wrote bench/results/calibration-pyllama-16m.md"
