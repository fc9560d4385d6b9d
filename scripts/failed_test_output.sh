#!/usr/bin/env bash
# Prints what each failed test of the last ctest run wrote, at most 60 lines a
# test: the assertion lines (gtest's "Failure" and the lines after it) where
# there are any, otherwise the end of its output. scripts/test.sh calls it
# after a failed run so that the reasons end the log (a CI log is often kept
# only from its end, where ctest lists the failed tests by name alone).
# Usage: scripts/failed_test_output.sh BUILD_DIR
set -euo pipefail
log="${1:?usage: $0 BUILD_DIR}/Testing/Temporary/LastTest.log"
[[ -f "$log" ]] || exit 0
awk '
  function flush(   i, shown) {
    if (!failed) return
    print "---- " name
    shown = 0
    for (i = 1; i <= count && shown < 60; ++i) if (mark[i]) { print lines[i]; ++shown }
    if (shown == 0) for (i = (count > 60 ? count - 59 : 1); i <= count; ++i) print lines[i]
  }
  /^[0-9]+\/[0-9]+ Testing: / { flush(); name = substr($0, index($0, "Testing: ") + 9); count = 0; failed = 0; after = 0; inside = 0; next }
  /<end of output>$/ { inside = 0; next }
  /^Output:$/ { inside = 1; getline; next }
  /^Test Failed/ { failed = 1; next }
  inside {
    lines[++count] = $0; mark[count] = 0
    if ($0 ~ /Failure$/ || $0 ~ /\[  FAILED  \]/ || $0 ~ /[Ee]xception/) after = 8
    if (after > 0) { mark[count] = 1; --after }
  }
  END { flush() }
' "$log"
