#!/usr/bin/env python3
"""The salvage of partly failed loads in the replay (run by ctest).

  check_salvage.py REPLAY

Runs kvfuse-replay with the lose-chunks fault alone (a rank loses a chunk in the middle of a
prefix a lookup just counted), every model, two passes, and checks: the five numbers that
must be zero are zero; loads failed part way and were salvaged; every model recomputed fewer
prompt tokens after its failed loads than a policy that fails a load whole would have; for
the dense model, exactly the salvaged tokens fewer; and the report's text carries the rows.
"""
import json
import os
import subprocess
import sys
import tempfile

ZEROS = ["invariant_violations", "corrupted_bytes", "stranded_parked", "leaked_slots", "two_pass_delta"]


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def main():
    replay = sys.argv[1]
    extra = ["--dir", "/dev/shm"] if os.access("/dev/shm", os.W_OK) else []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        proc = subprocess.run([replay, "--faults", "lose-chunks", "--two-pass", "--ranks", "4", *extra, "--json", out],
                              capture_output=True, text=True, timeout=1200)
        print(proc.stdout)
        if proc.returncode != 0:
            print(proc.stderr)
            fail(f"exit status {proc.returncode}")
        with open(out) as f:
            report = json.load(f)
    if "salvaged tokens" not in proc.stdout or "recomputed / fail-whole" not in proc.stdout:
        fail("the report's text lacks the salvage rows")
    for name, model in report["models"].items():
        for zero in ZEROS:
            value = model["must_be_zero"][zero]
            if (value["delta"] if isinstance(value, dict) else value) != 0:
                fail(f"{name}: {zero} = {value}")
        if model["faults"]["chunks_lost_mid_prefix"] == 0:
            fail(f"{name}: the fault lost no chunk")
        s = model["salvage"]
        if s["loads"] == 0 or s["salvaged_tokens"] == 0:
            fail(f"{name}: nothing salvaged: {s}")
        if s["recomputed_tokens"] >= s["fail_whole_tokens"]:
            fail(f"{name}: salvage recomputed {s['recomputed_tokens']}, failing whole {s['fail_whole_tokens']}")
        kept = s["fail_whole_tokens"] - s["recomputed_tokens"]
        if name == "dense" and kept != s["salvaged_tokens"]:
            fail(f"dense: {kept} tokens fewer recomputed, {s['salvaged_tokens']} salvaged")
        if kept < s["salvaged_tokens"]:
            fail(f"{name}: {kept} tokens fewer recomputed than the {s['salvaged_tokens']} salvaged")
        print(f"{name}: {s['loads']} loads salvaged ({s['second_loads']} through a second load), "
              f"{s['salvaged_tokens']} tokens kept; recomputed {s['recomputed_tokens']} against {s['fail_whole_tokens']}")
    print("ok")


if __name__ == "__main__":
    main()
