#!/usr/bin/env python3
"""The cache policies against the offline reference (docs/replay.md#cache-policy).

Runs kvfuse-replay on the first 1000 requests of the shipped trace with a byte budget of
1, 3, 10, 30 and 100% of each model's unlimited working set, small state (--state-scale 1)
and large (64), for dense, dsv4 and k3:

  lru       the memory tier's own LRU, the default checkpoint placement (the baseline)
  lru@all   the same with a checkpoint at every chunk boundary (--checkpoints all)
  cost      --cache-policy cost --checkpoints all: the engine's CacheLedger owns the budget

and computes, for the same trace, budgets and placement, Belady's offline reference with
bench/cache_reference.py (which also checks that its lru reproduces the replay's). Prints
one markdown table per state scale and writes everything to OUT/cache_policies.json, which
bench/plot.sh draws as docs/img/cache_policy.png.

  bench/cache_policies.py REPLAY [--out DIR] [--trace FILE] [--limit N] [--dir DIR]

Standard library only. About 12 minutes on two cores; the large-state passes hold up to
11 GB (the unlimited pass that measures the working set of `all` at --state-scale 64).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cache_reference as ref  # noqa: E402

SHARES = (1, 3, 10, 30, 100)
SCALES = (1, 64)
MODELS = ("dense", "dsv4", "k3")
CONFIGS = {  # name: (checkpoint placement, extra replay options)
    "lru": ("default", []),
    "lru@all": ("all", []),
    "cost": ("all", ["--cache-policy", "cost"]),
}


def run_replay(replay, trace, limit, scale, share, placement, extra, scratch, out_dir):
    name = f"cache_{placement}_{'_'.join(extra[1:]) or 'tier'}_s{scale}_{share}.json"
    out = os.path.join(out_dir, name)
    cmd = [replay, "--trace", trace, "--limit", str(limit), "--model", ",".join(MODELS), "--ranks", "2", "--tier", "memory",
           "--sync-saves", "--faults", "none", "--state-scale", str(scale), "--checkpoints", placement,
           "--tier-capacity", f"{share}%", "--dir", scratch, "--json", out, *extra]
    t0 = time.monotonic()
    with open(out[: -len(".json")] + ".log", "w", encoding="utf-8") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        sys.exit(f"cache_policies.py: kvfuse-replay failed ({rc}): {' '.join(cmd)}; see {log.name}")
    with open(out, encoding="utf-8") as f:
        report = json.load(f)
    print(f"  {placement:>7} {' '.join(extra) or 'tier lru':>20} scale {scale:>2} at {share:>3}%: "
          f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("replay", help="the kvfuse-replay binary")
    ap.add_argument("--out", default="build/bench-results", help="where the JSON goes (default build/bench-results)")
    ap.add_argument("--trace", default=os.path.join(os.path.dirname(__file__), "..", "traces", "mooncake_synthetic_trace.jsonl"))
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                    help="the replay's --dir")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    replays = os.path.join(a.out, "cache_replay")
    os.makedirs(replays, exist_ok=True)

    trace = ref.load_trace(a.trace, a.limit)
    ref.hbm_hits(trace)
    result = {"trace": os.path.basename(a.trace), "requests": a.limit, "reuse_bound_tokens": trace.bound, "scales": {}}
    ok = True
    for scale in SCALES:
        per_scale = result["scales"].setdefault(str(scale), {})
        for name, (placement, extra) in CONFIGS.items():
            for share in SHARES:
                report = run_replay(a.replay, a.trace, a.limit, scale, share, placement, extra, a.dir, replays)
                ok = ok and report["ok"]
                for model in MODELS:
                    m = report["models"][model]
                    point = per_scale.setdefault(model, {}).setdefault(str(share), {})
                    point[name] = m["reused_share_of_bound"]
                    point["working_set_bytes_" + placement] = m["tier_capacity"]["working_set_bytes"]
                    if "cache_ledger" in m:
                        point[name + "_ledger"] = m["cache_ledger"]
        # The reference, same placement as cost, and the check that its lru is the replay's.
        for placement in ("default", "all"):
            grid = ref.run_grid(trace, [float(s) for s in SHARES], [scale], list(MODELS), ["lru", "belady"],
                                ref.CheckpointPolicy.named(placement), log=lambda *x, **k: None)[str(scale)]
            for model in MODELS:
                for share in SHARES:
                    got = grid[model]["points"][ref.fmt_share(float(share))]
                    point = per_scale[model][str(share)]
                    point["belady" if placement == "all" else "belady@default"] = got["belady"]["share"]
                    point["reference_lru" if placement == "default" else "reference_lru@all"] = got["lru"]["share"]

    print(f"\n{a.limit} requests of {result['trace']}, reuse as a share of the trace's bound "
          f"({trace.bound:,} tokens); cost and belady with a checkpoint at every chunk boundary\n")
    for scale in SCALES:
        print(f"--state-scale {scale}\n")
        print("| S | model | lru | lru@all | cost | belady | cost / belady | cost / lru | cost / lru@all |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for share in SHARES:
            for model in MODELS:
                p = result["scales"][str(scale)][model][str(share)]
                print(f"| {share}% | {model} | {p['lru']:.3f} | {p['lru@all']:.3f} | {p['cost']:.3f} | {p['belady']:.3f} | "
                      f"{ref.ratio(p['cost'], p['belady'])} | {ref.ratio(p['cost'], p['lru'])} | {ref.ratio(p['cost'], p['lru@all'])} |")
        print()
    # The reference models the replay: its lru must be the replay's, at every point.
    worst = max(abs(p[k] - p[r]) for s in result["scales"].values() for m in s.values() for p in m.values()
                for k, r in (("lru", "reference_lru"), ("lru@all", "reference_lru@all")))
    result["reference_lru_worst_difference"] = worst
    print(f"the reference's lru against the replay's, worst difference over the grid: {worst:.4f}")
    with open(os.path.join(a.out, "cache_policies.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    if worst > 0.02:
        print("cache_policies.py: the reference no longer models the replay (lru differs by more than 0.02)", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
