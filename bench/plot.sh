#!/usr/bin/env bash
# Draws the benchmark plots from the JSON a bench run left behind (bench/report.py writes
# it; `./make.sh bench` runs both):
#
#   docs/img/joint_latency.png      BM_JointSweep (kvfuse_bench_connector.json): Kimi-K3 joint
#                                   load latency against leg size, concurrent lanes versus
#                                   the state leg after KV
#   docs/img/reuse_vs_capacity.png  replay_capacity_<N>MiB.json and replay_capacity_unlimited.json
#                                   (bench/report.py's kvfuse-replay runs): the dense model's reused tokens
#                                   (hbm + tier) against the per-rank memory-tier capacity,
#                                   with the trace's reuse bound
#
#   docs/img/checkpoint_policies.png  replay_policy_*.json: for dsv4 and k3, reused tokens as a
#                                   share of the dense model's against state checkpoints saved per
#                                   request, one point per checkpoint policy
#   docs/img/state_eviction.png     replay_eviction_<eviction>_<N>.json: dsv4's reused share of
#                                   dense against the index's state capacity, lru against
#                                   spared_tokens
#
#   docs/img/cache_policy.png       cache_policies.json (bench/cache_policies.py): reuse as a share
#                                   of the trace's bound against the tier budget (a share of the
#                                   working set), dsv4 with large state and dense, lru against
#                                   cost against the offline reference (Belady)
#
#   docs/img/llama_server_reuse.png  llama_server/summary.json (bench/llama_server/run.py): the
#                                   stock llama-server and kvfuse-llama-server, prompt tokens
#                                   reused as a share of the workload's bound, per model and
#                                   cache configuration, chat and trace
#
#   bench/plot.sh [RESULTS_DIR [IMG_DIR]]   defaults: build/bench-results, docs/img of the repository
#
# A plot whose JSON is missing is skipped with a message (exit 0); exit 1 if there was
# nothing to draw at all. Python's json module reads the JSON; gnuplot (Debian's
# gnuplot-nox, terminal pngcairo) draws.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
results=$(realpath -m "${1:-$root/build/bench-results}")
img=$(realpath -m "${2:-$root/docs/img}")
command -v gnuplot >/dev/null || { echo "plot.sh: gnuplot not found (scripts/deps.sh installs gnuplot-nox)" >&2; exit 1; }
mkdir -p "$img"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
drawn=0

# ---- joint-load latency against leg size ----------------------------------------------------
# One line per size: leg MiB, concurrent ms, after-KV ms (medians of the repetitions).
python3 - "$results/kvfuse_bench_connector.json" >"$work/joint.dat" <<'PY' || true
import json, re, sys
try:
    with open(sys.argv[1], encoding="utf-8") as f:
        runs = json.load(f)["benchmarks"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"plot.sh: {sys.argv[1]}: {e}")
rows = {}
for b in runs:
    m = re.fullmatch(r"BM_JointSweep/chunks:(\d+)/us_per_chunk:(\d+)/manual_time(_median)?", b.get("name", ""))
    if not m or b.get("error_occurred") or b.get("skipped"):
        continue
    chunks = int(m.group(1))
    # the median of the repetitions wins over a single run
    if m.group(3) or chunks not in rows:
        rows[chunks] = (b["leg_KiB"] / 1024, b["joint_ms"], b["serial_ms"], int(m.group(2)))
if not rows:
    sys.exit(1)  # the shell says what was skipped
print(f"# us_per_chunk {next(iter(rows.values()))[3]}")
for chunks in sorted(rows):
    print("%g %g %g" % rows[chunks][:3])
PY
if grep -q '^[0-9]' "$work/joint.dat"; then
  us=$(sed -n 's/^# us_per_chunk //p' "$work/joint.dat")
  gnuplot <<GP
set terminal pngcairo size 900,560 enhanced font "sans,11"
set output "$img/joint_latency.png"
set title "Kimi-K3 joint load: KV leg of 1-64 chunks of 256 KiB, state entry of the same size\n(tier fetch ${us} µs per 256 KiB, plus the copies; one rank, median of the repetitions)"
set xlabel "size of each leg (MiB)"
set ylabel "load() to record drained (ms)"
set logscale xy 2
set xrange [0.2:20]
set xtics ("0.25" 0.25, "0.5" 0.5, "1" 1, "2" 2, "4" 4, "8" 8, "16" 16)
set format y "%g"
set grid
set key top left
plot "$work/joint.dat" using 1:2 with linespoints lw 2 pt 7 title "KimiK3Connector: state leg on its own lane (concurrent)", \
     "" using 1:3 with linespoints lw 2 pt 5 title "KimiK3SerialConnector: state leg after KV (one lane)"
GP
  echo "plot.sh: wrote $img/joint_latency.png"
  drawn=$((drawn + 1))
else
  echo "plot.sh: skipped joint_latency.png (no sweep in $results/kvfuse_bench_connector.json)"
fi

# ---- reused tokens against the tier's capacity ----------------------------------------------
# One line per capacity, smallest first, "unlimited" last: x position, label, hbm, tier,
# hbm + tier; a comment line carries the reuse bound.
python3 - "$results" >"$work/reuse.dat" <<'PY' || true
import glob, json, os, re, sys
points, bound = [], None
for path in glob.glob(os.path.join(sys.argv[1], "replay_capacity_*.json")):
    m = re.fullmatch(r"replay_capacity_(?:(\d+)MiB|unlimited)\.json", os.path.basename(path))
    if not m:
        continue
    cap = float("inf") if m.group(1) is None else int(m.group(1)) << 20
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        reused = doc["models"]["dense"]["reused_tokens"]
        hbm, tier = float(reused["hbm"]), float(reused["tier"])
        bound = float(doc["workload"]["reuse_bound_tokens"])
        requests = int(doc["workload"]["requests"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"plot.sh: {path}: {e}", file=sys.stderr)
        continue
    points.append((cap, hbm, tier))
if not points or bound is None:
    sys.exit(1)  # the shell says what was skipped
points.sort()
finite = [p[0] for p in points if p[0] != float("inf")]
print(f"# bound {bound:g}")
print(f"# requests {requests}")
xs = [max(finite) * 2 if p[0] == float("inf") else p[0] for p in points] if finite else [1 << 30]
print(f"# xrange {min(xs) / 2**20 / 1.3:g} {max(xs) / 2**20 * 1.3:g}")
for cap, hbm, tier in points:
    if cap == float("inf"):  # one doubling right of the largest finite capacity
        x, label = (max(finite) * 2 if finite else 1 << 30) / 2**20, "unlimited"
    else:
        x = cap / 2**20
        label = f"{x / 1024:g} GiB" if x >= 1024 else f"{x:g} MiB"
    print(f'{x:g} "{label}" {hbm:g} {tier:g} {hbm + tier:g}')
PY
if grep -q '^[0-9]' "$work/reuse.dat"; then
  bound=$(sed -n 's/^# bound //p' "$work/reuse.dat")
  requests=$(sed -n 's/^# requests //p' "$work/reuse.dat")
  read -r xmin xmax < <(sed -n 's/^# xrange //p' "$work/reuse.dat")
  gnuplot <<GP
set terminal pngcairo size 900,560 enhanced font "sans,11"
set output "$img/reuse_vs_capacity.png"
set title "Dense model, 2 ranks, memory tier only, ${requests} requests of the shipped trace:\nprompt tokens reused against the tier's capacity per rank (kvfuse-replay, no faults)"
set xlabel "memory-tier capacity per rank"
set ylabel "reused prompt tokens"
set logscale x 2
set xrange [${xmin}:${xmax}]
set format y "%.0s%c"
set yrange [0:${bound} * 1.12]
set grid
set key right center
plot "$work/reuse.dat" using 1:5:xtic(2) with linespoints lw 2 pt 7 title "reused: HBM hits + tier loads", \
     "" using 1:3 with linespoints lw 1 dt 2 pt 6 title "of which HBM hits", \
     ${bound} with lines lw 2 dt 3 lc rgb "black" title "the trace's reuse bound"
GP
  echo "plot.sh: wrote $img/reuse_vs_capacity.png"
  drawn=$((drawn + 1))
else
  echo "plot.sh: skipped reuse_vs_capacity.png (no replay_capacity_*.json in $results)"
fi

# ---- the hybrid models: reuse against checkpoints per request, one point per policy ---------
# One line per policy: policy, dsv4 checkpoints/request, dsv4 share, k3 checkpoints/request,
# k3 share, and 1 for an every:N policy (the fixed-interval line), 0 otherwise.
python3 - "$results" >"$work/policies.dat" <<'PY' || true
import glob, json, os, re, sys
rows = []
for path in glob.glob(os.path.join(sys.argv[1], "replay_policy_*.json")):
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        policy = doc["options"]["checkpoints"]
        cells = [(doc["models"][m]["checkpoints_per_request"], doc["models"][m]["reused_share_of_dense"])
                 for m in ("dsv4", "k3")]
        requests = doc["workload"]["requests"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"plot.sh: {path}: {e}", file=sys.stderr)
        continue
    if any(x is None or y is None for x, y in cells):
        continue
    every = re.fullmatch(r"every:(\d+)", policy)
    rows.append((int(every.group(1)) if every else 0, policy, cells))
if not rows:
    sys.exit(1)  # the shell says what was skipped
print(f"# requests {requests}")
for n, policy, cells in sorted(rows, key=lambda r: r[2][0][0]):
    (x4, y4), (xk, yk) = cells
    print(f'"{policy}" {x4:g} {y4:g} {xk:g} {yk:g} {1 if n else 0}')
PY
if grep -q '^"' "$work/policies.dat"; then
  requests=$(sed -n 's/^# requests //p' "$work/policies.dat")
  grep '^"' "$work/policies.dat" | awk '$6 == 1' >"$work/every.dat"
  gnuplot <<GP
set terminal pngcairo size 900,560 enhanced font "sans,11"
set output "$img/checkpoint_policies.png"
set title "State checkpoints: what they buy and what they cost (kvfuse-replay, ${requests} requests of the shipped trace,\n2 ranks, unlimited memory tier, synchronous saves; the dense model's reuse in the same run = 1)"
set xlabel "state checkpoints saved per request"
set ylabel "reused prompt tokens / dense model's"
set logscale x 2
set xrange [0.4:40]
set yrange [0.4:1.05]
set grid
set key bottom right
plot "$work/every.dat" using 2:3 with lines lw 1 dt 2 lc rgb "gray50" title "every:N (N = 16, 8, 4, 2 chunks)", \
     "$work/policies.dat" using 2:3 with points pt 7 ps 1.5 lc rgb "#1f77b4" title "dsv4", \
     "" using 4:5 with points pt 6 ps 2.2 lw 2 lc rgb "#d62728" title "k3", \
     "" using 2:3:1 with labels offset char 0,1.1 notitle, \
     0.95 with lines lw 1 dt 3 lc rgb "black" title "the replay's hybrid test: at least 0.95, at most 3 per request"
GP
  echo "plot.sh: wrote $img/checkpoint_policies.png"
  drawn=$((drawn + 1))
else
  echo "plot.sh: skipped checkpoint_policies.png (no replay_policy_*.json in $results)"
fi

# ---- the hybrid models: reuse against the index's state capacity, per eviction --------------
# One line per capacity: capacity, lru share, spared_tokens share (dsv4, of dense's).
python3 - "$results" >"$work/eviction.dat" <<'PY' || true
import glob, json, os, re, sys
shares = {}
for path in glob.glob(os.path.join(sys.argv[1], "replay_eviction_*.json")):
    m = re.fullmatch(r"replay_eviction_(lru|spared_tokens)_(\d+)\.json", os.path.basename(path))
    if not m:
        continue
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        share = doc["models"]["dsv4"]["reused_share_of_dense"]
        requests = doc["workload"]["requests"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"plot.sh: {path}: {e}", file=sys.stderr)
        continue
    if share is not None:
        shares.setdefault(int(m.group(2)), {})[m.group(1)] = share
rows = [(cap, s["lru"], s["spared_tokens"]) for cap, s in sorted(shares.items()) if len(s) == 2]
if not rows:
    sys.exit(1)  # the shell says what was skipped
print(f"# requests {requests}")
for cap, lru, spared in rows:
    print(f"{cap} {lru:g} {spared:g}")
PY
if grep -q '^[0-9]' "$work/eviction.dat"; then
  requests=$(sed -n 's/^# requests //p' "$work/eviction.dat")
  gnuplot <<GP
set terminal pngcairo size 900,560 enhanced font "sans,11"
set output "$img/state_eviction.png"
set title "DSV4, default checkpoint policy, ${requests} requests of the shipped trace (kvfuse-replay, 2 ranks, unlimited\nmemory tier, synchronous saves): reuse against the state checkpoints the index keeps servable"
set xlabel "the index's state capacity (hashes, --state-capacity)"
set ylabel "reused prompt tokens / dense model's"
set logscale x 2
set yrange [0:1.05]
set grid
set key bottom right
plot "$work/eviction.dat" using 1:2 with linespoints lw 2 pt 7 title "lru: the least recently used goes", \
     "" using 1:3 with linespoints lw 2 dt 2 pt 6 ps 1.6 title "spared_tokens: of the 8 least recently used, the lowest boundary goes" noenhanced
GP
  echo "plot.sh: wrote $img/state_eviction.png"
  drawn=$((drawn + 1))
else
  echo "plot.sh: skipped state_eviction.png (no replay_eviction_*.json in $results)"
fi

# ---- the cache policies against the offline reference -------------------------------------
# One line per share: dsv4 at --state-scale 64 (lru, lru@all, cost, belady), then dense
# (lru, cost, belady).
python3 - "$results/cache_policies.json" >"$work/cache.dat" <<'PY' || true
import json, sys
try:
    with open(sys.argv[1], encoding="utf-8") as f:
        doc = json.load(f)
    large, dense = doc["scales"]["64"]["dsv4"], doc["scales"]["1"]["dense"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"plot.sh: {sys.argv[1]}: {e}")
print(f"# requests {doc['requests']}")
for share in sorted(large, key=float):
    p, d = large[share], dense[share]
    print(share, p["lru"], p["lru@all"], p["cost"], p["belady"], d["lru"], d["cost"], d["belady"])
PY
if [ -s "$work/cache.dat" ]; then
  requests=$(sed -n 's/^# requests //p' "$work/cache.dat")
  gnuplot <<GP
set terminal pngcairo size 900,560 enhanced font "sans,11"
set output "$img/cache_policy.png"
set title "${requests} requests of the shipped trace (kvfuse-replay, 2 ranks, memory tier, synchronous saves):\nreuse against the tier budget (dsv4: 64-chunk state; cost and Belady: a checkpoint at every chunk)"
set xlabel "tier budget per rank, % of the model's unlimited working set"
set ylabel "reused prompt tokens / trace bound"
set logscale x
set xtics (1, 3, 10, 30, 100)
set yrange [0:1.05]
set grid
set key top left reverse Left
plot "$work/cache.dat" using 1:5 with linespoints lw 2 pt 5 lc rgb "#444444" title "dsv4: Belady (offline)", \
     "" using 1:4 with linespoints lw 2 pt 7 lc rgb "#d62728" title "dsv4: --cache-policy cost", \
     "" using 1:2 with linespoints lw 2 pt 6 lc rgb "#1f77b4" title "dsv4: the tier's LRU", \
     "" using 1:3 with linespoints lw 1 dt 2 pt 6 lc rgb "#1f77b4" title "dsv4: the tier's LRU, --checkpoints all", \
     "" using 1:8 with linespoints lw 1 dt 3 pt 4 lc rgb "#444444" title "dense: Belady", \
     "" using 1:7 with linespoints lw 1 dt 3 pt 8 lc rgb "#d62728" title "dense: cost", \
     "" using 1:6 with linespoints lw 1 dt 3 pt 8 lc rgb "#1f77b4" title "dense: LRU"
GP
  echo "plot.sh: wrote $img/cache_policy.png"
  drawn=$((drawn + 1))
else
  echo "plot.sh: skipped cache_policy.png (no cache_policies.json in $results)"
fi

# ---- llama-server's prompt cache: reuse as a share of the bound, per model and configuration --
# bench/llama_server/run.py's summary.json. One file per workload: a header line of the
# configurations that ran, then per model its reused share of the bound in each ("?" where
# that configuration has no row for the model); a comment line names the skipped ones.
for workload in chat trace; do
  python3 - "$results/llama_server/summary.json" "$workload" >"$work/llama_server_$workload.dat" <<'PY' || true
import json, sys
try:
    with open(sys.argv[1], encoding="utf-8") as f:
        doc = json.load(f)
except (OSError, ValueError) as e:
    sys.exit(f"plot.sh: {sys.argv[1]}: {e}")
rows = [r for r in doc.get("rows", []) if r["workload"] == sys.argv[2]]
if not rows:
    sys.exit(1)  # the shell says what was skipped
configs, models = [], []
for r in rows:
    if r["config"] not in configs:
        configs.append(r["config"])
    if r["model"] not in models:
        models.append(r["model"])
share = {(r["model"], r["config"]): r["summary"]["reused_share_of_bound"] for r in rows}
notes = []
for s in doc.get("skipped", []):
    binary = "kvfuse-llama-server" if s["server"] == "kvfuse" else "llama-server"
    notes.append(f"{s['server']} rows not run (no {binary} binary)")
print(f"# note {'; '.join(notes) if notes else 'every configuration ran'}")
print(f"# date {doc.get('date_utc', '')}")
print(f"# title {doc.get('workload_descriptions', {}).get(sys.argv[2], sys.argv[2])}")
print(f"# ncol {len(configs) + 1}")
# stock in reds, kvfuse in blues (its cache ledger in purples), the passes after the first in greens
colors = {"stock-default": "#b30000", "stock-restart": "#fc8d59", "stock-ram64": "#e34a33", "stock-ram1": "#fdcc8a",
          "kvfuse-mem64": "#08519c", "kvfuse-mem1": "#3182bd", "kvfuse-mem1-lru": "#9e9ac8", "kvfuse-mem1-cost": "#54278f",
          "kvfuse-mem1-disk": "#6baed6",
          "kvfuse-warm": "#31a354", "kvfuse-restart": "#a1d99b"}
print(f"# colors {' '.join(colors.get(c, '#808080') for c in configs)}")
print("model " + " ".join(f'"{c}"' for c in configs))
for m in models:
    cells = [share.get((m, c)) for c in configs]
    print(f'"{m}" ' + " ".join("?" if v is None else f"{v:g}" for v in cells))
PY
done
if grep -q '^"' "$work/llama_server_chat.dat" 2>/dev/null; then
  note=$(sed -n 's/^# note //p' "$work/llama_server_chat.dat")
  date=$(sed -n 's/^# date //p' "$work/llama_server_chat.dat")
  panels=1
  grep -q '^"' "$work/llama_server_trace.dat" 2>/dev/null && panels=2
  chat_title=$(sed -n 's/^# title //p' "$work/llama_server_chat.dat")
  chat_ncol=$(sed -n 's/^# ncol //p' "$work/llama_server_chat.dat")
  chat_colors=$(sed -n 's/^# colors //p' "$work/llama_server_chat.dat")
  trace_colors=$(sed -n 's/^# colors //p' "$work/llama_server_trace.dat" 2>/dev/null)
  trace_title=$(sed -n 's/^# title //p' "$work/llama_server_trace.dat" 2>/dev/null)
  trace_ncol=$(sed -n 's/^# ncol //p' "$work/llama_server_trace.dat" 2>/dev/null)
  gnuplot <<GP
set terminal pngcairo size 1100,$((380 * panels + 60)) enhanced font "sans,10"
set output "$img/llama_server_reuse.png"
set multiplot layout ${panels},1 title "llama-server's prompt cache, stock and kvfuse: prompt tokens reused (the servers' timings.cache_n) / the workload's bound\\nbench/llama_server/run.py, ${date}; ${note}" noenhanced
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set datafile missing "?"
set yrange [0:1.1]
set ytics 0.2
set grid ytics
set key outside right top noenhanced
set ylabel "reused / bound"
set title "${chat_title}" noenhanced
colors = "${chat_colors}"
plot for [i=2:${chat_ncol}] "$work/llama_server_chat.dat" using i:xtic(1) title columnheader(i) lc rgb word(colors, i - 1)
if (${panels} == 2) {
  set title "${trace_title}" noenhanced
  colors = "${trace_colors}"
  plot for [i=2:${trace_ncol:-1}] "$work/llama_server_trace.dat" using i:xtic(1) title columnheader(i) lc rgb word(colors, i - 1)
}
unset multiplot
GP
  echo "plot.sh: wrote $img/llama_server_reuse.png"
  drawn=$((drawn + 1))
else
  echo "plot.sh: skipped llama_server_reuse.png (no $results/llama_server/summary.json with a chat row)"
fi

[ "$drawn" -gt 0 ]
