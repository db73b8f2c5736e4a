#!/usr/bin/env python3
"""kvfuse-llama's tests (run by ctest): run the program, read its JSON report, check it.

  check_llama.py two-pass BIN MODEL           the conversations twice, offload off then on:
                                              the five zeros, bitwise-equal outputs, and loads
                                              that really restored tokens from the tier
  check_llama.py control BIN MODEL CONTROL    flip-kv or wrong-boundary: the program exits 1
                                              and says why (different bits, or a refused resume)
  check_llama.py redis BIN                    two processes, one redis-server started here: the
                                              second restores what the first saved and gives its
                                              outputs bit for bit; a doctored expected file fails
  check_llama.py cluster BIN                  the same with a Redis Cluster started here (3
                                              primaries, 3 replicas) the two processes share
  check_llama.py cache-policy BIN             --cache-policy cost and lru at a budget that binds:
                                              the five zeros and the same bits, the ledger within
                                              its budget, the tier holding exactly what it counts
  check_llama.py usage BIN                    bad arguments and input exit 2 naming the value
"""
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from redis_cluster import redis_cluster  # noqa: E402
from redis_server import redis_server  # noqa: E402

ZEROS = ["invariant_violations", "corrupted_loads", "stranded_parked", "leaked_slots", "two_pass_delta"]
# Small enough for CI, large enough that every load kind happens: 4 conversations over 2
# system prompts, 3 turns, and a block pool that drops what the tier then serves.
WORKLOAD = ["--workload", "conversations", "--conversations", "4", "--system-prompts", "2", "--turns", "3",
            "--blocks", "10", "--ttft", "none"]


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def fast_dir():
    """The disk tier's files on tmpfs when there is one."""
    return ["--dir", "/dev/shm"] if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else []


def run(binary, args, expect_rc):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        proc = subprocess.run([binary, *args, *fast_dir(), "--json", out], capture_output=True, text=True, timeout=1200)
        print(proc.stdout)
        if proc.returncode != expect_rc:
            print(proc.stderr)
            fail(f"exit status {proc.returncode}, expected {expect_rc}")
        with open(out) as f:
            return json.load(f), proc.stdout


def conversations(report, model):
    return report["models"][model]["workloads"]["conversations"]


def check_zeros(report):
    if not report["ok"]:
        fail("the report says not ok")
    for name, model in report["models"].items():
        for workload, w in model["workloads"].items():
            for z in ZEROS:
                if w["must_be_zero"][z] != 0:
                    fail(f"{name} {workload}: {z} = {w['must_be_zero'][z]}")


def check_reuse(w, model):
    """Loads happened and restored tokens from the tier, and, for a model with state, the
    checkpoints that made them possible were saved: a run that computed everything from
    scratch would pass the comparison trivially."""
    loads = w["loads"]
    if w["outcomes"]["completed"] == 0 or w["reused_tokens"]["tier"] == 0:
        fail(f"{model}: no load restored tokens from the tier: {w['loads']}, {w['reused_tokens']}")
    if model == "llama":
        if loads["kv_only"] == 0 or loads["joint"] + loads["state_only"] != 0:
            fail(f"llama: expected kv-only loads only, got {loads}")
    else:
        if loads["joint"] == 0 or loads["state_only"] == 0 or loads["kv_only"] != 0:
            fail(f"{model}: expected joint and state-only loads, got {loads}")
        if w["checkpoints"]["saved"] == 0:
            fail(f"{model}: no checkpoint saved")


def two_pass(binary, model):
    report, _ = run(binary, ["--model", model, *WORKLOAD], 0)
    check_zeros(report)
    w = conversations(report, model)
    if w["two_pass"]["compared"] != w["requests"] or w["two_pass"]["delta"] != 0:
        fail(f"{model}: two passes compared {w['two_pass']}")
    check_reuse(w, model)


def control(binary, model, which):
    report, stdout = run(binary, ["--model", model, *WORKLOAD, "--control", which], 1)
    w = conversations(report, model)
    if not w["control"]:
        fail(f"{model}: the control did nothing")
    if "PROBLEM" not in stdout:
        fail("the result line does not say PROBLEM")
    if which == "wrong-boundary" and model == "deepseek4":
        # deepseek4's window carries its cells' positions: the restored sequence ends at the
        # wrong position and the resume is refused (then recomputed, so the bits agree).
        if w["resumes_refused"] == 0 or w["must_be_zero"]["corrupted_loads"] == 0:
            fail(f"deepseek4: the wrong-boundary state was not refused: {w}")
        if "another boundary" not in w["first_refusal"]:
            fail(f"deepseek4: the refusal does not name the boundary: {w['first_refusal']!r}")
    else:
        if w["two_pass"]["delta"] == 0 or w["must_be_zero"]["corrupted_loads"] == 0:
            fail(f"{model}: {which} did not change any output: {w['two_pass']}")
        if "resumed at token" not in w["first_difference"]:
            fail(f"{model}: the first difference is not a resumed request: {w['first_difference']!r}")


def redis(binary):
    with redis_server() as sock:
        two_engines(binary, ["--tier", "redis", "--redis", "unix:" + sock, "--key-prefix", "kvfuse-llama-test:"])


def cluster(binary):
    with redis_cluster() as c:
        two_engines(binary, ["--tier", "redis-cluster", "--redis", c.seeds(), "--key-prefix", "kvfuse-llama-test:"])


def two_engines(binary, tier):
    with tempfile.TemporaryDirectory() as tmp:
        first_out = os.path.join(tmp, "first.json")
        # The first engine: both passes (its own comparison), saving into the server.
        first, _ = run(binary, [*WORKLOAD, *tier, "--outputs-out", first_out], 0)
        check_zeros(first)
        # The second engine, another process with an empty index: it reseeds the index
        # from the server's keys, restores what the first saved, and must give the first
        # one's outputs bit for bit.
        second, _ = run(binary, [*WORKLOAD, *tier, "--passes", "1", "--outputs-expected", first_out], 0)
        check_zeros(second)
        for model, m in second["models"].items():
            w = m["workloads"]["conversations"]
            if m["expected_outputs"]["compared"] != w["requests"] or m["expected_outputs"]["delta"] != 0:
                fail(f"{model}: outputs against the first process: {m['expected_outputs']}")
            if w["reused_tokens"]["tier"] <= conversations(first, model)["reused_tokens"]["tier"]:
                fail(f"{model}: the second process restored no more than the first did: {w['reused_tokens']}")
            if model != "llama" and w["hashes_reseeded"] == 0:
                fail(f"{model}: the second process found no checkpoint in the server")
            if w["saves"]["failed"] != 0:
                fail(f"{model}: saves failed: {w['saves']}")
        # The comparison can fail: one changed logit bit in the expected file.
        with open(first_out) as f:
            doctored = json.load(f)
        entry = doctored["models"]["kimi-k3"]["conversations"][5]
        entry["logits"] = ("1" if entry["logits"][0] != "1" else "2") + entry["logits"][1:]
        doctored_out = os.path.join(tmp, "doctored.json")
        with open(doctored_out, "w") as f:
            json.dump(doctored, f)
        third, _ = run(binary, [*WORKLOAD, *tier, "--passes", "1", "--model", "kimi-k3",
                                "--outputs-expected", doctored_out], 1)
        if third["models"]["kimi-k3"]["expected_outputs"]["delta"] != 1:
            fail(f"a doctored expected file: {third['models']['kimi-k3']['expected_outputs']}")


def cache_policy(binary):
    """The ledger owns --tier-capacity of the whole memory+disk tier: what it evicts leaves
    both levels, so the disk holds exactly the entries and bytes the ledger counts, the
    memory tier (unlimited under a ledger) never evicts on its own and holds the same bytes,
    and no load misses."""
    budget = 262144
    reused = {}
    for policy in ("cost", "lru"):
        report, stdout = run(binary, [*WORKLOAD, "--tier-capacity", str(budget), "--cache-policy", policy], 0)
        check_zeros(report)
        if f"the cache ledger ({policy})" not in stdout:
            fail(f"{policy}: the report does not name the ledger")
        for model in report["models"]:
            w = conversations(report, model)
            ledger, tier = w["cache_ledger"], w["tier"]
            if w["two_pass"]["delta"] != 0 or w["two_pass"]["compared"] != w["requests"]:
                fail(f"{policy} {model}: two passes compared {w['two_pass']}")
            if ledger["budget_bytes"] != budget or ledger["bytes"] > budget:
                fail(f"{policy} {model}: the ledger keeps {ledger['bytes']} of {ledger['budget_bytes']} bytes")
            if ledger["evicted_kv"] + ledger["evicted_state"] == 0:
                fail(f"{policy} {model}: the budget never bound (nothing evicted): {ledger}")
            if (tier["disk_entries"], tier["disk_bytes"]) != (ledger["entries"], ledger["bytes"]):
                fail(f"{policy} {model}: the disk holds {tier['disk_entries']} entries / {tier['disk_bytes']} bytes, "
                     f"the ledger counts {ledger['entries']} / {ledger['bytes']}")
            if tier["memory_evictions"] != 0 or tier["memory_bytes"] != ledger["bytes"]:
                fail(f"{policy} {model}: the memory tier evicted on its own or holds what the ledger does not count: {tier}")
            if w["outcomes"]["state_missed"] != 0 or w["outcomes"]["failed"] != 0:
                fail(f"{policy} {model}: a load missed what the ledger said was kept: {w['outcomes']}")
        reused[policy] = sum(conversations(report, m)["reused_tokens"]["hbm"] + conversations(report, m)["reused_tokens"]["tier"]
                             for m in report["models"])
    # At a budget this tight the tier's LRU keeps little; cost keeps what saves most per byte.
    if reused["cost"] < reused["lru"]:
        fail(f"cost reused {reused['cost']} tokens over the three models, lru {reused['lru']}")
    print(f"reused tokens over the three models at {budget} bytes: cost {reused['cost']}, lru {reused['lru']}")


def usage(binary):
    cases = [
        (["--model", "gpt"], "gpt"),
        (["--control", "flip"], "flip"),
        (["--ttft", "300"], "300"),
        (["--ubatch", "48"], "48"),
        (["--tier", "redis"], "--redis"),
        (["--tier", "redis", "--redis", "localhost:6379x"], "--redis: kvfuse: invalid_argument: redis address 'localhost:6379x' has a port that is not a decimal number"),
        (["--tier", "redis-cluster"], "--tier redis-cluster: needs --redis"),
        (["--tier", "redis-cluster", "--redis", "127.0.0.1:1,localhost"], "redis address 'localhost' has no port"),
        (["--passes", "1", "--control", "flip-kv"], "--passes 2"),
        (["--checkpoints", "sometimes"], "sometimes"),
        (["--cache-policy", "fifo"], "fifo"),
        (["--cache-policy", "cost", "--tier", "redis", "--redis", "unix:/nonexistent"], "--cache-policy cost: owns a memory+disk tier's budget"),
        (["--model", "llama", "--control", "wrong-boundary", "--ttft", "none", "--workload", "conversations",
          "--turns", "1", "--conversations", "1"], "needs a model with state"),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        bad_trace = os.path.join(tmp, "bad.jsonl")
        with open(bad_trace, "w") as f:
            f.write('{"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [1]}\n')
        cases.append((["--workload", "trace", "--trace", bad_trace, "--ttft", "none"], "hash_ids has 1 ids, expected 2"))
        for args, named in cases:
            proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=300)
            if proc.returncode != 2:
                fail(f"{args}: exit status {proc.returncode}, expected 2\n{proc.stdout}\n{proc.stderr}")
            if named not in proc.stderr + proc.stdout:
                fail(f"{args}: the message does not name {named!r}:\n{proc.stderr}{proc.stdout}")


if __name__ == "__main__":
    what, *rest = sys.argv[1:]
    {"two-pass": two_pass, "control": control, "redis": redis, "cluster": cluster, "cache-policy": cache_policy,
     "usage": usage}[what](*rest)
    print("ok")
