#!/usr/bin/env python3
"""Offline reference for the replay's tier under a byte budget: lru, cost and belady.

What it models (kvfuse-replay with `--tier memory --sync-saves --faults none`, one rank:
every rank of the replay gets the same loads and saves, so every rank's tier holds the
same entries, and the budget is per rank):

- The workload: the Mooncake trace as apps/replay/workload.cpp reads it. Chunk i of a
  request (512 tokens) is keyed by (hash_ids[i], i) when the prompt covers it whole, by
  (request, i) otherwise (the prompt's tail and the output are the request's own). The
  reuse bound is the trace README's: per request, the leading run of already-seen ids in
  whole blocks, capped at input_length - 1.
- The engine's HBM prefix cache: host/block_pool.hpp's PrefixBlockPool (64-token blocks,
  `max(1024, 2 x longest request)` of them, LRU over cached blocks, blocks released in
  table order at finish), simulated exactly. It does not depend on the tier, so it runs once.
- Admission (Coordinator::admit over detail/coordinator_steps.hpp and planner.hpp): the
  lookup counts the leading prompt chunks the tier holds (`contains`, no LRU touch), capped
  at P floored to a chunk. Dense: a KvOnlyLoad of the chunks overlapping [hbm, end),
  end = min(lookup, floor_chunk(P - 1)); resume = max(end, hbm). Stateful: the servable
  boundaries are the chunk boundaries in (0, P - 1] whose checkpoint hash the *index*
  holds; the plan is the highest one in (hbm, lookup] (joint: KV chunks from the one
  holding hbm up to B, then the state), else the highest at or below hbm (state only).
- The index is not told of tier evictions (as in the replay): a checkpoint the tier
  dropped is still "servable" until a load misses it, which retracts its hash and resets
  the request's save watermark to 0; the salvage then tries one state-only load of the
  highest servable boundary at or below the KV frontier, else resumes at 0. A checkpoint
  the index still serves is deduplicated (not saved again) even if the tier dropped it.
- Checkpoint placement: checkpoint_policy.hpp's plan_checkpoints for the resume point the
  load claims, branch = max(lookup, hbm) (floored to the 64-token block grid: such a
  checkpoint is stored but never asked for, since the replay only asks for chunk
  boundaries), plus the generation-end checkpoint at floor_chunk(P + output - 1). Prefill
  checkpoints are put when the prefill reaches them; at finish the KV chunks from the
  watermark (the admission's lookup) up to floor_chunk(P + output) are put in order, then
  the generation-end checkpoint. No checkpoint is skipped for want of a snapshot slot.
- Sizes per rank: a KV chunk 512 x 8 = 4096 bytes; a state entry 4096 x F (K3) or
  4096 x F + 24 (DSV4's sidecar). The working set is what an unlimited tier holds at the
  end; capacity = ceil(S / 100 x working set), as apps/replay/main.cpp sizes it.
- Reuse = HBM tokens + tier tokens the requests resumed from, over the trace's bound
  (report.cpp's reused_share_of_bound).

The policies, over the same replay:

- `lru`: MemoryTier: get and put make an entry most recent, put evicts least recent first.
- `cost`: the cache policy (include/kvfuse/engine/cache_policy.hpp). Every kept entry has
  bytes, saved_tokens, hits and a priority H = L + w x saved_tokens / bytes, set on store and
  on every use, with w = 1 + hits for a checkpoint and 1 for a KV chunk; only a leaf (an
  entry no kept entry needs: KV chunk i is needed by chunk i + 1 of the same prefix, the KV
  chunk covering B by the checkpoint at B) is evicted, lowest H first (ties: least recently
  used), L = max(L, its H). saved_tokens (cache_saved_tokens): a dense KV chunk 512, a
  stateful model's KV chunk 128 (a quarter: it spares nothing without a checkpoint above
  it), a checkpoint at B: B. A checkpoint whose hash was never seen (stored, refused,
  evicted) is refused when it fits only by evicting; so is a dense model's KV chunk never
  seen before (kv_on_second_sight: the replay sets it for dense). As the C++ ledger does: a store of a
  kept entry is a use, and the entry a store needs is linked before the evictions (a store
  never evicts what it stands on; if only such entries are left the store is refused as
  too large). It is the replay's `--cache-policy cost` (an engine-side CacheLedger over
  unlimited tiers), as apps/replay/pass_loop.hpp and pass_admission.hpp wire it: every
  checkpoint store asks the ledger first (a kept one is a use, even when the Coordinator then
  deduplicates it), a checkpoint the ledger evicts is forgotten by the index, a checkpoint
  counts 4096 x F bytes (no DSV4 sidecar: state_entry), and a prefill checkpoint the ledger
  refused is not offered again at finish when it is also the generation-end one. At finish
  the KV chunks go to a ledger in order and the save stops at the first it does not keep
  (they are a prefix chain: the Coordinator sends only the kept prefix; the ledger still
  sees the chunks above, which is what lets a dense prefix in on its second sight, and
  forgets a new one it admitted there), and the generation-end
  checkpoint is not offered when its covering chunk was not kept; no checkpoint is offered
  when a chunk is larger than the whole budget.
  checkpoints_saved counts what reached the index, checkpoints_refused the refusals.
- `ledger-lru`: the replay's `--cache-policy lru`: the ledger's LRU (any entry may go,
  everything that fits comes in) with the same wiring (no stale hashes, a store of a kept
  checkpoint is a use).
- `belady`: the same leaves-only rule and no refusals, evicting the leaf whose next use is
  farthest (never = infinity; ties least recently used). The next use is static, from the
  trace: a KV chunk (key, i) is used by a later request r whose prompt holds that key at
  position i, with i inside r's reusable prefix (all of chunks 0..i seen before r), at or
  above the chunk holding r's HBM hit, and below r's last whole chunk under P - 1
  (i < (P - 1) // 512: no load reaches further). A chunk-boundary checkpoint at B is used by
  a later request whose chain of chunk keys below B is the same and with B <= P - 1; a
  checkpoint off the chunk grid is never used. "Used" is what a request could read, not
  what it will (a request resumes only from the highest checkpoint the index serves), so
  this is a strong offline reference, not a proven optimum: with dependencies and
  variable sizes no simple rule is. `belady-bypass` also refuses a new entry whose next use
  is farther than every evictable entry's.
- `reused-oracle`: knows which entries a later request reads, and how often, not when: it
  refuses an entry nobody reads again and evicts the leaf with the fewest reads left per
  byte (GDSF, with the same wiring as `cost`). The gap between it and Belady is what
  knowing *when* is worth.

What it does not model: faults, preemption, concurrency (it is --sync-saves only), the
break-even and min-load rules (off in the replay), snapshot slots running out, the index's
own hash capacity (262,144 by default: nothing is evicted there), disk or redis tiers.
"""
from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

CHUNK = 512
BLOCK = 64
KV_BYTES = CHUNK * 8  # one chunk's KV on one rank (content.hpp: 8 bytes per token per rank)
STATE_UNIT = 4096  # a state slot at --state-scale 1 (content.hpp default_slot_bytes)
DSV4_SIDECAR = 24  # state_legs.hpp SlotSidecar
MODELS = ("dense", "dsv4", "k3")
POLICIES = ("lru", "cost", "belady")  # also ledger-lru (--cache-policy lru), belady-bypass and reused-oracle
INF = math.inf


# ---------------------------------------------------------------------------- the workload


@dataclass
class Request:
    index: int
    prompt: int
    output: int
    keys: list  # chunk key ids, one per chunk of prompt + output
    nodes: list  # nodes[n]: the chain node of keys[:n] (node 0: the empty chain)
    bound: int  # reuse bound tokens
    run: int  # leading whole-prompt chunks whose keys earlier requests hold
    hbm: int = 0  # HBM prefix-cache hit, tokens (filled by hbm_hits)


@dataclass
class Trace:
    requests: list
    bound: int
    kv_parent: dict  # chunk key id -> the key of chunk i - 1 on its prefix (None for i = 0)
    node_parent: list  # chain node -> parent node
    node_key: list  # chain node -> its last chunk key id (None for the root)


def load_trace(path: str, limit: int) -> Trace:
    """Reads the first `limit` requests as workload.cpp does (keys interned to ints)."""
    key_ids: dict = {}
    chain: dict = {}
    node_parent, node_key = [0], [None]
    kv_parent: dict = {}
    seen_ids: set = set()
    reqs = []

    def key_of(k):
        kid = key_ids.get(k)
        if kid is None:
            kid = key_ids[k] = len(key_ids)
        return kid

    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            if limit and len(reqs) == limit:
                break
            d = json.loads(line)
            r = len(reqs)
            prompt, output, ids = d["input_length"], d["output_length"], d["hash_ids"]
            if len(ids) != -(-prompt // CHUNK):
                raise SystemExit(f"{path}: request {r}: {len(ids)} hash_ids for input_length {prompt}")
            run = 0
            while run < len(ids) and ids[run] in seen_ids:
                run += 1
            bound = min(run * CHUNK, prompt - 1)
            seen_ids.update(ids)
            total = prompt + output
            keys, nodes, node = [], [0], 0
            for i in range(-(-total // CHUNK)):
                whole = (i + 1) * CHUNK <= prompt and i < len(ids)
                kid = key_of(("t", ids[i], i) if whole else ("own", r, i))
                kv_parent.setdefault(kid, keys[-1] if keys else None)
                keys.append(kid)
                nxt = chain.get((node, kid))
                if nxt is None:
                    nxt = chain[(node, kid)] = len(node_parent)
                    node_parent.append(node)
                    node_key.append(kid)
                node = nxt
                nodes.append(node)
            reqs.append(Request(r, prompt, output, keys, nodes, bound, min(run, prompt // CHUNK)))
    if not reqs:
        raise SystemExit(f"{path}: no requests")
    return Trace(reqs, sum(q.bound for q in reqs), kv_parent, node_parent, node_key)


def block_ids(q: Request) -> list:
    # content.hpp block_id: the chunk key of the block and its position.
    return [(q.keys[b * BLOCK // CHUNK], b) for b in range(-(-(q.prompt + q.output) // BLOCK))]


def hbm_hits(trace: Trace, num_blocks: int | None = None) -> int:
    """Fills each request's HBM hit with PrefixBlockPool's behaviour under --sync-saves (one
    admission at a time, every block released before the next). Returns the pool size."""
    reqs = trace.requests
    if num_blocks is None:
        longest = max(-(-(q.prompt + q.output) // BLOCK) for q in reqs)
        num_blocks = max(1024, 2 * longest)  # apps/replay/main.cpp
    free = num_blocks
    cached: OrderedDict = OrderedDict()  # published, unpinned; first = least recently used
    for q in reqs:
        ids = block_ids(q)
        total = q.prompt + q.output
        limit = (q.prompt - 1) // BLOCK
        shared = 0
        while shared < limit and shared < len(ids) and ids[shared] in cached:
            del cached[ids[shared]]  # pinned: out of the LRU
            shared += 1
        need = len(ids) - shared
        if free + len(cached) < need:
            raise SystemExit(f"request {q.index}: the block pool cannot hold it")
        take = min(free, need)
        free -= take
        for _ in range(need - take):
            cached.popitem(last=False)
        q.hbm = shared * BLOCK
        # finish: publish whole blocks (an identity another block holds stays with it), then
        # release in table order: published blocks become most recent, the rest free.
        for b in range(shared):
            cached[ids[b]] = True
        pinned = set(ids[:shared])
        for b in range(shared, len(ids)):
            if (b + 1) * BLOCK <= total and ids[b] not in cached and ids[b] not in pinned:
                cached[ids[b]] = True
            else:
                free += 1
    return num_blocks


# ---------------------------------------------------------------- the checkpoint policy


@dataclass(frozen=True)
class CheckpointPolicy:
    at_branch: bool = True
    at_prompt_end: bool = True
    every_chunks: int = 8
    at_generation_end: bool = True
    max_prefill: float = 4  # INF: uncapped

    @staticmethod
    def named(name: str) -> "CheckpointPolicy":
        if name == "default":
            return CheckpointPolicy()
        if name == "last":
            return CheckpointPolicy(False, False, 0, True, 0)
        if name == "all":
            return CheckpointPolicy(True, True, 1, True, INF)
        if name.startswith("every:") and name[6:].isdigit() and int(name[6:]) > 0:
            return CheckpointPolicy(False, False, int(name[6:]), True, INF)
        raise SystemExit(f"checkpoint policy '{name}' is not one of default, last, all, every:N")


def plan_checkpoints(prompt: int, resume: int, branch: int, p: CheckpointPolicy) -> list:
    """checkpoint_policy.hpp's plan_checkpoints (block grid 64, chunk grid 512)."""
    last = prompt - 1
    if prompt == 0 or p.max_prefill == 0 or last <= resume:
        return []
    b = 0
    if p.at_branch and branch <= last:
        b = branch - branch % BLOCK
        b = b if b > resume else 0
    e = 0
    if p.at_prompt_end:
        e = last - last % CHUNK
        e = e if e > resume and e != b else 0
    out = [x for x in (b, e) if x][: int(min(2, p.max_prefill))]
    if p.every_chunks:
        stride = p.every_chunks * CHUNK
        x = last - last % stride
        while x > resume and len(out) < p.max_prefill:
            if x != b and x != e:
                out.append(x)
            x -= stride
    return sorted(out)


# ------------------------------------------------------------------------------ the tiers


class LruTier:
    """MemoryTier: get and put make an entry most recent; a put evicts least recent first."""

    def __init__(self, capacity: float):
        self.cap = capacity
        self.bytes = 0
        self.od: OrderedDict = OrderedDict()
        self.evictions = self.refusals = self.too_large = 0

    def contains(self, e) -> bool:
        return e in self.od

    def get(self, e) -> bool:
        if e not in self.od:
            return False
        self.od.move_to_end(e)
        return True

    def put(self, e, size: int) -> bool:
        if size > self.cap:
            self.too_large += 1
            return False
        old = self.od.pop(e, None)
        if old is not None:
            self.bytes -= old
        while self.bytes + size > self.cap:
            _, s = self.od.popitem(last=False)
            self.bytes -= s
            self.evictions += 1
        self.od[e] = size
        self.bytes += size
        return True

    def tick(self, t: int) -> None:
        pass


class DependentTier:
    """Leaves-only eviction by a priority (smallest first, ties least recently used) over a
    heap with lazy deletion: an item is live while its entry is kept, its version is the
    entry's and no kept entry needs it. Entries needed by something are re-pushed when their
    last dependent goes. Subclasses say what the priority is and what they refuse."""

    def __init__(self, capacity: float, sim: "Replay"):
        self.cap = capacity
        self.sim = sim
        self.index: set = set()  # the Replay's, set by Replay.run
        self.prompt_end = -1  # the boundary of the request being stored (Replay._request)
        self.bytes = 0
        self.kept: dict = {}  # entry -> [priority, recency, version, size, hits]
        self.needed_by: dict = {}  # entry -> kept entries that need it (kept or not itself)
        self.heap: list = []
        self.clock = 0
        self.evictions = self.refusals = self.too_large = 0

    # -- what subclasses define
    def priority(self, e, hits: int, size: int) -> float:
        raise NotImplementedError

    def refuse(self, e, size: int, fits: bool) -> bool:
        return False

    # -- the structure
    def _file(self, e, hits: int, touch: bool = True) -> None:
        # A new priority and version; `touch`: also most recent (a store or a use).
        ent = self.kept[e]
        self.clock += 1
        ent[0] = self.priority(e, hits, ent[3])
        ent[2] = self.clock
        if touch:
            ent[1] = self.clock
        ent[4] = hits
        if not self.needed_by.get(e):
            heapq.heappush(self.heap, (ent[0], ent[1], ent[2], e))

    def _link(self, parent, delta: int) -> None:
        if parent is None:
            return
        n = self.needed_by.get(parent, 0) + delta
        self.needed_by[parent] = n
        if n == 0 and parent in self.kept:  # a leaf again: evictable with what it had
            ent = self.kept[parent]
            heapq.heappush(self.heap, (ent[0], ent[1], ent[2], parent))

    def _victim(self):
        while self.heap:
            prio, _, ver, e = heapq.heappop(self.heap)
            ent = self.kept.get(e)
            if ent is None or ent[2] != ver or self.needed_by.get(e):
                continue
            return e, prio
        return None, None

    def _evict(self, e) -> None:
        # An owner of the budget (the replay's CacheLedger) tells the index what it drops:
        # no stale hash is served, or deduplicates a new save of the same checkpoint.
        if isinstance(e, tuple):
            self.index.discard(e)
        size = self.kept.pop(e)[3]
        self.bytes -= size
        self.evictions += 1
        self._link(self.sim.parent_of(e), -1)
        self.on_evicted(e)

    def on_evicted(self, e) -> None:
        pass

    def forget(self, e) -> None:
        # CacheLedger::forget: dropped without a victim's accounting (not an eviction).
        ent = self.kept.pop(e, None)
        if ent is None:
            return
        self.bytes -= ent[3]
        self._link(self.sim.parent_of(e), -1)

    def contains(self, e) -> bool:
        return e in self.kept

    def get(self, e) -> bool:
        ent = self.kept.get(e)
        if ent is None:
            return False
        self._file(e, ent[4] + 1)
        return True

    def put(self, e, size: int) -> bool:
        if e in self.kept:  # a store of a kept entry is a use (CacheLedger::store)
            return self.get(e)
        fits = self.bytes + size <= self.cap
        if self.refuse(e, size, fits):
            self.refusals += 1
            return False
        if size > self.cap:
            self.too_large += 1
            return False
        parent = self.sim.parent_of(e)
        self._link(parent, +1)  # what it stands on is not a victim of its own store
        while self.bytes + size > self.cap:
            victim, prio = self._victim()
            if victim is None:  # all that is left is what it stands on: too large, as CacheLedger says
                self._link(parent, -1)
                self.too_large += 1
                return False
            self.on_victim(prio)
            self._evict(victim)
        self.kept[e] = [0.0, 0, 0, size, 0]
        self.bytes += size
        self.on_stored(e)
        self._file(e, 0)
        return True

    def on_victim(self, prio) -> None:
        pass

    def on_stored(self, e) -> None:
        pass

    def tick(self, t: int) -> None:
        pass


class CostTier(DependentTier):
    """cache_policy.hpp's `cost`: GDSF over leaves, first-seen checkpoints refused under
    pressure. The weights are cache_saved_tokens() and cache_priority() of the header.
    It is the replay's CacheLedger (`--cache-policy cost`): see Replay._save_state."""

    ledger = True

    def __init__(self, capacity, sim):
        super().__init__(capacity, sim)
        self.inflation = 0.0
        self.seen: set = set()

    def priority(self, e, hits, size):
        # Uses count for checkpoints only: a KV chunk's uses are its prefix's, already
        # weighed by the checkpoint standing on it (and for dense, recency alone does best).
        # A checkpoint divides by its footprint: its bytes and the KV it stands on.
        if isinstance(e, tuple):
            return self.inflation + (1 + hits) * e[1] / (size + (-(-e[1] // CHUNK)) * KV_BYTES)
        return self.inflation + self.saved_tokens(e) / size

    def saved_tokens(self, e) -> int:
        if isinstance(e, tuple):
            return e[1]  # a checkpoint at B spares the prefill of [0, B)
        # A stateful model's KV chunk spares nothing alone; a quarter of its tokens keeps
        # it below the checkpoints as a leaf (under a kept checkpoint it is pinned anyway).
        return CHUNK // 4 if self.sim.stateful else CHUNK

    def refuse(self, e, size, fits):
        if not isinstance(e, tuple):
            if self.sim.stateful:
                return False
            # A dense model's KV chunk comes in on second sight (the replay's CacheLedger with
            # kv_on_second_sight): never seen before, only when it fits without an eviction.
            # The ledger's seen set of 2^16 KV keys is never full here (20,050 keys in the
            # first 1000 requests of the shipped trace), so a set models it. Larger than the
            # budget: too large, as the ledger says, not refused.
            first_seen = e not in self.seen
            self.seen.add(e)
            return first_seen and not fits and size <= self.cap
        first_seen = e not in self.seen
        self.seen.add(e)
        # Light (at most two chunks' KV, the replay's light_state_bytes) and prompt-end
        # checkpoints come in on first sight.
        if size <= 2 * KV_BYTES or e[1] == self.prompt_end:
            return False
        return first_seen and not fits

    def on_victim(self, prio):
        # Leaves only: an entry pinned for a while may come free below L; L never falls.
        self.inflation = max(self.inflation, prio)


class LedgerLruTier(LruTier):
    """`--cache-policy lru`: the replay's CacheLedger with the lru policy over unlimited tiers.
    The same LRU as MemoryTier (a use or a store of a kept entry makes it most recent, the
    least recent goes, needed or not, everything that fits comes in), but as an owner of the
    budget: an evicted checkpoint is forgotten by the index too (no stale hash is served or
    deduplicated), a store of a kept checkpoint is a use, and it counts the ledger's bytes
    (Replay._save_state)."""

    ledger = True

    def __init__(self, capacity: float, sim: "Replay"):
        super().__init__(capacity)
        self.index: set = set()  # the Replay's, set by Replay.run
        self.prompt_end = -1  # the boundary of the request being stored (Replay._request)

    def put(self, e, size: int) -> bool:
        if e in self.od:  # CacheLedger::store: already kept, a use
            return self.get(e)
        if size > self.cap:
            self.too_large += 1
            return False
        while self.bytes + size > self.cap:
            v, s = self.od.popitem(last=False)
            self.bytes -= s
            self.evictions += 1
            if isinstance(v, tuple):
                self.index.discard(v)
        self.od[e] = size
        self.bytes += size
        return True

    def forget(self, e) -> None:
        size = self.od.pop(e, None)
        if size is not None:
            self.bytes -= size


class BeladyTier(DependentTier):
    """The offline reference: the leaf next used farthest in the future goes."""

    def __init__(self, capacity, sim, bypass: bool = False):
        super().__init__(capacity, sim)
        self.now = -1
        self.bypass = bypass

    def next_use(self, e) -> float:
        uses = self.sim.uses.get(e)
        if not uses:
            return INF
        i = bisect.bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else INF

    def priority(self, e, hits, size):
        return -self.next_use(e)

    def tick(self, t):
        # Request t has read what it reads: what it could have used is due again later.
        self.now = t
        for e in self.sim.uses_of[t]:
            ent = self.kept.get(e)
            if ent is not None:
                self._file(e, ent[4], touch=False)

    def refuse(self, e, size, fits):
        if not self.bypass or fits:
            return False
        # Peek at the farthest evictable entry: refuse a newcomer due later than it.
        victim, prio = self._victim()
        if victim is None:
            return False
        ent = self.kept[victim]
        heapq.heappush(self.heap, (ent[0], ent[1], ent[2], victim))
        return self.next_use(e) > -prio


class ReusedOracleTier(CostTier):
    """`reused-oracle`: knows which entries are read again and how often, not when. It
    refuses an entry no later request reads and weighs the rest by the reads still to come
    (GDSF, as `cost`, with w = reads left). What it reaches bounds any policy that learns
    only *which* entries are shared; what Belady reaches above it is knowing *when*."""

    def __init__(self, capacity, sim):
        super().__init__(capacity, sim)
        self.now = -1

    def tick(self, t):
        self.now = t

    def reads_left(self, e) -> int:
        uses = self.sim.uses.get(e, ())
        return len(uses) - bisect.bisect_right(uses, self.now)

    def priority(self, e, hits, size):
        footprint = size + (-(-e[1] // CHUNK)) * KV_BYTES if isinstance(e, tuple) else size
        return self.inflation + self.reads_left(e) * self.saved_tokens(e) / footprint

    def refuse(self, e, size, fits):
        return self.reads_left(e) == 0


def make_tier(policy: str, capacity: float, sim: "Replay"):
    if policy == "lru":
        return LruTier(capacity)
    if policy == "cost":
        return CostTier(capacity, sim)
    if policy == "ledger-lru":
        return LedgerLruTier(capacity, sim)
    if policy == "belady":
        return BeladyTier(capacity, sim)
    if policy == "belady-bypass":
        return BeladyTier(capacity, sim, bypass=True)
    if policy == "reused-oracle":
        return ReusedOracleTier(capacity, sim)
    raise SystemExit(f"unknown policy {policy}")


# ----------------------------------------------------------------------------- the replay


@dataclass
class Result:
    reused_hbm: int = 0
    reused_tier: int = 0
    evictions: int = 0
    refusals: int = 0
    too_large: int = 0
    state_misses: int = 0
    checkpoints_saved: int = 0  # ledger tiers: sent (CoordinatorStats::checkpoints_saved); else every save tried
    checkpoints_refused: int = 0  # ledger tiers: checkpoint stores the ledger refused (RunResult::checkpoints_refused)
    bytes_held: int = 0
    state_bytes: int = 0


class Replay:
    """One model's admissions and saves over a tier, request by request (--sync-saves)."""

    def __init__(self, trace: Trace, model: str, state_scale: int, checkpoints: CheckpointPolicy):
        self.trace = trace
        self.model = model
        self.stateful = model != "dense"
        self.state_bytes = STATE_UNIT * state_scale + (DSV4_SIDECAR if model == "dsv4" else 0)
        # What the ledger counts a checkpoint as (pass_loop.hpp state_entry: state_scale x
        # default_slot_bytes, no sidecar); the budget is still sized from the tier's bytes.
        self.ledger_state_bytes = STATE_UNIT * state_scale
        self.policy = checkpoints
        self._uses = None

    def parent_of(self, e):
        if isinstance(e, tuple):  # a checkpoint needs the KV chunk covering its boundary
            return self.trace.node_key[e[0]]
        return self.trace.kv_parent[e]

    def checkpoint_id(self, q: Request, b: int):
        # StateChain::of: the chain over every chunk the tokens before b touch, and b.
        return (q.nodes[-(-b // CHUNK)], b)

    # Belady's next-use lists (the module docstring says what a use is); built once.
    def _build_uses(self):
        uses: dict = {}
        uses_of = []
        for q in self.trace.requests:
            mine = []
            top = min(q.run, (q.prompt - 1) // CHUNK)
            for i in range(q.hbm // CHUNK, top):
                mine.append(q.keys[i])
            if self.stateful:
                for j in range(1, (q.prompt - 1) // CHUNK + 1):
                    if j > q.run:
                        break  # a prefix never seen before cannot have a checkpoint yet
                    mine.append((q.nodes[j], j * CHUNK))
            for e in mine:
                uses.setdefault(e, []).append(q.index)
            uses_of.append(mine)
        self._uses = (uses, uses_of)

    @property
    def uses(self):
        if self._uses is None:
            self._build_uses()
        return self._uses[0]

    @property
    def uses_of(self):
        if self._uses is None:
            self._build_uses()
        return self._uses[1]

    def run(self, policy: str, capacity: float) -> Result:
        tier = make_tier(policy, capacity, self)
        res = Result()
        index: set = set()  # the OffloadIndex's servable checkpoint hashes
        tier.index = index
        for t, q in enumerate(self.trace.requests):
            self._request(t, q, tier, index, res)
        res.evictions, res.refusals, res.too_large = tier.evictions, tier.refusals, tier.too_large
        res.bytes_held = tier.bytes
        if isinstance(tier, LruTier):  # LedgerLruTier too
            res.state_bytes = sum(s for e, s in tier.od.items() if isinstance(e, tuple))
        else:
            res.state_bytes = sum(v[3] for e, v in tier.kept.items() if isinstance(e, tuple))
        return res

    def _save_state(self, ck, tier, index, res) -> bool:
        """A checkpoint store; returns False when a ledger refused it."""
        if getattr(tier, "ledger", False):
            if KV_BYTES > tier.cap:
                # A budget smaller than a chunk keeps no KV for a checkpoint to stand on: the
                # replay refuses it before the ledger sees it.
                res.checkpoints_refused += 1
                return False
            # The replay's checkpoint() and finish(): the ledger first (a kept one is a use),
            # then the Coordinator, which deduplicates a hash the index serves. What the
            # ledger evicts the index forgets, so the index serves only what it keeps.
            if not tier.put(ck, self.ledger_state_bytes):
                res.checkpoints_refused += 1
                return False
            if ck not in index:
                res.checkpoints_saved += 1
                index.add(ck)
            return True
        if ck in index:
            return True  # deduplicated: the index serves it (whether the tier still holds it or not)
        res.checkpoints_saved += 1
        if tier.put(ck, self.state_bytes):
            index.add(ck)
        return True

    def _request(self, t: int, q: Request, tier, index: set, res: Result) -> None:
        keys, prompt, hbm = q.keys, q.prompt, q.hbm
        total = prompt + q.output
        prompt_chunks = -(-prompt // CHUNK)
        held = 0
        while held < prompt_chunks and tier.contains(keys[held]):
            held += 1
        lookup = min(held * CHUNK, prompt - prompt % CHUNK)
        last = prompt - 1
        tier.prompt_end = last - last % CHUNK  # what the ledger lets in on first sight
        watermark = lookup
        planned: list = []
        if not self.stateful:
            resume = hbm
            end = min(lookup, last - last % CHUNK)
            if lookup > hbm and end > hbm:
                for c in range(hbm // CHUNK, end // CHUNK):
                    tier.get(keys[c])
                resume = end
        else:
            servable = [b for b in range(CHUNK, last + 1, CHUNK) if self.checkpoint_id(q, b) in index]
            joint = max((b for b in servable if hbm < b <= lookup), default=0)
            state_only = max((b for b in servable if b <= hbm), default=0)
            claimed = joint or state_only
            planned = plan_checkpoints(prompt, claimed, max(lookup, hbm), self.policy)
            resume = 0
            if claimed:
                frontier = hbm
                if joint:
                    for c in range(hbm // CHUNK, joint // CHUNK):
                        tier.get(keys[c])
                    frontier = joint

                def restored(b: int) -> bool:
                    # A state load of b: a genuine miss retracts the hash.
                    ck = self.checkpoint_id(q, b)
                    if tier.get(ck):
                        return True
                    res.state_misses += 1
                    index.discard(ck)
                    return False

                if restored(claimed):
                    resume = claimed
                else:
                    # The watermark is reset, and one state-only load of the highest servable
                    # boundary below the frontier.
                    watermark = 0
                    fallback = max((b for b in servable if b <= min(claimed, frontier)
                                    and self.checkpoint_id(q, b) in index), default=0)
                    if fallback and restored(fallback):
                        resume = fallback
        used_hbm = min(resume, hbm)
        res.reused_hbm += used_hbm
        res.reused_tier += resume - used_hbm
        tier.tick(t)
        captured = 0
        if self.stateful:
            gen_end = (total - 1) - (total - 1) % CHUNK if self.policy.at_generation_end else 0
            planned_set = set(planned)
            stops = sorted({b for b in planned if b > resume} | ({gen_end} if gen_end > resume else set()))
            for b in stops:
                if b in planned_set:
                    # Refused or not, a prefill checkpoint is offered once: finish() does not
                    # offer the same boundary again (a second offer is no second sighting).
                    self._save_state(self.checkpoint_id(q, b), tier, index, res)
                elif b == gen_end:
                    captured = b
        # A ledger's KV is a prefix chain: finish() saves only up to the first chunk it does
        # not keep, and a checkpoint whose covering chunk is above that is not offered. The
        # ledger still sees every chunk (a dense chunk's sighting counts); one it admits
        # above the gap, new, is not sent, so it is forgotten again.
        ledger = getattr(tier, "ledger", False)
        chunks = total // CHUNK
        kept_end = chunks
        for c in range(watermark // CHUNK, chunks):
            known = tier.contains(keys[c])
            kept = tier.put(keys[c], KV_BYTES)
            if not ledger:
                continue
            if not kept and kept_end == chunks:
                kept_end = c
            elif kept and c > kept_end and not known:
                tier.forget(keys[c])
        if captured:
            if -(-captured // CHUNK) - 1 < kept_end:
                self._save_state(self.checkpoint_id(q, captured), tier, index, res)
            else:
                res.checkpoints_refused += 1


# ------------------------------------------------------------------------------- the grid


def share_of_bound(r: Result, bound: int) -> float:
    return (r.reused_hbm + r.reused_tier) / max(1, bound)


def run_grid(trace, shares, scales, models, policies, checkpoints, sized_by=None, log=print):
    """Every (scale, model, share, policy) point; dense does not depend on the state scale.
    `sized_by`: the checkpoint policy whose unlimited working set the shares are of (the
    replay's is the run's own; another one compares placements at equal bytes)."""
    out = {}
    dense_cache = {}
    for scale in scales:
        per_scale = out.setdefault(str(scale), {})
        for model in models:
            if model == "dense" and "dense" in dense_cache:
                per_scale["dense"] = dense_cache["dense"]
                continue
            sim = Replay(trace, model, scale, checkpoints)
            ws = sim.run("lru", INF)
            if sized_by is not None and sized_by != checkpoints and model != "dense":
                ws.bytes_held = Replay(trace, model, scale, sized_by).run("lru", INF).bytes_held
            m = {"working_set_bytes": ws.bytes_held, "unlimited_share": share_of_bound(ws, trace.bound),
                 "state_bytes_per_request": ws.state_bytes / len(trace.requests), "points": {}}
            for s in shares:
                cap = max(1, math.ceil(s / 100.0 * ws.bytes_held))
                point = {"capacity_bytes": cap}
                for p in policies:
                    t0 = time.perf_counter()
                    r = sim.run(p, cap)
                    point[p] = {"share": share_of_bound(r, trace.bound), "reused_hbm": r.reused_hbm,
                                "reused_tier": r.reused_tier, "evictions": r.evictions, "refusals": r.refusals, "too_large": r.too_large,
                                "state_misses": r.state_misses, "checkpoints_saved": r.checkpoints_saved,
                                "checkpoints_refused": r.checkpoints_refused,
                                "seconds": round(time.perf_counter() - t0, 3)}
                m["points"][fmt_share(s)] = point
            per_scale[model] = m
            if model == "dense":
                dense_cache["dense"] = m
            log(f"  done: state scale {scale}, {model}", file=sys.stderr)
    return out


def fmt_share(s: float) -> str:
    return f"{s:g}%"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b > 0 else "n/a"


def print_tables(grid, shares, models, policies, bound):
    for scale, per in grid.items():
        print(f"\n### state scale {scale}: reuse / trace bound ({bound:,} tokens)\n")
        ws = ", ".join(f"{m} {per[m]['working_set_bytes'] / 1e6:.1f} MB" for m in models)
        print(f"working sets per rank: {ws}\n")
        cols = [f"{m} {p}" for m in models for p in policies]
        print("| S | " + " | ".join(cols) + " |")
        print("| --- " * (len(cols) + 1) + "|")
        for s in shares:
            k = fmt_share(s)
            vals = [f"{per[m]['points'][k][p]['share']:.4f}" for m in models for p in policies]
            print(f"| {k} | " + " | ".join(vals) + " |")
        if "cost" in policies:
            print("\n| S | " + " | ".join(f"{m} cost/{p}" for m in models for p in policies if p != "cost") + " |")
            print("| --- " * (1 + len(models) * (len(policies) - 1)) + "|")
            for s in shares:
                k = fmt_share(s)
                vals = [ratio(per[m]["points"][k]["cost"]["share"], per[m]["points"][k][p]["share"])
                        for m in models for p in policies if p != "cost"]
                print(f"| {k} | " + " | ".join(vals) + " |")
        print("\nevictions / refused admissions (+ stores too large: all that was left was what they stand on) / "
              "state misses (a load found a checkpoint the index still served gone):\n")
        print("| S | " + " | ".join(cols) + " |")
        print("| --- " * (len(cols) + 1) + "|")
        for s in shares:
            k = fmt_share(s)
            vals = []
            for m in models:
                for p in policies:
                    x = per[m]["points"][k][p]
                    big = f" + {x['too_large']}" if x["too_large"] else ""
                    vals.append(f"{x['evictions']} / {x['refusals']}{big} / {x['state_misses']}")
            print(f"| {k} | " + " | ".join(vals) + " |")


def check_against_replay(grid, paths, tolerance=0.02) -> bool:
    """Compares `lru` with kvfuse-replay --json reports run with --tier-capacity S%."""
    ok = True
    print("\n### lru against kvfuse-replay\n")
    print("| report | model | S | replay | lru | diff | working set replay / here |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path in paths:
        with open(path) as f:
            rep = json.load(f)
        scale = str(rep.get("options", {}).get("state_scale", 1))
        for model, m in rep.get("models", {}).items():
            cap = m.get("tier_capacity")
            here = grid.get(scale, {}).get(model)
            if cap is None or here is None:
                continue
            k = fmt_share(cap["percent"])
            if k not in here["points"]:
                continue
            mine = here["points"][k]["lru"]["share"]
            theirs = m["reused_share_of_bound"]
            diff = mine - theirs
            ok = ok and abs(diff) <= tolerance
            print(f"| {path} | {model} | {k} | {theirs:.4f} | {mine:.4f} | {diff:+.4f} | "
                  f"{cap['working_set_bytes']:,} / {here['working_set_bytes']:,} |")
    print(f"\nwithin {tolerance}: {'yes' if ok else 'NO'}")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--shares", default="1,3,10,30,100", help="tier capacities, %% of each model's working set")
    ap.add_argument("--state-scales", default="1,64")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="lru (the tier's own LRU), cost and ledger-lru (--cache-policy cost / lru), belady, belady-bypass, reused-oracle")
    ap.add_argument("--checkpoints", default="default", help="default, last, all, every:N (the replay's --checkpoints)")
    ap.add_argument("--size-by", help="size the shares by this placement's working set (default: the --checkpoints one)")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--check-docs", action="store_true", help="compare lru with the --replay-json reports")
    ap.add_argument("--replay-json", nargs="*", default=[], help="kvfuse-replay --json reports run with --tier-capacity S%%")
    a = ap.parse_args(argv)
    shares = [float(x) for x in a.shares.split(",")]
    scales = [int(x) for x in a.state_scales.split(",")]
    models = a.models.split(",")
    policies = a.policies.split(",")
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m}")
    t0 = time.perf_counter()
    trace = load_trace(a.trace, a.limit)
    blocks = hbm_hits(trace)
    grid = run_grid(trace, shares, scales, models, policies, CheckpointPolicy.named(a.checkpoints),
                    CheckpointPolicy.named(a.size_by) if a.size_by else None)
    seconds = time.perf_counter() - t0
    print(f"{len(trace.requests)} requests of {a.trace}, HBM pool {blocks} blocks, checkpoints {a.checkpoints}; "
          f"{'' if not a.size_by else f'capacity of the {a.size_by} working set; '}{seconds:.1f} s")
    print_tables(grid, shares, models, policies, trace.bound)
    ok = True
    if a.check_docs or a.replay_json:
        if not a.replay_json:
            print("\n--check-docs: give the replay's reports with --replay-json FILE...", file=sys.stderr)
            ok = False
        else:
            ok = check_against_replay(grid, a.replay_json)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "requests": len(trace.requests), "reuse_bound_tokens": trace.bound,
                       "hbm_blocks": blocks, "checkpoints": a.checkpoints, "seconds": round(seconds, 2),
                       "state_scales": grid}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
