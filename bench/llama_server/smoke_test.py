#!/usr/bin/env python3
"""The ctest of the llama-server benchmark's driver: a small chat replayed against a real
stock llama-server, so the figures bench/llama_server/run.py reports rest on checked ground.

    smoke_test.py --server PATH_TO_LLAMA_SERVER --models-dir DIR

What it asserts, each a way the benchmark could report nonsense:
  1. the bound is right on sequences whose bound is known by hand;
  2. every request's timings.cache_n + timings.prompt_n is its prompt's length, and every
     reply has the n_predict tokens asked for (the driver counts what the server counted);
  3. with the cache on, 0 < reused <= bound, and no request reused more than its own bound;
  4. a prompt sent again right after itself reuses all of it but one token: its bound;
  5. the same chat with "cache_prompt": false reuses 0 (so 3 measures the cache, not the
     driver), and a request doctored to claim more than its bound is caught by the summary;
  6. the run's JSON reads back to the same summary;
  7. run.py, the orchestrator, runs a small version of the benchmark end to end: its stock
     rows are there, a kvfuse row whose binary is missing is skipped and said so (never
     stood in for), and the restarted stock server's bound counts the first pass.
Exit 0 when all hold, 1 naming the first that does not.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
import run  # noqa: E402


def check(ok, what):
    if not ok:
        print(f"llama_server_bench smoke: FAILED: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"  ok: {what}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, help="the stock llama-server")
    p.add_argument("--models-dir", required=True, help="where llama.gguf is")
    a = p.parse_args()

    # 1. The bound, by hand: [1 2 3 4] first (0); [1 2 3 9] shares 3 with it; [1 2 3 4 7 8]
    # continues the first request's prompt + reply [7 8] (capped at 6 - 1 = 5); a repeat of
    # [5 6] after [5 6] with no reply is capped at 1.
    bounds = driver.reuse_bounds([([1, 2, 3, 4], [7, 8]), ([1, 2, 3, 9], []), ([1, 2, 3, 4, 7, 8], [0]),
                                  ([5, 6], []), ([5, 6], [])])
    check(bounds == [0, 3, 5, 0, 1], f"the bound of hand-made sequences is [0, 3, 5, 0, 1] (got {bounds})")

    model = os.path.join(a.models_dir, "llama.gguf")
    check(os.path.exists(model), f"{model} exists")
    chat = driver.make_chat(conversations=3, system_prompts=2, turns=2, reply_len=(8, 16), seed=7)
    with tempfile.TemporaryDirectory(prefix="kvfuse-llama-server-smoke-") as tmp:
        server = run.Server(a.server, model, run.COMMON_FLAGS, tmp, "stock")
        try:
            server.wait_ready()
            cached = driver.replay(server.url, chat, clients=run.SLOTS, server_pid=server.proc.pid)
            # 4. one prompt twice on one client, on the same server
            prompt = driver.make_chat(conversations=1, system_prompts=1, turns=1, seed=11)[0]
            repeat = driver.replay(server.url, [prompt, driver.Request("repeat", prompt.tokens, prompt.n_predict)],
                                   clients=1)
        finally:
            server.stop()
        server = run.Server(a.server, model, run.COMMON_FLAGS, tmp, "stock-nocache")
        try:
            server.wait_ready()
            uncached = driver.replay(server.url, chat, clients=run.SLOTS, cache_prompt=False)
        finally:
            server.stop()

        s = cached["summary"]
        print(driver.format_table([driver.table_row("llama", "chat", "stock", s),
                                   driver.table_row("llama", "chat", "cache_prompt off", uncached["summary"])]))
        # 2.
        check(not s["miscounted_requests"], "cache_n + prompt_n is the prompt's length in every response")
        check(not s["short_replies"], "every reply has the tokens asked for")
        check(s["requests"] == len(chat), f"all {len(chat)} requests answered")
        # 3.
        check(s["bound_tokens"] > 0, f"the chat has a bound > 0 ({s['bound_tokens']})")
        check(0 < s["reused_tokens"] <= s["bound_tokens"],
              f"0 < reused {s['reused_tokens']} <= bound {s['bound_tokens']}")
        check(s["requests_over_bound"] == 0, "no request reused more than its own bound")
        check(s["ttft_wall_ms_p50"] > 0 and s["requests_per_second"] > 0, "TTFT and requests/s are measured")
        check(s["vm_hwm_mib"] and s["vm_hwm_mib"] > 0, f"the server's VmHWM is read ({s['vm_hwm_mib']} MiB)")
        # 4.
        second = repeat["requests"][1]
        check(second["timings"]["cache_n"] == len(prompt.tokens) - 1 == second["bound"],
              f"a repeated prompt of {len(prompt.tokens)} tokens reuses {len(prompt.tokens) - 1}, its bound "
              f"(got {second['timings']['cache_n']}, bound {second['bound']})")
        # 5.
        check(uncached["summary"]["reused_tokens"] == 0,
              f"with cache_prompt off nothing is reused (got {uncached['summary']['reused_tokens']})")
        doctored = json.loads(json.dumps(cached))
        doctored["requests"][-1]["timings"]["cache_n"] = doctored["requests"][-1]["bound"] + 1
        doctored["requests"][-1]["timings"]["prompt_n"] -= 1
        check(driver.summarize(doctored)["requests_over_bound"] == 1,
              "a response doctored to claim one token more than its bound is counted as over it")
        # 6.
        path = os.path.join(tmp, "run.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cached, f)
        with open(path, encoding="utf-8") as f:
            back = json.load(f)
        check(back["summary"] == s and driver.summarize(back) == s, "the run's JSON reads back to the same summary")
        # 7.
        out = os.path.join(tmp, "orchestrated")
        env = dict(os.environ, STOCK_SERVER=a.server, KVFUSE_SERVER=os.path.join(tmp, "no-such-binary"))
        proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py"),
                               "--quick", "--models", "llama", "--models-dir", a.models_dir, "--out-dir", out,
                               "--configs", "stock-default,stock-restart,kvfuse-mem1"],
                              env=env, capture_output=True, text=True, timeout=240)
        print(proc.stdout[-3000:], proc.stderr[-2000:])
        check(proc.returncode == 0, f"run.py --quick exits 0 (got {proc.returncode})")
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
        rows = {(r["workload"], r["config"]): r["summary"] for r in summary["rows"]}
        check(set(rows) == {(w, c) for w in ("chat", "trace") for c in ("stock-default", "stock-restart")},
              f"run.py wrote the four stock rows and nothing else (got {sorted(rows)})")
        check([x["configs"] for x in summary["skipped"]] == [["kvfuse-mem1"]] and "skipping kvfuse-mem1" in proc.stdout,
              "the kvfuse row without a binary is skipped and said so")
        first, again = rows[("chat", "stock-default")], rows[("chat", "stock-restart")]
        check(again["prior_requests"] == first["requests"] and again["bound_tokens"] > first["bound_tokens"],
              f"the restarted server's bound counts the first pass ({again['bound_tokens']} > {first['bound_tokens']})")
    print("llama_server_bench smoke: all checks hold")


if __name__ == "__main__":
    main()
