#!/usr/bin/python3
"""kvfuse-llama-server's end-to-end checks, run by ctest (the `llama_server` entries).

Each case starts real servers (the stock llama-server and kvfuse-llama-server) on free ports
in a temporary directory, sends real HTTP requests (token arrays to /completion) and checks
what comes back:

    bitwise MODEL     multi-turn conversations (later prompts hold the earlier replies):
                      every kvfuse response has the tokens and first-step probabilities of
                      the stock server with its cache off, and kvfuse reused tokens
    control-kv        one byte of the first chunk a load reads is flipped in the tier: the
                      response differs from the reference (the check can fail)
    control-state     a kimi-k3 load gets the state of another boundary: the response differs
    restart           kill -9, restart on the same --kvfuse-disk: the repeat reuses from disk
    redis             two servers over one redis-server: the second reuses what the first
                      computed; then redis-server is stopped and both still answer right
    cluster           two servers over one Redis Cluster (3 primaries, 3 replicas, started
                      here): the second reuses what the first computed, with the same bits
    cache-policy MODEL  --kvfuse-cache-policy cost and lru at a memory budget that binds: the
                      responses keep the stock server's bits, the ledger keeps at most its
                      budget and the memory tier holds exactly what it counts
    flags             bad --kvfuse-* values exit 1 naming the flag and the value, before
                      the model loads

Replies are kept ASCII with a grammar ("root ::= [a-z ]+"): stock /completion answers 500
when a random model emits bytes that are not UTF-8. Greedy (temperature 0), --parallel 1,
-fa off, -ub 64 (docs/llama-server.md says why each matters).

    check_llama_server.py CASE --stock BIN --kvfuse BIN --models DIR [--redis-server BIN]
"""
import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "apps", "common"))
from redis_cluster import redis_cluster  # noqa: E402

GRAMMAR = "root ::= [a-z ]+"
COMMON = ["-c", "4096", "-np", "1", "-fa", "off", "-ub", "64", "-t", "2", "--metrics", "--no-warmup"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process on a free port; its log is in the temporary directory."""

    def __init__(self, binary, model, tmp, name, extra=(), env=None):
        self.port = free_port()
        self.log_path = os.path.join(tmp, f"{name}.log")
        self.log = open(self.log_path, "w")
        args = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port)] + COMMON + list(extra)
        e = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        e.update(env or {})
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode} at start:\n{self.tail()}")
            try:
                status, _ = self.get("/health")
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not become healthy in 60 s:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self):
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-30:])

    def request(self, method, path, body=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        c.request(method, path, body=None if body is None else json.dumps(body),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def get(self, path):
        return self.request("GET", path)

    def complete(self, tokens, cache_prompt=True, n_predict=12, id_slot=None):
        body = {"prompt": tokens, "n_predict": n_predict, "temperature": 0, "n_probs": 4, "grammar": GRAMMAR,
                "cache_prompt": cache_prompt, "return_tokens": True, "samplers": ["top_k"], "top_k": 1}
        if id_slot is not None:
            body["id_slot"] = id_slot
        status, data = self.request("POST", "/completion", body)
        if status != 200:
            raise RuntimeError(f"/completion answered {status}: {data[:300]!r}\n{self.tail()}")
        return json.loads(data)

    def metrics(self):
        status, data = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def conversations(seed=7, n_conv=3, turns=3):
    """Token prompts: two system prompts shared by the conversations; each turn appends a user
    message of its own. Replies are appended by the caller."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 320) for _ in range(rng.randrange(280, 420))] for _ in range(2)]
    convs = []
    for c in range(n_conv):
        users = [[rng.randrange(3, 320) for _ in range(rng.randrange(30, 140))] for _ in range(turns)]
        convs.append((systems[c % 2], users))
    return convs


def first_step(resp):
    probs = resp.get("completion_probabilities") or []
    return json.dumps(probs[0] if probs else None, sort_keys=True)


def order(n_conv, turns):
    """The first conversation's turns back to back (continuations in the same slot, whose
    own cells hold the replies), then the others' turns interleaved (each prompt in a slot
    that held another conversation)."""
    return [(0, t) for t in range(turns)] + [(c, t) for t in range(turns) for c in range(1, n_conv)]


def play(server, convs, cache_prompt=True, n_predict=12):
    """Runs the conversations (in `order`); returns, per request, (prompt, tokens, first-step
    probabilities, timings)."""
    history = [list(system) for system, _ in convs]
    out = []
    for c, t in order(len(convs), len(convs[0][1])):
        prompt = history[c] + convs[c][1][t]
        r = server.complete(prompt, cache_prompt=cache_prompt, n_predict=n_predict)
        out.append((prompt, r["tokens"], first_step(r), r.get("timings", {})))
        history[c] = prompt + r["tokens"]
    return out


def zeros(m):
    bad = {k: v for k, v in m.items() if k.startswith("kvfuse:must_be_zero") and v != 0}
    if bad:
        raise AssertionError(f"numbers that must be zero are not: {bad}")


def compare(ref, got, what):
    diffs = [i for i, (a, b) in enumerate(zip(ref, got)) if a[1] != b[1] or a[2] != b[2]]
    return diffs


def start_kvfuse(a, tmp, model, name, extra=(), env=None):
    return Server(a.kvfuse, model, tmp, name, extra, env)


def case_bitwise(a, tmp, arch):
    model = os.path.join(a.models, f"{arch}.gguf")
    extra = ["--swa-full"] if arch == "deepseek4" else []
    convs = conversations()
    stock = Server(a.stock, model, tmp, "stock", ["--cache-ram", "0"] + extra)
    # Replies long enough to cross a chunk boundary, so the next turn can reuse them.
    reply = 40
    try:
        ref = play(stock, convs, cache_prompt=False, n_predict=reply)
    finally:
        stock.stop()
    kv = start_kvfuse(a, tmp, model, "kvfuse", ["--kvfuse-memory", "64MiB"] + extra)
    try:
        got = play(kv, convs, n_predict=reply)
        m = kv.metrics()
        zeros(m)
        status, data = kv.get("/slots")
        slots = json.loads(data) if status == 200 else []
    finally:
        kv.stop()
    if not slots or "n_prompt_tokens_cache_backend" not in slots[0]:
        raise AssertionError(f"/slots does not say how many prompt tokens came from kvfuse: {slots}")
    for family in ("kvfuse:reused_tokens_total{source=\"kvfuse\"}", "kvfuse:loads_total{kind=\"kv-only\"}",
                   "kvfuse:checkpoints_total{event=\"saved\"}", "kvfuse:tier_gets_total{tier=\"memory\",result=\"hit\"}"):
        if family not in m:
            raise AssertionError(f"/metrics lacks {family}")
    if m["kvfuse:reused_tokens_total{source=\"kvfuse\"}"] != sum(g[3].get("cache_backend_n", 0) for g in got):
        raise AssertionError("/metrics and the responses' timings disagree on the tokens kvfuse restored")
    diffs = compare(ref, got, "kvfuse")
    reused = sum(g[3].get("cache_n", 0) for g in got)
    from_kvfuse = sum(g[3].get("cache_backend_n", 0) for g in got)
    prompt = sum(len(g[0]) for g in got)
    print(f"{arch}: {len(got)} requests, {prompt} prompt tokens, reused {reused} ({from_kvfuse} from kvfuse), "
          f"{len(diffs)} responses differ from stock with its cache off")
    if diffs:
        i = diffs[0]
        raise AssertionError(f"response {i} differs:\n stock  {ref[i][1]} {ref[i][2][:200]}\n kvfuse {got[i][1]} {got[i][2][:200]}")
    if from_kvfuse == 0:
        raise AssertionError("kvfuse restored nothing: the check compared nothing it restored")
    # A turn that reused cells past its conversation's previous prompt reused that prompt's
    # reply, which a decode step computed: kvfuse recomputed it as a prefill (settle) first.
    prev = {}
    into_reply = 0
    for (c, t), g in zip(order(len(convs), len(convs[0][1])), got):
        if c in prev and g[3].get("cache_n", 0) > prev[c]:
            into_reply += 1
        prev[c] = len(g[0])
    print(f"{arch}: {into_reply} turns reused their previous reply; settles {m.get('kvfuse:settles_total', 0):.0f}, "
          f"{m.get('kvfuse:settled_tokens_total', 0):.0f} tokens recomputed after replies")
    if m.get("kvfuse:settles_total", 0) == 0:
        raise AssertionError("no reply was recomputed as a prefill after its response")
    # deepseek4 resumes only at odd multiples of 128 (case_boundaries), too far apart for a
    # 40-token reply to hold one below the next prompt's tail split.
    if into_reply == 0 and arch != "deepseek4":
        raise AssertionError("no turn reused its previous reply")


def case_boundaries(a, tmp, arch):
    """Prompts of several lengths, each asked again after another prompt took the slot: the
    repeat resumes from kvfuse at whatever boundary it allows (for deepseek4 the odd
    multiples of 128: a resume at 256 or 512 changed its first-step probabilities), with
    the reference's bits."""
    model = os.path.join(a.models, f"{arch}.gguf")
    rng = random.Random(3)
    other = [rng.randrange(3, 320) for _ in range(200)]
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (300, 434, 460, 520, 600)]
    stock = Server(a.stock, model, tmp, "stock", ["--cache-ram", "0"])
    try:
        ref = [stock.complete(p, cache_prompt=False) for p in prompts]
    finally:
        stock.stop()
    kv = start_kvfuse(a, tmp, model, "kvfuse", ["--kvfuse-memory", "64MiB"])
    restored = []
    try:
        for p, r0 in zip(prompts, ref):
            kv.complete(p)
            kv.complete(other)
            r = kv.complete(p)
            restored.append(r["timings"].get("cache_backend_n", 0))
            if r["tokens"] != r0["tokens"] or first_step(r) != first_step(r0):
                raise AssertionError(f"a {len(p)}-token prompt resumed at {restored[-1]} differs from the reference")
        zeros(kv.metrics())
    finally:
        kv.stop()
    print(f"{arch}: prompts of {[len(p) for p in prompts]} tokens resumed at {restored}, each with the reference's bits")
    if not any(restored):
        raise AssertionError("nothing was resumed")


def case_parallel(a, tmp, arch):
    """--parallel 2, a KV stream per slot: a prompt prefilled in one slot is restored into the
    other (its blob cut to the one-stream form for the codec and padded back for llama.cpp),
    one request at a time, with the bits of the stock server at --parallel 2 with its cache
    off."""
    model = os.path.join(a.models, f"{arch}.gguf")
    extra = ["-np", "2"] + (["--swa-full"] if arch == "deepseek4" else [])
    rng = random.Random(5)
    first, second = ([rng.randrange(3, 320) for _ in range(n)] for n in (520, 660))
    plan = [(first, 0), (first, 1), (second, 1), (second, 0), (first, 0)]
    stock = Server(a.stock, model, tmp, "stock", ["--cache-ram", "0"] + extra)
    try:
        ref = [stock.complete(p, cache_prompt=False, id_slot=slot) for p, slot in plan]
    finally:
        stock.stop()
    kv = start_kvfuse(a, tmp, model, "kvfuse", ["--kvfuse-memory", "64MiB"] + extra)
    try:
        got = [kv.complete(p, id_slot=slot) for p, slot in plan]
        zeros(kv.metrics())
        log = kv.tail()
    finally:
        kv.stop()
    if "serving without kvfuse" in log:
        raise AssertionError(f"the server did not use kvfuse at --parallel 2:\n{log}")
    restored = [g["timings"].get("cache_backend_n", 0) for g in got]
    for i, ((p, slot), r0, r) in enumerate(zip(plan, ref, got)):
        if r["tokens"] != r0["tokens"] or first_step(r) != first_step(r0):
            raise AssertionError(f"request {i} ({len(p)} tokens, slot {slot}, {restored[i]} restored) differs from the reference")
    print(f"{arch} --parallel 2: slots {[slot for _, slot in plan]} restored {restored}, each with the reference's bits")
    if restored[1] == 0 or restored[3] == 0:
        raise AssertionError("a prompt computed in one slot was not restored into the other")


def case_stock(a, tmp):
    """Without a --kvfuse-* flag the kvfuse binary is the stock server: the same responses,
    timings counts and no kvfuse field, with stock's own cache on."""
    model = os.path.join(a.models, "llama.gguf")
    convs = conversations()
    out = []
    for binary, name in ((a.stock, "stock"), (a.kvfuse, "kvfuse-off")):
        s = Server(binary, model, tmp, name)
        try:
            out.append(play(s, convs))
            status, data = s.get("/metrics")
            if b"kvfuse:" in data:
                raise AssertionError(f"{name}'s /metrics has kvfuse families with no --kvfuse-* flag")
        finally:
            s.stop()
    stock, off = out
    for i, (x, y) in enumerate(zip(stock, off)):
        if x[1] != y[1] or x[2] != y[2] or x[3].get("cache_n") != y[3].get("cache_n"):
            raise AssertionError(f"response {i} of kvfuse-llama-server without kvfuse flags differs from stock")
        if "cache_backend_n" in y[3]:
            raise AssertionError("kvfuse-llama-server without kvfuse flags reports cache_backend_n")
    print(f"no kvfuse flag: {len(off)} responses, cache_n and timings fields the same as stock's (its cache on)")


def case_control(a, tmp, which):
    arch = "llama" if which == "kv" else "kimi-k3"
    model = os.path.join(a.models, f"{arch}.gguf")
    convs = conversations(n_conv=3, turns=2)  # the third shares the first's system prompt
    stock = Server(a.stock, model, tmp, "stock", ["--cache-ram", "0"])
    try:
        ref = play(stock, convs, cache_prompt=False)
    finally:
        stock.stop()
    kv = start_kvfuse(a, tmp, model, "kvfuse", ["--kvfuse-memory", "64MiB"],
                      env={"KVFUSE_LLAMA_SERVER_CONTROL": "flip-kv" if which == "kv" else "wrong-state"})
    try:
        got = play(kv, convs)
        m = kv.metrics()
    finally:
        kv.stop()
    diffs = compare(ref, got, "control")
    refused = m.get("kvfuse:restores_refused_total", 0)
    tampered = m.get("kvfuse:control_tampered_total", 0)
    print(f"control {which}: tampered {tampered:g} entries; {len(diffs)} responses differ; {refused:g} restores refused")
    if tampered == 0:
        raise AssertionError("the control found nothing to tamper with")
    if not diffs and refused == 0:
        raise AssertionError("a tampered entry changed nothing and was not refused: the check cannot fail")


def case_restart(a, tmp):
    model = os.path.join(a.models, "llama.gguf")
    disk = os.path.join(tmp, "disk")
    convs = conversations(n_conv=1, turns=1)
    prompt = convs[0][0] + convs[0][1][0]
    kv = start_kvfuse(a, tmp, model, "kvfuse-1", ["--kvfuse-memory", "4MiB", "--kvfuse-disk", disk])
    first = kv.complete(prompt)
    kv.kill9()
    kv = start_kvfuse(a, tmp, model, "kvfuse-2", ["--kvfuse-memory", "4MiB", "--kvfuse-disk", disk])
    try:
        again = kv.complete(prompt)
        zeros(kv.metrics())
    finally:
        kv.stop()
    n = again["timings"].get("cache_backend_n", 0)
    print(f"restart: the repeat reused {n} of {len(prompt)} prompt tokens from disk")
    if n == 0:
        raise AssertionError("after kill -9 and a restart the repeat reused nothing from disk")
    if again["tokens"] != first["tokens"] or first_step(again) != first_step(first):
        raise AssertionError("the repeat after the restart answered other tokens or probabilities")


@contextlib.contextmanager
def redis_server(binary, tmp):
    sock = os.path.join(tmp, "redis.sock")
    proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no",
                             "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield sock, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def shared_tier_reference(a, tmp):
    """The dense model and stock's answers (its cache off) to the conversations two servers
    on one shared tier (a redis-server, a cluster) then replay."""
    model = os.path.join(a.models, "llama.gguf")
    stock = Server(a.stock, model, tmp, "stock", ["--cache-ram", "0"])
    try:
        return model, play(stock, conversations(n_conv=2, turns=2), cache_prompt=False)
    finally:
        stock.stop()


def case_redis(a, tmp):
    model, ref = shared_tier_reference(a, tmp)
    with redis_server(a.redis_server, tmp) as (sock, redis):
        flags = ["--kvfuse-memory", "4MiB", "--kvfuse-redis", f"unix:{sock}"]
        one = start_kvfuse(a, tmp, model, "kvfuse-1", flags)
        two = start_kvfuse(a, tmp, model, "kvfuse-2", flags)
        try:
            p0 = ref[0][0]
            r1 = one.complete(p0)
            r2 = two.complete(p0)
            n = r2["timings"].get("cache_backend_n", 0)
            print(f"redis: the second server's first request reused {n} of {len(p0)} tokens the first computed")
            if n == 0:
                raise AssertionError("the second server reused nothing the first saved in redis")
            if r2["tokens"] != ref[0][1] or r1["tokens"] != ref[0][1] or first_step(r2) != ref[0][2]:
                raise AssertionError("a response over redis differs from stock with its cache off")
            redis.kill()
            redis.wait()
            # Redis is gone: every request is still answered, with the reference's bits.
            for i, (prompt, tokens, probs, _) in enumerate(ref[1:], 1):
                r = (one if i % 2 else two).complete(prompt)
                if r["tokens"] != tokens or first_step(r) != probs:
                    raise AssertionError(f"request {i} after redis stopped differs from the reference")
            m = two.metrics()
            zeros(m)
            failed = m.get("kvfuse:saves_total{result=\"failed\"}", 0) + \
                m.get("kvfuse:tier_gets_total{tier=\"redis\",result=\"failed\"}", 0)
            print(f"redis stopped: {len(ref) - 1} requests answered as the reference; {failed:g} failed tier calls counted")
            if failed == 0:
                raise AssertionError("redis stopped, and no failed save or get was counted")
        finally:
            one.stop()
            two.stop()


def case_cluster(a, tmp):
    model, ref = shared_tier_reference(a, tmp)
    with redis_cluster() as cluster:
        flags = ["--kvfuse-memory", "4MiB", "--kvfuse-redis", "cluster:" + cluster.seeds()]
        one = start_kvfuse(a, tmp, model, "kvfuse-1", flags)
        two = start_kvfuse(a, tmp, model, "kvfuse-2", flags)
        try:
            for i, (prompt, tokens, probs, _) in enumerate(ref):
                r1 = one.complete(prompt)
                r2 = two.complete(prompt)
                n = r2["timings"].get("cache_backend_n", 0)
                if i == 0:
                    print(f"cluster: the second server's first request reused {n} of {len(prompt)} tokens the first computed")
                    if n == 0:
                        raise AssertionError("the second server reused nothing the first saved in the cluster")
                for who, r in (("first", r1), ("second", r2)):
                    if r["tokens"] != tokens or first_step(r) != probs:
                        raise AssertionError(f"request {i} on the {who} server over the cluster differs from the reference")
            zeros(one.metrics())
            zeros(two.metrics())
        finally:
            one.stop()
            two.stop()


def case_cache_policy(a, tmp, arch):
    model = os.path.join(a.models, f"{arch}.gguf")
    extra = ["--swa-full"] if arch == "deepseek4" else []
    convs = conversations(n_conv=4)
    stock = Server(a.stock, model, tmp, "stock", ["--cache-ram", "0"] + extra)
    try:
        ref = play(stock, convs, cache_prompt=False, n_predict=40)
    finally:
        stock.stop()
    budget = 512 << 10
    for policy in ("cost", "lru"):
        kv = start_kvfuse(a, tmp, model, f"kvfuse-{policy}",
                          ["--kvfuse-memory", "512KiB", "--kvfuse-cache-policy", policy] + extra)
        try:
            got = play(kv, convs, n_predict=40)
            m = kv.metrics()
            zeros(m)
        finally:
            kv.stop()
        diffs = compare(ref, got, "kvfuse")
        if diffs:
            i = diffs[0]
            raise AssertionError(f"{policy}: response {i} differs from stock's:\n stock  {ref[i][1]}\n kvfuse {got[i][1]}")
        kept = m['kvfuse:cache_ledger_bytes{kind="kv"}'] + m['kvfuse:cache_ledger_bytes{kind="state"}']
        evicted = m['kvfuse:cache_ledger_total{event="evicted_kv"}'] + m['kvfuse:cache_ledger_total{event="evicted_state"}']
        refused = m['kvfuse:cache_ledger_total{event="refused_first_seen"}']
        restored = m['kvfuse:reused_tokens_total{source="kvfuse"}']
        memory = m['kvfuse:tier_bytes{tier="memory"}']
        print(f"{arch} {policy}: the ledger keeps {kept:.0f} of {budget} bytes, evicted {evicted:.0f}, refused {refused:.0f}; "
              f"the memory tier holds {memory:.0f}; {restored:.0f} tokens restored")
        if m['kvfuse:cache_ledger_bytes{kind="budget"}'] != budget or kept > budget:
            raise AssertionError(f"{policy}: the ledger keeps {kept} bytes of a {budget}-byte budget")
        if evicted == 0:
            raise AssertionError(f"{policy}: the budget never bound")
        if memory != kept or m["kvfuse:tier_evictions_total"] != 0:
            raise AssertionError(f"{policy}: the memory tier holds {memory} bytes and evicted "
                                 f"{m['kvfuse:tier_evictions_total']} on its own; the ledger counts {kept}")
        if restored == 0:
            raise AssertionError(f"{policy}: nothing was restored from the tier")


def case_flags(a, tmp):
    model = os.path.join(a.models, "llama.gguf")
    missing = os.path.join(tmp, "no-such-model.gguf")
    blocked = os.path.join(tmp, "file")
    open(blocked, "w").close()
    cases = [
        (["--kvfuse-memory", "-5MiB"], missing, "--kvfuse-memory -5MiB"),
        (["--kvfuse-memory", "5XB"], missing, "--kvfuse-memory 5XB"),
        (["--kvfuse-disk", os.path.join(blocked, "sub")], missing, "--kvfuse-disk " + os.path.join(blocked, "sub")),
        (["--kvfuse-redis", "unix:" + os.path.join(tmp, "none.sock")], missing, "--kvfuse-redis unix:"),
        (["--kvfuse-redis", "nohost"], missing, "--kvfuse-redis nohost"),
        (["--kvfuse-checkpoints", "sometimes"], missing, "sometimes"),
        (["--kvfuse-chunk-tokens", "0"], missing, "--kvfuse-chunk-tokens 0"),
        (["--kvfuse-frobnicate", "1"], missing, "--kvfuse-frobnicate"),
        (["--kvfuse-memory", "4MiB", "--kvfuse-chunk-tokens", "100"], model, "--kvfuse-chunk-tokens 100"),
        (["--kvfuse-cache-policy", "fifo"], missing, "--kvfuse-cache-policy fifo"),
        (["--kvfuse-cache-policy", "cost", "--kvfuse-disk", tmp], missing, "--kvfuse-cache-policy cost: owns the memory"),
    ]
    for flags, m, needle in cases:
        args = [a.kvfuse, "-m", m] + COMMON + flags
        p = subprocess.run(args, capture_output=True, text=True, timeout=60)
        if p.returncode != 1 or needle not in p.stderr + p.stdout:
            raise AssertionError(f"{' '.join(flags)}: exit {p.returncode}, expected 1 naming '{needle}':\n{p.stderr[-800:]}")
        if "loading model" in (p.stderr + p.stdout) and m == model:
            raise AssertionError(f"{' '.join(flags)}: the model was loaded before the bad value was refused")
    print(f"flags: {len(cases)} bad values each exit 1 naming the flag and the value")


def max_logprob_delta(a, b):
    """The largest difference of a first-step log-probability between two responses."""
    pa, pb = json.loads(a), json.loads(b)
    if not pa or not pb:
        return 0.0
    la = [pa["logprob"]] + [t["logprob"] for t in pa.get("top_logprobs", [])]
    lb = [pb["logprob"]] + [t["logprob"] for t in pb.get("top_logprobs", [])]
    return max((abs(x - y) for x, y in zip(la, lb)), default=0.0)


def case_compare(a, tmp, arch, parallel):
    """Not a test: measures, against stock with its cache off, stock with its default cache
    and kvfuse (docs/llama-server.md#compare). With --parallel above 1 the conversations run
    concurrently, one client thread each, and stock cache-off runs twice."""
    import threading
    global COMMON
    COMMON = [x if x != "1" or COMMON[i - 1] != "-np" else str(parallel) for i, x in enumerate(COMMON)]
    model = os.path.join(a.models, f"{arch}.gguf")
    extra = ["--swa-full"] if arch == "deepseek4" else []
    convs = conversations(n_conv=max(3, parallel), turns=3)

    def run(binary, flags, cache_prompt, name):
        s = Server(binary, model, tmp, name, flags + extra)
        try:
            if parallel == 1:
                return play(s, convs, cache_prompt)
            out = {}
            history = [list(system) for system, _ in convs]

            def one(c):
                for t in range(3):
                    prompt = history[c] + convs[c][1][t]
                    r = s.complete(prompt, cache_prompt=cache_prompt)
                    out[(c, t)] = (prompt, r["tokens"], first_step(r), r.get("timings", {}))
                    history[c] = prompt + r["tokens"]
            threads = [threading.Thread(target=one, args=(c,)) for c in range(len(convs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return [out[k] for k in sorted(out)]
        finally:
            s.stop()

    ref = run(a.stock, ["--cache-ram", "0"], False, "stock-off")
    runs = [("stock, its cache on", run(a.stock, [], True, "stock-on")),
            ("kvfuse " + a.kvfuse_flags, run(a.kvfuse, a.kvfuse_flags.split(), True, "kvfuse"))]
    if parallel > 1:
        runs.insert(0, ("stock, its cache off, again", run(a.stock, ["--cache-ram", "0"], False, "stock-off-2")))
    prompt = sum(len(r[0]) for r in ref)
    for name, got in runs:
        tok = sum(1 for x, y in zip(ref, got) if x[1] != y[1])
        probs = sum(1 for x, y in zip(ref, got) if x[2] != y[2])
        delta = max((max_logprob_delta(x[2], y[2]) for x, y in zip(ref, got)), default=0.0)
        reused = sum(g[3].get("cache_n", 0) for g in got)
        print(f"{arch} --parallel {parallel}: {name}: {len(got)} responses, tokens differ {tok}, first-step probabilities "
              f"differ {probs} (max {delta:.2e}), reused {reused} of {prompt} prompt tokens")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("model", nargs="?")
    ap.add_argument("--stock", required=True)
    ap.add_argument("--kvfuse", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--redis-server", default=shutil.which("redis-server"))
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--kvfuse-flags", default="--kvfuse-memory 64MiB", help="compare: kvfuse's flags")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvfuse-llama-server-")
    try:
        if a.case == "bitwise":
            case_bitwise(a, tmp, a.model)
        elif a.case in ("control-kv", "control-state"):
            case_control(a, tmp, a.case.split("-")[1])
        elif a.case == "restart":
            case_restart(a, tmp)
        elif a.case == "redis":
            if not a.redis_server:
                raise RuntimeError("redis-server is missing. Run, as root: apt-get install -y redis-server libhiredis-dev")
            case_redis(a, tmp)
        elif a.case == "cluster":
            case_cluster(a, tmp)
        elif a.case == "flags":
            case_flags(a, tmp)
        elif a.case == "cache-policy":
            case_cache_policy(a, tmp, a.model)
        elif a.case == "boundaries":
            case_boundaries(a, tmp, a.model)
        elif a.case == "parallel":
            case_parallel(a, tmp, a.model)
        elif a.case == "stock":
            case_stock(a, tmp)
        elif a.case == "compare":
            case_compare(a, tmp, a.model, a.parallel)
        else:
            raise SystemExit(f"unknown case {a.case}")
    except (AssertionError, RuntimeError) as e:
        print(f"FAIL: {e}", file=sys.stderr)
        print(f"(logs kept in {tmp})", file=sys.stderr)
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
