#!/usr/bin/env python3
"""The side-by-side benchmark: the stock llama-server and kvfuse-llama-server,
each started here on a free port in a temporary directory, replaying the same workloads
through driver.py, per model and per cache configuration; one table, and the JSON that
bench/plot.sh draws docs/img/llama_server_reuse.png from.

    run.py [--build-dir DIR] [--models llama,kimi-k3,deepseek4] [--workloads chat,trace]
           [--configs ID,...] [--out-dir DIR]
    run.py --table SUMMARY_JSON [--markdown]      the table again from a run's summary.json

Why it starts the servers itself: each configuration must begin from an empty cache in a
fresh process, and the resident memory and the restart are properties of that process.

The configurations (`--configs` takes their ids), every server with
`-fa off -ub 64 -np 2 -c 8192 --metrics` (flash attention off and a ubatch that divides
kvfuse's chunk: the conditions of docs/llama.md), and `--swa-full` for deepseek4 (its raw
sliding-window cache then holds every cell of the context; at this commit
llama_model_n_swa() reports 0 for deepseek4, so the server's own SWA handling is the same
either way):

  stock-default       stock, its default cache (--cache-ram 8192 MiB: never full here)
  stock-restart       that server killed with SIGKILL after its run, started again, the
                      same workload replayed (stock keeps nothing across a restart)
  stock-ram64         stock, --cache-ram 64
  stock-ram1          stock, --cache-ram 1: a budget that binds on these workloads
  kvfuse-mem64        kvfuse-llama-server --kvfuse-memory 64MiB, memory only
  kvfuse-mem1         --kvfuse-memory 1MiB, memory only: the same binding budget
  kvfuse-mem1-lru     --kvfuse-memory 1MiB --kvfuse-cache-policy lru: the engine's cache
                      ledger owns the budget, evicting the least recently used entry
  kvfuse-mem1-cost    --kvfuse-memory 1MiB --kvfuse-cache-policy cost: the ledger keeps what
                      saves most prefill per byte (docs/reference.md#cache-policy)
  kvfuse-mem1-disk    --kvfuse-memory 1MiB --kvfuse-disk DIR
  kvfuse-warm         that server replaying the same workload a second time
  kvfuse-restart      that server killed with SIGKILL, started again on the same DIR, the
                      same workload replayed a third time

A follow-up (stock-restart, kvfuse-warm, kvfuse-restart) runs only with the configuration it
follows, and its bound counts the earlier passes' prompts and replies as earlier requests
(a prompt seen in full before is bounded by its length - 1), so "of bound" stays a share of
what an ideal cache that survived could serve.

Binaries: $STOCK_SERVER and $KVFUSE_SERVER, by default
<build-dir>/integrations/llama/server/llama-server and .../kvfuse-llama-server (the CMake
targets llama_server_stock and kvfuse_llama_server). A binary that is not there skips its
rows, said in the output and in summary.json; nothing stands in for it. Models:
<build-dir>/integrations/llama/models/<model>.gguf (target kvfuse_llama_models), or
--models-dir. Every server runs with OMP_WAIT_POLICY=PASSIVE, so its OpenMP threads sleep
rather than spin between batches and leave a CPU to the client on a small machine.

Exit status: 0 when every run that could start finished, 1 when a server failed to start or
a request failed (named), 2 for bad arguments. The goals of the issue print PASS or MISS but
do not fail the run: timings on a shared machine are evidence, not a gate.
"""
import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ["llama", "kimi-k3", "deepseek4"]
COMMON_FLAGS = ["-fa", "off", "-ub", "64", "-np", "2", "-c", "8192", "--metrics"]
SLOTS = 2

# id, server, flags, label, the configuration it follows (None: a server of its own) and
# how (None, "pass": again on the same process, "restart": on a new process after SIGKILL).
# "{disk}" is the run's disk directory.
DISK_FLAGS = ["--kvfuse-memory", "1MiB", "--kvfuse-disk", "{disk}"]
CONFIGS = [
    ("stock-default", "stock", [], "stock, default cache", None, None),
    ("stock-restart", "stock", [], "stock, default cache, restarted", "stock-default", "restart"),
    ("stock-ram64", "stock", ["--cache-ram", "64"], "stock --cache-ram 64", None, None),
    ("stock-ram1", "stock", ["--cache-ram", "1"], "stock --cache-ram 1", None, None),
    ("kvfuse-mem64", "kvfuse", ["--kvfuse-memory", "64MiB"], "kvfuse 64MiB", None, None),
    ("kvfuse-mem1", "kvfuse", ["--kvfuse-memory", "1MiB"], "kvfuse 1MiB", None, None),
    ("kvfuse-mem1-lru", "kvfuse", ["--kvfuse-memory", "1MiB", "--kvfuse-cache-policy", "lru"], "kvfuse 1MiB, ledger lru",
     None, None),
    ("kvfuse-mem1-cost", "kvfuse", ["--kvfuse-memory", "1MiB", "--kvfuse-cache-policy", "cost"], "kvfuse 1MiB, ledger cost",
     None, None),
    ("kvfuse-mem1-disk", "kvfuse", DISK_FLAGS, "kvfuse 1MiB + disk", None, None),
    ("kvfuse-warm", "kvfuse", DISK_FLAGS, "kvfuse 1MiB + disk, second pass", "kvfuse-mem1-disk", "pass"),
    ("kvfuse-restart", "kvfuse", DISK_FLAGS, "kvfuse 1MiB + disk, restarted", "kvfuse-mem1-disk", "restart"),
]
CONFIG_BY_ID = {c[0]: c for c in CONFIGS}
# The goals at the binding budget, on the chat workload.
SHARE_GOAL = {"llama": 0.8, "kimi-k3": 0.75, "deepseek4": 0.75}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process on a free port; its log in the run's temporary directory."""

    def __init__(self, binary, model_path, flags, workdir, name):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.argv = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(self.port)] + flags
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env)

    def log_tail(self, n=15):
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout=120):
        """Until /health answers 200 (503 while the model loads)."""
        client = driver.Client(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it was ready:\n"
                                   f"  {' '.join(self.argv)}\n{self.log_tail()}")
            try:
                status, _ = client.get("/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server was not ready after {timeout} s:\n  {' '.join(self.argv)}\n{self.log_tail()}")

    def stop(self, kill=False):
        """SIGTERM and wait (SIGKILL after 15 s), or SIGKILL at once: a crash."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def default_binaries(build_dir):
    server_dir = os.path.join(build_dir, "integrations", "llama", "server")
    return {"stock": os.environ.get("STOCK_SERVER") or os.path.join(server_dir, "llama-server"),
            "kvfuse": os.environ.get("KVFUSE_SERVER") or os.path.join(server_dir, "kvfuse-llama-server")}


def workload_args(quick):
    """The workloads' options: the defaults of driver.py, or a small version (--quick)."""
    ns = argparse.Namespace(conversations=6, system_prompts=2, turns=3, reply_tokens=[16, 48], seed=1,
                            trace=os.path.join(REPO, "traces", "mooncake_synthetic_trace.jsonl"), limit=60,
                            trace_block_tokens=16, max_output=16)
    if quick:
        ns.conversations, ns.turns, ns.limit = 3, 2, 12
    return ns


def describe(workload, w):
    """One line saying what a workload is, for the table and the plot."""
    if workload == "chat":
        return (f"chat: {w.conversations} conversations x {w.turns} turns, {w.system_prompts} system prompts, "
                f"replies of {w.reply_tokens[0]}-{w.reply_tokens[1]} tokens inside later prompts, {SLOTS} clients")
    return (f"trace: the first {w.limit} requests of {os.path.basename(w.trace)}, {w.trace_block_tokens} tokens per "
            f"512-token block, at most {w.max_output} output tokens, {SLOTS} clients")


def save_log(server, logs):
    """The server's own log (slot choices, cache loads) beside the JSON."""
    shutil.copy(server.log_path, os.path.join(logs, os.path.basename(server.log_path)))


def save_run(record, out_dir, flags, seconds):
    """Writes one pass's JSON, prints its line, returns its row of summary.json."""
    path = os.path.join(out_dir, f"{record['model']}_{record['workload']}_{record['config']}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f)
    s = record["summary"]
    print(f"  {record['model']:9} {record['workload']:5} {record['config']:17} reused {s['reused_tokens']:>7,} of "
          f"bound {s['bound_tokens']:>7,} ({s['reused_share_of_bound'] or 0:.3f}), {seconds:.1f} s", flush=True)
    for key in ("miscounted_requests", "short_replies"):
        if s[key]:
            print(f"    {key}: {', '.join(s[key])}", flush=True)
    if s["requests_over_bound"]:
        print(f"    {s['requests_over_bound']} requests reused more than their bound", flush=True)
    return {"model": record["model"], "workload": record["workload"], "config": record["config"],
            "label": record["label"], "server": record["server"], "flags": flags,
            "json": os.path.basename(path), "seconds": seconds, "summary": s}


def run_all(a):
    # Servers run in temporary directories: a relative build tree would not be found there.
    a.build_dir = os.path.abspath(a.build_dir)
    binaries = default_binaries(a.build_dir)
    models_dir = a.models_dir or os.path.join(a.build_dir, "integrations", "llama", "models")
    logs = os.path.join(a.out_dir, "logs")
    shutil.rmtree(logs, ignore_errors=True)  # an earlier run's files would pass for this one's
    os.makedirs(logs)
    for model in MODELS:
        for workload in ("chat", "trace"):
            for c in CONFIGS:
                stale = os.path.join(a.out_dir, f"{model}_{workload}_{c[0]}.json")
                if os.path.exists(stale):
                    os.remove(stale)
    present = {k: os.access(v, os.X_OK) for k, v in binaries.items()}
    skipped = []
    for kind in ("stock", "kvfuse"):
        if not present[kind]:
            ids = [c for c in a.configs if CONFIG_BY_ID[c][1] == kind]
            if ids:
                skipped.append({"server": kind, "binary": binaries[kind], "configs": ids})
                print(f"llama_server bench: {binaries[kind]} is not there: skipping {', '.join(ids)} "
                      f"(set {'STOCK_SERVER' if kind == 'stock' else 'KVFUSE_SERVER'} or build its target)")
    summary = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "load_average": os.getloadavg(), "binaries": binaries, "common_flags": COMMON_FLAGS,
               "models": a.models, "workloads": a.workloads, "quick": a.quick, "skipped": skipped, "rows": []}
    wargs = workload_args(a.quick)
    summary["workload_descriptions"] = {w: describe(w, wargs) for w in a.workloads}
    if not any(present[CONFIG_BY_ID[c][1]] for c in a.configs):
        with open(os.path.join(a.out_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        print("llama_server bench: no server binary to run; nothing measured")
        return 0
    failures = 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvfuse-llama-server-bench-") as tmp:
        for model in a.models:
            model_path = os.path.join(models_dir, f"{model}.gguf")
            if not os.path.exists(model_path):
                print(f"llama_server bench: {model_path} is not there (build the target kvfuse_llama_models, "
                      f"or pass --models-dir)", file=sys.stderr)
                return 1
            flags = COMMON_FLAGS + (["--swa-full"] if model == "deepseek4" else [])
            for workload in a.workloads:
                wargs.workload = workload
                requests = driver.workload_from_args(wargs)
                disk = os.path.join(tmp, f"{model}-{workload}-disk")
                shutil.rmtree(disk, ignore_errors=True)
                for config in a.configs:
                    cid, kind, extra, label, follows, _ = CONFIG_BY_ID[config]
                    if follows is not None or not present[kind]:
                        continue  # a follow-up runs inside the configuration it follows
                    followups = [c for c in CONFIGS if c[4] == cid and c[0] in a.configs]
                    server_flags = flags + [x.replace("{disk}", disk) for x in extra]
                    if "{disk}" in extra:
                        os.makedirs(disk)
                    passes = [(cid, label, None)] + [(f[0], f[3], f[5]) for f in followups]
                    prior, server = [], None
                    try:
                        for pid, plabel, how in passes:
                            t0 = time.monotonic()
                            if how == "restart" or server is None:
                                if server is not None:
                                    server.stop(kill=True)  # a crash: the restart finds what it leaves
                                    save_log(server, logs)
                                server = Server(binaries[kind], model_path, server_flags, tmp,
                                                f"{model}-{workload}-{pid}")
                                server.wait_ready()
                            record = driver.replay(server.url, requests, clients=SLOTS, n_probs=a.n_probs,
                                                   reply_filter=a.reply_filter, server_pid=server.proc.pid,
                                                   prior=prior)
                            prior = prior + [(r["prompt"], r["reply"]) for r in record["requests"]]
                            record.update({"model": model, "workload": workload, "config": pid, "label": plabel,
                                           "server": kind, "argv": server.argv})
                            summary["rows"].append(save_run(record, a.out_dir, server_flags, time.monotonic() - t0))
                    except (RuntimeError, driver.ServerError, OSError) as e:
                        print(f"llama_server bench: {model} {workload} {cid}: {e}\n"
                              f"{server.log_tail() if server else ''}", file=sys.stderr)
                        failures += 1
                    finally:
                        if server is not None:
                            server.stop()
                            save_log(server, logs)
    summary["seconds"] = time.monotonic() - started
    with open(os.path.join(a.out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    text = report(summary, markdown=False)
    with open(os.path.join(a.out_dir, "table.txt"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print(text)
    return 1 if failures else 0


def report(summary, markdown):
    """The table of a run (text or Markdown), then the goals."""
    rows = summary["rows"]
    by = {(r["model"], r["workload"], r["config"]): r["summary"] for r in rows}
    cells = []
    for r in rows:
        s = r["summary"]
        ref = by.get((r["model"], r["workload"], "stock-default"))
        same = "n/a" if ref is None else ("yes" if ref["replies_sha256"] == s["replies_sha256"] else "no")
        cells.append(driver.table_row(r["model"], r["workload"], r["config"], s) + [same])
    header = [name for name, _ in driver.COLUMNS] + ["replies = stock"]
    out = []
    if markdown:
        out.append("| " + " | ".join(header) + " |")
        out.append("| " + " | ".join("---" for _ in header) + " |")
        out += ["| " + " | ".join(c) + " |" for c in cells]
    else:
        widths = [max(len(x) for x in col) for col in zip(header, *cells)]
        for i, row in enumerate([header] + cells):
            out.append("  ".join(x.ljust(w) if j < 3 else x.rjust(w) for j, (x, w) in enumerate(zip(row, widths))))
            if i == 0:
                out.append("  ".join("-" * w for w in widths))
    out.append("")
    out.append(f"{summary['date_utc']}, load average {summary['load_average'][0]:.2f}, "
               f"{summary.get('seconds', 0):.0f} s; TTFT: client wall time to the first streamed token (ms); "
               f"prompt_ms: the server's timings.prompt_ms; VmHWM: the server's peak resident memory")
    for w, text in summary.get("workload_descriptions", {}).items():
        out.append(f"{w}: {text[len(w) + 2:]}")
    for s in summary["skipped"]:
        out.append(f"skipped: {', '.join(s['configs'])} ({s['binary']} is not there)")
    goals = []
    for model in summary["models"]:
        chat = {c: by.get((model, "chat", c)) for c in CONFIG_BY_ID}

        def share(c):
            return chat[c]["reused_share_of_bound"] if chat[c] else None

        for k, st in (("kvfuse-mem1", "stock-ram1"), ("kvfuse-mem1-cost", "stock-ram1"), ("kvfuse-mem64", "stock-ram64")):
            if chat[k] and chat[st]:
                ok = chat[k]["reused_tokens"] >= chat[st]["reused_tokens"]
                goals.append(f"{'PASS' if ok else 'MISS'}  {model} chat: {k} reuses {chat[k]['reused_tokens']:,} "
                             f">= {st} {chat[st]['reused_tokens']:,}")
        for k in ("kvfuse-mem1", "kvfuse-mem1-cost"):
            if chat[k]:
                ok = share(k) >= SHARE_GOAL[model]
                goals.append(f"{'PASS' if ok else 'MISS'}  {model} chat: {k} reuses {share(k):.3f} "
                             f"of the bound >= {SHARE_GOAL[model]}")
        if chat["kvfuse-mem1-cost"] and chat["kvfuse-mem1-lru"]:
            ok = chat["kvfuse-mem1-cost"]["reused_tokens"] >= chat["kvfuse-mem1-lru"]["reused_tokens"]
            goals.append(f"{'PASS' if ok else 'MISS'}  {model} chat: cost reuses {chat['kvfuse-mem1-cost']['reused_tokens']:,} "
                         f">= the ledger's lru {chat['kvfuse-mem1-lru']['reused_tokens']:,}")
        if chat["kvfuse-restart"] and chat["kvfuse-warm"] and chat["kvfuse-warm"]["reused_tokens"]:
            ratio = chat["kvfuse-restart"]["reused_tokens"] / chat["kvfuse-warm"]["reused_tokens"]
            goals.append(f"{'PASS' if ratio >= 0.9 else 'MISS'}  {model} chat: after a restart it reuses {ratio:.3f} "
                         f"of what the warm server reused on the same pass >= 0.9")
        for c in ("kvfuse-mem64", "kvfuse-mem1", "kvfuse-mem1-lru", "kvfuse-mem1-cost", "kvfuse-mem1-disk", "kvfuse-warm",
                  "kvfuse-restart"):
            if chat[c] and chat[c].get("must_be_zero"):
                goals.append(f"MISS  {model} chat: {c}: kvfuse's must-be-zero counters sum to "
                             f"{chat[c]['must_be_zero']:g}")
    if goals:
        out.append("goals (docs/llama-server.md; informative: a MISS does not fail the run):")
        out += ["  " + g for g in goals]
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", default=os.path.join(REPO, "build", "release"),
                   help="the kvfuse build tree with KVFUSE_BUILD_LLAMA=ON (default build/release)")
    p.add_argument("--models-dir", help="where <model>.gguf are (default <build-dir>/integrations/llama/models)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated (default all three)")
    p.add_argument("--workloads", default="chat,trace", help="comma-separated: chat, trace (default both)")
    p.add_argument("--configs", default=",".join(c[0] for c in CONFIGS), help="comma-separated ids (default all)")
    p.add_argument("--out-dir", default=os.path.join(REPO, "build", "bench-results", "llama_server"))
    p.add_argument("--quick", action="store_true", help="small workloads (3 conversations x 2 turns, 12 trace lines)")
    p.add_argument("--n-probs", type=int, default=4)
    p.add_argument("--reply-filter", choices=["grammar", "none"], default="grammar")
    p.add_argument("--table", metavar="SUMMARY_JSON", help="print the table of an earlier run and exit")
    p.add_argument("--markdown", action="store_true", help="with --table: as a Markdown table")
    a = p.parse_args()
    if a.table:
        with open(a.table, encoding="utf-8") as f:
            print(report(json.load(f), a.markdown))
        return 0
    a.models = [m for m in a.models.split(",") if m]
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.configs = [c for c in a.configs.split(",") if c]
    for name, values, allowed in (("--models", a.models, MODELS), ("--workloads", a.workloads, ["chat", "trace"]),
                                  ("--configs", a.configs, list(CONFIG_BY_ID))):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            p.error(f"{name}: {', '.join(bad) or 'empty'}; expected some of {', '.join(allowed)}")
    for c in a.configs:
        follows = CONFIG_BY_ID[c][4]
        if follows and follows not in a.configs:
            p.error(f"--configs: {c} follows {follows}, which is not in the list")
    return run_all(a)


if __name__ == "__main__":
    sys.exit(main())
