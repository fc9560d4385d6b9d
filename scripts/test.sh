#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh), then runs the whole test suite,
# which includes the low-precision tests once per forced CPU kernel family
# (ctest label low_precision; tests/CMakeLists.txt). Set CI=true to make the
# h5py readers and chromium (the HTML report's rendering test) required.
# Usage: scripts/test.sh [ctest arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
status=0
ctest --test-dir build --output-on-failure -j "$(nproc)" "$@" || status=$?
if [[ $status -ne 0 ]]; then
  echo "==== why the failed tests failed (their output is also above, where each ended) ===="
  scripts/failed_test_output.sh build
fi
exit "$status"
