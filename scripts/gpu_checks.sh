#!/usr/bin/env bash
# One call on the GPU machine: build kvforge there and run every GPU check.
#   - the whole ctest suite, CUDA tests included (they skip on CPU machines);
#   - HF transformers' bf16 argmax made on the same GPU (make_cuda_reference.py)
#     against ours (CudaPyLlama test);
#   - full-file perplexity of pyllama-16m on heldout.txt on CUDA (bf16, fp32)
#     against transformers' on the same windows (committed fixtures), within 0.1%;
#   - the README's demo with --device cuda.
# Inputs: .carry/shared (models/pyllama-16m, data/*.txt) copied from ../shared,
# and optionally .carry/debs (-dev packages the image may lack; or .stash/debs,
# kept by a GPU_CHECKS_ONLY=stash call just before).
# Results go to $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
# GPU_CHECKS_ONLY=kernels is narrowed by: KERNEL_TESTS (the CUDA test
# binaries; empty: none), KERNEL_TEST_FILTER, SKIP_MATRIX, SKIP_TORCH_OPS, SKIP_SANITIZER,
# SANITIZER_TOOLS, SANITIZER_TESTS, SANITIZER_APPEND_FILTER, SANITIZER_DECODE_FILTER, SANITIZER_STEP_FILTER, SKIP_BASELINES, DECODE_BASELINES_ARGS,
# SKIP_DECODE_BENCH, DECODE_BENCH_ARGS, DECODE_BENCH_BF16, BASELINE_TAR,
# COMPARE_ARGS, COMPARE_FIRST, SKIP_PROFILE,
# PROFILE_METHODS, PROFILE_KERNEL, PROFILE_BENCH_FLAGS, PROFILE_BATCH, PROFILE_CONTEXTS,
# PROFILE_LAUNCHES, PROFILE_SKIP, PROFILE_SECTIONS, PROFILE_CACHE, PROFILE_APPEND, PROFILE_APPEND_METHODS, PROFILE_APPEND_BATCHES,
# PROFILE_APPEND_SKIP, PROFILE_APPEND_DURATIONS and
# BUILD_TARGETS, SKIP_BUILD, DECODE_BENCH_TIMEOUT (each explained where it is read below).
# $OUT gets the few result files (the device tool returns at most 8);
# every log lands in $LOGS, packed into $OUT/gpu-logs.tar.gz at the end.
OUT=$(realpath -m "${OUT:-out/gpu}")
LOGS=$(realpath -m "${LOGS:-out/gpu-logs}")
mkdir -p "$OUT" "$LOGS"
export KVFORGE_SHARED=$PWD/.carry/shared
status=0
step() { echo; echo "=== $*"; }
check() { if "$@"; then echo "ok: $*"; else echo "FAILED: $*"; status=1; fi; }

step machine
# The device tool's copy of the tree may carry a stale .git: the caller can
# name the commit (KVFORGE_COMMIT).
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; echo "${KVFORGE_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"; } | tee "$LOGS/machine.txt"

# FlashInfer's wheel (scripts/prepare_flashinfer_wheels.sh) comes in three
# parts, .carry-wheels/a, b and c, because one call carries at most 64 MiB
# with the tree: every call keeps the parts it carries in .stash/ (ignored,
# so they stay on the machine while it is warm), and the call that completes
# the set joins, checks and installs the wheel. The -dev packages
# (.carry/debs) are kept the same way.
# GPU_CHECKS_ONLY=stash: a call that only keeps what it carries and stops.
# The grid's sequence, back to back: stash with .carry-wheels/a and
# .carry/debs, the build with .carry-wheels/b, the grid with .carry-wheels/c
# and SKIP_BUILD=1.
mkdir -p .stash
kept=0
for part in .carry-wheels/*/; do
  [ -d "$part" ] || continue
  name=$(basename "$part")
  rm -rf ".stash/wheels-$name" && cp -r "$part" ".stash/wheels-$name" && kept=1
done
if [ -d .carry/debs ]; then rm -rf .stash/debs && cp -r .carry/debs .stash/debs && kept=1; fi
if [ "${GPU_CHECKS_ONLY:-}" = stash ]; then
  ls -la .stash/*
  [ $kept = 1 ] || { echo "gpu_checks (stash): neither .carry-wheels/<part> nor .carry/debs was carried"; exit 1; }
  echo "gpu_checks (stash): kept; call again back to back (the machine is released after a short idle time)"
  exit 0
fi

step dependencies
# FlashInfer for the decode baselines, once every part of its wheel has been
# kept (PARTS in part a says how many): joined, checked, installed without
# network (the small wheels, in the last part, only where the import is
# missing).
if [ -f .stash/wheels-a/PARTS ] && installed=$(python3 -c "import flashinfer; print(flashinfer.__version__)" 2> /dev/null); then
  echo "flashinfer $installed already installed (an earlier call)"
elif [ -f .stash/wheels-a/PARTS ]; then
  parts=(.stash/wheels-*/flashinfer.part-*)
  if [ "${#parts[@]}" = "$(cat .stash/wheels-a/PARTS)" ]; then
    wheel_dir=$(mktemp -d)
    wheel=$wheel_dir/$(awk '{print $2}' .stash/wheels-a/SHA256)
    cat "${parts[@]}" > "$wheel"
    if (cd "$wheel_dir" && sha256sum -c "$OLDPWD/.stash/wheels-a/SHA256" > /dev/null); then
      for pair in tvm_ffi:apache_tvm_ffi einops:einops tabulate:tabulate pynvml:nvidia_ml_py packaging:packaging \
                  click:click tqdm:tqdm; do
        python3 -c "import ${pair%%:*}" 2> /dev/null ||
          python3 -m pip install -q --no-index --no-deps .stash/wheels-*/"${pair#*:}"-*.whl
      done
      python3 -m pip install -q --no-index --no-deps "$wheel" &&
        python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, 'installed')"
    else
      echo "FlashInfer wheel: SHA256 mismatch (parts from different preparations?); baselines without it"
    fi
    rm -rf "$wheel_dir"
  else
    echo "FlashInfer wheel: ${#parts[@]} of $(cat .stash/wheels-a/PARTS) parts kept so far (${parts[*]})"
  fi
fi
debs=.stash/debs  # carried in this call or kept by one before
for pc in libpcre2-8 openssl; do
  if ! pkg-config --exists "$pc" && ls "$debs"/*.deb >/dev/null 2>&1; then
    echo "$pc missing: unpacking carried -dev packages ($debs)"
    for deb in "$debs"/*.deb; do dpkg -x "$deb" /; done
  fi
done

step build
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTORCH_CUDA_ARCH_LIST=9.0 \
  -DKVFORGE_SHARED_DIR="$KVFORGE_SHARED" > "$LOGS/configure.log" 2>&1 || { tail -30 "$LOGS/configure.log"; exit 1; }
# GPU_CHECKS_ONLY=rotation: only what kvforge rotate needs (a device call
# has 10 minutes; the whole build takes half of them).
if [ "${GPU_CHECKS_ONLY:-}" = kernels ]; then
  targets="--target test_runtime_kernels_cpu test_append_cuda test_decode_attention_cuda test_decode_attention_cuda_matrix test_decode_step_cuda test_step_append_fuses kvforge_bench_decode_attention"
  # The op library's CUDA test builds its artifact with the kvforge binary.
  [ -n "${SKIP_TORCH_OPS:-}" ] || targets="$targets kvforge kvforge_torch_ops"
elif [ "${GPU_CHECKS_ONLY:-}" = eval ]; then
  targets="--target kvforge test_cache_perplexity test_needle_probe"
elif [ "${GPU_CHECKS_ONLY:-}" = agree ]; then
  targets="--target kvforge"
elif [ "${GPU_CHECKS_ONLY:-}" = rotation ]; then
  targets="--target kvforge kvforge_bench_rotation test_rotation_fit test_rotation_objective test_differentiable_quantizer test_quantizers test_rotate_cli"
else
  targets=""
fi
# BUILD_TARGETS: only these (a benchmark-only call).
[ -z "${BUILD_TARGETS:-}" ] || targets="--target $BUILD_TARGETS"
# BASELINE_TAR (kernels mode): `git archive`s of other trees (one or
# several, space-separated), carried (e.g. in .carry/); each one's decode
# benchmark builds beside this tree's (in /tmp/kvforge-base/NAME, NAME the
# archive's name without .tar), and after the checks all run alternately
# with COMPARE_ARGS (compare_commits: the same-run comparisons of
# bench/README.md).
baseline_build=""
baseline_names=""
if [ "${GPU_CHECKS_ONLY:-}" = kernels ] && [ -n "${BASELINE_TAR:-}" ]; then
  rm -rf /tmp/kvforge-base && mkdir -p /tmp/kvforge-base
  for tar in $BASELINE_TAR; do
    name=$(basename "$tar" .tar)
    mkdir -p "/tmp/kvforge-base/$name" && tar -xf "$tar" -C "/tmp/kvforge-base/$name"
    baseline_names="$baseline_names $name"
  done
  (for name in $baseline_names; do  # side by side: each one's longest file is its critical path
     (cmake -S "/tmp/kvforge-base/$name" -B "/tmp/kvforge-base/$name/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DTORCH_CUDA_ARCH_LIST=9.0 -DKVFORGE_SHARED_DIR="$KVFORGE_SHARED" &&
      cmake --build "/tmp/kvforge-base/$name/build" -j "$(nproc)" --target kvforge_bench_decode_attention) &
   done
   failed=0
   for job in $(jobs -p); do wait "$job" || failed=1; done
   exit $failed) > "$LOGS/baseline_build.log" 2>&1 &
  baseline_build=$!
fi
# SKIP_BUILD=1: the binaries of a call just before on the same warm machine
# (build-gpu/ stays there between calls; the tree is copied again with new
# times, so ninja would rebuild it all): a benchmark-only call.
if [ -n "${SKIP_BUILD:-}" ]; then
  echo "build skipped (SKIP_BUILD): build-gpu/ from an earlier call"
  [ -x build-gpu/bench/kvforge_bench_decode_attention ] || { echo "SKIP_BUILD: no build-gpu/ on this machine"; exit 1; }
else
  cmake --build build-gpu -j "$(nproc)" $targets > "$LOGS/build.log" 2>&1 || { grep -E 'error|FAILED' -A5 "$LOGS/build.log" | head -60; exit 1; }
fi
KV=build-gpu/tools/kvforge
MODEL=$KVFORGE_SHARED/models/pyllama-16m
HELDOUT=$KVFORGE_SHARED/data/heldout.txt

rotation_checks() {
  step "rotation: CUDA tests"
  for t in test_quantizers test_rotation_objective test_rotation_fit test_differentiable_quantizer; do
    ./build-gpu/tests/$t --gtest_filter='*Cuda*' > "$LOGS/$t.log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |OK \]" "$LOGS/$t.log"
  done
  step "rotation benchmark: Llama-3-8B shapes, 16 x 2048 tokens, 80 steps"
  ./build-gpu/bench/kvforge_bench_rotation --device cuda --layers 32 --windows 16 --tokens 2048 --steps 80 \
    --budget "${ROTATION_BENCH_BUDGET:-150}" --out "$OUT/rotation_bench.json" > "$LOGS/rotation_bench.log" 2>&1 || status=1
  tail -25 "$LOGS/rotation_bench.log"
  step "rotation: kvforge rotate --device cuda on pyllama-16m (16 x 2048 calibration, 8 x 2048 held-out captures)"
  $KV capture --quiet --model "$MODEL" --data "$KVFORGE_SHARED/data/calib.txt" --samples 16 --seq-len 2048 --seed 0 \
    --device cuda --out /tmp/calib.h5 > "$LOGS/rot_capture.log" 2>&1 || status=1
  $KV capture --quiet --model "$MODEL" --data "$HELDOUT" --samples 8 --seq-len 2048 --seed 1 --device cuda \
    --fields q,k_pre,k_post,v --out /tmp/heldout.h5 >> "$LOGS/rot_capture.log" 2>&1 || status=1
  $KV calibrate --quiet --acts /tmp/calib.h5 --out /tmp/art.h5 --method int2-rot,kvquant --bits 2 \
    > "$LOGS/rot_calibrate.log" 2>&1 || status=1
  start=$(date +%s.%N)
  $KV rotate --acts /tmp/calib.h5 --model "$MODEL" --artifact /tmp/art.h5 --config int2-rot-2bit,kvquant-2bit \
    --device cuda --write-bases --heldout-acts /tmp/heldout.h5 --json "$OUT/rotate_pyllama_cuda.json" \
    > "$LOGS/rotate_cuda.log" 2>&1 || { tail -5 "$LOGS/rotate_cuda.log"; status=1; }
  python3 -c "print('kvforge rotate --device cuda wall seconds (2 configs, 5 layers, bases + learned + held-out):', round($(date +%s.%N) - $start, 1))" | tee -a "$OUT/rotate_pyllama_cuda_time.txt"
  grep -E "done in|validation" "$LOGS/rotate_cuda.log" | tail -12
}
eval_checks() {
  step "eval: CUDA tests"
  for t in test_cache_perplexity test_needle_probe; do
    ./build-gpu/tests/$t --gtest_filter='*Cuda*:*FullPrecision*' > "$LOGS/$t.log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |OK \]|Failure" "$LOGS/$t.log"
  done
  step "kvforge run --device cuda on pyllama-16m (the main job)"
  start=$(date +%s.%N)
  timeout "${RUN_TIMEOUT:-330}" $KV run --model "$MODEL" --calib "$KVFORGE_SHARED/data/calib.txt" --heldout "$HELDOUT" \
    --device cuda --out /tmp/run > "$OUT/run_stdout.txt" 2> "$LOGS/run.log" || { tail -5 "$LOGS/run.log"; status=1; }
  python3 -c "print('kvforge run --device cuda wall seconds:', round($(date +%s.%N) - $start, 1))" | tee -a "$OUT/run_stdout.txt"
  cat "$OUT/run_stdout.txt"
  cp /tmp/run/eval.json /tmp/run/report.html "$OUT/" 2>/dev/null
  grep -E "done in|stage" "$LOGS/run.log" | tail -12
}
# Issue 9: `kvforge eval --through-kernels` against the simulated cache on
# the same GPU, every token a decoding step, compared needle by needle
# (scripts/compare_eval_runs.py; docs/evaluation.md). fp32 compares the
# kernels' arithmetic with the simulation's (as the CPU test does); bf16 is
# the serving dtype, where the simulation also rounds dequantized values to
# bf16 and attends in bf16 while the kernels keep float32: expect near-ties
# to break there (its margins say which). Artifact: $AGREE_ARTIFACT, else
# .carry/artifact.h5. The default workload (2 perplexity windows of 512,
# needles at 256 and 512 tokens: 24 probes per configuration) fits one
# device call with the build: at every token a decoding step, the simulated
# run and the build alone took 280 s on the H200 with 4 windows and 1024.
# AGREE_WINDOWS / AGREE_CONTEXTS widen it.
agree_checks() {
  local artifact=${AGREE_ARTIFACT:-.carry/artifact.h5}
  local flags="--model $MODEL --data $HELDOUT --artifact $artifact --device cuda --chunk 1 --prefill-chunk 1 --ctx 512 --max-windows ${AGREE_WINDOWS:-2} --needle-contexts ${AGREE_CONTEXTS:-256,512} --needle-depths 0,0.5,1 --needle-probes 4 --configs ${AGREE_CONFIGS:-kvquant-2bit,kivi-2bit,int2-rot-2bit,rtn-2bit} ${AGREE_FLAGS:-}"
  for dtype in ${AGREE_DTYPES:-fp32 bf16}; do
    step "eval --through-kernels vs the simulated cache, cuda $dtype"
    start=$(date +%s.%N)
    $KV eval --quiet $flags --dtype $dtype --json "$OUT/agree_simulated_$dtype.json" > "$LOGS/agree_simulated_$dtype.log" 2>&1 \
      || { tail -5 "$LOGS/agree_simulated_$dtype.log"; status=1; }
    $KV eval --quiet $flags --dtype $dtype --through-kernels --json "$OUT/agree_kernels_$dtype.json" \
      > "$LOGS/agree_kernels_$dtype.log" 2>&1 || { tail -5 "$LOGS/agree_kernels_$dtype.log"; status=1; }
    python3 -c "print('wall seconds (both runs):', round($(date +%s.%N) - $start, 1))"
    check python3 scripts/compare_eval_runs.py "$OUT/agree_simulated_$dtype.json" "$OUT/agree_kernels_$dtype.json"
  done
}
# The end of a GPU_CHECKS_ONLY mode: the logs packed into $OUT, the verdict,
# the exit status.
finish_mode() {
  tar -czf "$OUT/gpu-logs.tar.gz" --exclude='*.safetensors' --exclude='*.h5' --exclude='*.ncu-rep' --exclude='*.csv' -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
  echo; echo "gpu_checks ($1): $([ $status = 0 ] && echo PASSED || echo FAILED)"
  exit $status
}
kernel_checks() {
  step "kernels: CUDA append and decode attention against the CPU reference"
  # test_append_cuda: 18 layouts byte-equal after every append, then batch 64
  # of mixed lengths and a 128K context (AppendCudaLarge); the decode matrix:
  # the issue's covering design and 64K/128K contexts, a line of worst ratios
  # per case ("[ case ] ..."). SKIP_MATRIX=1 leaves the matrix out.
  # KERNEL_TESTS names others (empty: none); KERNEL_TEST_FILTER narrows
  # their cases (a gtest filter).
  # test_decode_step_cuda: decode_step (an append and the decode over it in
  # one call) against append then decode_attention, bit for bit;
  # test_step_append_fuses (host code) which steps it runs in one launch.
  kernel_tests="test_append_cuda test_decode_attention_cuda test_decode_step_cuda test_step_append_fuses"
  [ -n "${SKIP_MATRIX:-}" ] || kernel_tests="$kernel_tests test_decode_attention_cuda_matrix"
  kernel_tests=${KERNEL_TESTS-$kernel_tests}
  for t in $kernel_tests; do
    if [ -x ./build-gpu/tests/$t ]; then
      start=$(date +%s)
      ./build-gpu/tests/$t --gtest_filter="${KERNEL_TEST_FILTER:-*}" > "$LOGS/$t.log" 2>&1 || { status=1; failed_tests="${failed_tests:-} $t"; }
      grep -E "^\[  (PASSED|FAILED|SKIPPED) |OK \]|Failure|^\[ [a-z]" "$LOGS/$t.log" | head -80
      echo "$t: $(( $(date +%s) - start )) s"
    else
      echo "FAILED: $t was not built"; status=1
    fi
  done
  if [ -z "${SKIP_TORCH_OPS:-}" ]; then
    step "kernels: the PyTorch op library on CUDA against its CPU cache (tests/test_torch_ops.py)"
    # The smallest repro of the crash seen on this image (2026-12-01: a
    # segfault in plain torch CPU ops right after load_library): which
    # libraries the op library brings (outside torch's own) and whether
    # loading it alone breaks torch.
    lib=build-gpu/kernels/libkvforge_torch_ops.so
    ldd "$lib" | grep -E "libstdc|libgcc" | awk '{print "  ldd:", $1, $3}'
    # A copy of libstdc++'s locale objects inside the library (a static
    # libstdc++) breaks std::regex beside torch's shared one (2026-12-01).
    echo "  the compiler's libstdc++.so: $(${CXX:-c++} -print-file-name=libstdc++.so)"
    echo "  libstdc++ internals defined in the library: $(nm -C --defined-only "$lib" | grep -c -E 'codecvt_c32|locale::_S_initialize')"
    timeout 60 python3 -X faulthandler -c "
import torch
x = torch.arange(0, 8, 2).float() / 8
torch.classes.load_library('$lib')
print('  load_library alone: torch CPU ops after it', (torch.arange(0, 8, 2).float() / 8).equal(x), flush=True)
" 2>&1 | tail -15
    # -V: the test's lines also when it passes; it prints a timed line before
    # each part and each CUDA call, and faulthandler the Python stack of a
    # crash, so the end of the log names where it stopped.
    if ctest --test-dir build-gpu -R '^test_torch_ops$' -V --output-on-failure > "$LOGS/test_torch_ops.log" 2>&1; then
      grep -E "^[0-9]+:   \(f0?\)|CUDA runtimes mapped|tests passed" "$LOGS/test_torch_ops.log" | head -24
    else
      status=1
      echo "FAILED: test_torch_ops; the end of its log:"
      tail -25 "$LOGS/test_torch_ops.log"
      # The native stack of the crash: cuda-gdb debugs host code too (the
      # image has no gdb).
      if command -v cuda-gdb > /dev/null; then
        echo "--- the test again under cuda-gdb: the native backtrace"
        timeout 240 cuda-gdb -q -batch -ex "set pagination off" -ex "handle SIGSEGV stop print" -ex run -ex bt \
          -ex "info symbol \$pc" --args python3 -u tests/test_torch_ops.py "$lib" "$KV" "$MODEL" \
          "$KVFORGE_SHARED/data/calib.txt" > "$LOGS/test_torch_ops_gdb.log" 2>&1
        grep -E "^#[0-9]+|SIGSEGV|received signal|in section" "$LOGS/test_torch_ops_gdb.log" | head -40
      fi
    fi
  fi
  if [ -z "${SKIP_SANITIZER:-}" ] && command -v compute-sanitizer > /dev/null; then
    step "kernels: compute-sanitizer memcheck and racecheck on the test sizes"
    # Small cases of both kernels: decode on six layouts (outliers and
    # pre-RoPE keys, sliding window and sink, plain, and int2-rot's rotated
    # sink and window beside the 64-token steps: the exact blocks, the
    # rotated merge of four heads a block; one case with an int8 split left
    # empty by a short sequence); append on seven (the
    # same three, int2-rot's rotations, the exhausted outlier pool, the
    # pipelined asynchronous appends, rtn and int2-rot through the
    # block-per-sequence kernel as well as the token-parallel one); and the
    # matrix's batches of 8 mixed lengths (1 to 8192 tokens) on both decode
    # kernels. SANITIZER_TOOLS narrows the tools (default memcheck racecheck).
    decode_filter='*rtn_2bit_d128_gqa1:*kivi_sliding_sink*:*kvquant_2bit_d128_gqa4'
    decode_filter="$decode_filter:*int8_steps64x4_int2rot_rotated_2bit_d128_gqa4:*int8_steps64x3_int2rot_rotated_4bit_d128_gqa4"
    decode_filter="$decode_filter:*int8_steps64x4_int2rot_rotated_merge_heads_2bit_d128_gqa4"
    decode_filter="$decode_filter:*int8_steps64x4_int2rot_rotated_bf16_rows_2bit_d64_gqa1:*int2rot_window_fp32_rows_4bit_d128_gqa8"
    # The exact kernel's blocks of several passes (their softmax state in
    # shared memory from pass to pass).
    decode_filter="$decode_filter:*int8_steps64x4_int2rot_rotated_chunk256_2bit_d128_gqa4"
    # Its tensor-core passes (bf16 rows) at GQA 8: the value tiles by cp.async and ldmatrix.
    decode_filter="$decode_filter:*int2rot_window_bf16_rows_4bit_d128_gqa8:*int8_int2rot_rotated_bf16_rows_2bit_d64_gqa8"
    # The int8 splits' cluster merge (distributed shared memory), empty
    # splits in a cluster among them.
    decode_filter="$decode_filter:*int8_steps64x4_rtn_4bit_d64_gqa1_page12_bf16io"
    # The lookup kernel (kvquant_2bit_d128_gqa4 above too): its 8-head
    # instantiation at 4 bits, and lengths around its steps at head_dim 64.
    decode_filter="$decode_filter:*lookup_kvquant_4bit_d128_gqa8:*lookup_kvquant_2bit_d64_gqa4_bf16io"
    # Its value corrections of lanes on one channel summed by a tree over
    # their ranks (every lane of a step on the same channels).
    decode_filter="$decode_filter:*lookup_kvquant_repeated_2bit_d128_gqa4"
    # The same sums in the int8 and bf16 tensor-core kernels (add_value_outliers).
    decode_filter="$decode_filter:*int8_rtn_outliers_repeated_2bit_d64_gqa4_page12:*rtn_groups32_outliers_repeated_4bit_d128_gqa8"
    decode_filter=${SANITIZER_DECODE_FILTER:-$decode_filter}
    append_filter='*AppendCuda.*/rtn_2bit_d128_gqa1:*AppendCuda.*/kivi_sliding_sink*:*AppendCuda.*/kvquant_2bit_d128_gqa4'
    append_filter="$append_filter:*AppendCuda.*/int2rot_rotated_2bit_d128_gqa4:AppendCudaOutlierPool.*:AppendCudaAsynchronous.*"
    # The token-parallel kernel takes rtn and int2-rot: their block-per-sequence runs too.
    append_filter="$append_filter:*AppendCuda.*/rtn_2bit_d128_gqa1_per_sequence:*AppendCuda.*/int2rot_rotated_2bit_d128_gqa4_per_sequence"
    # The rotated token kernel's ring of staged rows at head_dim 256 (32 chunks, 4 in flight).
    append_filter="$append_filter:*AppendCuda.*/int2rot_rotated_2bit_d256_gqa2"
    # KIVI's group completion over a ring that wraps inside the group (a group of 12, a ring of 11).
    append_filter="$append_filter:*AppendCuda.*/kivi_group12_2bit_d64_gqa4"
    # KIVI keys and values in two channel slices each, a block a slice (append_slices.h).
    append_filter="$append_filter:*AppendCuda.*/kivi_slices_residual0_2bit_d256_gqa2"
    # Per-token groups of 32 in a slice of 8 groups and a narrower one of 4 (append_slices.h).
    append_filter="$append_filter:*AppendCuda.*/rtn_groups32_slices_2bit_d192_gqa2"
    append_filter=${SANITIZER_APPEND_FILTER:-$append_filter}
    # decode_step's decode queued right behind its append: the int8 kernel
    # (rtn: the one-token steps' appends inside its launch, and from empty
    # sequences, where its warps write and read back the pages they open),
    # the exact ranges of a window (int2-rot), int2-rot's rotated appends in
    # the query rotation's kernel (its slices' turns over shared memory; 3
    # sequences from empty, the rotation before the exact blocks), the
    # lookup kernel (its short case: racecheck over the full one ran past
    # 270 s).
    step_filter=${SANITIZER_STEP_FILTER:-'*/rtn_2bit_d128_gqa4:*/rtn_from_empty_2bit_d128_gqa4:*/int2rot_window_2bit_d128_gqa4:*/int2rot_rotated_from_empty_2bit_d128_gqa4:*/kvquant_short_2bit_d128_gqa4'}
    matrix_filter='*kivi_sliding_sink_page12_2bit_d64_gqa1_batch8:*kvquant_tau_bf16_2bit_d64_gqa4_batch8:*int2rot_rotated_centred_4bit_d128_gqa8_batch8'
    for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
      for t in ${SANITIZER_TESTS:-test_decode_attention_cuda_matrix test_decode_attention_cuda test_append_cuda test_decode_step_cuda}; do
        case $t in
          test_append_cuda) filter=$append_filter ;;
          test_decode_step_cuda) filter=$step_filter ;;
          test_decode_attention_cuda_matrix) filter=$matrix_filter ;;
          *) filter=$decode_filter ;;
        esac
        compute-sanitizer --tool $tool --error-exitcode 9 --show-backtrace device ./build-gpu/tests/$t \
          --gtest_filter="$filter" > "$LOGS/sanitizer_${tool}_$t.log" 2>&1 || { echo "FAILED: $tool $t"; status=1; }
        echo "$tool $t:"; grep -m1 -A14 -E "^========= (Invalid|Error|Race|Misaligned)" "$LOGS/sanitizer_${tool}_$t.log"
        tail -2 "$LOGS/sanitizer_${tool}_$t.log"
      done
    done
  fi
}
# This tree's decode benchmark and each BASELINE_TAR's, alternately, twice
# each (COMPARE_ARGS: the benchmark's flags), into one file:
# $OUT/decode-compare.json (the runs' commits: new and the archives' names).
compare_commits() {
  step "decode attention: this tree against BASELINE_TAR ($baseline_names), alternately (${COMPARE_ARGS:-})"
  if ! wait "$baseline_build"; then
    echo "FAILED: the baselines' build"; grep -E 'error|FAILED' -A5 "$LOGS/baseline_build.log" | head -30; status=1; return
  fi
  local files=""
  for round in 1 2; do
    for which in new $baseline_names; do
      local bin=./build-gpu/bench/kvforge_bench_decode_attention
      [ $which = new ] || bin=/tmp/kvforge-base/$which/build/bench/kvforge_bench_decode_attention
      $bin ${COMPARE_ARGS:-} --commit "$which" --out "/tmp/compare_${which}_$round.json" > "$LOGS/compare_${which}_$round.log" 2>&1 ||
        { tail -5 "$LOGS/compare_${which}_$round.log"; status=1; }
      files="$files /tmp/compare_${which}_$round.json"
    done
  done
  python3 - "$OUT/decode-compare.json" $files <<'PY'
import json, sys
runs = [{"file": f, **json.load(open(f))} for f in sys.argv[2:]]
json.dump({"runs": runs}, open(sys.argv[1], "w"), indent=1)
table = {}
for run in runs:
    for r in run["rows"]:
        key = (r["method"], r["bits"], r["context"], r["batch"])
        table.setdefault(key, {}).setdefault(run["commit"], []).append(
            (r["time_us"], r.get("append_time_us", 0.0), r.get("append_device_us", 0.0)))
names = list(dict.fromkeys(run["commit"] for run in runs))
print("method bits context batch: decode/append/append-device us (rounds) of", " | ".join(names))
def cells(ts):
    return " ".join(f"{d:.1f}/{a:.1f}/{ad:.1f}" for d, a, ad in ts)
for key, t in sorted(table.items()):
    print(*key, ":", " | ".join(cells(t.get(name, [])) for name in names))
PY
}
if [ "${GPU_CHECKS_ONLY:-}" = kernels ]; then
  # COMPARE_FIRST=1: the comparison before the tests (a call that may run
  # out of time keeps the measurement).
  if [ -n "${COMPARE_FIRST:-}" ] && [ -n "$baseline_build" ]; then
    compare_commits
    kernel_checks
  else
    kernel_checks
    [ -z "$baseline_build" ] || compare_commits
  fi
  [ -n "${SKIP_BASELINES:-}" ] || { step "decode baselines: SDPA bf16, FlashInfer (if installed), copy bandwidth"
  timeout 300 python3 bench/decode_baselines.py --out "$OUT/decode_baselines.json" ${DECODE_BASELINES_ARGS:-} > "$LOGS/decode_baselines.log" 2>&1 \
    || { tail -3 "$LOGS/decode_baselines.log"; status=1; }
  tail -4 "$LOGS/decode_baselines.log"; }
  [ -n "${SKIP_DECODE_BENCH:-}" ] || { step "decode attention benchmark: the runtime kernels vs bf16 SDPA (and FlashInfer from the baselines)"
  baselines=""; [ -s "$OUT/decode_baselines.json" ] && baselines="--baselines $OUT/decode_baselines.json"
  # DECODE_BENCH_BF16=1: the bf16 tensor-core kernel's columns too (the
  # int8 kernel's predecessor, where the int8 one is the default).
  bf16_columns=""
  [ -z "${DECODE_BENCH_BF16:-}" ] || bf16_columns="--bf16-tensor-cores"
  # DECODE_BENCH_TIMEOUT (seconds, default none): a grid that may outlast
  # the call stops there; the rows it finished (one JSON line each on its
  # log) come back as $OUT/decode_attention_rows.jsonl.
  timeout "${DECODE_BENCH_TIMEOUT:-0}" ./build-gpu/bench/kvforge_bench_decode_attention --out "$OUT/decode_attention.json" ${DECODE_BENCH_ARGS:-} $bf16_columns \
    $baselines --commit "${KVFORGE_COMMIT:-unknown}" \
    --command "DECODE_BENCH_ARGS='${DECODE_BENCH_ARGS:-}' DECODE_BENCH_BF16='${DECODE_BENCH_BF16:-}' SKIP_BASELINES='${SKIP_BASELINES:-}' DECODE_BASELINES_ARGS='${DECODE_BASELINES_ARGS:-}' GPU_CHECKS_ONLY=kernels bash scripts/gpu_checks.sh" \
    > "$LOGS/decode_attention_bench.log" 2>&1 \
    || { tail -5 "$LOGS/decode_attention_bench.log"; status=1
         grep '^{' "$LOGS/decode_attention_bench.log" > "$OUT/decode_attention_rows.jsonl"; }
  tail -6 "$LOGS/decode_attention_bench.log"; }
  # Where the tensor-core kernel's time goes: Nsight Compute on one launch
  # (32K tokens, batch 8, 2 bits) per method in PROFILE_METHODS: occupancy,
  # warp stall reasons, issue rates and the hottest SASS lines. Clocks left
  # alone (--clock-control none), as the device notes ask.
  if [ -z "${SKIP_PROFILE:-}" ] && command -v ncu > /dev/null; then
    # PROFILE_SECTIONS replaces the sections (e.g. "SpeedOfLight LaunchStats"
    # with PROFILE_KERNEL="decode_|rotate_group": each kernel's duration,
    # quickly, and no per-line source export);
    # PROFILE_SKIP the matched launches skipped first (default 1: a warm-up;
    # a whole decode call's kernels with PROFILE_KERNEL matching them all);
    # PROFILE_CACHE=none keeps the caches as the kernel before left them
    # (ncu flushes them before each profiled kernel by default: the rotation
    # matrices and the split states then come from memory, which in a
    # decode call they do not).
    cache_flags="--cache-control ${PROFILE_CACHE:-all}"
    sections="SpeedOfLight Occupancy LaunchStats WarpStateStats SchedulerStats InstructionStats MemoryWorkloadAnalysis SourceCounters"
    section_flags=$(for s in ${PROFILE_SECTIONS:-$sections}; do printf -- '--section %s ' "$s"; done)
    # PROFILE_CONTEXTS: the contexts profiled (default 32768; e.g. "4096
    # 8192 32768" to tell a call's fixed cost from its walk). Each profile
    # puts two files in $OUT: keep the methods, batches and contexts few.
    for method in ${PROFILE_METHODS:-rtn}; do for batch in ${PROFILE_BATCH:-8}; do for context in ${PROFILE_CONTEXTS:-32768}; do
      name=$method; [ "${PROFILE_BATCH:-8}" = 8 ] || name=${method}_b$batch
      [ "${PROFILE_CONTEXTS:-32768}" = 32768 ] || name=${name}_c$context
      step "kernels: ncu profile of the decode kernel ${PROFILE_KERNEL:-decode_int8} ($method, $context tokens, batch $batch, 2 bits)"
      # PROFILE_KERNEL (a regex; default the int8 tensor-core kernel, the default) and
      # PROFILE_BENCH_FLAGS (e.g. --bf16-tensor-cores with PROFILE_KERNEL=decode_tensor_core)
      # profile another kernel of the same run; PROFILE_BATCH another batch
      # (1: where launches and latency, not the step loop, set the time) and
      # PROFILE_LAUNCHES more launches in a row (e.g. PROFILE_KERNEL=decode_
      # PROFILE_LAUNCHES=3: the exact ranges', the int8 and the merge kernel
      # of one decode call, each with its duration; "decode_|rotate_group"
      # adds int2-rot's query rotation: a bare "rotate" also matches the
      # bench's prefill append, append_token_rotated_kernel).
      timeout 150 ncu --clock-control none --kernel-name "regex:${PROFILE_KERNEL:-decode_int8}" --launch-skip "${PROFILE_SKIP:-1}" \
        --launch-count "${PROFILE_LAUNCHES:-1}" $section_flags $cache_flags \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        --import-source yes -f -o "$LOGS/ncu_$name" \
        ./build-gpu/bench/kvforge_bench_decode_attention --contexts "$context" --batches "$batch" --methods "$method" --bits 2 \
        --repeats 2 ${PROFILE_BENCH_FLAGS:-} --out /tmp/profile_bench.json > "$LOGS/ncu_$name.run.log" 2>&1 || { echo "ncu failed"; tail -5 "$LOGS/ncu_$name.run.log"; }
      ncu -i "$LOGS/ncu_$name.ncu-rep" --print-summary none > "$LOGS/ncu_$name.log" 2>&1
      # Per SASS instruction (with its CUDA line): executions and stall
      # samples, for the per-line breakdown of the tile loop (bench/README).
      if [ -z "${PROFILE_SECTIONS:-}" ]; then
        ncu -i "$LOGS/ncu_$name.ncu-rep" --page source --csv --print-source cuda,sass > "$LOGS/ncu_source_$name.csv" 2>&1 ||
          echo "ncu --page source failed: $(tail -1 "$LOGS/ncu_source_$name.csv")"
        gzip -kf "$LOGS/ncu_source_$name.csv" && cp "$LOGS/ncu_source_$name.csv.gz" "$OUT/" 2>/dev/null
      fi
      grep -E "^  void |Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issued Ipc|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Warp Cycles Per Issued|Memory Throughput|DRAM Throughput|Compute \(SM\)|Executed Instructions |Stall|stall|Dynamic Shared|Static Shared|Waves Per SM|Grid Size|Block Size|L1/TEX Hit|L2 Hit|Bank" "$LOGS/ncu_$name.log" | head -70
      cp "$LOGS/ncu_$name.log" "$OUT/ncu_$name.txt" 2>/dev/null
    done; done; done
  fi
  # The decode-step append kernel (one token per sequence, batch 1 and 32):
  # its duration and where its time goes. PROFILE_APPEND=1;
  # PROFILE_APPEND_METHODS (default rtn; int2-rot: the rotated token kernel)
  # and PROFILE_APPEND_BATCHES (default "1 32") narrow or widen it;
  # PROFILE_APPEND_SKIP (default 20) picks the profiled launch (the append
  # launches before it skipped), e.g. one that completes a KIVI key group.
  if [ -n "${PROFILE_APPEND:-}" ] && command -v ncu > /dev/null; then
    append_warm_up=20  # append launches skipped before the durations (and by default the profile)
    for method in ${PROFILE_APPEND_METHODS:-rtn}; do
      for batch in ${PROFILE_APPEND_BATCHES:-1 32}; do
        name="append_${method}_b$batch"
        append_bench=(./build-gpu/bench/kvforge_bench_decode_attention --contexts 4096 --batches "$batch"
                      --methods "$method" --bits 2 --repeats 2 --out /tmp/profile_append.json)
        step "kernels: ncu profile of the decode-step append kernel ($method, batch $batch, 2 bits)"
        timeout 120 ncu --clock-control none --kernel-name regex:append --launch-skip "${PROFILE_APPEND_SKIP:-$append_warm_up}" --launch-count 1 \
          --section SpeedOfLight --section LaunchStats --section WarpStateStats --section SchedulerStats \
          --section InstructionStats --section MemoryWorkloadAnalysis --section SourceCounters \
          --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
          --import-source yes -f -o "$LOGS/ncu_$name" \
          "${append_bench[@]}" > "$LOGS/ncu_$name.run.log" 2>&1 || { echo "ncu failed"; tail -5 "$LOGS/ncu_$name.run.log"; }
        ncu -i "$LOGS/ncu_$name.ncu-rep" --print-summary none > "$LOGS/ncu_$name.log" 2>&1
        ncu -i "$LOGS/ncu_$name.ncu-rep" --page source --csv --print-source cuda,sass > "$LOGS/ncu_source_$name.csv" 2>&1
        gzip -kf "$LOGS/ncu_source_$name.csv" && cp "$LOGS/ncu_source_$name.csv.gz" "$OUT/" 2>/dev/null
        grep -E "append|Duration|Registers Per|Grid Size|Block Size|Warp Cycles Per Issued|Executed Instructions |Dynamic Shared|Static Shared|Stall|stall|L2 Hit|Issue Slots Busy" "$LOGS/ncu_$name.log" | head -40
        cp "$LOGS/ncu_$name.log" "$OUT/ncu_$name.txt" 2>/dev/null
        # PROFILE_APPEND_DURATIONS=N: also the durations of N consecutive
        # decode-step appends (only gpu__time_duration, so each launch costs
        # little under ncu): where a per_channel_tokens layout (KIVI's keys)
        # completes a group every G steps, which launches carry its cost.
        if [ -n "${PROFILE_APPEND_DURATIONS:-}" ]; then
          timeout 120 ncu --clock-control none --kernel-name regex:append --launch-skip "$append_warm_up" \
            --launch-count "$PROFILE_APPEND_DURATIONS" --metrics gpu__time_duration.sum --csv \
            "${append_bench[@]}" > "$LOGS/ncu_durations_$name.csv" 2>&1 ||
            echo "ncu (durations) failed: $(tail -1 "$LOGS/ncu_durations_$name.csv")"
          python3 - "$LOGS/ncu_durations_$name.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if rows:
    head = rows[0]
    at = {k: head.index(k) for k in ("Kernel Name", "Metric Unit", "Metric Value")}
    print("append launch durations:", " ".join(r[at["Metric Value"]] + r[at["Metric Unit"]] for r in rows[1:]))
    print("kernels:", sorted({r[at["Kernel Name"]].split("(")[0] for r in rows[1:]}))
PY
        fi
      done
    done
  fi
  finish_mode kernels
fi
if [ "${GPU_CHECKS_ONLY:-}" = agree ]; then
  agree_checks
  finish_mode agree
fi
if [ "${GPU_CHECKS_ONLY:-}" = eval ]; then
  eval_checks
  finish_mode eval
fi
if [ "${GPU_CHECKS_ONLY:-}" = rotation ]; then
  rotation_checks
  finish_mode rotation
fi

step "HF transformers reference on this GPU"
check python3 scripts/make_cuda_reference.py --model "$MODEL" --text "$HELDOUT" --out "$LOGS/hf_cuda_reference.safetensors"

step ctest
export KVFORGE_HF_CUDA_REFERENCE=$LOGS/hf_cuda_reference.safetensors
# The forced CPU kernel families are CI's portability check, not the GPU's;
# with them the suite outlasts the device tool's 10-minute call.
ctest --test-dir build-gpu -j 8 -E '^cpu_family' --output-on-failure > "$LOGS/ctest.log" 2>&1 || status=1
tail -5 "$LOGS/ctest.log"
grep -E "agreement with transformers|Failed|FAILED" "$LOGS/ctest.log" | head -20
./build-gpu/tests/test_transformer --gtest_filter='CudaPyLlama*' 2>&1 | grep agreement

step "perplexity on CUDA, whole heldout.txt"
for dtype in bf16 fp32; do
  $KV perplexity --model "$MODEL" --data "$HELDOUT" --device cuda --dtype $dtype --batch 16 --json \
    > "$OUT/ppl_${dtype}.json" 2> "$LOGS/ppl_${dtype}.log" || { tail -3 "$LOGS/ppl_${dtype}.log"; status=1; }
done
check python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
ok = True
for dtype, ref_name in (("bf16", "bfloat16"), ("fp32", "float32")):
    ours = json.load(open(f"{out}/ppl_{dtype}.json"))
    ref = json.load(open(f"tests/fixtures/reference/pyllama_full_ppl_{ref_name}_cuda.json"))
    ref_ppl = ref.get("perplexity") or ref["results"]["perplexity"]
    rel = abs(ours["perplexity"] / ref_ppl - 1)
    line = (f"{dtype}: kvforge {ours['perplexity']:.5f} ({ours['windows']} windows, {ours['tokens_scored']} tokens, "
            f"{ours['tokens_per_second']:.0f} tok/s) vs transformers {ref_ppl:.5f}: relative difference {rel:.2e}")
    print(line)
    ok = ok and rel < 1e-3
sys.exit(0 if ok else 1)
PY

step "demo with --device cuda"
KVFORGE_DEMO_OUT=$LOGS/demo KVFORGE_SKIP_SETUP=1 BUILD_DIR=build-gpu bash scripts/run_demo.sh --device cuda > "$LOGS/demo.log" 2>&1 || status=1
tail -8 "$LOGS/demo.log"

step "capture on CUDA: pyllama-16m, 16 x 2048 calibration windows, all fields"
start=$(date +%s.%N)
$KV capture --model "$MODEL" --data "$KVFORGE_SHARED/data/calib.txt" --samples 16 --seq-len 2048 --device cuda \
  --out /tmp/acts.h5 > "$LOGS/capture.log" 2>&1 || status=1
tail -3 "$LOGS/capture.log"
ls -la /tmp/acts.h5 && python3 -c "print('capture wall seconds:', $(date +%s.%N) - $start)"

step "greedy decoding at batch 1: kvforge generate, and the decode benchmark (SDPA over the cache as baseline)"
$KV generate --model "$MODEL" --prompt "def fibonacci(n):" --max-new 256 --ignore-eos --device cuda --json \
  > "$OUT/generate_cuda.json" 2> "$LOGS/generate_cuda.log" || status=1
python3 -c "import json,sys; print({k: v for k, v in json.load(open(sys.argv[1])).items() if k in ('prefill_seconds', 'decode_tokens_per_second')})" "$OUT/generate_cuda.json"
./build-gpu/bench/kvforge_bench_decode --model "$MODEL" --device cuda --prompt 512 --new 256 \
  --out "$LOGS/decode_bench_pyllama.json" > "$LOGS/decode_bench_pyllama.log" 2>&1 || status=1
./build-gpu/bench/kvforge_bench_decode --layers 32 --device cuda --prompt 2048 --new 128 \
  --out "$LOGS/decode_bench_8b.json" > "$LOGS/decode_bench_8b.log" 2>&1 || status=1
python3 - "$LOGS" "$OUT/decode_bench.json" <<'PY' || status=1
import json, sys
runs = {name: json.load(open(f"{sys.argv[1]}/decode_bench_{name}.json")) for name in ("pyllama", "8b")}
json.dump(runs, open(sys.argv[2], "w"), indent=2)
for name, r in runs.items():
    a, g = r["attention_per_step_ms"], r["generate"]
    print(f"{name}: attention per step {a['sdpa_baseline']:.3f} ms (SDPA) vs {a['grouped_attention']:.3f} ms (grouped), "
          f"x{a['speedup']:.1f}; decode tok/s eager {g['eager']['decode_tokens_per_second']:.0f}, "
          f"sdpa {g['sdpa']['decode_tokens_per_second']:.0f}; prefill tok/s sdpa {g['sdpa']['prefill_tokens_per_second']:.0f}")
PY

# A fresh machine spends ~5 of the device tool's 10 minutes a call building:
# GPU_CHECKS_SKIP_BENCH=1 leaves the benchmark to a second call.
if [ -n "${GPU_CHECKS_SKIP_BENCH:-}" ]; then echo "benchmark skipped"; else
step "capture benchmark: Llama-3-8B shapes, random weights"
./build-gpu/bench/kvforge_bench_capture --device cuda --seq-len 2048 --iters 5 --store-dir /tmp \
  --long-context 32768 131072 --out "$OUT/capture_bench.json" > "$LOGS/capture_bench.log" 2>&1 || status=1
tail -60 "$LOGS/capture_bench.log"
fi

cp "$LOGS/ctest.log" "$OUT/"
tar -czf "$OUT/gpu-logs.tar.gz" --exclude='*.safetensors' --exclude='*.h5' -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
echo
echo "gpu_checks: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
