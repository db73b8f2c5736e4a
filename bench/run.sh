#!/usr/bin/env bash
# Runs every kvfuse benchmark binary in a directory and prints the targets table
# (bench/README.md). The work is done by bench/report.py, which reads each binary's JSON
# output with Python's json module (standard library only).
#
#   bench/run.sh [BENCH_DIR]        default: build/release/bench
set -euo pipefail
exec python3 "$(dirname "$0")/report.py" "$@"
