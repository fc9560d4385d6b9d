#!/usr/bin/env bash
# What a GPU call carries (carry [".carry"]), rebuilt on a fresh machine:
#   .carry/shared    a copy of ../shared (the model and the texts; 37 MB)
#   .carry/debs      the -dev packages the GPU image lacks (pcre2, openssl
#                    headers; gpu_checks unpacks them when pkg-config misses them)
#   .carry/artifact.h5  the artifact GPU_CHECKS_ONLY=agree evaluates, when
#                    out/demo/artifact.h5 exists (scripts/run_demo.sh)
# .carry is git-ignored. FlashInfer travels apart (prepare_flashinfer_wheels.sh).
# Usage: scripts/prepare_gpu_carry.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${KVFORGE_SHARED:-../shared}
mkdir -p .carry/debs
rm -rf .carry/shared && cp -r "$SHARED" .carry/shared
(cd .carry/debs && apt-get download libpcre2-dev libssl-dev libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 2> /dev/null)
[ -f out/demo/artifact.h5 ] && cp out/demo/artifact.h5 .carry/artifact.h5
du -sh .carry
