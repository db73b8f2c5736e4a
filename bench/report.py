#!/usr/bin/env python3
"""Runs every kvfuse benchmark binary in a directory (and the replay, when it is built), then
prints one table of the ratios bench/README.md sets targets for, each with its target and
PASS/MISS, plus informative rows.

    bench/report.py [BENCH_DIR]          default: build/release/bench
    bench/report.py --json-dir DIR       no runs: the table again from the JSON in DIR

Every figure in the table comes from this run: each binary runs --repetitions times
(default 3) and writes its results as JSON (--benchmark_out, --benchmark_out_format=json);
its console output goes to a log beside the JSON. The table is read back from those files
with Python's json module, using the median of the repetitions. Ratios whose two sides are
timed inside one benchmark are that benchmark's own counters; the others are computed here
from two benchmarks of the same binary and the same run. The replay (kvfuse-replay) writes
JSON too: one throughput run over every model, a sweep of the dense model's reuse over
per-rank tier capacities, and the hybrid models' reuse over checkpoint policies and over state
capacities with each hash eviction, which bench/plot.sh draws. Everything lands in --out-dir
(default build/bench-results), which bench/plot.sh and --json-dir read.

Exit status: 1 if a binary failed, 2 on a usage error, else 0. A missed target is reported
(MISS, and a count at the end), not turned into a failure: timings on a shared machine are
evidence, not a gate. Standard library only.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

UNIT_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


class Results:
    """Every binary's JSON output: name -> {benchmark name -> benchmark object}."""

    def __init__(self) -> None:
        self.by_binary: dict[str, dict[str, dict]] = {}

    def load(self, binary: str, path: str) -> None:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            return  # the binary ran no benchmark (--filter)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"report.py: cannot read {path}: {e}", file=sys.stderr)
            return
        runs = {}
        for b in doc.get("benchmarks", []):
            runs.setdefault(b.get("name", ""), b)  # the first run of a name wins
        self.by_binary[binary] = runs

    def metric(self, binary: str, name: str, key: str) -> float | None:
        """KEY of the run named NAME of BINARY: the median of its repetitions (NAME_median)
        when the binary ran with repetitions, else the run named exactly NAME;
        real_time/cpu_time in ns. None if the binary, the run or the key is absent, or the
        run reported an error or was skipped."""
        runs = self.by_binary.get(binary, {})
        run = runs.get(name + "_median", runs.get(name))
        if run is None or run.get("error_occurred") or run.get("skipped"):
            return None
        value = run.get(key)
        if not isinstance(value, (int, float)):
            return None
        if key in ("real_time", "cpu_time"):
            value = value * UNIT_NS.get(run.get("time_unit", "ns"), 1.0)
        return float(value)


class Table:
    OPS = {"<": lambda v, t: v < t, "<=": lambda v, t: v <= t, ">": lambda v, t: v > t, ">=": lambda v, t: v >= t}

    def __init__(self) -> None:
        self.targets = 0
        self.misses = 0

    @staticmethod
    def shown(value: float, unit: str) -> str:
        if unit == "x" or abs(value) < 1:
            return f"{value:.3f}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"

    def row(self, label: str, value: float | None, unit: str, op: str = "", target: float | None = None,
            note: str = "") -> None:
        """One line: LABEL, VALUE in UNIT, the target (OP TARGET) and PASS/MISS; without OP the
        row is informative and NOTE, if any, stands in the target column."""
        target_text = f"{op} {target:g} {unit}" if op else note
        if op:
            self.targets += 1
        if value is None:
            print(f"  {label:<80} {'n/a':>12}  {target_text:<14} {'(did not run)' if op else ''}".rstrip())
            if op:
                self.misses += 1
            return
        verdict = ""
        if op:
            verdict = "PASS" if self.OPS[op](value, target) else "MISS"
            if verdict == "MISS":
                self.misses += 1
        print(f"  {label:<80} {self.shown(value, unit) + ' ' + unit:>12}  {target_text:<14} {verdict}".rstrip())

    @staticmethod
    def section(text: str) -> None:
        print(f"  -- {text}")


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def scale(a: float | None, divisor: float) -> float | None:
    return None if a is None else a / divisor


def run_binaries(bench_dir: str, out_dir: str, args: argparse.Namespace, results: Results) -> int:
    status = 0
    binaries = sorted(
        p for p in glob.glob(os.path.join(bench_dir, "kvfuse_bench_*")) if os.path.isfile(p) and os.access(p, os.X_OK)
    )
    if not binaries:
        print(f"report.py: no kvfuse_bench_* binaries in {bench_dir}", file=sys.stderr)
        sys.exit(2)
    for path in binaries:
        name = os.path.basename(path)
        out, log = os.path.join(out_dir, name + ".json"), os.path.join(out_dir, name + ".log")
        if os.path.exists(out):
            os.remove(out)
        cmd = [path, f"--benchmark_min_time={args.min_time}", f"--benchmark_repetitions={args.repetitions}",
               "--benchmark_display_aggregates_only=true", f"--benchmark_out={out}", "--benchmark_out_format=json"]
        if args.filter:
            cmd.append(f"--benchmark_filter={args.filter}")
        print(f"  running {name} ...", end="", flush=True)
        t0 = time.monotonic()
        with open(log, "w", encoding="utf-8") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
        print(f" {time.monotonic() - t0:.0f} s", flush=True)
        if rc != 0:
            print(f"report.py: {name} failed (exit status {rc}); its output: {log}", file=sys.stderr)
            status = 1
        if os.path.isfile(out):
            results.load(name, out)
    return status


# The replay runs: one throughput run over every model, and the dense model's reuse against
# the per-rank capacity of a memory tier (bench/plot.sh draws it), "unlimited" last. On the
# shipped trace the dense model's tier holds about 150 MiB per rank at the end, so the sweep
# runs from a few percent of that to more than all of it. Each run of the whole trace takes
# about 5 s on two cores.
REPLAY_MODELS = ("dense", "dsv4", "k3", "multi")
THROUGHPUT_PREFIX = "replay_throughput_"  # one JSON per repetition: replay_throughput_<i>.json
CAPACITY_PREFIX = "replay_capacity_"
CAPACITY_LIMIT = 0  # the whole trace
CAPACITIES = tuple(f"{mib}MiB" for mib in (2, 4, 8, 16, 32, 64, 128)) + ("unlimited",)
# The hybrid models' state checkpoints, in the setting of the replay's hybrid test (first 1000
# requests, 2 ranks, unlimited memory tier, synchronous saves; a few seconds a run): reuse
# (as a share of the dense model's, same run) against checkpoints per request for each
# policy, and against the index's state capacity for each eviction (default policy; dsv4
# alone, k3 reuses the same tokens). bench/plot.sh draws both.
HYBRID_LIMIT = 1000
HYBRID_SETTING = ("--ranks", "2", "--tier", "memory", "--tier-capacity", "unlimited", "--sync-saves")
POLICY_PREFIX = "replay_policy_"      # replay_policy_<policy, ':' dropped>.json
POLICIES = ("last", "every:16", "every:8", "every:4", "every:2", "all", "default")
EVICTION_PREFIX = "replay_eviction_"  # replay_eviction_<eviction>_<capacity>.json
EVICTIONS = ("lru", "spared_tokens")
STATE_CAPACITIES = (32, 64, 128, 256, 512, 1024, 1536, 2048, 4096)


def policy_file(policy: str) -> str:
    return f"{POLICY_PREFIX}{policy.replace(':', '')}.json"


def run_replay(args: argparse.Namespace, out_dir: str) -> int:
    """Runs kvfuse-replay for the throughput row, the capacity sweep and the hybrid models'
    policy and eviction sweeps. Returns 1 if a run failed, 0 otherwise (also when the replay
    is not built: the rows then say n/a)."""
    if not (os.path.isfile(args.replay) and os.access(args.replay, os.X_OK)):
        print(f"  (no replay binary at {args.replay}: its rows and the reuse plot are skipped)")
        return 0
    status = 0
    for stale in glob.glob(os.path.join(out_dir, "replay_*.json")):
        os.remove(stale)
    runs = [(f"{THROUGHPUT_PREFIX}{i}.json", ["--limit", str(args.replay_limit), "--model", ",".join(REPLAY_MODELS),
                                              "--tier", "memory", "--tier-capacity", "unlimited"])
            for i in range(1, max(1, args.repetitions) + 1)]
    for cap in CAPACITIES:
        limit = ["--limit", str(args.capacity_limit)] if args.capacity_limit > 0 else []
        runs.append((f"{CAPACITY_PREFIX}{cap}.json",
                     [*limit, "--model", "dense", "--ranks", "2", "--tier", "memory", "--tier-capacity", cap]))
    hybrid = ["--limit", str(HYBRID_LIMIT), *HYBRID_SETTING]
    for policy in POLICIES:
        runs.append((policy_file(policy), [*hybrid, "--model", "dense,dsv4,k3", "--checkpoints", policy]))
    for eviction in EVICTIONS:
        for cap in STATE_CAPACITIES:
            runs.append((f"{EVICTION_PREFIX}{eviction}_{cap}.json",
                         [*hybrid, "--model", "dense,dsv4", "--state-capacity", str(cap), "--hash-eviction", eviction]))
    for out_name, extra in runs:
        out = os.path.join(out_dir, out_name)
        log = out[: -len(".json")] + ".log"
        # --dir: the replay makes its scratch directory under it and removes it at exit
        cmd = [args.replay, "--trace", args.trace, "--faults", "none", "--dir", args.replay_dir, "--json", out, *extra]
        print(f"  running kvfuse-replay {' '.join(extra)} ...", end="", flush=True)
        t0 = time.monotonic()
        with open(log, "w", encoding="utf-8") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
        print(f" {time.monotonic() - t0:.0f} s", flush=True)
        if rc != 0:
            print(f"report.py: kvfuse-replay failed (exit status {rc}); its output: {log}", file=sys.stderr)
            status = 1
    return status


def load_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def number(doc: dict | None, *keys: str) -> float | None:
    """doc[k0][k1]...: a number, or None where a key is missing or the value is no number."""
    for k in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(k)
    return float(doc) if isinstance(doc, (int, float)) and not isinstance(doc, bool) else None


def report(r: Results, out_dir: str, trace: str) -> int:
    t = Table()
    m = r.metric
    idx, comp, conn = "kvfuse_bench_offload_index", "kvfuse_bench_completion", "kvfuse_bench_connector"
    rt, tiers, coord = "kvfuse_bench_runtime", "kvfuse_bench_tiers", "kvfuse_bench_coordinator"
    dense, hit = "BM_DenseVsHandWritten", "BM_LoadVsMemcpy64MiB"
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            load = " ".join(f.read().split()[:3])
    except OSError:
        load = "?"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"== kvfuse: the targets table (bench/README.md), every figure from this run ({now}, "
        f"{os.cpu_count()} CPUs, load average {load}) =="
    )
    print(f"  {'what':<80} {'measured':>12}  target")

    t.section("engine index (kvfuse_bench_offload_index)")
    t.row("stats() with the full audit, 2^20 indexed hashes", m(idx, "BM_Stats/1048576", "real_time"), "ns", "<", 1000)
    t.row("fail 2048 outstanding loads in one step",
          scale(m(idx, "BM_FailAll2048/manual_time", "real_time"), 1e6), "ms", "<", 0.5)
    pair = "BM_RequestLoadCompletePair/cold:{}/log2_hashes:{}/repeats:5_{}"
    t.row("request_load + settle pair, median (hot hash)", m(idx, pair.format(0, 20, "median"), "real_time"), "ns", "<",
          200)
    cold = m(idx, pair.format(1, 20, "median"), "real_time")
    t.row("request_load + settle pair, median (cold hash of 2^20)", cold, "ns", "<=", 250)
    lo, hi = m(idx, pair.format(1, 20, "min"), "real_time"), m(idx, pair.format(1, 20, "max"), "real_time")
    t.row("  cold: fastest repetition", lo, "ns")
    t.row("  cold: slowest repetition", hi, "ns")
    t.row("  cold floor: one dependent DRAM miss (pointer chase, 1 GiB), median",
          m(idx, "BM_PointerChase/MiB:1024/repeats:5_median", "real_time"), "ns")
    floor2 = m(idx, "BM_PointerChase2/MiB:32/repeats:5_median", "real_time")
    t.row("  cold floor: two dependent misses in 32 MiB (find the slot, then its LRU neighbours), median",
          floor2, "ns")
    t.row("  cold pair / that two-miss floor", ratio(cold, floor2), "x")
    big = m(idx, pair.format(1, 23, "median"), "real_time")
    t.row("  cold hash of 2^23 (a 256 MiB table, beyond the last-level cache), median", big, "ns")
    t.row("  that pair / two dependent misses in 256 MiB",
          ratio(big, m(idx, "BM_PointerChase2/MiB:256/repeats:5_median", "real_time")), "x")

    t.section("completion path (kvfuse_bench_completion)")
    t.row("records drained + merged through lane queues and quorum, 8 ranks",
          scale(m(comp, "BM_DrainMerge/8/manual_time", "items_per_second"), 1e6), "M/s", ">=", 10)
    t.row("pushed + drained + merged on one thread, 8 ranks",
          scale(m(comp, "BM_PushDrainMerge/8", "items_per_second"), 1e6), "M/s")
    t.row("producer thread + engine thread, 8 ranks",
          scale(m(comp, "BM_Threaded/8/real_time", "items_per_second"), 1e6), "M/s")

    ipc = "kvfuse_bench_ipc"
    t.section("ranks as processes (kvfuse_bench_ipc; shared memory rings against in-process lanes)")
    procs = m(ipc, "BM_DrainMergeProcesses/manual_time", "items_per_second")
    threads = m(ipc, "BM_DrainMergeThreads/manual_time", "items_per_second")
    t.row("records drained + merged at 8 ranks: rank processes' rings / rank threads' lanes",
          ratio(procs, threads), "x", ">=", 0.8)
    t.row("  rings, 8 rank processes", scale(procs, 1e6), "M/s")
    t.row("  lanes, 8 rank threads", scale(threads, 1e6), "M/s")
    rt_p = m(ipc, "BM_LoadRoundTripProcesses/manual_time", "real_time")
    rt_t = m(ipc, "BM_LoadRoundTripThreads/manual_time", "real_time")
    t.row("one 4 KiB load's round trip, rank process / rank thread", ratio(rt_p, rt_t), "x")
    t.row("  rank process", scale(rt_p, 1e3), "us")
    t.row("  rank thread", scale(rt_t, 1e3), "us")

    t.section("engine loop (kvfuse_bench_coordinator; 8 ranks, 16-chunk K3 joint loads, no copies; 5 repetitions)")
    creq = "BM_CoordinatorRequest/ranks_inline/checkpoints:1/repeats:5/manual_time"
    t.row("coordinator per request: admit..unpark + finish, median",
          m(coord, creq + "_median", "ns_per_request"), "ns", "<=", 1000)
    t.row("  fastest repetition", m(coord, creq + "_min", "ns_per_request"), "ns")
    t.row("  slowest repetition", m(coord, creq + "_max", "ns_per_request"), "ns")
    t.row("  admit: plan, ticket, LoadRequest, 8 record pushes, park", m(coord, creq + "_median", "admit_ns"), "ns")
    t.row("  step: drain, 8-record quorum merge, settle, unpark", m(coord, creq + "_median", "step_ns"), "ns")
    t.row("  finish: nothing new to save, release", m(coord, creq + "_median", "finish_ns"), "ns")
    t.row("  heap allocations per request, scheduler thread", m(coord, creq + "_median", "allocs_per_request"), "allocs")
    t.row("coordinator per request, record pushes not timed",
          m(coord, "BM_CoordinatorRequest/ranks_untimed/checkpoints:1/repeats:5/manual_time_median", "ns_per_request"),
          "ns")
    t.row("coordinator per request, 16 candidate checkpoints",
          m(coord, "BM_CoordinatorRequest/ranks_inline/checkpoints:16/repeats:5/manual_time_median", "ns_per_request"),
          "ns")
    t.row("coordinator per request, records from a producer thread (wall)",
          m(coord, "BM_CoordinatorRequest/ranks_thread/checkpoints:1/repeats:5/manual_time_median", "ns_per_request"),
          "ns")

    t.section("connector load path (kvfuse_bench_connector; medians, both sides timed in the same iterations)")
    lat = "BM_JointLoad/delay_us:2000/leg_KiB:64/apart:0/manual_time"
    bw = "BM_JointLoad/delay_us:0/leg_KiB:16384"
    t.row("joint / max(kv, state), 2 ms tier latency per get, K3 lanes", m(conn, lat, "joint_over_max"), "x", "<=", 1.10)
    t.row("serialized (state leg after_kv, one lane) / max(kv, state)", m(conn, lat, "serial_over_max"), "x")
    t.row("joint / max(kv, state), two 16 MiB memcpy legs, OS placement",
          m(conn, bw + "/apart:0/manual_time", "joint_over_max"), "x")
    t.row("joint / max(kv, state), two 16 MiB memcpy legs, lanes on 2 CPUs",
          m(conn, bw + "/apart:1/manual_time", "joint_over_max"), "x")
    t.row("serialized / max(kv, state), the same memcpy legs", m(conn, bw + "/apart:0/manual_time", "serial_over_max"),
          "x")
    print("  joint-load sweep: KV chunks of 256 KiB vs one state entry as large, 100 us fetch per 256 KiB "
          "(docs/img/joint_latency.png)")
    for chunks in (1, 2, 4, 8, 16, 32, 64):
        sweep = f"BM_JointSweep/chunks:{chunks}/us_per_chunk:100/manual_time"
        j, sl = m(conn, sweep, "joint_ms"), m(conn, sweep, "serial_ms")
        size = f"{chunks * 256} KiB" if chunks < 4 else f"{chunks // 4} MiB"
        both = f"{j:.2f} vs {sl:.2f} ms" if j is not None and sl is not None else "n/a"
        t.row(f"  legs of {size:>7}: concurrent / state after KV ({both})", ratio(j, sl), "x")
    t.row("dense connector / hand-written load, 64 x 1 MiB, one CPU",
          m(conn, f"{dense}/inline:1/chunks:64/placement:1/manual_time", "conn_over_hand"), "x", "<=", 1.02)
    t.row("dense connector / hand-written load, 16 x 1 MiB, one CPU",
          m(conn, f"{dense}/inline:1/chunks:16/placement:1/manual_time", "conn_over_hand"), "x")
    t.row("  the same, connector minus hand-written (two thread hand-offs)",
          m(conn, f"{dense}/inline:1/chunks:16/placement:1/manual_time", "overhead_us"), "us")
    t.row("dense connector / calling-thread hand-written load, 64 x 1 MiB, OS placement",
          m(conn, f"{dense}/inline:1/chunks:64/placement:0/manual_time", "conn_over_hand"), "x")
    t.row("dense connector / calling-thread hand-written load, 64 x 1 MiB, lanes apart (lane_cpus)",
          m(conn, f"{dense}/inline:1/chunks:64/placement:2/manual_time", "conn_over_hand"), "x", "<=", 1.05)
    t.row("  the connector's load after a calling-thread copy / after its own (the other CPU's cache)",
          m(conn, f"{dense}/inline:1/chunks:64/placement:2/manual_time", "after_other_over_steady"), "x")
    t.row("hand-written, sync per chunk / sync once, threaded stream",
          m(conn, f"{dense}/inline:0/chunks:64/placement:0/manual_time", "hand_over_one_sync"), "x")
    same = "BM_DenseVsSameShape"

    def same_name(chunks: int, placement: int = 0, spin: int = 0, poll: int = 0) -> str:
        longer = "/min_time:0.500" if chunks >= 16 else ""  # its own MinTime (bench_connector.cpp)
        return f"{same}/chunks:{chunks}/placement:{placement}/spin_us:{spin}/poll_us:{poll}{longer}/manual_time"

    def in_class(name: str, key: str) -> float | None:
        value = m(conn, name, key)
        return value if value else None  # 0: fewer than 30 loads of a side in that class

    for chunks in (1, 4, 16, 64):
        t.row(f"dense connector / same-shape hand-written load, {chunks} x 1 MiB, lanes apart (lane_cpus)",
              m(conn, same_name(chunks, 2), "conn_over_same"), "x", "<=", 1.01)
        t.row("  A/A control in the same run: a second same-shape load / the first",
              m(conn, same_name(chunks, 2), "control_over_same"), "x")
    for chunks in (1, 4, 16, 64):
        name = same_name(chunks)
        for cls, where in (("together", "on the scheduler's CPU"), ("apart", "on another CPU")):
            t.row(f"dense connector / same-shape, {chunks} x 1 MiB, OS placement, loads whose lane ran {where}, "
                  "path by path", in_class(name, f"conn_over_same_{cls}"), "x", "<=", 1.01)
            t.row("  A/A control, the same loads: a second same-shape load / the first",
                  in_class(name, f"control_over_same_{cls}"), "x")
            once = [m(conn, name, f"at_once_share_{cls}_{side}") or 0 for side in ("conn", "same", "control")]
            if cls == "together":
                t.row("  paths mixed as the kernel drew them (record there at the first look: connector "
                      f"{once[0]:.2f}, same-shape {once[1]:.2f}, control {once[2]:.2f}; A/A "
                      f"{in_class(name, f'control_over_same_{cls}_mixed') or 0:.3f})",
                      in_class(name, f"conn_over_same_{cls}_mixed"), "x")
        shares = [m(conn, name, f"apart_share_{side}") for side in ("same", "control")]
        t.row("  all loads, placement unsorted: dense / same-shape (A/A: "
              f"{m(conn, name, 'control_over_same') or 0:.3f})", m(conn, name, "conn_over_same"), "x")
        t.row("  share of loads on another CPU: connector (same-shape "
              f"{shares[0] or 0:.2f}, control {shares[1] or 0:.2f})", m(conn, name, "apart_share_conn"), "x")
    for chunks in (1, 16, 64):
        name = same_name(chunks, 1)
        t.row(f"dense connector / same-shape, {chunks} x 1 MiB, every thread on one CPU (placement taken out)",
              m(conn, name, "conn_over_same"), "x")
        t.row("  same-shape load / calling-thread load, the same (the price of running on a lane, kvfuse or not)",
              m(conn, name, "same_over_hand"), "x")
    t.row("  same-shape load / calling-thread load, 1 x 1 MiB, OS placement (the hand-off's price)",
          m(conn, same_name(1), "same_over_hand"), "x")
    t.row("  process CPU / wall, 1 x 1 MiB, OS placement, no spin", m(conn, same_name(1), "cpu_per_wall"), "x")
    for spin, poll, what in ((50, 0, "both lanes spin 50 us (ConnectorOptions::lane_spin)"),
                             (50, 50, "lanes spin 50 us + scheduler polls 50 us")):
        for chunks in (1, 4):
            name = same_name(chunks, 0, spin, poll)
            for cls, where in (("together", "lane on the scheduler's CPU"), ("apart", "on another CPU")):
                aa = in_class(name, f"control_over_same_{cls}")
                t.row(f"dense connector / same-shape, {chunks} x 1 MiB, OS placement, {what}, {where} "
                      f"(A/A {aa or 0:.3f})", in_class(name, f"conn_over_same_{cls}"), "x", "<=", 1.01)
            t.row(f"  all loads, placement unsorted (A/A: {m(conn, name, 'control_over_same') or 0:.3f})",
                  m(conn, name, "conn_over_same"), "x")
            t.row(f"  connector load time (no spin: {m(conn, same_name(chunks), 'conn_us') or 0:.1f} us)",
                  m(conn, name, "conn_us"), "us")
            t.row("  process CPU / wall (2.0 = both CPUs busy)", m(conn, name, "cpu_per_wall"), "x")
    parts = (("to_get_ns", "load() to the tier get: hand-off to the lane (+ spec checks)"),
             ("get_ns", "the tier get"),
             ("get_to_copy_ns", "get end to copy"),
             ("copy_ns", "the copy (copy_async, inline stream)"),
             ("sync_ns", "the synchronize"),
             ("to_emit_ns", "synchronize end to emit (record built)"),
             ("emit_ns", "emit: the record's push + doorbell (futex wake)"),
             ("drain_ns", "emit end to record drained (scheduler wake-up + drain)"))
    handoffs = (("to_get_ns", "hand-off to the lane"), ("copy_ns", "copy_async (threaded: the stream's wake)"),
                ("sync_ns", "synchronize (threaded: the lane's wake)"), ("emit_ns", "emit (futex wake)"),
                ("drain_ns", "scheduler wake-up + drain"))

    def fixed_name(one_cpu: int, spin: int = 0, poll: int = 0, inline: int = 1) -> str:
        return f"BM_FixedCost/one_cpu:{one_cpu}/spin_us:{spin}/poll_us:{poll}/inline:{inline}/manual_time"

    for pin, where in ((0, "OS placement"), (1, "one CPU")):
        fixed = fixed_name(pin)
        t.row(f"fixed cost: load() to record drained, 1 x 4 KiB chunk, {where}, median",
              scale(m(conn, fixed, "total_ns"), 1e3), "us", *(("<=", 10) if pin == 0 else ()))
        for key, what in parts:
            t.row(f"  {what}", scale(m(conn, fixed, key), 1e3), "us")
        t.row("  (bare Lane submit until its task starts, same run)", scale(m(conn, fixed, "bare_handoff_ns"), 1e3),
              "us")
        dom = m(conn, fixed, "dominant_part")
        if dom is not None and 0 <= int(dom) < len(parts):
            print(f"    dominant part: {parts[int(dom)][1]}")
        t.row("  process CPU per iteration (load + bare hand-off) / wall", m(conn, fixed, "cpu_per_wall"), "x")
    for spin, poll, inline, what, targeted in (
            (50, 0, 1, "lanes spin 50 us", True),
            (50, 50, 1, "lanes spin 50 us + scheduler polls 50 us", True),
            (0, 50, 1, "scheduler polls 50 us, lanes sleep", False),
            (0, 0, 0, "threaded stream, no spin", False),
            (50, 0, 0, "threaded stream, lanes + stream spin 50 us", False),
            (50, 50, 0, "threaded stream, lanes + stream spin 50 us + scheduler polls 50 us", False)):
        fixed = fixed_name(0, spin, poll, inline)
        t.row(f"fixed cost, 1 x 4 KiB, OS placement, {what}", scale(m(conn, fixed, "total_ns"), 1e3), "us",
              *(("<=", 10) if targeted else ()))
        split = ", ".join(f"{label} {v / 1e3:.2f}" for key, label in handoffs
                          if (v := m(conn, fixed, key)) is not None and (inline == 0 or key not in ("copy_ns", "sync_ns")))
        if split:
            print(f"    hand-offs (us): {split}")
        cpu, wall = m(conn, fixed, "cpu_us_per_iter"), m(conn, fixed, "wall_us_per_iter")
        t.row(f"  process CPU / wall per iteration ({cpu or 0:.1f} / {wall or 0:.1f} us)",
              m(conn, fixed, "cpu_per_wall"), "x")
    t.row("load-path / memcpy bytes/s, 64 MiB memory-tier hit, inline stream",
          m(conn, f"{hit}/inline:1/one_cpu:1/manual_time", "load_over_memcpy"), "x", ">=", 0.90)
    t.row("  the same, threaded stream", m(conn, f"{hit}/inline:0/one_cpu:1/manual_time", "load_over_memcpy"), "x")
    t.row("  the same, inline stream, OS placement",
          m(conn, f"{hit}/inline:1/one_cpu:0/manual_time", "load_over_memcpy"), "x")
    t.row("  the same, threaded stream, OS placement",
          m(conn, f"{hit}/inline:0/one_cpu:0/manual_time", "load_over_memcpy"), "x")

    red = "kvfuse_bench_redis"
    t.section("RedisTier (kvfuse_bench_redis; own redis-server on a unix socket; medians, both sides in the same iterations)")
    for kib in (16, 256):
        row = f"BM_RedisLoad/chunk_KiB:{kib}/connector:0/manual_time"
        t.row(f"RedisTier KV load / plain pipelined hiredis GET bytes/s, 64 x {kib} KiB",
              m(red, row, "kvfuse_over_hiredis"), "x", ">=", 0.90)
        t.row(f"  round trips per 64-chunk load, {kib} KiB chunks", m(red, row, "round_trips_per_load"), "trips", "<=", 1)
        t.row(f"  RedisTier load, {kib} KiB chunks", m(red, row, "kvfuse_GBps"), "GB/s")
        t.row(f"  plain hiredis, {kib} KiB chunks", m(red, row, "hiredis_GBps"), "GB/s")
        t.row(f"  the same through a DenseConnector load (lane hand-off), {kib} KiB chunks",
              m(red, f"BM_RedisLoad/chunk_KiB:{kib}/connector:1/manual_time", "kvfuse_over_hiredis"), "x")

    cl = "kvfuse_bench_redis_cluster"
    t.section("RedisClusterTier (kvfuse_bench_redis_cluster; own clusters on loopback; medians, both sides in the same iterations)")
    for kib in (16, 256):
        row = f"BM_ClusterBatch/chunk_KiB:{kib}/real_time"
        t.row(f"3-primary cluster / one RedisTier node, time per 64 x {kib} KiB batch",
              m(cl, row, "cluster_over_single"), "x", "<=", 1.3)
        t.row(f"  round trips per batch / nodes touched, {kib} KiB chunks",
              ratio(m(cl, row, "round_trips_per_batch"), m(cl, row, "nodes_touched")), "x", "<=", 1)
    for kib in (16, 256):
        t.row(f"cluster tier, all slots on one primary / RedisTier on it, throughput, 64 x {kib} KiB",
              m(cl, f"BM_ClusterRouting/chunk_KiB:{kib}/real_time", "cluster_over_single_throughput"), "x", ">=", 0.90)

    t.section("runtime and tiers (informative)")
    t.row("HostRuntime copy_async / memcpy bytes/s, 64 MiB, 1 MiB ops, threaded",
          m(rt, "BM_CopyAsyncVsMemcpy/chunk_KiB:1024/inline:0/manual_time", "vs_memcpy"), "x")
    t.row("HostRuntime copy_async / memcpy bytes/s, 64 MiB, 1 MiB ops, inline",
          m(rt, "BM_CopyAsyncVsMemcpy/chunk_KiB:1024/inline:1/manual_time", "vs_memcpy"), "x")
    t.row("lane submit + join round trip", scale(m(rt, "BM_LaneRoundTrip", "real_time"), 1e3), "us")
    memcpy_bps = m(tiers, "memcpy_64MiB/real_time", "bytes_per_second")
    t.row("MemoryTier hit + copy out / memcpy bytes/s, one 64 MiB entry",
          ratio(m(tiers, "memory_tier_hit_64MiB/real_time", "bytes_per_second"), memcpy_bps), "x")
    t.row("MemoryTier 32 x 2 MiB chunk hits + copies / memcpy bytes/s",
          ratio(m(tiers, "memory_tier_chunks/real_time", "bytes_per_second"), memcpy_bps), "x")
    t.row("DiskTier 4 MiB hit (page cache, checksummed) / memcpy bytes/s",
          ratio(m(tiers, "disk_tier_hit_4MiB/real_time", "bytes_per_second"), memcpy_bps), "x")
    t.section(f"replay (kvfuse-replay; {trace}, memory tier, no faults)")
    docs = [d for d in (load_json(p) for p in sorted(glob.glob(os.path.join(out_dir, THROUGHPUT_PREFIX + "*.json"))))
            if d is not None]
    limit = number(docs[0], "workload", "requests") if docs else None
    what = f"{limit:.0f} requests" if limit is not None else "the trace"
    ok = "" if all(d.get("ok") is True for d in docs) else " (a run reported ok: false)"
    for model in REPLAY_MODELS:
        rates = [x for x in (number(d, "models", model, "requests_per_second") for d in docs) if x is not None]
        t.row(f"replay throughput, {model} model, {what}, median of {len(rates)}{ok}",
              statistics.median(rates) if rates else None, "req/s", note="informative")
    cap = load_json(os.path.join(out_dir, f"{CAPACITY_PREFIX}unlimited.json"))
    reused = [number(cap, "models", "dense", "reused_tokens", where) for where in ("hbm", "tier")]
    total = None if None in reused else sum(x for x in reused if x is not None)
    requests = number(cap, "workload", "requests")
    ok = "" if cap is None or cap.get("ok") is True else " (ok: false)"
    t.row(f"dense, 2 ranks, {requests or 0:.0f} requests, unlimited memory tier: reused / reuse bound{ok}",
          ratio(total, number(cap, "workload", "reuse_bound_tokens")), "x", note="informative")
    t.section(f"hybrid models' state checkpoints ({HYBRID_LIMIT} requests, 2 ranks, unlimited memory tier, "
              "synchronous saves; reuse as a share of the dense model's in the same run)")
    policies = {p: load_json(os.path.join(out_dir, policy_file(p))) for p in ("default", "last", "all")}
    for model in ("dsv4", "k3"):
        for p, doc in policies.items():
            ok = "" if doc is None or doc.get("ok") is True else " (ok: false)"
            t.row(f"{model}, --checkpoints {p}: reused / dense's reused{ok}",
                  number(doc, "models", model, "reused_share_of_dense"), "x", note="informative")
            t.row(f"{model}, --checkpoints {p}: checkpoints saved per request",
                  number(doc, "models", model, "checkpoints_per_request"), "", note="informative")
        default, top = policies["default"], policies["all"]
        t.row(f"{model}, default against all: reuse / all's reuse",
              ratio(number(default, "models", model, "reused_share_of_dense"),
                    number(top, "models", model, "reused_share_of_dense")), "x", note="informative")
        t.row(f"{model}, default against all: checkpoints / all's checkpoints",
              ratio(number(default, "models", model, "checkpoints_per_request"),
                    number(top, "models", model, "checkpoints_per_request")), "x", note="informative")
    print("  standing staging bytes = lanes x buffer: asserted by the tests (R12), not timed here.")
    print(f"  {t.targets - t.misses} of {t.targets} targets met in this run.")
    return t.misses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_dir", nargs="?", default="build/release/bench")
    ap.add_argument("--json-dir", help="no runs: read the JSON in DIR (kvfuse_bench_*.json, replay_*.json)")
    ap.add_argument("--out-dir", default="build/bench-results",
                    help="where the runs write their JSON and logs (default build/bench-results)")
    ap.add_argument("--min-time", default="0.1", help="--benchmark_min_time for every binary (default 0.1)")
    ap.add_argument("--repetitions", type=int, default=3, help="--benchmark_repetitions (default 3)")
    ap.add_argument("--filter", help="--benchmark_filter for every binary (a quick look at a few rows)")
    ap.add_argument("--replay", default="build/release/apps/replay/kvfuse-replay", help="the kvfuse-replay binary")
    ap.add_argument("--no-replay", action="store_true", help="skip the replay runs")
    ap.add_argument("--trace", default="traces/mooncake_synthetic_trace.jsonl", help="the trace the replay runs")
    ap.add_argument("--replay-limit", type=int, default=300, help="requests of the throughput run (default 300)")
    ap.add_argument("--capacity-limit", type=int, default=CAPACITY_LIMIT,
                    help="requests of each capacity-sweep run (default: the whole trace)")
    ap.add_argument("--replay-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                    help="the replay's --dir (default /dev/shm)")
    args = ap.parse_args()

    results = Results()
    status = 0
    if args.json_dir:
        out_dir = args.json_dir
        files = sorted(glob.glob(os.path.join(out_dir, "kvfuse_bench_*.json")))
        if not files:
            print(f"report.py: no kvfuse_bench_*.json in {out_dir}", file=sys.stderr)
            return 2
        for path in files:
            results.load(os.path.basename(path)[: -len(".json")], path)
    else:
        if not os.path.isdir(args.bench_dir):
            print(f"report.py: no such directory: {args.bench_dir}", file=sys.stderr)
            print("  build: cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release && cmake --build build/release",
                  file=sys.stderr)
            return 2
        out_dir = args.out_dir
        os.makedirs(out_dir, exist_ok=True)
        print(f"== kvfuse benchmarks: JSON and logs in {out_dir} ==", flush=True)
        status = run_binaries(args.bench_dir, out_dir, args, results)
        if not args.no_replay:
            status = run_replay(args, out_dir) or status
        print(flush=True)
    report(results, out_dir, args.trace)
    return status


if __name__ == "__main__":
    sys.exit(main())
