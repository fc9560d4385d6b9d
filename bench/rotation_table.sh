#!/usr/bin/env bash
# The rotation table on pyllama-16m (issue 8): per layer, the held-out
# attention error of the key term (KL + lambda * post-W_O error, values
# exact) and of the value term (post-W_O error, exact keys) for the
# configuration as calibrated (no rotation), each fixed base (identity,
# Hadamard/QuaRot, OSCAR eigenbasis; every one with its quantizer refitted
# to the rotated data) and the learned OptR rotation, for the int2-rot
# layout and for kvquant (RoPE-commuting pair-angle keys, free values).
# Fitted on captures of calib.txt, measured on captures of heldout.txt.
# Writes bench/results/rotation-pyllama-16m.{md,json}.
# Usage: bench/rotation_table.sh
#   env: SAMPLES, SEQ, HELDOUT_SAMPLES, CONFIGS (default int2-rot-2bit,kvquant-2bit), DEVICE, KV, KVFORGE_SHARED,
#        WORK, RESULTS, ROTATE_FLAGS (extra flags for kvforge rotate)
set -euo pipefail
cd "$(dirname "$0")/.."
KV=${KV:-build/tools/kvforge}
SHARED=${KVFORGE_SHARED:-../shared}
MODEL=$SHARED/models/pyllama-16m
CALIB_DATA=$SHARED/data/calib.txt
HELDOUT_DATA=$SHARED/data/heldout.txt
WORK=${WORK:-out/calibration-table}   # shares the calibration table's captures
RESULTS=${RESULTS:-bench/results}
SAMPLES=${SAMPLES:-16}
SEQ=${SEQ:-2048}
HELDOUT_SAMPLES=${HELDOUT_SAMPLES:-8}
CONFIGS=${CONFIGS:-int2-rot-2bit,kvquant-2bit}
DEVICE=${DEVICE:-cpu}
mkdir -p "$WORK" "$RESULTS"

[ -f "$WORK/calib.h5" ] || $KV capture --model "$MODEL" --data "$CALIB_DATA" --samples "$SAMPLES" \
  --seq-len "$SEQ" --seed 0 --device "$DEVICE" --out "$WORK/calib.h5"
[ -f "$WORK/heldout.h5" ] || $KV capture --model "$MODEL" --data "$HELDOUT_DATA" --samples "$HELDOUT_SAMPLES" \
  --seq-len "$SEQ" --seed 1 --device "$DEVICE" --fields q,k_pre,k_post,v --out "$WORK/heldout.h5"

ART=$WORK/rotation-artifact.h5
rm -f "$ART"
$KV calibrate --acts "$WORK/calib.h5" --out "$ART" --bits 2 --method int2-rot,kvquant
start=$(date +%s)
$KV rotate --acts "$WORK/calib.h5" --model "$MODEL" --artifact "$ART" --config "$CONFIGS" --write-bases \
  --device "$DEVICE" --heldout-acts "$WORK/heldout.h5" --json "$WORK/rotation.json" ${ROTATE_FLAGS:-}
seconds=$(( $(date +%s) - start ))

python3 bench/format_rotation_table.py "$WORK/rotation.json" \
  --command "bench/rotation_table.sh (SAMPLES=$SAMPLES SEQ=$SEQ HELDOUT_SAMPLES=$HELDOUT_SAMPLES CONFIGS=$CONFIGS DEVICE=$DEVICE ROTATE_FLAGS='${ROTATE_FLAGS:-}')" \
  --commit "$(git rev-parse --short HEAD)" --machine "$(nproc) cores, $(uname -m), $DEVICE" --rotate-seconds "$seconds" \
  --model "$(basename "$MODEL")" --calib-windows "$SAMPLES" --heldout-windows "$HELDOUT_SAMPLES" --seq-len "$SEQ" \
  --json-out "$RESULTS/rotation-pyllama-16m.json" > "$RESULTS/rotation-pyllama-16m.md"
echo "wrote $RESULTS/rotation-pyllama-16m.md"
