// The engine side of the Redis tiers' multi-threaded tests (tests/test_redis_presets_threads.cpp,
// tests/test_redis_cluster_presets_threads.cpp): an index, quorum and pump; ranks whose
// connectors run over one tier per rank or one shared; a prompt saved, loaded back and
// checked byte for byte on every rank.
#pragma once

#include "connector_harness.hpp"

#include <cstring>
#include <memory>
#include <optional>
#include <vector>

namespace kvfuse::testing {

constexpr std::uint32_t kWorld = 4;

/// Index + quorum + pump, and the settlements a scheduler would act on.
struct Engine : PumpedEngine {
  Engine() : PumpedEngine(kWorld, 4) {}
};

/// One rank: pools and its connector over `tier` (the rank's own tier, or one shared by
/// every rank of the engine: keys carry the rank).
template <class Conn>
struct Rank {
  using TierType = typename Conn::kv_leg_type::tier_type;
  DevicePools<HostRuntime> pools;
  Conn conn;
  Rank(HostRuntime& rt, std::uint32_t rank, TpQuorum& group, TierType& tier)
      : pools(rt, small_geometry(rank, kWorld)), conn(make(rt, group, tier)) {}
  Conn make(HostRuntime& rt, TpQuorum& group, TierType& tier) {
    if constexpr (Conn::has_state)
      return Conn(pools.geo, rt, pools.memory(), PagedKv<TierType>(tier), typename Conn::state_leg_type(tier), group);
    else
      return Conn(pools.geo, rt, pools.memory(), PagedKv<TierType>(tier), NoState{}, group);
  }
};

/// An engine's ranks and their tiers: one tier per rank, or one for all, each made by
/// `make_tier` (a RedisTier on the test's server, a RedisClusterTier on its cluster).
template <class Conn>
struct Ranks {
  using TierType = typename Rank<Conn>::TierType;
  std::vector<std::unique_ptr<TierType>> tiers;
  std::vector<std::unique_ptr<Rank<Conn>>> ranks;
  template <class MakeTier>
  Ranks(HostRuntime& rt, Engine& engine, MakeTier&& make_tier, bool one_tier) {
    for (std::uint32_t r = 0; r < kWorld; ++r) {
      if (!one_tier || tiers.empty()) tiers.push_back(make_tier());
      ranks.push_back(std::make_unique<Rank<Conn>>(rt, r, engine.group, *tiers.back()));
    }
  }
  ~Ranks() { ranks.clear(); }  // connectors (and their lanes) before the tiers
};

struct Prompt {
  RankGeometry geo = small_geometry(0, kWorld);
  TokenCount tokens;
  TokenCount boundary;
  std::vector<PrefixHash> keys;
  std::vector<BlockId> saved_blocks;
  PrefixHash state_hash;
  Prompt(std::uint64_t seed, std::size_t chunks)
      : tokens(chunks * geo.chunk_tokens),
        boundary(tokens - geo.block_tokens),
        keys(chunk_keys(seed, chunks)),
        saved_blocks(block_range(0, tokens / geo.block_tokens)),
        state_hash{0x5000 + seed} {}
};

/// The forward wrote the prompt on every rank; the engine saves its KV (and its state).
template <class Conn>
void save_prompt(Engine& engine, Ranks<Conn>& ranks, const Prompt& p) {
  const KvSave kv = engine.index.request_save(KvSave{SaveKey{p.keys.back(), {}}, p.keys, p.saved_blocks}).take_ticket().dispatch();
  std::optional<StateSave> state;
  if constexpr (Conn::has_state)
    state = engine.index.request_save(StateSave{SaveKey{p.state_hash, {}}, SlotId{0}, p.boundary}).take_ticket().dispatch();
  for (auto& rank : ranks.ranks) {
    rank->pools.write_prompt(p.saved_blocks, p.tokens);
    if constexpr (Conn::has_state) rank->pools.write_state(SlotId{0}, p.state_hash);
    rank->conn.save_kv(kv);
    if constexpr (Conn::has_state) rank->conn.save_state(*state);
  }
  const std::size_t saves = Conn::has_state ? 2 : 1;
  REQUIRE(engine.settle(0, 2 * saves));
  for (std::size_t i = engine.stores.size() - 2 * saves; i < engine.stores.size(); ++i) CHECK(engine.stores[i].ok);
}

/// Dispatches a load of the whole prompt (joint for stateful presets) to every rank.
template <class Conn>
LoadRequest load_prompt(Engine& engine, Ranks<Conn>& ranks, const Prompt& p, RequestId id, std::uint32_t first_block) {
  std::optional<StateSpec> state;
  if constexpr (Conn::has_state)
    state = StateSpec{p.boundary, p.state_hash, SlotId{2}, p.geo.block_tokens, p.geo.chunk_tokens};
  LoadGrant grant =
      engine.index.request_load(id, KvSpec{0, p.tokens, p.keys, block_range(first_block, p.tokens / p.geo.block_tokens)}, state);
  REQUIRE(grant.granted());
  const LoadRequest request = grant.ticket().dispatch();
  for (auto& rank : ranks.ranks) rank->conn.load(request);
  return request;
}

template <class Conn>
void wipe(Ranks<Conn>& ranks) {
  for (auto& rank : ranks.ranks) {
    std::memset(rank->pools.blocks, 0, rank->pools.geo.num_blocks * rank->pools.geo.block_bytes());
    std::memset(rank->pools.slots, 0, rank->pools.geo.num_slots * rank->pools.geo.slot_bytes);
  }
}

template <class Conn>
void check_every_byte(Ranks<Conn>& ranks, const Prompt& p, std::uint32_t first_block) {
  for (auto& rank : ranks.ranks) {
    CAPTURE(rank->pools.geo.rank);
    CHECK(rank->pools.holds_prompt(block_range(first_block, p.tokens / p.geo.block_tokens), 0, p.tokens));
    if constexpr (Conn::has_state) CHECK(rank->pools.holds_state(SlotId{2}, p.state_hash));
  }
}

}  // namespace kvfuse::testing
