#!/usr/bin/env python3
"""Replays a workload against a running llama-server and reports how much of each prompt its
prompt cache served.

    driver.py --url http://127.0.0.1:PORT --workload chat|trace [options] [--json OUT]

Why a separate client: the side-by-side benchmark compares the stock llama-server
with kvfuse-llama-server as a user sees them, through HTTP, so every figure here comes from
what the server answers (`timings` of each response, `/metrics`, its `/proc/PID/status`) and
from the client's own clock, never from inside either server. Python's standard library only
(http.client): it runs wherever the servers build.

What it sends: `POST /completion` with the prompt as a token array (so the tokens are exactly
the ones the bound below is computed on, with no tokenizer in between), `temperature` 0,
`n_predict`, `n_probs`, `cache_prompt` true, `return_tokens` true, `ignore_eos` true and
`stream` true. The tiny random test models can emit byte tokens that do not form UTF-8,
which the stock server answers with a 500, so by default each request carries the grammar
`root ::= [a-z ]+`: the replies are ASCII byte tokens, still greedy within the grammar
(`--reply-filter none` drops it).

The two workloads (token ids are drawn from seeds: the same options give the same prompts,
and a chat turn's prompt contains the reply tokens the server returned for earlier turns):

- chat: more conversations than slots, each opening with one of a few shared system prompts,
  several turns; turn t of every conversation is sent before turn t+1 of any, the next
  request going to whichever client is free (as many clients as the server has slots), and
  a turn waits for its conversation's previous reply. Its shape is kvfuse-llama's
  conversations (apps/llama/workload.hpp); the ids come from Python's random, so they differ.
- trace: the first requests of a Mooncake-format trace (traces/ in the repository), scaled
  as kvfuse-llama scales it (apps/llama/workload.hpp): each 512-token block becomes
  `--trace-block-tokens` tokens whose ids derive from the block's hash id and the position in
  the block, the output is scaled the same way and capped.

The bound: the prompt tokens an ideal prefix cache could have served. For each request in
workload order, the longest common prefix of its prompt with any earlier request's prompt
followed by that request's reply, capped at the prompt's length - 1 (a server must compute
at least one token to sample from); summed over the requests. A run that replays the
workload again (a second pass, or after a restart) counts the earlier passes' requests as
earlier (`prior`).

Each request opens its own connection: at this commit the stock server closes a connection
after a streamed response, so the next request on a kept-alive one fails.

Per run it reports prompt tokens, reused tokens (the sum of `timings.cache_n`, which this
llama.cpp version sets to the prompt tokens it did not recompute; `timings.prompt_n` is the
rest, and the two must add up to the prompt), reused as a share of the bound, time to first
token p50 / p99 twice (the client's wall time from sending the request to the first streamed
token, and the server's own `timings.prompt_ms`), requests per second over the run's wall
time, and the server's resident memory (VmHWM, VmRSS) when given its pid.
"""
import argparse
import hashlib
import http.client
import json
import os
import random
import socket
import sys
import threading
import time
import urllib.parse

VOCAB = 320  # integrations/llama/models/make_models.py: 3 specials, 256 byte tokens, fillers
MASK64 = (1 << 64) - 1
ASCII_GRAMMAR = "root ::= [a-z ]+"


def mix64(x):
    """kvfuse::mix64 (include/kvfuse/bridge/ids.hpp), the splitmix64 finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def token_from(bits, vocab=VOCAB):
    """A token id of the tiny models' vocabulary, never one of its three specials."""
    return 3 + bits % (vocab - 3)


# ---- workloads ----------------------------------------------------------------------------


class Request:
    """One request. `prefix_of` names the request whose prompt and reply open this prompt
    (a chat turn's conversation so far), or None; `tokens` follow it."""

    def __init__(self, label, tokens, n_predict, prefix_of=None):
        self.label = label
        self.tokens = tokens
        self.n_predict = n_predict
        self.prefix_of = prefix_of


def make_chat(conversations=6, system_prompts=2, turns=3, system_len=(192, 384), user_len=(48, 224),
              reply_len=(16, 48), seed=1):
    """The chat workload, in the order it is sent: every conversation's turn 0, then every
    turn 1, and so on. Conversation c opens with system prompt c % system_prompts."""
    rng = random.Random(seed)

    def draw(n):
        return [token_from(rng.getrandbits(64)) for _ in range(n)]

    systems = [draw(rng.randint(*system_len)) for _ in range(system_prompts)]
    by_conversation = []
    for c in range(conversations):
        row = []
        for t in range(turns):
            tokens = (systems[c % system_prompts] if t == 0 else []) + draw(rng.randint(*user_len))
            row.append((f"conversation {c}, turn {t}", tokens, rng.randint(*reply_len)))
        by_conversation.append(row)
    requests, index_of = [], {}
    for t in range(turns):
        for c in range(conversations):
            label, tokens, n_predict = by_conversation[c][t]
            index_of[(c, t)] = len(requests)
            requests.append(Request(label, tokens, n_predict, index_of[(c, t - 1)] if t else None))
    return requests


def read_trace(path, limit=60, block_tokens=16, max_output=16):
    """The first `limit` requests of a Mooncake-format trace, scaled as apps/llama/workload.hpp
    (read_trace) scales them: a prompt of ceil(input_length * block_tokens / 512) tokens, token
    i derived from hash_ids[i // block_tokens] and i % block_tokens; the output scaled the same
    way, at least 1 and at most max_output."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, 1):
            if len(requests) >= limit:
                break
            if not text.strip():
                continue
            try:
                line = json.loads(text)
                input_length, output_length, hash_ids = line["input_length"], line["output_length"], line["hash_ids"]
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{line_no}: not a trace line ({e})")
            if len(hash_ids) != (input_length + 511) // 512:
                raise SystemExit(f"{path}:{line_no}: {len(hash_ids)} hash_ids for input_length {input_length}")
            n = (input_length * block_tokens + 511) // 512
            tokens = [token_from(mix64(mix64((hash_ids[i // block_tokens] + 0x74726163) & MASK64) ^ (i % block_tokens)))
                      for i in range(n)]
            n_predict = min(max((output_length * block_tokens + 511) // 512, 1), max_output)
            requests.append(Request(f"trace line {line_no}", tokens, n_predict))
    if not requests:
        raise SystemExit(f"{path}: no requests")
    return requests


# ---- the bound ----------------------------------------------------------------------------


class PrefixTrie:
    """Token sequences as a trie of dicts: the longest common prefix of a new sequence with
    any inserted one in time linear in its length."""

    def __init__(self):
        self.root = {}

    def longest_prefix(self, tokens):
        node, n = self.root, 0
        for t in tokens:
            node = node.get(t)
            if node is None:
                break
            n += 1
        return n

    def insert(self, tokens):
        node = self.root
        for t in tokens:
            node = node.setdefault(t, {})


def reuse_bounds(sequences, prior=()):
    """sequences: (prompt, reply) per request in workload order. Returns each prompt's bound:
    its longest common prefix with any earlier prompt + reply, at most len(prompt) - 1.
    `prior`: (prompt, reply) of what the cache saw before this run (an earlier pass of the
    same workload, for a run after a restart), counted as earlier."""
    trie, bounds = PrefixTrie(), []
    for prompt, reply in prior:
        trie.insert(list(prompt) + list(reply))
    for prompt, reply in sequences:
        bounds.append(min(trie.longest_prefix(prompt), max(len(prompt) - 1, 0)))
        trie.insert(list(prompt) + list(reply))
    return bounds


# ---- the HTTP client ----------------------------------------------------------------------


class ServerError(RuntimeError):
    pass


class Client:
    """Requests to one server, one at a time, like one user. Each request opens its own
    connection: the stock server at this commit closes a connection after a streamed
    response, so a kept-alive one fails on the next request."""

    def __init__(self, url, timeout=300):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise SystemExit(f"--url {url}: expected http://HOST:PORT")
        self.host, self.port, self.timeout = u.hostname, u.port or 80, timeout

    def _connect(self, timeout):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.connect()
        # A request goes out as headers and body in two writes: without this, Nagle's
        # algorithm can hold the body until the server's delayed ACK (40 ms on Linux).
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def get(self, path):
        conn = self._connect(30)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            conn.close()

    def complete(self, body):
        """Streams one /completion. Returns (reply tokens, first-step probabilities, the final
        event, seconds to the first token, seconds to the end), timed from before connecting."""
        data = json.dumps(body).encode()
        start = time.perf_counter()
        conn = self._connect(self.timeout)
        try:
            conn.request("POST", "/completion", body=data, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                raise ServerError(f"HTTP {r.status}: {r.read().decode('utf-8', 'replace')[:500]}")
            tokens, probs, final, first = [], None, None, None
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments (pings)
                event = json.loads(line[5:])
                if "error" in event:
                    raise ServerError(f"error event: {event['error']}")
                if event.get("tokens"):
                    if first is None:
                        first = time.perf_counter() - start
                    if not event.get("stop"):
                        tokens.extend(event["tokens"])
                if probs is None and event.get("completion_probabilities"):
                    probs = event["completion_probabilities"][0]
                if event.get("stop"):
                    final = event
                    break
            end = time.perf_counter() - start
        finally:
            conn.close()
        if final is None:
            raise ServerError("the stream ended without a final event")
        return tokens, probs, final, first if first is not None else end, end


# ---- one run ------------------------------------------------------------------------------


def percentile(values, q):
    """Linear interpolation between the closest ranks (q in [0, 100])."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def proc_memory(pid):
    """VmHWM and VmRSS of a process in MiB, from /proc/PID/status; None when unreadable."""
    out = {"vm_hwm_mib": None, "vm_rss_mib": None}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    out["vm_hwm_mib" if key == "VmHWM" else "vm_rss_mib"] = int(value.split()[0]) / 1024.0
    except (OSError, ValueError):
        pass
    return out


def parse_metrics(text):
    """Prometheus text: {'name{labels}': value} for every sample line."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            samples[name] = float(value)
        except ValueError:
            continue
    return samples


STANDARD_TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                    "predicted_ms", "predicted_per_token_ms", "predicted_per_second", "draft_n", "draft_n_accepted"}


def replay(url, requests, clients=2, n_probs=4, reply_filter="grammar", cache_prompt=True, server_pid=None,
           timeout=300, prior=()):
    """Sends `requests` with `clients` concurrent clients and returns the run's record:
    per-request results and the summary (see summarize). `prior`: the (prompt, reply) pairs
    of earlier passes the server's cache saw, for the bound (see reuse_bounds)."""
    results = [None] * len(requests)
    done = [threading.Event() for _ in requests]
    lock = threading.Lock()
    state = {"next": 0, "error": None}

    def prompt_of(i):
        r = requests[i]
        if r.prefix_of is None:
            return list(r.tokens)
        before = results[r.prefix_of]
        return before["prompt"] + before["reply"] + list(r.tokens)

    def worker():
        client = Client(url, timeout)
        while True:
            with lock:
                i = state["next"]
                if i >= len(requests) or state["error"]:
                    return
                state["next"] += 1
            r = requests[i]
            if r.prefix_of is not None:
                while not done[r.prefix_of].wait(1.0):
                    if state["error"]:
                        return
                if results[r.prefix_of] is None:
                    return  # its conversation failed; the error is recorded
            prompt = prompt_of(i)
            body = {"prompt": prompt, "n_predict": r.n_predict, "temperature": 0, "n_probs": n_probs,
                    "cache_prompt": cache_prompt, "return_tokens": True, "ignore_eos": True, "stream": True}
            if reply_filter == "grammar":
                body["grammar"] = ASCII_GRAMMAR
            started = time.perf_counter()
            try:
                reply, probs, final, ttft, total = client.complete(body)
                results[i] = {
                    "label": r.label, "prompt": prompt, "reply": reply, "n_predict": r.n_predict,
                    "first_step_probs": probs, "timings": final.get("timings", {}),
                    "id_slot": final.get("id_slot"), "tokens_evaluated": final.get("tokens_evaluated"),
                    "ttft_s": ttft, "total_s": total, "started": started, "ended": started + total,
                }
            except Exception as e:  # noqa: BLE001 - any failure ends the run, named
                with lock:
                    state["error"] = state["error"] or f"{r.label}: {type(e).__name__}: {e}"
                return
            finally:
                done[i].set()  # after results[i]: a later turn reads it

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, clients))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if state["error"]:
        raise ServerError(state["error"])
    record = {"requests": results, "wall_s": wall, "clients": clients, "reply_filter": reply_filter,
              "cache_prompt": cache_prompt, "prior": [[list(p), list(r)] for p, r in prior]}
    probe = Client(url)
    try:
        status, text = probe.get("/metrics")
        record["metrics"] = parse_metrics(text) if status == 200 else {}
    except OSError:
        record["metrics"] = {}
    record["memory"] = proc_memory(server_pid) if server_pid else {"vm_hwm_mib": None, "vm_rss_mib": None}
    record["summary"] = summarize(record)
    return record


def summarize(record):
    rs = record["requests"]
    bounds = reuse_bounds([(r["prompt"], r["reply"]) for r in rs], record.get("prior", ()))
    prompt_tokens = sum(len(r["prompt"]) for r in rs)
    reused = sum(int(r["timings"].get("cache_n", 0)) for r in rs)
    # cache_n + prompt_n is the whole prompt in this llama.cpp version; a request where it is
    # not means the server counted differently (or served another prompt), and is named.
    miscounted = [r["label"] for r in rs
                  if int(r["timings"].get("cache_n", -1)) + int(r["timings"].get("prompt_n", -1)) != len(r["prompt"])]
    short = [r["label"] for r in rs if len(r["reply"]) != r["n_predict"]]
    extra = {}
    for r in rs:
        for k, v in r["timings"].items():
            if k not in STANDARD_TIMINGS and isinstance(v, (int, float)):
                extra[k] = extra.get(k, 0) + v
    # Two fingerprints of what the server answered, to compare runs: the reply tokens alone,
    # and the reply tokens with the first step's probabilities.
    replies, outputs = hashlib.sha256(), hashlib.sha256()
    for r in rs:
        replies.update(json.dumps(r["reply"]).encode())
        outputs.update(json.dumps([r["reply"], r["first_step_probs"]], sort_keys=True).encode())
    bound = sum(bounds)
    ttft = [r["ttft_s"] * 1e3 for r in rs]
    prompt_ms = [float(r["timings"].get("prompt_ms", 0.0)) for r in rs]
    span = max(r["ended"] for r in rs) - min(r["started"] for r in rs) if rs else 0.0
    for r, b in zip(rs, bounds):
        r["bound"] = b
    return {
        "requests": len(rs),
        "prior_requests": len(record.get("prior", ())),
        "prompt_tokens": prompt_tokens,
        "reused_tokens": reused,
        "bound_tokens": bound,
        "reused_share_of_bound": reused / bound if bound else None,
        "reused_share_of_prompt": reused / prompt_tokens if prompt_tokens else None,
        "requests_over_bound": sum(1 for r, b in zip(rs, bounds) if int(r["timings"].get("cache_n", 0)) > b),
        "ttft_wall_ms_p50": percentile(ttft, 50), "ttft_wall_ms_p99": percentile(ttft, 99),
        "prompt_ms_p50": percentile(prompt_ms, 50), "prompt_ms_p99": percentile(prompt_ms, 99),
        "requests_per_second": len(rs) / span if span > 0 else None,
        "vm_hwm_mib": record["memory"]["vm_hwm_mib"], "vm_rss_mib": record["memory"]["vm_rss_mib"],
        "miscounted_requests": miscounted, "short_replies": short,
        # kvfuse-llama-server's timings say how much of cache_n its backend restored
        # (cache_backend_n); the stock server has no such field.
        "reused_from_backend": extra.get("cache_backend_n"),
        # kvfuse's five counters that must stay zero, summed from /metrics (None for stock).
        "must_be_zero": (sum(v for k, v in record.get("metrics", {}).items() if k.startswith("kvfuse:must_be_zero"))
                         if any(k.startswith("kvfuse:must_be_zero") for k in record.get("metrics", {})) else None),
        "extra_timings": extra,
        "replies_sha256": replies.hexdigest(), "outputs_sha256": outputs.hexdigest(),
    }


# ---- reporting ----------------------------------------------------------------------------

COLUMNS = [("model", "{}"), ("workload", "{}"), ("config", "{}"), ("prompt", "{:,}"), ("bound", "{:,}"),
           ("reused", "{:,}"), ("by kvfuse", "{:,}"), ("of bound", "{:.3f}"),
           ("TTFT p50", "{:.1f}"), ("TTFT p99", "{:.1f}"), ("prompt_ms p50", "{:.1f}"), ("prompt_ms p99", "{:.1f}"),
           ("req/s", "{:.2f}"), ("VmHWM MiB", "{:.0f}")]


def table_row(model, workload, config, s):
    values = [model, workload, config, s["prompt_tokens"], s["bound_tokens"], s["reused_tokens"],
              s.get("reused_from_backend"), s["reused_share_of_bound"], s["ttft_wall_ms_p50"], s["ttft_wall_ms_p99"],
              s["prompt_ms_p50"], s["prompt_ms_p99"], s["requests_per_second"], s["vm_hwm_mib"]]
    return [("n/a" if v is None else fmt.format(v)) for (_, fmt), v in zip(COLUMNS, values)]


def format_table(rows):
    """rows: lists of cells (table_row); a plain-text table with a header."""
    header = [name for name, _ in COLUMNS]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).rjust(w) if i >= 3 else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def workload_from_args(a):
    if a.workload == "chat":
        return make_chat(a.conversations, a.system_prompts, a.turns, reply_len=tuple(a.reply_tokens), seed=a.seed)
    return read_trace(a.trace, a.limit, a.trace_block_tokens, a.max_output)


def add_workload_args(p, repo):
    p.add_argument("--conversations", type=int, default=6, help="chat: conversations (default 6)")
    p.add_argument("--system-prompts", type=int, default=2, help="chat: shared system prompts (default 2)")
    p.add_argument("--turns", type=int, default=3, help="chat: turns per conversation (default 3)")
    p.add_argument("--reply-tokens", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX"),
                   help="chat: output tokens per turn (default 16 48)")
    p.add_argument("--seed", type=int, default=1, help="chat: seed of the token ids (default 1)")
    p.add_argument("--trace", default=os.path.join(repo, "traces", "mooncake_synthetic_trace.jsonl"),
                   help="trace: the Mooncake-format trace (default: the shipped one)")
    p.add_argument("--limit", type=int, default=60, help="trace: its first N requests (default 60)")
    p.add_argument("--trace-block-tokens", type=int, default=16, help="trace: tokens per 512-token block (default 16)")
    p.add_argument("--max-output", type=int, default=16, help="trace: most output tokens (default 16)")
    p.add_argument("--clients", type=int, default=2, help="concurrent clients: the server's slots (default 2)")
    p.add_argument("--n-probs", type=int, default=4, help="n_probs of each request (default 4)")
    p.add_argument("--reply-filter", choices=["grammar", "none"], default="grammar",
                   help=f"grammar: every request carries \"{ASCII_GRAMMAR}\" (default); none: no grammar")


def main():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server, http://HOST:PORT")
    p.add_argument("--workload", choices=["chat", "trace"], required=True)
    p.add_argument("--server-pid", type=int, help="read the server's VmHWM / VmRSS from /proc/PID/status")
    p.add_argument("--json", help="write the run (every request and the summary) here")
    p.add_argument("--label", default="server", help="the config column of the table")
    add_workload_args(p, repo)
    a = p.parse_args()
    record = replay(a.url, workload_from_args(a), a.clients, a.n_probs, a.reply_filter, server_pid=a.server_pid)
    record["workload"] = a.workload
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(record, f)
    print(format_table([table_row("-", a.workload, a.label, record["summary"])]))
    s = record["summary"]
    for key in ("miscounted_requests", "short_replies"):
        if s[key]:
            print(f"{key}: {', '.join(s[key])}", file=sys.stderr)


if __name__ == "__main__":
    main()
