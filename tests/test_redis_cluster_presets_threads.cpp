// The presets over RedisClusterTier, 4 ranks as threads, against a Redis Cluster of the
// test's own (3 primaries, 3 replicas): store, load back, every byte checked, one round trip
// per touched primary; a primary killed while loads and saves run (its replica promoted:
// in the window loads fail and saves are not stored, never a wrong byte, then the new map
// serves); a frozen primary (the loads fail without retracting what the tier may hold).
// In every one the engine's zeros hold: no invariant violation, nothing outstanding or
// pending, the index consistent. Built and run under ThreadSanitizer as well.
#include "redis_cluster.hpp"
#include "redis_engine_harness.hpp"

#include <kvfuse/engine/index_consistency.hpp>
#include <kvfuse/tier/redis_cluster_tier.hpp>

#include <atomic>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

/// Makes RedisClusterTiers on `cluster`.
auto tiers_on(const RedisCluster& cluster) {
  return [&cluster] {
    RedisClusterTierOptions o = cluster.options();
    o.command_timeout = std::chrono::milliseconds(300);
    return std::make_unique<RedisClusterTier>(o);
  };
}

/// The engine's zeros once every rank drained: nothing outstanding or pending, no
/// invariant violated, the index consistent.
template <class Conn>
void check_zeros(Engine& engine, Ranks<Conn>& ranks) {
  for (auto& rank : ranks.ranks) rank->conn.drain();
  const IndexStats stats = engine.index.stats();
  CHECK(stats.outstanding == 0);
  CHECK(stats.invariant_violations == 0);
  CHECK(engine.pump.stats().group.pending == 0);
  CHECK(check_consistency(engine.index).ok);
}

template <class Conn>
void run_preset(bool one_tier) {
  RedisCluster cluster;
  HostRuntime rt;
  Engine engine;
  Ranks<Conn> ranks(rt, engine, tiers_on(cluster), one_tier);
  const Prompt p(7, 16);
  save_prompt(engine, ranks, p);
  if constexpr (Conn::has_state) CHECK(engine.index.could_serve(p.state_hash));
  std::vector<RedisClusterTierStats> before;
  for (auto& tier : ranks.tiers) before.push_back(tier->stats());
  wipe(ranks);
  const LoadRequest request = load_prompt(engine, ranks, p, RequestId{1}, 0);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().key == request.key);
  CHECK(engine.loads.back().kind == Resolution::completed);
  check_every_byte(ranks, p, 0);
  if (!one_tier) {
    // Each rank's 16-chunk KV load was one round trip per primary holding its chunks (and
    // the state get one more): never one per chunk.
    for (std::uint32_t r = 0; r < kWorld; ++r) {
      std::set<std::string> owners;
      for (const PrefixHash h : p.keys)
        owners.insert(ranks.tiers[r]->owner_of(ranks.tiers[r]->slot_of(TierKey{p.geo.model, h, kWorld, r, EntryKind::kv_chunk})));
      const std::uint64_t trips = ranks.tiers[r]->stats().totals.round_trips - before[r].totals.round_trips;
      CHECK(trips == owners.size() + (Conn::has_state ? 1 : 0));
    }
  }
  check_zeros(engine, ranks);
  for (auto& tier : ranks.tiers) {
    CHECK(tier->stats().totals.rejected == 0);
    CHECK(tier->stats().totals.get_failures == 0);
  }
}

}  // namespace

TEST_CASE("redis cluster presets: DenseConnector stores and loads every byte across 4 ranks") {
  run_preset<DenseConnector<RedisClusterTier>>(false);
}

TEST_CASE("redis cluster presets: KimiK3Connector stores and loads every byte across 4 ranks") {
  run_preset<KimiK3Connector<RedisClusterTier>>(false);
}

TEST_CASE("redis cluster presets: Dsv4Connector with one RedisClusterTier shared by the 4 ranks") {
  run_preset<Dsv4Connector<RedisClusterTier>>(true);
}

TEST_CASE("R1 loads and saves in flight when a cluster primary is killed settle once per rank and the promoted replica then serves") {
  using Conn = KimiK3Connector<RedisClusterTier>;
  RedisCluster cluster;
  HostRuntime rt;
  Engine engine;
  Ranks<Conn> ranks(rt, engine, tiers_on(cluster), false);
  const Prompt p(11, 16);
  save_prompt(engine, ranks, p);
  // The primary of the first chunk's slot on rank 0 dies while loads and saves go on.
  const std::size_t victim =
      cluster.owner_of(ranks.tiers[0]->slot_of(TierKey{p.geo.model, p.keys[0], kWorld, 0, EntryKind::kv_chunk}));
  std::atomic<bool> killed{false};
  std::size_t dispatched = 0, completed = 0, after_kill = 0, saves_refused = 0;
  std::uint64_t seed = 100;
  for (; after_kill < 6 || dispatched < 20; ++seed) {
    if (dispatched == 10) {
      cluster.kill(victim);
      killed = true;
    }
    const bool dead = killed.load();
    wipe(ranks);
    (void)load_prompt(engine, ranks, p, RequestId{seed}, 0);
    ++dispatched;
    REQUIRE(engine.settle(1, 0));  // each load settles exactly once, whatever the cluster did
    if (engine.loads.back().kind == Resolution::completed) {
      ++completed;
      check_every_byte(ranks, p, 0);  // a completed load holds every byte: never a wrong one
    }
    // A save in the window: stored, or refused by some rank (then never indexed).
    const Prompt fresh(seed, 2);
    const KvSave kv = engine.index.request_save(KvSave{SaveKey{fresh.keys.back(), {}}, fresh.keys, fresh.saved_blocks}).take_ticket().dispatch();
    for (auto& rank : ranks.ranks) {
      rank->pools.write_prompt(fresh.saved_blocks, fresh.tokens);
      rank->conn.save_kv(kv);
    }
    REQUIRE(engine.settle(0, 2));
    if (!engine.stores.back().ok) ++saves_refused;
    if (dead) ++after_kill;
  }
  CHECK(completed >= 10);  // the ten before the kill
  CHECK(completed < dispatched);  // the dead primary's chunks failed the loads after it
  CHECK(saves_refused > 0);
  // Replica promoted: the cluster converges, and the tier finds the new map by itself.
  cluster.wait_converged("the replica's promotion");
  const Prompt after(9999, 16);
  save_prompt(engine, ranks, after);  // every put stored (save_prompt checks)
  wipe(ranks);
  (void)load_prompt(engine, ranks, after, RequestId{99999}, 0);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::completed);
  check_every_byte(ranks, after, 0);
  check_zeros(engine, ranks);
  const IndexStats stats = engine.index.stats();
  CHECK(stats.completed + stats.failed == dispatched + 1);
  std::uint64_t failures = 0, wrong = 0;
  for (auto& tier : ranks.tiers) {
    const RedisClusterTierStats s = tier->stats();
    failures += s.totals.get_failures + s.totals.put_failures;
    wrong += s.totals.rejected;
    CHECK(s.cluster.map_refreshes >= 2);  // the first map, and one after the promotion
  }
  CHECK(failures > 0);
  CHECK(wrong == 0);
}

TEST_CASE("R1 a frozen cluster primary fails the loads it serves without retracting the state, and serves once thawed") {
  using Conn = KimiK3Connector<RedisClusterTier>;
  RedisClusterSpec spec;
  spec.node_timeout_ms = 60000;  // no failover while it is frozen
  RedisCluster cluster(spec);
  HostRuntime rt;
  Engine engine;
  Ranks<Conn> ranks(rt, engine, tiers_on(cluster), true);
  const Prompt p(13, 16);
  save_prompt(engine, ranks, p);
  const std::size_t frozen =
      cluster.owner_of(ranks.tiers[0]->slot_of(TierKey{p.geo.model, p.state_hash, kWorld, 0, EntryKind::state}));
  cluster.pause(frozen);
  (void)load_prompt(engine, ranks, p, RequestId{1}, 0);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::failed);
  CHECK_FALSE(engine.loads.back().state_missed);  // timed out: the tier may still have it
  CHECK(engine.index.could_serve(p.state_hash));
  CHECK(ranks.tiers[0]->stats().totals.timeouts > 0);
  cluster.resume(frozen);
  wipe(ranks);
  (void)load_prompt(engine, ranks, p, RequestId{2}, 0);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::completed);
  check_every_byte(ranks, p, 0);
  check_zeros(engine, ranks);
}
