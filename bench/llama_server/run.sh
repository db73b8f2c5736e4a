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
# First what a hit costs against llama.cpp's own restore (integrations/llama/server/
# bench_restore_cost.cpp), when the build has it: medians of three repetitions, and the ratio
# kvfuse / llama at each prompt length.
restore=$build/integrations/llama/server/kvfuse_bench_llama_restore
if [ -x "$restore" ]; then
  out=$here/../../build/bench-results/llama_server
  mkdir -p "$out"
  OMP_WAIT_POLICY=PASSIVE "$restore" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/restore_cost.json" --benchmark_out_format=json
  python3 - "$out/restore_cost.json" <<'EOF'
import json, sys
rows = {b["run_name"]: b["real_time"] for b in json.load(open(sys.argv[1]))["benchmarks"] if b.get("aggregate_name") == "median"}
for name, t in sorted(rows.items()):
    if name.startswith("BM_restore_kvfuse/"):
        ref = rows.get(name.replace("kvfuse", "llama"))
        if ref:
            print(f"restore cost, {name.split('/')[1]} tokens: kvfuse {t:.0f} us, llama.cpp {ref:.0f} us, ratio {t / ref:.2f} (goal <= 1.2)")
EOF
else
  echo "kvfuse: $restore is not built; the restore-cost rows are skipped" >&2
fi
exec python3 "$here/run.py" --build-dir "$build" "$@"
