#!/usr/bin/env bash
# Runs the side-by-side benchmark of llama-server's prompt cache: the stock
# llama-server and kvfuse-llama-server of a kvfuse build tree, each started on a free port in
# a temporary directory, replaying a multi-user chat and the first requests of the shipped
# Mooncake trace for the three tiny models; prints one table and writes the JSON that
# bench/plot.sh draws docs/img/llama_server_reuse.png from. The work is done by run.py
# (Python's standard library only; its --help lists the configurations and options).
#
#   bench/llama_server/run.sh [BUILD_DIR] [run.py options]   default BUILD_DIR: build/release
#
# STOCK_SERVER / KVFUSE_SERVER override the binaries; a missing binary skips its rows.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=build/release
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  build=$1
  shift
fi
exec python3 "$here/run.py" --build-dir "$build" "$@"
