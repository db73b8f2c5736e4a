#!/usr/bin/env python3
"""Hand-checked cases for bench/cache_reference.py: python3 bench/test_cache_reference.py

Replay-level cases write a few requests as a Mooncake JSONL and leave the HBM hit at 0
(hbm_hits is not called), so that the tier alone decides; tier-level cases drive the tiers
through a stand-in for the replay (parent_of, stateful, the chain nodes)."""
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cache_reference as cr  # noqa: E402

KV = cr.KV_BYTES


def trace_of(rows):
    """rows: (input_length, output_length, hash_ids)."""
    fd, path = tempfile.mkstemp(suffix=".jsonl")
    with os.fdopen(fd, "w") as f:
        for p, o, ids in rows:
            f.write(json.dumps({"timestamp": 0, "input_length": p, "output_length": o, "hash_ids": ids}) + "\n")
    try:
        return cr.load_trace(path, 0)
    finally:
        os.unlink(path)


class StandIn:
    """What the dependent tiers ask the replay: who an entry needs, whether KV saves anything.
    KV chunks are ints; a checkpoint is (chain node, boundary), needing node_key[node]."""

    def __init__(self, kv_parent, node_parent, node_key, stateful=True):
        self.kv_parent, self.stateful = kv_parent, stateful
        self.trace = cr.Trace([], 0, kv_parent, node_parent, node_key)

    def parent_of(self, e):
        return self.trace.node_key[e[0]] if isinstance(e, tuple) else self.kv_parent[e]


class ReplayCases(unittest.TestCase):
    def test_reuse_bound_and_keys(self):
        t = trace_of([(1025, 0, [7, 8, 9]), (1100, 0, [7, 8, 5])])
        # Request 1: two leading ids seen (7, 8) = 1024 tokens, under P - 1 = 1099.
        self.assertEqual([q.bound for q in t.requests], [0, 1024])
        self.assertEqual(t.requests[0].keys[:2], t.requests[1].keys[:2])
        self.assertNotEqual(t.requests[0].keys[2], t.requests[1].keys[2])  # a partial chunk is the request's own

    def test_lru_and_belady_differ(self):
        # One whole chunk per request (P = 513), a tier of two chunks. A B C A B:
        # LRU has dropped A by the time it returns, and B after; Belady drops B for C
        # (B comes back after A), so A hits, then C (never used again) goes for B.
        t = trace_of([(513, 0, [k, 100 + i]) for i, k in enumerate([1, 2, 3, 1, 2])])
        sim = cr.Replay(t, "dense", 1, cr.CheckpointPolicy())
        self.assertEqual(t.bound, 1024)
        lru, belady = sim.run("lru", 2 * KV), sim.run("belady", 2 * KV)
        self.assertEqual(lru.reused_tier, 0)
        self.assertEqual(belady.reused_tier, 512)
        self.assertEqual(cr.share_of_bound(belady, t.bound), 0.5)
        self.assertEqual(sim.run("lru", cr.INF).reused_tier, 1024)

    def test_hybrid_resumes_from_a_checkpoint(self):
        # Request 0 checkpoints its prompt end (1024), mid-prefill, then saves chunks 0, 1.
        # Request 1 shares both chunks: a joint load of them and the state at 1024.
        t = trace_of([(1025, 0, [1, 2, 3]), (1025, 0, [1, 2, 4])])
        sim = cr.Replay(t, "k3", 1, cr.CheckpointPolicy())
        r = sim.run("lru", 3 * KV)
        self.assertEqual((r.reused_tier, r.checkpoints_saved, r.state_misses), (1024, 1, 0))
        # Two entries' worth: the checkpoint went in first and is the one LRU drops, but the
        # index still serves it: request 1 plans the joint load and misses.
        r = sim.run("lru", 2 * KV)
        self.assertEqual((r.reused_tier, r.state_misses), (0, 1))

    def test_hbm_pool_prefix_hit(self):
        t = trace_of([(1025, 0, [1, 2, 3]), (1100, 0, [1, 2, 4])])
        cr.hbm_hits(t)
        # Request 1 pins request 0's 16 blocks of chunks 0 and 1 (its third chunk is its own).
        self.assertEqual([q.hbm for q in t.requests], [0, 1024])
        dense = cr.Replay(t, "dense", 1, cr.CheckpointPolicy()).run("lru", cr.INF)
        self.assertEqual((dense.reused_hbm, dense.reused_tier), (1024, 0))

    def test_plan_checkpoints(self):
        d = cr.CheckpointPolicy()
        self.assertEqual(cr.plan_checkpoints(1025, 0, 0, d), [1024])
        # Branch at 704 (block grid), prompt end 9728, every 8 chunks: 8192 and 4096, capped at 4.
        self.assertEqual(cr.plan_checkpoints(10000, 0, 704, d), [704, 4096, 8192, 9728])
        self.assertEqual(cr.plan_checkpoints(10000, 4096, 704, d), [8192, 9728])
        self.assertEqual(cr.plan_checkpoints(10000, 0, 0, cr.CheckpointPolicy.named("last")), [])


class CostCases(unittest.TestCase):
    def chain(self):
        # k0 <- k1: one prefix of two chunks; node 1 = [k0], node 2 = [k0, k1].
        return StandIn({0: None, 1: 0, 10: None, 11: None, 12: None}, [0, 0, 1], [None, 0, 1])

    def test_a_checkpoint_keeps_its_kv(self):
        for policy, kv_kept in (("cost", True), ("lru", False)):
            sim = self.chain()
            tier = cr.make_tier(policy, 3 * KV, sim)
            ck = (1, 512)  # needs k0
            for e in (ck, 0, 1):
                self.assertTrue(tier.put(e, KV))
            tier.get(ck)  # read once: cost weighs it (1 + 1) x 512 / its footprint of two chunks
            for e in (10, 11, 12):  # unrelated chunks: something must go each time
                self.assertTrue(tier.put(e, KV))
            # cost: k0 (the oldest) stays while the checkpoint needs it: the leaves go first,
            # chunk 1 and then each newcomer (a hybrid's chunk weighs 128 tokens, the
            # checkpoint twice 512 over two chunks); LRU drops k0 and the checkpoint first.
            self.assertEqual(tier.contains(0), kv_kept, policy)
            self.assertEqual(tier.contains(ck), kv_kept, policy)

    def test_first_seen_checkpoint_refused_under_pressure(self):
        sim = self.chain()
        heavy = 3 * KV  # above two chunks' KV: must be seen twice (light ones come in at once)
        tier = cr.CostTier(heavy + 3 * KV, sim)
        self.assertTrue(tier.put((1, 512), heavy))  # first seen, but it fits: admitted
        for e in (10, 11, 12):
            self.assertTrue(tier.put(e, KV))
        self.assertFalse(tier.put((2, 1024), heavy))  # first seen, needs an eviction: refused
        self.assertEqual((tier.refusals, tier.evictions), (1, 0))
        self.assertTrue(tier.put((2, 1024), heavy))  # seen now: admitted, evicting
        self.assertEqual((tier.refusals, tier.evictions), (1, 1))
        # Per footprint byte the checkpoint (512 over three chunks and its one below) weighs
        # what a hybrid's chunk does (a quarter chunk over one): the older goes.
        self.assertFalse(tier.contains((1, 512)))
        tier.prompt_end = 1536
        self.assertTrue(tier.put((2, 1536), heavy))  # first seen, but its prompt's end: let in
        light = cr.CostTier(2 * KV, sim)
        light.put((1, 512), KV)
        light.put(10, KV)
        self.assertTrue(light.put((2, 1024), 2 * KV))  # first seen, light: let in
        self.assertEqual(light.refusals, 0)
        lru = cr.LruTier(2 * KV)
        for e in ((1, 512), 10, (2, 1024)):
            self.assertTrue(lru.put(e, KV))
        self.assertEqual(lru.refusals, 0)

    def test_gdsf_inflation(self):
        sim = StandIn({e: None for e in "abcde"}, [0], [None], stateful=False)
        tier = cr.CostTier(2 * KV, sim)
        tier.seen.update("abcde")  # all seen before: a dense chunk comes in on second sight
        tier.put("a", KV)
        tier.put("b", KV)  # both 0 + 512 / 4096 = 0.125
        tier.get("a")  # a KV chunk's uses do not weigh: still 0.125, but more recent
        tier.put("c", KV)  # evicts b, the older of equals: L = 0.125, c = 0.25
        self.assertEqual((set(tier.kept), tier.inflation), ({"a", "c"}, 0.125))
        tier.get("a")  # used after the eviction: a = L + 0.125 = 0.25, newer than c
        tier.put("d", KV)  # a and c tie at 0.25: c, used less recently, goes; L = 0.25
        self.assertEqual((set(tier.kept), tier.inflation), ({"a", "d"}, 0.25))
        tier.put("e", KV)  # a (0.25) below d (0.375): without inflation it would be d
        self.assertEqual((set(tier.kept), tier.inflation), ({"d", "e"}, 0.25))

    def test_checkpoint_uses_weigh_and_kv_weighs_by_model(self):
        sim = StandIn({0: None, 1: 0}, [0, 0, 1], [None, 0, 1])
        tier = cr.CostTier(10 * KV, sim)
        self.assertEqual(tier.saved_tokens((2, 1024)), 1024)  # the whole prefix below B
        self.assertEqual(tier.saved_tokens(0), 128)  # a hybrid's chunk: a quarter of its tokens
        self.assertEqual(cr.CostTier(KV, StandIn({0: None}, [0], [None], stateful=False)).saved_tokens(0), 512)
        tier.put((1, 512), KV)
        tier.get((1, 512))
        self.assertEqual(tier.kept[(1, 512)][0], 2 * 512 / (2 * KV))  # (1 + hits) x B / (bytes + KV below), L = 0
        tier.put(0, KV)
        tier.get(0)
        self.assertEqual(tier.kept[0][0], 128 / KV)  # a chunk's use: no weight


    def test_dense_kv_comes_in_on_second_sight(self):
        dense = StandIn({e: None for e in "abcd"}, [0], [None], stateful=False)
        tier = cr.CostTier(2 * KV, dense)
        self.assertTrue(tier.put("a", KV))  # first seen, but it fits: admitted
        self.assertTrue(tier.put("b", KV))
        self.assertFalse(tier.put("c", KV))  # first seen, needs an eviction: refused
        self.assertEqual((tier.refusals, tier.evictions), (1, 0))
        self.assertTrue(tier.put("c", KV))  # seen now: admitted, evicting a
        self.assertEqual((set(tier.kept), tier.refusals, tier.evictions), ({"b", "c"}, 1, 1))
        self.assertFalse(tier.put("d", 3 * KV))  # larger than the budget: too large, not refused
        self.assertEqual((tier.refusals, tier.too_large), (1, 1))
        # A hybrid's chunk and lru: every chunk that fits the budget comes in.
        hybrid = cr.CostTier(2 * KV, StandIn({e: None for e in "abc"}, [0], [None]))
        lru = cr.make_tier("ledger-lru", 2 * KV, dense)
        for t in (hybrid, lru):
            for e in "abc":
                self.assertTrue(t.put(e, KV))
            self.assertEqual(t.refusals, 0)


class BeladyCases(unittest.TestCase):
    def test_leaves_only(self):
        # Belady may not evict what a kept entry needs even if it is never used again.
        sim = StandIn({0: None, 1: 0, 5: None}, [0], [None])
        sim.uses = {1: [3], 5: [2]}
        sim.uses_of = [[], [], [], []]
        tier = cr.BeladyTier(2 * KV, sim)
        tier.put(0, KV)  # never used again, but 1 needs it
        tier.put(1, KV)
        tier.put(5, KV)  # the only leaf is 1 (next use 3): it goes, then 0 is a leaf again
        self.assertEqual(set(tier.kept), {0, 5})


class ReusedOracleCases(unittest.TestCase):
    def test_refuses_what_is_never_read_and_weighs_reads_left(self):
        # Dense chunks, no dependencies. 1 is read twice more, 2 once, 3 never.
        sim = StandIn({1: None, 2: None, 3: None, 4: None}, [0], [None], stateful=False)
        sim.uses = {1: [1, 2], 2: [1], 4: [3]}
        tier = cr.ReusedOracleTier(2 * KV, sim)
        tier.tick(0)
        self.assertTrue(tier.put(1, KV))
        self.assertTrue(tier.put(2, KV))
        self.assertFalse(tier.put(3, KV))  # never read again: refused, nothing evicted
        self.assertEqual((tier.refusals, tier.evictions), (1, 0))
        # 4 (one read left) evicts 2 (one read left, older): 1 (two left) stays.
        self.assertTrue(tier.put(4, KV))
        self.assertEqual(set(tier.kept), {1, 4})


class LedgerCases(unittest.TestCase):
    """The replay's --cache-policy wiring: cost and ledger-lru are CacheLedgers."""

    def test_prompt_end_checkpoint_comes_in_on_first_sight(self):
        # State 4 chunks (heavy). Request 0 fills the budget with chunks 1, 2 and its
        # checkpoint at 1024. Request 1's checkpoint at 1024 is first seen and needs room,
        # but it is its prompt end (and generation end): let in, evicting request 0's. Request
        # 2 shares request 1's two chunks and resumes there.
        t = trace_of([(1025, 0, [1, 2, 3]), (1025, 0, [5, 6, 7]), (1025, 0, [5, 6, 8])])
        r = cr.Replay(t, "k3", 4, cr.CheckpointPolicy()).run("cost", 6 * KV)
        self.assertEqual((r.reused_tier, r.checkpoints_saved, r.checkpoints_refused), (1024, 2, 0))

    def test_ledger_lru_forgets_what_it_evicts(self):
        # As test_hybrid_resumes_from_a_checkpoint at two entries: the tier's LRU drops the
        # checkpoint and the index still serves it (a miss); the ledger tells the index.
        t = trace_of([(1025, 0, [1, 2, 3]), (1025, 0, [1, 2, 4])])
        sim = cr.Replay(t, "k3", 1, cr.CheckpointPolicy())
        tier_lru, ledger_lru = sim.run("lru", 2 * KV), sim.run("ledger-lru", 2 * KV)
        self.assertEqual((tier_lru.reused_tier, tier_lru.state_misses), (0, 1))
        self.assertEqual((ledger_lru.reused_tier, ledger_lru.state_misses), (0, 0))
        self.assertEqual(sim.run("ledger-lru", 3 * KV).reused_tier, 1024)

    def test_ledger_counts_state_without_the_sidecar(self):
        t = trace_of([(1025, 0, [1, 2, 3])])
        sim = cr.Replay(t, "dsv4", 2, cr.CheckpointPolicy())
        self.assertEqual(sim.run("lru", cr.INF).state_bytes, 2 * 4096 + cr.DSV4_SIDECAR)
        self.assertEqual(sim.run("cost", cr.INF).state_bytes, 2 * 4096)
        self.assertEqual(sim.run("ledger-lru", cr.INF).state_bytes, 2 * 4096)

    def test_a_dense_prefix_comes_in_on_its_second_sight(self):
        # A budget of three chunks, filled by request 0. Request 1's three chunks are first
        # seen and need room: all refused, but the ledger has seen all three (finish offers
        # the chunks above a refused one too). Request 2, the same prompt, stores all three
        # (seen), evicting request 0's; request 3 reads them. Had the save stopped offering
        # at the first refusal, each repeat would have let in one chunk more.
        t = trace_of([(1537, 0, [9, 8, 7, 6])] + [(1537, 0, [1, 2, 3, 4])] * 3)
        r = cr.Replay(t, "dense", 1, cr.CheckpointPolicy()).run("cost", 3 * KV)
        self.assertEqual((r.reused_tier, r.refusals, r.evictions, r.too_large), (1536, 3, 3, 0))
        # The ledger's lru lets every chunk that fits in: requests 2 and 3 read request 1's.
        self.assertEqual(cr.Replay(t, "dense", 1, cr.CheckpointPolicy()).run("ledger-lru", 3 * KV).reused_tier, 2 * 1536)

    def test_a_checkpoint_on_a_refused_chunk_is_not_offered(self):
        # k3, state one chunk (light), a budget of two. Prefill checkpoint at 1024 (needs
        # chunk 1), then chunk 0; chunk 1 evicts the checkpoint (chunk 0 is pinned); chunk 2
        # finds only what it stands on: too large, so the KV sent stops at chunk 2 and the
        # generation-end checkpoint at 1536, which needs chunk 2, is not offered.
        t = trace_of([(1025, 512, [1, 2, 3])])
        r = cr.Replay(t, "k3", 1, cr.CheckpointPolicy()).run("cost", 2 * KV)
        self.assertEqual((r.checkpoints_saved, r.checkpoints_refused, r.too_large, r.evictions), (1, 1, 1, 1))
        # No chunk fits a budget smaller than one (all three are too large): no checkpoint is
        # offered at all.
        r = cr.Replay(t, "k3", 1, cr.CheckpointPolicy()).run("cost", KV - 1)
        self.assertEqual((r.checkpoints_saved, r.checkpoints_refused, r.too_large), (0, 2, 3))

    def test_a_deduplicated_checkpoint_is_a_use(self):
        # checkpoint(): the ledger sees the store first (already kept: a use), then the
        # Coordinator deduplicates it against the index.
        t = trace_of([(1025, 0, [1, 2, 3])])
        sim = cr.Replay(t, "k3", 1, cr.CheckpointPolicy())
        ck = sim.checkpoint_id(t.requests[0], 1024)
        tier, index, res = cr.CostTier(10 * KV, sim), set(), cr.Result()
        tier.index = index
        self.assertTrue(sim._save_state(ck, tier, index, res))
        self.assertTrue(sim._save_state(ck, tier, index, res))
        self.assertEqual((res.checkpoints_saved, tier.kept[ck][4]), (1, 1))


if __name__ == "__main__":
    unittest.main()
