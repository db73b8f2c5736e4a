#!/usr/bin/env bash
# Runs every kvfuse benchmark binary in a directory, then prints one table of the ratios
# the ratios bench/README.md sets targets for, each with its target and PASS/MISS.
#
#   bench/run.sh [BENCH_DIR]        default: build/release/bench   (about a minute and a half on 2 cores)
#
# Every figure in the table comes from this run: each binary writes its results as JSON
# (--benchmark_out) next to its usual console table, and the table is read back from those
# files with awk (no python needed). Ratios whose two sides are timed inside one benchmark
# (kvfuse_bench_connector, kvfuse_bench_runtime) and the per-request costs of
# kvfuse_bench_coordinator are that benchmark's own counters; the others are computed here
# from two benchmarks of the same binary and the same run.
# Exit status: 1 if a binary failed, else 0; a missed target is reported (MISS, and a count
# at the end), not turned into a failure: timings on a shared machine are evidence, not a
# gate.
set -euo pipefail

dir=${1:-build/release/bench}
min_time=0.3
if [ ! -d "$dir" ]; then
  echo "run.sh: no such directory: $dir" >&2
  echo "  build: cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release && cmake --build build/release" >&2
  exit 2
fi

out=$(mktemp -d "${TMPDIR:-/tmp}/kvfuse-bench.XXXXXX")
trap 'rm -rf "$out"' EXIT

status=0
ran=0
for bin in "$dir"/kvfuse_bench_*; do
  [ -f "$bin" ] && [ -x "$bin" ] || continue
  name=$(basename "$bin")
  echo "=== $name ==="
  if ! "$bin" --benchmark_min_time="$min_time" --benchmark_out="$out/$name.json" --benchmark_out_format=json; then
    echo "run.sh: $name failed" >&2
    status=1
  fi
  ran=$((ran + 1))
  echo
done
if [ "$ran" -eq 0 ]; then
  echo "run.sh: no kvfuse_bench_* binaries in $dir" >&2
  exit 2
fi

# metric BINARY BENCHMARK KEY: the value of KEY in the run named exactly BENCHMARK of
# BINARY's JSON output; real_time and cpu_time converted to nanoseconds. Prints nothing if
# the binary, the run or the key is absent, or the run reported an error.
metric() {
  local file="$out/$1.json"
  [ -f "$file" ] || return 0
  awk -v want="$2" -v key="$3" '
    function value(line) {
      sub(/^[ \t]*"[^"]*": */, "", line)
      sub(/,?[ \t\r]*$/, "", line)
      gsub(/"/, "", line)
      return line
    }
    function flush() {
      if (cur == want && v != "" && !failed) {
        if (key == "real_time" || key == "cpu_time") v *= (u == "us" ? 1e3 : u == "ms" ? 1e6 : u == "s" ? 1e9 : 1)
        printf "%.10g\n", v
        found = 1
      }
    }
    /^[ \t]*"name": / { flush(); if (found) exit; cur = value($0); v = ""; u = ""; failed = 0; next }
    cur != want { next }
    /^[ \t]*"error_occurred": true/ { failed = 1 }
    /^[ \t]*"time_unit": / { u = value($0) }
    { t = $0; sub(/^[ \t]*/, "", t); if (index(t, "\"" key "\": ") == 1) v = value($0) }
    END { if (!found) flush() }
  ' "$file"
}

# calc EXPR: awk arithmetic on numbers already fetched (empty operands give empty output).
calc() { awk "BEGIN { printf \"%.6g\", $1 }"; }

# row LABEL VALUE UNIT [OP TARGET]: one table line. OP is <, <=, > or >= (the value must
# satisfy "VALUE OP TARGET"); without OP the row is informative.
misses=0 targets=0
row() {
  local label=$1 value=$2 unit=$3 op=${4:-} target=${5:-} shown verdict=""
  [ -n "$op" ] && targets=$((targets + 1))
  if [ -z "$value" ]; then
    printf '  %-64s %12s  %-12s %s\n' "$label" "n/a" "${op:+$op $target $unit}" "${op:+(did not run)}"
    [ -n "$op" ] && misses=$((misses + 1))
    return 0
  fi
  shown=$(awk -v v="$value" -v unit="$unit" \
    'BEGIN { printf (unit == "x" || v < 1 ? "%.3f" : v >= 100 ? "%.0f" : v >= 10 ? "%.1f" : "%.2f"), v }')
  if [ -n "$op" ]; then
    if awk -v v="$value" -v t="$target" -v op="$op" \
      'BEGIN { exit !((op == "<" && v < t) || (op == "<=" && v <= t) || (op == ">" && v > t) || (op == ">=" && v >= t)) }'; then
      verdict=PASS
    else
      verdict=MISS
      misses=$((misses + 1))
    fi
  fi
  printf '  %-64s %12s  %-12s %s\n' "$label" "$shown $unit" "${op:+$op $target $unit}" "$verdict"
}

# Fetch with a fallback to empty, so one missing number never aborts the table.
m() { metric "$@" || true; }
ratio() { # ratio NUMERATOR DENOMINATOR (either empty -> empty)
  if [ -n "$1" ] && [ -n "$2" ]; then calc "$1 / $2"; fi
}
div() { # div VALUE DIVISOR (unit conversion; empty -> empty)
  if [ -n "$1" ]; then calc "$1 / $2"; fi
}

idx=kvfuse_bench_offload_index comp=kvfuse_bench_completion conn=kvfuse_bench_connector
rt=kvfuse_bench_runtime tiers=kvfuse_bench_tiers coord=kvfuse_bench_coordinator
dense=BM_DenseVsHandWritten hit=BM_LoadVsMemcpy64MiB

load=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
echo "== kvfuse: the targets table (bench/README.md), every figure from this run ($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, load average $load) =="
printf '  %-64s %12s  %-12s %s\n' "what" "measured" "target" ""
echo "  -- engine index (kvfuse_bench_offload_index)"
row "stats() with the full audit, 2^20 indexed hashes" "$(m $idx BM_Stats/1048576 real_time)" ns "<" 1000
row "fail 2048 outstanding loads in one step" "$(div "$(m $idx BM_FailAll2048/manual_time real_time)" 1e6)" ms "<" 0.5
row "request_load + settle pair, median (hot hash)" \
  "$(m $idx BM_RequestLoadCompletePair/cold:0/repeats:5_median real_time)" ns "<" 200
row "request_load + settle pair, median (cold hash of 2^20)" \
  "$(m $idx BM_RequestLoadCompletePair/cold:1/repeats:5_median real_time)" ns
echo "  -- completion path (kvfuse_bench_completion)"
row "records drained + merged through lane queues and quorum, 8 ranks" \
  "$(div "$(m $comp BM_DrainMerge/8/manual_time items_per_second)" 1e6)" M/s ">=" 10
row "pushed + drained + merged on one thread, 8 ranks" "$(div "$(m $comp BM_PushDrainMerge/8 items_per_second)" 1e6)" M/s
row "producer thread + engine thread, 8 ranks" "$(div "$(m $comp BM_Threaded/8/real_time items_per_second)" 1e6)" M/s
echo "  -- engine loop (kvfuse_bench_coordinator; 8 ranks, 16-chunk K3 joint loads, no copies; 5 repetitions)"
creq=BM_CoordinatorRequest/ranks_inline/checkpoints:1/repeats:5/manual_time
row "coordinator per request: admit..unpark + finish, median" "$(m $coord ${creq}_median ns_per_request)" ns "<=" 1000
row "  fastest repetition" "$(m $coord ${creq}_min ns_per_request)" ns
row "  slowest repetition" "$(m $coord ${creq}_max ns_per_request)" ns
row "  admit: plan, ticket, LoadRequest, 8 record pushes, park" "$(m $coord ${creq}_median admit_ns)" ns
row "  step: drain, 8-record quorum merge, settle, unpark" "$(m $coord ${creq}_median step_ns)" ns
row "  finish: nothing new to save, release" "$(m $coord ${creq}_median finish_ns)" ns
row "  heap allocations per request, scheduler thread" "$(m $coord ${creq}_median allocs_per_request)" allocs
row "coordinator per request, record pushes not timed" \
  "$(m $coord BM_CoordinatorRequest/ranks_untimed/checkpoints:1/repeats:5/manual_time_median ns_per_request)" ns
row "coordinator per request, 16 candidate checkpoints" \
  "$(m $coord BM_CoordinatorRequest/ranks_inline/checkpoints:16/repeats:5/manual_time_median ns_per_request)" ns
row "coordinator per request, records from a producer thread (wall)" \
  "$(m $coord BM_CoordinatorRequest/ranks_thread/checkpoints:1/repeats:5/manual_time_median ns_per_request)" ns
echo "  -- connector load path (kvfuse_bench_connector; medians, both sides timed in the same iterations)"
lat=BM_JointLoad/delay_us:2000/leg_KiB:64/apart:0/manual_time
bw=BM_JointLoad/delay_us:0/leg_KiB:16384
row "joint / max(kv, state), 2 ms tier latency per get, K3 lanes" "$(m $conn $lat joint_over_max)" x "<=" 1.10
row "serialized (state leg after_kv, one lane) / max(kv, state)" "$(m $conn $lat serial_over_max)" x
row "joint / max(kv, state), two 16 MiB memcpy legs, OS placement" "$(m $conn $bw/apart:0/manual_time joint_over_max)" x
row "joint / max(kv, state), two 16 MiB memcpy legs, lanes on 2 CPUs" "$(m $conn $bw/apart:1/manual_time joint_over_max)" x
row "serialized / max(kv, state), the same memcpy legs" "$(m $conn $bw/apart:0/manual_time serial_over_max)" x
row "dense connector / hand-written load, 64 x 1 MiB, one CPU" \
  "$(m $conn $dense/inline:1/chunks:64/one_cpu:1/manual_time conn_over_hand)" x "<=" 1.02
row "dense connector / hand-written load, 16 x 1 MiB, one CPU" \
  "$(m $conn $dense/inline:1/chunks:16/one_cpu:1/manual_time conn_over_hand)" x
row "  the same, connector minus hand-written (two thread hand-offs)" \
  "$(m $conn $dense/inline:1/chunks:16/one_cpu:1/manual_time overhead_us)" us
row "dense connector / hand-written load, 64 x 1 MiB, OS placement" \
  "$(m $conn $dense/inline:1/chunks:64/one_cpu:0/manual_time conn_over_hand)" x
row "hand-written, sync per chunk / sync once, threaded stream" \
  "$(m $conn $dense/inline:0/chunks:64/one_cpu:0/manual_time hand_over_one_sync)" x
row "load-path / memcpy bytes/s, 64 MiB memory-tier hit, inline stream" \
  "$(m $conn $hit/inline:1/one_cpu:1/manual_time load_over_memcpy)" x ">=" 0.90
row "  the same, threaded stream" "$(m $conn $hit/inline:0/one_cpu:1/manual_time load_over_memcpy)" x
row "  the same, inline stream, OS placement" "$(m $conn $hit/inline:1/one_cpu:0/manual_time load_over_memcpy)" x
row "  the same, threaded stream, OS placement" "$(m $conn $hit/inline:0/one_cpu:0/manual_time load_over_memcpy)" x
echo "  -- runtime and tiers (informative)"
row "HostRuntime copy_async / memcpy bytes/s, 64 MiB, 1 MiB ops, threaded" \
  "$(m $rt BM_CopyAsyncVsMemcpy/chunk_KiB:1024/inline:0/manual_time vs_memcpy)" x
row "HostRuntime copy_async / memcpy bytes/s, 64 MiB, 1 MiB ops, inline" \
  "$(m $rt BM_CopyAsyncVsMemcpy/chunk_KiB:1024/inline:1/manual_time vs_memcpy)" x
row "lane submit + join round trip" "$(div "$(m $rt BM_LaneRoundTrip real_time)" 1e3)" us
memcpy_bps=$(m $tiers memcpy_64MiB/real_time bytes_per_second)
row "MemoryTier hit + copy out / memcpy bytes/s, one 64 MiB entry" \
  "$(ratio "$(m $tiers memory_tier_hit_64MiB/real_time bytes_per_second)" "$memcpy_bps")" x
row "MemoryTier 32 x 2 MiB chunk hits + copies / memcpy bytes/s" \
  "$(ratio "$(m $tiers memory_tier_chunks/real_time bytes_per_second)" "$memcpy_bps")" x
row "DiskTier 4 MiB hit (page cache, checksummed) / memcpy bytes/s" \
  "$(ratio "$(m $tiers disk_tier_hit_4MiB/real_time bytes_per_second)" "$memcpy_bps")" x
echo "  standing staging bytes = lanes x buffer: asserted by the tests (R12), not timed here."

echo "  $((targets - misses)) of $targets targets met in this run."
exit "$status"
