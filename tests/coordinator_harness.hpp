// The engine of the coordinator tests: index, quorum, pump, 4 ranks as threads (each
// connector on its own lanes), a transport and a lookup over rank 0's tier, and the
// Coordinator; plus prompts with their checkpoints and the forward that writes them.
#pragma once

#include "connector_harness.hpp"
#include "test_support.hpp"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace kvfuse::testing {

constexpr std::uint32_t kWorld = 4;
using Mem = MemoryTier<>;

/// One rank: pools, its tier, its connector.
template <class Conn>
struct Rank {
  DevicePools<HostRuntime> pools;
  Mem tier{std::size_t{1} << 20};
  Conn conn;
  Rank(HostRuntime& rt, std::uint32_t r, TpQuorum& group)
      : pools(rt, small_geometry(r, kWorld)), conn(make(rt, group)) {}
  Conn make(HostRuntime& rt, TpQuorum& group) {
    if constexpr (Conn::has_state)
      return Conn(pools.geo, rt, pools.memory(), PagedKv<Mem>(tier), typename Conn::state_leg_type(tier), group);
    else
      return Conn(pools.geo, rt, pools.memory(), PagedKv<Mem>(tier), NoState{}, group);
  }
};

/// The engine's transport: a copy of each load and save to every rank it reaches.
template <class Conn>
struct Transport {
  explicit Transport(std::vector<std::unique_ptr<Rank<Conn>>>* r) : ranks(r) {}
  std::vector<std::unique_ptr<Rank<Conn>>>* ranks = nullptr;
  bool drop_next = false;          // the connector found the prefix gone at build time
  bool lose_next = false;          // sent, but no rank ever receives it
  std::uint32_t skip_rank = kWorld;  // a rank that never receives (dead, or late)
  std::optional<LoadRequest> last;  // the last load sent
  bool send(const LoadRequest& r) {
    if (std::exchange(drop_next, false)) return false;
    last = r;
    if (std::exchange(lose_next, false)) return true;
    for (std::uint32_t i = 0; i < ranks->size(); ++i)
      if (i != skip_rank) (*ranks)[i]->conn.load(r);
    return true;
  }
  bool send(const KvSave& s) {
    for (auto& rank : *ranks) rank->conn.save_kv(s);
    return true;
  }
  bool send(const StateSave& s) {
    if constexpr (Conn::has_state)
      for (auto& rank : *ranks) rank->conn.save_state(s);
    return true;
  }
};

/// The engine's lookup: rank 0's tier, as LMCache asks its first worker.
template <class Conn>
struct Lookup {
  std::vector<std::unique_ptr<Rank<Conn>>>* ranks = nullptr;
  bool evict_after_next = false;  // the tier loses what it just reported (between lookup and dispatch)
  std::size_t operator()(std::span<const PrefixHash> keys) {
    const RankGeometry& g = (*ranks)[0]->pools.geo;
    std::size_t n = 0;
    while (n < keys.size() && (*ranks)[0]->tier.contains(TierKey{g.model, keys[n], g.world_size, 0, EntryKind::kv_chunk})) ++n;
    if (std::exchange(evict_after_next, false))
      for (auto& rank : *ranks)
        for (std::size_t i = 0; i < n; ++i)
          (void)rank->tier.erase(TierKey{g.model, keys[i], g.world_size, rank->pools.geo.rank, EntryKind::kv_chunk});
    return n;
  }
};

/// The checkpoint policy over the harness's grids (64-token chunks): the branch point, the
/// prompt's end and every 2 chunks, at most 3 per admission.
inline CheckpointPolicy harness_policy() {
  CheckpointPolicy p;
  p.every_chunks = 2;
  p.max_prefill = 3;
  return p;
}

/// The whole engine: index, quorum, pump, ranks, coordinator.
template <class Conn>
struct Engine {
  HostRuntime rt;
  TpQuorum group{TpQuorumOptions{kWorld, 3, 1024}};
  OffloadIndex<> index{OffloadIndexOptions{.hash_capacity = 1024, .slot_count = 4}};  // the Release events free slots
  SettlementPump<TpQuorum, OffloadIndex<>> pump{group, index};
  std::vector<std::unique_ptr<Rank<Conn>>> ranks;
  Transport<Conn> transport{&ranks};
  Lookup<Conn> lookup{&ranks};
  Coordinator<TpQuorum, Transport<Conn>, Lookup<Conn>> coord;
  std::vector<Unpark> unparked;
  std::vector<Freed> freed;

  /// The harness's options: its grids (16-token blocks, 64-token chunks) and policy.
  static CoordinatorOptions options() { return CoordinatorOptions{Conn::layout, PlanGrids{16, 64}, 0, 64, harness_policy()}; }

  explicit Engine(CoordinatorOptions o = options()) : coord(o, index, pump, transport, lookup) {
    for (std::uint32_t r = 0; r < kWorld; ++r) ranks.push_back(std::make_unique<Rank<Conn>>(rt, r, group));
  }
  ~Engine() {
    for (auto& rank : ranks) rank->conn.drain();
  }
  std::size_t snapshots_back = 0;  // snapshot slots handed back by steps (the tests reset it)
  /// One step, collecting its events.
  void step() {
    const auto s = coord.step();
    unparked.insert(unparked.end(), s.unparked.begin(), s.unparked.end());
    freed.insert(freed.end(), s.freed.begin(), s.freed.end());
    snapshots_back += s.snapshots.size();
  }
  /// `n` steps, collecting every event (a step's events are only seen here).
  void steps(int n) {
    for (int i = 0; i < n; ++i) step();
  }
  /// Steps until `pred()` (10 s bound), collecting every event.
  template <class Pred>
  bool step_until(Pred pred) {
    return eventually([&] {
      step();
      return pred();
    });
  }
  bool was_freed(RequestId id) const { return frees_of(id) > 0; }
  std::size_t frees_of(RequestId id) const {
    return static_cast<std::size_t>(std::count_if(freed.begin(), freed.end(), [&](const Freed& r) { return r.request == id; }));
  }
  std::size_t unparks_of(RequestId id) const {
    return static_cast<std::size_t>(std::count_if(unparked.begin(), unparked.end(), [&](const Unpark& u) { return u.request == id; }));
  }
};

/// A prompt of `chunks` chunks (64 tokens each) and its checkpoints on the 16-token grid.
struct Prompt {
  TokenCount tokens;
  std::vector<PrefixHash> keys;
  std::vector<Checkpoint> checkpoints;
  Prompt(std::uint64_t id, std::size_t chunks, TokenCount extra = 16) : tokens(chunks * 64 + extra), keys(chunk_keys(id, chunks + 1)) {
    for (TokenCount b = 16; b < tokens; b += 16) checkpoints.push_back(Checkpoint{b, PrefixHash{id * 1000 + b}});
  }
  PrefixHash hash_at(TokenCount b) const { return PrefixHash{checkpoints.front().hash.value - 16 + b}; }
};

/// The forward of `p` on every rank: KV into `blocks`, the state at `boundary` into `slot`.
template <class Conn>
void forward(Engine<Conn>& e, const Prompt& p, const std::vector<BlockId>& blocks, SlotId slot, TokenCount boundary) {
  for (auto& rank : e.ranks) {
    rank->pools.write_prompt(blocks, p.tokens);
    if constexpr (Conn::has_state) rank->pools.write_state(slot, p.hash_at(boundary));
  }
}

using K3 = KimiK3Connector<Mem>;
using Dsv4 = Dsv4Connector<Mem>;
using Dense = DenseConnector<Mem>;

/// Saves `p` through request `id` (compute, forward, finish) and waits until it landed.
template <class Conn>
void save_prompt(Engine<Conn>& e, RequestId id, const Prompt& p, TokenCount boundary) {
  const std::vector<BlockId> blocks = block_range(0, static_cast<std::uint32_t>(p.tokens / 16 + 1));
  (void)e.coord.admit(AdmitRequest{id, p.tokens, 0, p.keys, blocks, p.checkpoints, SlotId{0}});
  forward(e, p, blocks, SlotId{0}, boundary);
  (void)e.coord.finish(FinishRequest{id, p.tokens, p.keys, blocks, Checkpoint{boundary, p.hash_at(boundary)}, SlotId{0}});
  REQUIRE(e.step_until([&] { return e.was_freed(id) && e.index.stats().saves_outstanding == 0; }));
}

}  // namespace kvfuse::testing
