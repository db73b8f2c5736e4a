#!/usr/bin/env python3
"""The replay's tests (run by ctest): run kvfuse-replay, read its JSON report, and check it.

  check_replay.py faults REPLAY         every model, every fault, two passes: the five zeros,
                                        and every fault and load kind really happened
  check_replay.py trace REPLAY TRACE    the first 200 requests of a trace: the five zeros
  check_replay.py bound REPLAY TRACE    unlimited tier + synchronous saves: reused tokens within
                                        [0.99, 1.0] of the trace's reuse bound
  check_replay.py hybrid REPLAY TRACE [ARGS...]
                                        the first 1000 requests, unlimited memory tier, synchronous
                                        saves: dsv4 and k3 each reuse >= 0.95 of the dense model's
                                        reused tokens with <= 3.0 checkpoints saved per request,
                                        never above the bound; then the same check must fail with
                                        --checkpoints last, and with no snapshot slot the default
                                        policy must skip (and count) every prefill checkpoint and
                                        reuse what `last` reuses. ARGS (say --checkpoints last):
                                        only the first check, with ARGS added
  check_replay.py usage REPLAY TRACE    bad arguments and input exit 2 and name the bad value
  check_replay.py cache REPLAY TRACE    --cache-policy cost at 10% of the working set: the ledger keeps its budget,
                                        the tiers evict nothing themselves, dsv4 reuses 1.2x LRU's; 100% changes nothing
  check_replay.py share REPLAY TRACE    --tier-capacity 30% and 100% of the working set an unlimited pass holds,
                                        and --state-scale 4
  check_replay.py redis REPLAY          --tier redis against a redis-server started here (unix
                                        socket in a temporary directory): the five zeros, and
                                        one round trip per KV load
  check_replay.py cluster REPLAY        --tier redis-cluster against a 3-primary, 3-replica cluster
                                        started here, a primary SIGKILLed once the offload-on
                                        pass has stored entries: the five zeros on both passes,
                                        the kill hit the run (failed gets or puts counted), the
                                        tier served loads
  check_replay.py processes REPLAY      the faults test with --ranks-as processes: the five zeros,
                                        the kill fault killed a rank process mid-load and the
                                        engine saw it, tore down the running admissions and got
                                        a new incarnation back; no rank process outlives the run,
                                        nor an engine killed with SIGKILL
  check_replay.py modes REPLAY TRACE    the first 200 requests with no fault, ranks as threads
                                        and as processes: the same loads, reuse, checked bytes
                                        and tier calls
"""
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from redis_cluster import redis_cluster  # noqa: E402
from redis_server import redis_server  # noqa: E402

ZEROS = ["invariant_violations", "corrupted_bytes", "stranded_parked", "leaked_slots", "two_pass_delta"]


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def fast_dir():
    """The disk tiers' files on tmpfs when there is one: the same files, a tenth of the time."""
    return ["--dir", "/dev/shm"] if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else []


def run(replay, args, expect_rc=0, env=None):
    args = [*args, *fast_dir()]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        metrics = os.path.join(tmp, "metrics.prom")
        proc = subprocess.run([replay, *args, "--json", out, "--metrics-out", metrics],
                              capture_output=True, text=True, timeout=1200, env=env)
        print(proc.stdout)
        if proc.returncode != expect_rc:
            print(proc.stderr)
            fail(f"exit status {proc.returncode}, expected {expect_rc}")
        with open(out) as f:
            report = json.load(f)
        with open(metrics) as f:
            text = f.read()
    if "# TYPE kvfuse_" not in text:
        fail("--metrics-out wrote no kvfuse_ metric families")
    report["metrics_text"] = text
    return report


def check_zeros(report, two_pass):
    if not report["ok"]:
        fail("report says not ok")
    for name, model in report["models"].items():
        for z in ZEROS:
            if model["must_be_zero"][z] != 0:
                fail(f"{name}: {z} = {model['must_be_zero'][z]}")
        if model["verified_bytes"] == 0:
            fail(f"{name}: no byte was checked: the replay restored nothing")
        if model["requests"]["completed"] == 0:
            fail(f"{name}: no request completed")
        if two_pass and model["two_pass"]["compared"] < model["requests"]["completed"] // 2:
            fail(f"{name}: two passes compared only {model['two_pass']['compared']} outputs")


# 320 blocks of 64 tokens: far less HBM than the sessions need, so prefixes come back from the tier.
# Seed 3: its coins abort and preempt requests in every model (seed 1 preempts none).
FAULTS = ["--sessions", "10", "--turns", "5", "--ranks", "4", "--two-pass", "--tier-capacity", "256KiB",
          "--blocks", "320", "--seed", "3"]


def faults(replay, *extra, env=None):
    report = run(replay, [*FAULTS, *extra], env=env)
    check_zeros(report, True)
    check_faults_happened(report)
    return report


def check_faults_happened(report):
    models = report["models"]
    if set(models) != {"dense", "dsv4", "k3", "multi"}:
        fail(f"models replayed: {sorted(models)}")
    def total(f):
        return sum(f(m) for m in models.values())
    if total(lambda m: m["faults"]["rank_deaths"]) == 0 or total(lambda m: m["faults"]["disk_reopens"]) == 0:
        fail("the rank death or the disk reopen never happened")
    if total(lambda m: m["faults"]["aborts"]) + total(lambda m: m["faults"]["preemptions"]) == 0:
        fail("no request was aborted or preempted mid-load")
    # A preempted request keeps its id; admitted again while its first admission's orphaned
    # load still holds that admission's blocks, it has two admissions, each freed on its own
    # Freed (a mix-up shows as an invariant violation or a leak above).
    if total(lambda m: m["requests"]["readmitted_while_held"]) == 0:
        fail("no request was admitted again while its earlier admission still held its blocks")
    if total(lambda m: m["faults"]["state_entries_removed"]) == 0:
        fail("no state entry was removed from a rank")
    if total(lambda m: m["hashes_retracted"]) == 0:
        fail("no hash was retracted although state entries were removed")
    for kind in ["kv_only", "joint", "state_only"]:
        if total(lambda m: m["loads"][kind]) == 0:
            fail(f"no {kind} load happened")
    if models["multi"]["loads"]["pd_transfer"] == 0:
        fail("multi: the P/D sub never won")
    serial = models["k3"]["comparison"]
    if serial is None or serial["model"] != "k3-serial" or serial["latency"]["joint"]["count"] == 0:
        fail(f"k3: no joint load timed with the state leg after KV: {serial}")


TAG = "KVFUSE_REPLAY_TEST_TAG"


def tagged(tag):
    """Live (not zombie) processes whose environment has TAG=tag: a replay and its rank processes."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"{TAG}={tag}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def wait_until_gone(tag, what):
    deadline = time.monotonic() + 10  # a sanitizer build on a loaded machine exits slowly
    while tagged(tag):
        if time.monotonic() > deadline:
            fail(f"{what}: processes left running: {tagged(tag)}")
        time.sleep(0.02)


def processes(replay):
    tag = f"{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, TAG: tag}
    # The engine killed with SIGKILL mid-run: every rank process ends on its own (ShmRank sees
    # the engine's pidfd); none is left running.
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([replay, "--sessions", "200", "--turns", "5", "--ranks", "4", "--ranks-as", "processes",
                                 "--model", "k3", "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 60
        while len(tagged(tag)) < 5:  # the engine and its four ranks
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                fail(f"the rank processes never all started: {tagged(tag)}")
            time.sleep(0.01)
        time.sleep(0.2)  # mid-run
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_until_gone(tag, "the engine killed with SIGKILL")
        print("engine killed with SIGKILL: every rank process ended")
    # Every fault, two passes, ranks as processes (the next engine also removes the segment
    # the killed one left).
    check_processes(faults(replay, "--ranks-as", "processes", env=env))
    wait_until_gone(tag, "after the run")
    # Thrice the sessions: when the rank dies, admissions hold bytes on it (restored, cached,
    # or written at a checkpoint stop), so an engine that kept them running after the rank
    # came back empty would show corrupted bytes or a two-pass delta here.
    crowded = ["--sessions", "30", "--turns", "4", "--ranks", "4", "--two-pass", "--tier-capacity", "256KiB",
               "--blocks", "640", "--seed", "3", "--ranks-as", "processes"]
    report = run(replay, crowded)
    check_zeros(report, True)
    if any(m["rank_processes"]["torn_down"] == 0 for m in report["models"].values()):
        fail("a model had no running admission to tear down when its rank process died")
    check_processes(report)


def check_processes(report):
    models = report["models"]
    killed = restarted = torn_down = 0
    for name, m in models.items():
        if m["ranks_as"] != "processes":
            fail(f"{name}: ran with ranks as {m['ranks_as']}")
        k, r = m["faults"]["rank_processes_killed"], m["faults"]["rank_processes_restarted"]
        seen = m["rank_processes"]["deaths_seen"]
        ranks = m["rank_processes"]["ranks"]
        if seen != k:
            fail(f"{name}: {k} rank processes killed but the engine saw {seen} die")
        segment = m["rank_processes"]["segment"]
        if segment["deaths"] != k or segment["attaches"] != 4 + r or segment["faulty"] != 0:
            fail(f"{name}: the segment saw {segment['deaths']} deaths, {segment['attaches']} attaches, "
                 f"{segment['faulty']} faulty ranks after {k} kills and {r} restarts")
        if len(ranks) != 4 or any(c["loads"] + c["kv_saves"] == 0 or c["bytes_corrupted"] != 0 for c in ranks):
            fail(f"{name}: what the rank processes reported: {ranks}")
        if sum(c["bytes_checked"] for c in ranks) == 0:
            fail(f"{name}: no rank process checked a byte")
        if r > 0 and ranks[-1]["incarnation"] != 1 + r:
            fail(f"{name}: the last rank was restarted {r} times but its process is incarnation {ranks[-1]['incarnation']}")
        killed, restarted, torn_down = killed + k, restarted + r, torn_down + m["rank_processes"]["torn_down"]
        print(f"{name}: killed {k}, restarted {r}, admissions torn down {m['rank_processes']['torn_down']}, "
              f"per rank loads {[c['loads'] for c in ranks]}, bytes checked {[c['bytes_checked'] for c in ranks]}")
    if killed == 0 or restarted == 0:
        fail(f"the kill fault killed {killed} and restarted {restarted} rank processes")
    if torn_down == 0:
        fail("no running admission was torn down when a rank process died")


def modes(replay, path):
    args = ["--trace", path, "--limit", "200", "--ranks", "4", "--faults", "none"]
    threads = run(replay, [*args, "--ranks-as", "threads"])
    procs = run(replay, [*args, "--ranks-as", "processes"])
    check_zeros(threads, False)
    check_zeros(procs, False)
    for name, t in threads["models"].items():
        p = procs["models"][name]
        for key in ("loads", "reused_tokens", "verified_bytes", "requests", "tier_calls", "saves"):
            if t.get(key) != p.get(key):
                fail(f"{name}: {key} as threads {t.get(key)}, as processes {p.get(key)}")
        print(f"{name}: the same counts; requests/s as threads {t['requests_per_second']:.0f}, "
              f"as processes {p['requests_per_second']:.0f}")


def trace(replay, path):
    report = run(replay, ["--trace", path, "--limit", "200", "--ranks", "4"])
    check_zeros(report, False)
    if report["workload"]["requests"] != 200:
        fail(f"replayed {report['workload']['requests']} requests, not 200")
    bound = report["workload"]["reuse_bound_tokens"]
    for name, m in report["models"].items():
        used = m["reused_tokens"]["hbm"] + m["reused_tokens"]["tier"]
        if m["reused_tokens"]["tier"] == 0:
            fail(f"{name}: the tier served nothing")
        if name == "dense" and used > bound:
            fail(f"{name}: reused {used} tokens, above the trace's bound {bound}: a false hit")


def bound(replay, path):
    report = run(replay, ["--trace", path, "--limit", "200", "--ranks", "2", "--model", "dense", "--faults", "none",
                          "--tier-capacity", "unlimited", "--sync-saves"])
    check_zeros(report, False)
    b = report["workload"]["reuse_bound_tokens"]
    m = report["models"]["dense"]
    used = m["reused_tokens"]["hbm"] + m["reused_tokens"]["tier"]
    print(f"reused {used} of the bound {b} ({100.0 * used / b:.2f}%)")
    if used > b:
        fail(f"reused {used} > bound {b}: a false hit")
    if used < 0.99 * b:
        fail(f"reused {used} < 99% of the bound {b}")


# The setting: the numbers of the README's hybrid rows. Two ranks: the reuse is the
# same with eight (the lookup asks every rank), in a third of the time.
HYBRID = ["--model", "dense,dsv4,k3", "--limit", "1000", "--tier", "memory", "--tier-capacity", "unlimited",
          "--sync-saves", "--faults", "none", "--ranks", "2"]
HYBRID_SHARE = 0.95            # of the dense model's reused tokens, at least
HYBRID_CHECKPOINTS = 3.0       # saved per request, at most


def reused(model):
    return model["reused_tokens"]["hbm"] + model["reused_tokens"]["tier"]


def metric(text, family, model):
    """The sample of FAMILY for MODEL in a Prometheus text, or None."""
    for line in text.splitlines():
        if line.startswith(family + '{model="' + model + '"} '):
            return float(line.rsplit(" ", 1)[1])
    return None


def hybrid_problems(report):
    """What keeps the hybrid models of REPORT from the issue's numbers ([] when none)."""
    problems = []
    bound = report["workload"]["reuse_bound_tokens"]
    dense = reused(report["models"]["dense"])
    for name in ("dsv4", "k3"):
        m = report["models"][name]
        used, share, per_request = reused(m), m["reused_share_of_dense"], m["checkpoints_per_request"]
        print(f"{name}: reused {used} tokens = {share:.4f} of dense's {dense}, {used / bound:.4f} of the bound; "
              f"{per_request:.3f} checkpoints and {m['state_bytes_per_request']:.0f} state bytes per request; "
              f"{m['checkpoints']['skipped']} skipped")
        # The report's share, the Prometheus sample and the tokens must tell one story.
        if abs(share - used / dense) > 1e-9:
            problems.append(f"{name}: reused_share_of_dense {share} but {used} / {dense} = {used / dense}")
        for family, value in (("kvfuse_replay_reused_share_of_dense", share),
                              ("kvfuse_replay_checkpoints_per_request", per_request),
                              ("kvfuse_replay_state_bytes_per_request", m["state_bytes_per_request"])):
            sample = metric(report["metrics_text"], family, name)
            if sample is None or abs(sample - value) > 1e-9 * max(1.0, value):
                problems.append(f"{name}: --metrics-out has {family} = {sample}, the JSON {value}")
        if used > bound:
            problems.append(f"{name}: reused {used} tokens, above the trace's bound {bound}: a false hit")
        if share < HYBRID_SHARE:
            problems.append(f"{name}: reused {share:.4f} of dense's tokens, below {HYBRID_SHARE}")
        if per_request > HYBRID_CHECKPOINTS:
            problems.append(f"{name}: {per_request:.3f} checkpoints saved per request, above {HYBRID_CHECKPOINTS}")
        if per_request > 0 and m["state_bytes_per_request"] <= 0:
            problems.append(f"{name}: checkpoints saved but no state bytes stored")
    return problems


def hybrid(replay, path, *extra):
    report = run(replay, ["--trace", path, *HYBRID, *extra])
    check_zeros(report, False)
    problems = hybrid_problems(report)
    if problems:
        fail("; ".join(problems))
    if extra:
        return
    # The check tells the policies apart: one checkpoint per request, at the end of the
    # generated tokens (the replay before checkpoint policies), fails it.
    last = run(replay, ["--trace", path, *HYBRID, "--checkpoints", "last"])
    check_zeros(last, False)
    if not hybrid_problems(last):
        fail("with --checkpoints last the hybrid numbers still hold: the check cannot fail")
    # No snapshot slot: every planned prefill checkpoint is skipped and counted, the prefill
    # never waits for one, and what is left is the generation-end checkpoint: `last`.
    dsv4_only = [a if HYBRID[i - 1] != "--model" else "dsv4" for i, a in enumerate(HYBRID)]
    starved = run(replay, ["--trace", path, *dsv4_only, "--snapshot-slots", "0"])
    check_zeros(starved, False)
    m, old = starved["models"]["dsv4"], last["models"]["dsv4"]
    if m["checkpoints"]["skipped"] == 0:
        fail("dsv4 with no snapshot slot skipped no checkpoint")
    if m["requests"]["completed"] != starved["workload"]["requests"]:
        fail(f"dsv4 with no snapshot slot completed {m['requests']['completed']} requests")
    if (reused(m), m["checkpoints"]["saved"]) != (reused(old), old["checkpoints"]["saved"]):
        fail(f"dsv4 with no snapshot slot reused {reused(m)} tokens from {m['checkpoints']['saved']} checkpoints; "
             f"with --checkpoints last {reused(old)} from {old['checkpoints']['saved']}")
    print(f"no snapshot slot: {m['checkpoints']['skipped']} prefill checkpoints skipped, the reuse of `last`")


# A share of the working set: the first 300 requests of the trace, dense and k3 (with its
# serial comparison), synchronous saves, so that every run holds the same bytes.
SHARE = ["--limit", "300", "--ranks", "2", "--model", "dense,k3", "--tier", "memory", "--sync-saves",
         "--faults", "none"]


def share(replay, path):
    unlimited = run(replay, ["--trace", path, *SHARE, "--tier-capacity", "unlimited"])
    full = run(replay, ["--trace", path, *SHARE, "--tier-capacity", "100%"])
    part = run(replay, ["--trace", path, *SHARE, "--tier-capacity", "30%"])  # at 10% LRU keeps no reusable chunk
    for report in (unlimited, full, part):
        check_zeros(report, False)
    for name in ("dense", "k3"):
        if "tier_capacity" in unlimited["models"][name]:
            fail(f"{name}: a byte capacity reports a share it was not given")
        ws = full["models"][name]["tier_capacity"]["working_set_bytes"]
        if ws <= 0:
            fail(f"{name}: the unlimited pass held no bytes")
        if full["models"][name]["tier_capacity"]["bytes"] != ws:
            fail(f"{name}: 100% is {full['models'][name]['tier_capacity']['bytes']} bytes, the working set {ws}")
        got = part["models"][name]["tier_capacity"]
        if got["working_set_bytes"] != ws or got["bytes"] != math.ceil(ws * 0.3) or got["percent"] != 30:
            fail(f"{name}: 30% of {ws} bytes resolved to {got}")
        whole, cut = reused(full["models"][name]), reused(part["models"][name])
        if whole != reused(unlimited["models"][name]):
            fail(f"{name}: at 100% of the working set it reused {whole}, unlimited {reused(unlimited['models'][name])}")
        if not cut < whole:
            fail(f"{name}: at 30% it reused {cut}, not less than the {whole} of 100%: the capacity did not bind")
        evicted = sum(float(line.rsplit(" ", 1)[1]) for line in part["metrics_text"].splitlines()
                      if line.startswith("kvfuse_tier_evictions_total{") and f'model="{name}"' in line)
        if evicted == 0:
            fail(f"{name}: at 30% the memory tiers evicted nothing")
        print(f"{name}: working set {ws} bytes per rank; reused {whole} at 100%, {cut} at 30% ({int(evicted)} evictions)")
    # --state-scale 4: every checkpoint four chunks' KV, the same plans, every byte still checked.
    scaled = run(replay, ["--trace", path, *SHARE, "--tier-capacity", "unlimited", "--state-scale", "4"])
    check_zeros(scaled, False)
    if scaled["options"].get("state_scale") != 4 or "state_scale" in unlimited["options"]:
        fail(f"the report's options say state_scale {scaled['options'].get('state_scale')}")
    for name in ("dense", "k3"):
        small, large = unlimited["models"][name], scaled["models"][name]
        if reused(large) != reused(small):
            fail(f"{name}: a larger state changed the reuse of an unlimited tier: {reused(large)} against {reused(small)}")
        if name == "dense":
            if large["state_bytes_per_request"] != 0:
                fail("dense stored state")
            continue
        ratio = large["state_bytes_per_request"] / small["state_bytes_per_request"]
        if not 3.9 < ratio <= 4:  # each entry is its slot plus a small header
            fail(f"{name}: state bytes per request grew {ratio:.3f} times with --state-scale 4")
        print(f"{name}: --state-scale 4 stores {ratio:.3f} times the state bytes, reuse unchanged")


# The cache ledger (--cache-policy): the first 600 requests, dense and dsv4, state 16 chunks
# a checkpoint, one at every chunk boundary (the placement `cost` wants), synchronous saves.
CACHE = ["--limit", "600", "--ranks", "2", "--model", "dense,dsv4", "--tier", "memory", "--sync-saves", "--faults", "none",
         "--state-scale", "16", "--checkpoints", "all"]


def metric_samples(report, family, name):
    """Every sample of `family` labelled with model `name`, by rank label."""
    out = {}
    for line in report["metrics_text"].splitlines():
        if line.startswith(family + "{") and f'model="{name}"' in line and 'tier="memory"' in line:
            rank = line.split('rank="', 1)[1].split('"', 1)[0]
            out[rank] = float(line.rsplit(" ", 1)[1])
    return out


def cache(replay, path):
    lru = run(replay, ["--trace", path, *CACHE, "--tier-capacity", "10%"])
    cost = run(replay, ["--trace", path, *CACHE, "--tier-capacity", "10%", "--cache-policy", "cost"])
    full = run(replay, ["--trace", path, *CACHE, "--tier-capacity", "100%", "--cache-policy", "cost"])
    for report in (lru, cost, full):
        check_zeros(report, False)
    if cost["options"].get("cache_policy") != "cost" or "cache_policy" in lru["options"]:
        fail(f"the report's options say cache_policy {cost['options'].get('cache_policy')}")
    for name in ("dense", "dsv4"):
        if "cache_ledger" in lru["models"][name]:
            fail(f"{name}: a run without --cache-policy reports a ledger")
        ledger = cost["models"][name]["cache_ledger"]
        budget = cost["models"][name]["tier_capacity"]["bytes"]
        if ledger["policy"] != "cost" or ledger["budget_bytes"] != budget:
            fail(f"{name}: the ledger's budget is {ledger['budget_bytes']}, the 10% capacity {budget}")
        if not 0 < ledger["bytes"] <= budget or ledger["bytes"] != ledger["kv_bytes"] + ledger["state_bytes"]:
            fail(f"{name}: the ledger keeps {ledger['bytes']} bytes against a budget of {budget}: {ledger}")
        if ledger["evicted_kv"] + ledger["evicted_state"] == 0:
            fail(f"{name}: at 10% the ledger evicted nothing")
        # The ledger owns the budget: the tiers never evict on their own and hold what it keeps
        # (a state entry is its slot plus a small header the ledger does not count).
        held = metric_samples(cost, "kvfuse_tier_bytes", name)
        evicted = metric_samples(cost, "kvfuse_tier_evictions_total", name)
        if len(held) != 2 or any(v != 0 for v in evicted.values()):
            fail(f"{name}: the memory tiers evicted on their own: {evicted}")
        for rank, b in held.items():
            if not ledger["bytes"] <= b <= ledger["bytes"] + 64 * (ledger["state_bytes"] // (16 * 4096) + 1):
                fail(f"{name}: rank {rank}'s tier holds {b} bytes, the ledger counts {ledger['bytes']}")
        whole = full["models"][name]
        if whole["cache_ledger"]["evicted_kv"] + whole["cache_ledger"]["evicted_state"] != 0 or \
                whole["cache_ledger"]["refused_first_seen"] != 0:
            fail(f"{name}: at 100% of the working set the ledger evicted or refused: {whole['cache_ledger']}")
        if reused(whole) != reused(lru_unlimited(replay, path, name)):
            fail(f"{name}: at 100% with the ledger it reused {reused(whole)}, an unlimited tier more")
        a, b = reused(lru["models"][name]), reused(cost["models"][name])
        print(f"{name}: at 10% of the working set the tier's LRU reused {a} tokens, the cost ledger {b} "
              f"(evicted {ledger['evicted_kv']} KV / {ledger['evicted_state']} state, refused {ledger['refused_first_seen']})")
        if name == "dsv4" and not b >= 1.2 * a:
            fail(f"dsv4: the cost policy reused {b} tokens at 10%, less than 1.2 x LRU's {a}")
        if name == "dense" and b < a:
            fail(f"dense: the cost policy reused {b} tokens at 10%, less than LRU's {a}")
    # Ranks as processes: the ledger's erases cross the control channel, the same choices.
    procs = run(replay, ["--trace", path, *CACHE, "--tier-capacity", "10%", "--cache-policy", "cost",
                         "--ranks-as", "processes"])
    threads = run(replay, ["--trace", path, *CACHE, "--tier-capacity", "10%", "--cache-policy", "cost"])
    check_zeros(procs, False)
    for name in ("dense", "dsv4"):
        p, t = procs["models"][name], threads["models"][name]
        if (reused(p), p["cache_ledger"]) != (reused(t), t["cache_ledger"]):
            fail(f"{name}: ranks as processes reused {reused(p)} with {p['cache_ledger']}, as threads {reused(t)} "
                 f"with {t['cache_ledger']}")
    print("ranks as processes: the same ledger and reuse as threads")
    # The offline reference (bench/cache_reference.py) models this replay: its lru and cost
    # reuse what the replay's do, at the same point.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
    import cache_reference as ref
    trace = ref.load_trace(path, 600)
    ref.hbm_hits(trace)
    grid = ref.run_grid(trace, [10.0], [16], ["dense", "dsv4"], ["lru", "cost"], ref.CheckpointPolicy.named("all"),
                        log=lambda *a, **k: None)["16"]
    for name in ("dense", "dsv4"):
        for policy, report in (("lru", lru), ("cost", cost)):
            mine = grid[name]["points"]["10%"][policy]["share"]
            theirs = report["models"][name]["reused_share_of_bound"]
            if abs(mine - theirs) > 1e-9:
                fail(f"{name}: the reference's {policy} reuses {mine:.6f} of the bound, the replay {theirs:.6f}")
    print("the offline reference's lru and cost reuse exactly what the replay's do")


_unlimited = {}


def lru_unlimited(replay, path, name):
    if not _unlimited:
        _unlimited.update(run(replay, ["--trace", path, *CACHE, "--tier-capacity", "unlimited"])["models"])
    return _unlimited[name]


def usage(replay, path):
    with tempfile.TemporaryDirectory() as tmp:
        bad_line = os.path.join(tmp, "bad.jsonl")
        with open(path) as f, open(bad_line, "w") as out:
            out.write(f.readline())
            out.write(f.readline())
            out.write('{"timestamp": 5, "input_length": "many", "output_length": 3, "hash_ids": [1]}\n')
        not_json = os.path.join(tmp, "not.jsonl")
        with open(not_json, "w") as out:
            out.write('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{oops\n')
        # hash_ids holds one id per 512-token block of the prompt: 100 tokens are one block.
        too_many_ids = os.path.join(tmp, "ids.jsonl")
        with open(too_many_ids, "w") as out:
            out.write('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n')
            out.write('{"timestamp": 1, "input_length": 100, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5]}\n')
        too_few_ids = os.path.join(tmp, "few.jsonl")
        with open(too_few_ids, "w") as out:
            out.write('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}\n')
        unreadable = os.path.join(tmp, "missing.jsonl")
        json_out = os.path.join(tmp, "never.json")
        cases = [
            (["--model", "gpt"], "gpt"),
            (["--faults", "evict,meteor"], "meteor"),
            (["--trace", unreadable], "missing.jsonl"),
            (["--trace", bad_line], ":3:"),
            (["--trace", not_json], ":2:"),
            (["--trace", too_many_ids], "ids.jsonl:2: hash_ids has 5 ids, expected 1"),
            (["--trace", too_few_ids], "few.jsonl:1: hash_ids has 2 ids, expected 3"),
            (["--tier-capacity", "0"], "--tier-capacity"),
            (["--tier-capacity", "-5"], "-5"),
            (["--tier-capacity", "-5MiB"], '"-5MiB"'),
            (["--tier-capacity", "5XB"], '"5XB"'),
            (["--tier-capacity", ""], '--tier-capacity: ""'),
            (["--tier-capacity", "1e99"], '"1e99"'),
            (["--tier-capacity", "1.5MiB"], '"1.5MiB"'),
            (["--tier-capacity", "MiB"], '"MiB"'),
            (["--tier-capacity", "99999999999999999999"], '"99999999999999999999"'),
            (["--tier-capacity", "17179869184GiB"], '"17179869184GiB"'),
            (["--tier-capacity", "0KiB"], '"0KiB"'),
            (["--tier-capacity", "0%"], '"0%" must be a share in (0%, 100%]'),
            (["--tier-capacity", "100.5%"], '"100.5%" must be a share'),
            (["--tier-capacity", "%"], '"%" is not a share'),
            (["--tier-capacity", "-5%"], '"-5%" is not a share'),
            (["--tier-capacity", "1e1%"], '"1e1%" is not a share'),
            (["--tier-capacity", "1.2.3%"], '"1.2.3%" is not a share'),
            (["--tier", "redis", "--redis", "unix:/nonexistent/redis.sock", "--tier-capacity", "10%"],
             '"10%" sizes a memory tier, and --tier redis has none'),
            (["--tier", "redis-cluster:127.0.0.1:1", "--tier-capacity", "10%"], "--tier redis-cluster has none"),
            (["--ranks", "0"], "--ranks"),
            (["--ranks-as", "forks"], "forks"),
            (["--sessions", "-1"], "-1"),
            (["--blocks", "0"], "--blocks"),
            (["--checkpoints", "sometimes"], "'sometimes'"),
            (["--checkpoints", "every:0"], "'every:0'"),
            (["--checkpoints", "every:4294967296"], "'every:4294967296'"),
            (["--state-capacity", "0"], "--state-capacity"),
            (["--state-capacity", "2147483649"], "--state-capacity"),
            (["--hash-eviction", "fifo"], "fifo"),
            (["--cache-policy", "fifo"], "fifo"),
            (["--snapshot-slots", "4097"], "--snapshot-slots"),
            (["--snapshot-slots", "-1"], "--snapshot-slots"),
            (["--state-scale", "0"], "--state-scale"),
            (["--state-scale", "1025"], "--state-scale"),
            (["--state-scale", "1024", "--slots", "300"], "more than 1 GiB"),
            (["--tier", "redis", "--redis", "localhost"], "--redis: kvfuse: invalid_argument: redis address 'localhost' has no port"),
            (["--tier", "redis", "--redis", "localhost:65536"], "'localhost:65536' has a port outside"),
            (["--tier", "redis-cluster"], "--tier redis-cluster: needs its seeds"),
            (["--tier", "redis-cluster:localhost"], "redis address 'localhost' has no port"),
            (["--tier", "redis-cluster:127.0.0.1:1,"], "redis address '' has no port"),
            (["--tier", "redis-clusters:x"], "redis-clusters:x"),
        ]
        for args, needle in cases:
            proc = subprocess.run([replay, *args, "--json", json_out], capture_output=True, text=True, timeout=60)
            if proc.returncode != 2:
                fail(f"{args}: exit status {proc.returncode}, expected 2\n{proc.stdout}{proc.stderr}")
            if needle not in proc.stderr or "usage" not in proc.stderr.lower():
                fail(f"{args}: the message does not name {needle!r} with the usage:\n{proc.stderr}")
            if os.path.exists(json_out):
                fail(f"{args}: wrote {json_out} although it failed")
            print(f"ok: {' '.join(args)} -> exit 2: {proc.stderr.splitlines()[0]}")


def redis(replay):
    with redis_server() as sock:
        report = run(replay, ["--tier", "redis", "--redis", "unix:" + sock, "--model", "dense,k3,multi",
                              "--sessions", "8", "--turns", "4", "--ranks", "4", "--blocks", "240", "--two-pass"])
        check_zeros(report, True)
        for name, m in report["models"].items():
            if m["reused_tokens"]["tier"] == 0:
                fail(f"{name}: nothing came back from redis")
        # The remote tier's own counters reach the exposition, per rank and model.
        trips = [line for line in report["metrics_text"].splitlines()
                 if line.startswith("kvfuse_tier_round_trips_total{") and 'tier="redis"' in line]
        if len(trips) < 4 or not any(float(line.rsplit(" ", 1)[1]) > 0 for line in trips):
            fail(f"--metrics-out has no redis round trips: {trips}")
        # A batched tier stays batched through the ranks' wrapper: each KV load is one
        # get_batch, one round trip, however many chunks it reads. The server-side count
        # (the tier's own metric) must equal the calls the wrapper made, each one exchange.
        for name, m in report["models"].items():
            calls = m["tier_calls"]
            loads, reads, chunks = calls["kv_loads_sent"], calls["kv_reads"], calls["kv_chunks_read"]
            if loads == 0 or chunks <= loads:
                fail(f"{name}: {loads} KV loads reading {chunks} chunks: no load read several chunks to batch")
            if reads != loads:
                fail(f"{name}: {reads} KV reads from redis for {loads} KV loads: not one round trip per load")
            server = sum(int(line.rsplit(" ", 1)[1]) for line in trips if re.search(f'model="{name}"', line))
            if server != calls["total"]:
                fail(f"{name}: redis counted {server} round trips, the ranks made {calls['total']} tier calls")
            print(f"{name}: {loads} KV loads, {reads} KV round trips for {chunks} chunks; {server} round trips in all")


def cluster(replay):
    with redis_cluster(node_timeout_ms=500) as c, tempfile.TemporaryDirectory() as tmp:
        out, metrics, log = (os.path.join(tmp, name) for name in ("report.json", "metrics.prom", "stdout.txt"))
        args = [replay, "--tier", "redis-cluster:" + c.seeds(), "--model", "dense,k3,dsv4", "--sessions", "40", "--turns", "5",
                "--ranks", "4", "--blocks", "240", "--two-pass", "--json", out, "--metrics-out", metrics, *fast_dir()]
        with open(log, "w") as stdout:
            proc = subprocess.Popen(args, stdout=stdout, stderr=subprocess.STDOUT)
            try:
                # Entries in the cluster: the first offload-on pass is running. Kill a primary under it.
                while c.keys_held() < 100 and proc.poll() is None:
                    time.sleep(0.05)
                if proc.poll() is not None:
                    fail("the replay ended before the cluster held 100 entries: no primary was killed mid-run")
                victim = c.primaries()[0]
                c.kill(victim)
                killed_at = time.monotonic()
                print(f"killed the primary on port {victim} with {c.keys_held()} entries in the others")
                c.wait_converged("the replica's promotion")
                promoted_at = time.monotonic()
                running = proc.poll() is None
                rc = proc.wait(timeout=1200)
                print(f"the cluster converged {promoted_at - killed_at:.1f} s after the kill, "
                      f"{'with the replay still running' if running else 'after the replay ended'}; "
                      f"the replay ended {time.monotonic() - killed_at:.1f} s after the kill")
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        with open(log) as f:
            print(f.read())
        if rc != 0:
            fail(f"exit status {rc}, expected 0")
        with open(out) as f:
            report = json.load(f)
        with open(metrics) as f:
            text = f.read()
        check_zeros(report, True)
        for name, m in report["models"].items():
            if m["reused_tokens"]["tier"] == 0:
                fail(f"{name}: nothing came back from the cluster")

        def total(family):
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(family + "{") and 'tier="redis-cluster"' in line)
        lost = total("kvfuse_tier_get_failures_total") + total("kvfuse_tier_put_failures_total") + \
            total("kvfuse_tier_timeouts_total")
        if lost == 0:
            fail("no get or put failed: the killed primary never touched the run")
        tiers = [line for line in text.splitlines()
                 if line.startswith("kvfuse_tier_map_refreshes_total{") and 'tier="redis-cluster"' in line]
        if total("kvfuse_tier_map_refreshes_total") <= len(tiers):  # each tier learnt its first map
            fail("no rank's tier learnt a second map: the promoted replica was never found")
        if total("kvfuse_tier_rejected_total") != 0:
            fail("values were rejected")
        print(f"{int(lost)} gets and puts failed around the kill; "
              f"{int(total('kvfuse_tier_map_refreshes_total'))} maps learnt; the five zeros held")


if __name__ == "__main__":
    what, replay_bin, *rest = sys.argv[1:]
    {"faults": faults, "trace": trace, "bound": bound, "hybrid": hybrid, "usage": usage,
     "redis": redis, "cluster": cluster, "processes": processes, "modes": modes, "share": share, "cache": cache}[what](replay_bin, *rest)
    print("ok")
