#!/usr/bin/env python3
"""The replay's report holds still across refactors (run by ctest).

  check_golden.py REPLAY TRACE GOLDEN_DIR

Runs kvfuse-replay on two fixed-seed workloads and compares each JSON report, with the
fields that measure time left out, with the one kept in GOLDEN_DIR:
  faults.json    the default workload: every model, every fault, two passes, ranks as threads
  trace300.json  the first 300 requests of TRACE: dense, dsv4, k3; an unlimited memory tier,
                 synchronous saves, no fault, 2 ranks
Every count (loads by kind, reuse, checkpoints, bytes checked, tier calls, the five zeros)
must be the same; a difference names the field. Then the comparison must fail once: the
first 299 requests of TRACE against the 300-request report.

A change that means to change the counts regenerates the files with --write.
"""
import json
import os
import subprocess
import sys
import tempfile

# Measured time: moves from run to run, as do the tier calls the eviction and lose-chunks
# faults race with loads in flight (the erases they make, and a few chunk reads on either
# side of them). Every outcome, load, resume point, checked byte and saved entry is still
# compared.
VOLATILE = ("requests_per_second", "wall_seconds", "latency")
VOLATILE_TIER_CALLS = ("erases", "total", "kv_reads", "kv_chunks_read")


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def workloads(trace, limit=300):
    return {
        "faults": ["--two-pass", "--ranks-as", "threads"],
        "trace300": ["--model", "dense,dsv4,k3", "--trace", trace, "--limit", str(limit), "--tier", "memory",
                     "--tier-capacity", "unlimited", "--sync-saves", "--faults", "none", "--ranks", "2"],
    }


def stripped(report):
    source = report.get("workload", {}).get("source")
    if isinstance(source, str):
        report["workload"]["source"] = os.path.basename(source)  # where the checkout is does not count
    for model in report["models"].values():
        for key in VOLATILE:
            model.pop(key, None)
        if isinstance(model.get("comparison"), dict):
            for key in VOLATILE:
                model["comparison"].pop(key, None)
        if isinstance(model.get("tier_calls"), dict):
            for key in VOLATILE_TIER_CALLS:
                model["tier_calls"].pop(key, None)
    return report


def report_of(replay, args):
    extra = ["--dir", "/dev/shm"] if os.access("/dev/shm", os.W_OK) else []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        proc = subprocess.run([replay, *args, *extra, "--json", out], capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            print(proc.stdout, proc.stderr)
            fail(f"kvfuse-replay {' '.join(args)} exited {proc.returncode}")
        with open(out) as f:
            return stripped(json.load(f))


def differences(got, want, path=""):
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in sorted(set(got) | set(want)):
            if key not in got or key not in want:
                out.append(f"{path}/{key}: {'missing' if key not in got else 'not in the golden report'}")
            else:
                out += differences(got[key], want[key], f"{path}/{key}")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r}, golden {want!r}"]


def main():
    write = "--write" in sys.argv
    replay, trace, golden = [a for a in sys.argv[1:] if a != "--write"]
    for name, args in workloads(trace).items():
        got = report_of(replay, args)
        path = os.path.join(golden, name + ".json")
        if write:
            with open(path, "w") as f:
                json.dump(got, f, indent=1, sort_keys=True)
            print(f"wrote {path}")
            continue
        with open(path) as f:
            want = json.load(f)
        diff = differences(got, want)
        if diff:
            fail(f"{name}: the report differs from {path} in {len(diff)} fields:\n  " + "\n  ".join(diff[:40]))
        print(f"{name}: every count equals {path}")
    if write:
        return
    # The comparison can fail: one request fewer changes the counts.
    with open(os.path.join(golden, "trace300.json")) as f:
        want = json.load(f)
    diff = differences(report_of(replay, workloads(trace, 299)["trace300"]), want)
    if not diff:
        fail("the first 299 requests gave the 300-request report: the comparison cannot fail")
    print(f"control: 299 requests differ from the golden report in {len(diff)} fields, as they must")


if __name__ == "__main__":
    main()
