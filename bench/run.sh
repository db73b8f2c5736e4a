#!/usr/bin/env bash
# Runs every kvfuse benchmark binary in a directory (three repetitions each), then
# kvfuse-replay when it is built, and prints one table: the targets table of
# bench/README.md with PASS/MISS, and informative rows. The work is done by bench/report.py,
# which keeps each run's JSON and log in build/bench-results (read with Python's json
# module, standard library only); bench/plot.sh draws the plots from that JSON.
#
#   bench/run.sh [BENCH_DIR] [report.py options]   default BENCH_DIR: build/release/bench
set -euo pipefail
exec python3 "$(dirname "$0")/report.py" "$@"
