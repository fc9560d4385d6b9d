#!/usr/bin/env bash
# Sets up and builds (scripts/setup.sh), then runs the whole test suite.
# Usage: scripts/test.sh [ctest arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"
