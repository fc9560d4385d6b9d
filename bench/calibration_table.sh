#!/usr/bin/env bash
# The calibration table on pyllama-16m: every method's published default
# (kvquant, kivi, int2-rot, rtn) at 2, 3 and 4 bits beside kvforge's own
# variants (KIVI's keys with the sliding window; KVQuant with per-head tau
# value outliers, with iterated Q-Norm, and with both, as kvforge had it) and
# the KVQuant ablations (uniform grid, no Fisher weighting, no outliers),
# fitted on captures of calib.txt and measured on captures of heldout.txt,
# with effective bits at the nominal and at the held-out outlier fractions.
# Also draws results/error-vs-bits-pyllama-16m.png (plot_error_vs_bits.py; needs matplotlib, installed if missing).
# Writes bench/results/calibration-pyllama-16m.{md,json}.
# Usage: bench/calibration_table.sh
#   env: SAMPLES, SEQ, HELDOUT_SAMPLES, BITS (default 2,3,4), DEVICE, KV, KVFORGE_SHARED, WORK, RESULTS
set -euo pipefail
cd "$(dirname "$0")/.."
KV=${KV:-build/tools/kvforge}
SHARED=${KVFORGE_SHARED:-../shared}
MODEL=$SHARED/models/pyllama-16m
CALIB_DATA=$SHARED/data/calib.txt
HELDOUT_DATA=$SHARED/data/heldout.txt
WORK=${WORK:-out/calibration-table}
RESULTS=${RESULTS:-bench/results}
SAMPLES=${SAMPLES:-16}
SEQ=${SEQ:-2048}
HELDOUT_SAMPLES=${HELDOUT_SAMPLES:-8}
BITS=${BITS:-2,3,4}
DEVICE=${DEVICE:-cpu}
mkdir -p "$WORK" "$RESULTS"

[ -f "$WORK/calib.h5" ] || $KV capture --model "$MODEL" --data "$CALIB_DATA" --samples "$SAMPLES" \
  --seq-len "$SEQ" --seed 0 --device "$DEVICE" --out "$WORK/calib.h5"
[ -f "$WORK/heldout.h5" ] || $KV capture --model "$MODEL" --data "$HELDOUT_DATA" --samples "$HELDOUT_SAMPLES" \
  --seq-len "$SEQ" --seed 1 --device "$DEVICE" --fields q,k_pre,k_post,v --out "$WORK/heldout.h5"

ART=$WORK/artifact.h5
rm -f "$ART"
fit() { $KV calibrate --acts "$WORK/calib.h5" --out "$ART" --append --bits "$BITS" "$@"; }
# The published methods (each method's default).
fit --method kvquant,kivi,int2-rot,rtn
# kvforge's variants (named METHOD-Nbit-SUFFIX by calibrate).
fit --method kivi --key-window sliding
fit --method kvquant --value-outliers tau --value-scaling head
fit --method kvquant --q-norm iterated
fit --method kvquant --value-outliers tau --value-scaling head --q-norm iterated
# KVQuant ablations of the paper default.
fit --method kvquant --name uniform --uniform
fit --method kvquant --name no-fisher --no-fisher
fit --method kvquant --name no-outliers --outliers 0
$KV inspect "$ART" --acts "$WORK/heldout.h5" --json > "$WORK/inspect.json"

python3 bench/format_calibration_table.py "$WORK/inspect.json" \
  --command "bench/calibration_table.sh (SAMPLES=$SAMPLES SEQ=$SEQ HELDOUT_SAMPLES=$HELDOUT_SAMPLES BITS=$BITS DEVICE=$DEVICE)" \
  --commit "$(git rev-parse --short HEAD)" --machine "$(nproc) cores, $(uname -m), $DEVICE" \
  --model "$(basename "$MODEL")" --calib-data "$(basename "$CALIB_DATA")" --calib-windows "$SAMPLES" \
  --heldout-data "$(basename "$HELDOUT_DATA")" --heldout-windows "$HELDOUT_SAMPLES" --seq-len "$SEQ" \
  --json-out "$RESULTS/calibration-pyllama-16m.json" > "$RESULTS/calibration-pyllama-16m.md"
echo "wrote $RESULTS/calibration-pyllama-16m.md"

# The error-versus-effective-bits plot: methods compared at equal bits.
python3 -c 'import matplotlib' 2>/dev/null || python3 -m pip install -q matplotlib
python3 bench/plot_error_vs_bits.py "$RESULTS/calibration-pyllama-16m.json" --out "$RESULTS/error-vs-bits-pyllama-16m.png"
echo "wrote $RESULTS/error-vs-bits-pyllama-16m.png"
