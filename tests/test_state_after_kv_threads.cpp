// StateAfterKv and KimiK3SerialConnector: Kimi-K3's recurrent state leg ordered after the KV
// leg. A joint load restores KV and state byte-exact, and the state leg's tier get starts
// only once the KV leg's gets are done (while KimiK3Connector, the control, runs it during
// them).
#include "connector_harness.hpp"
#include "tier_test_support.hpp"

#include <atomic>
#include <type_traits>

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

using Mem = MemoryTier<>;

/// A MemoryTier that can hold KV gets at a gate and records what the state gets saw.
struct WatchedTier {
  Mem inner{std::size_t{1} << 20};
  Gate kv_gate;
  std::atomic<bool> gate_kv{false};
  std::atomic<int> kv_gets_in_flight{0};
  std::atomic<int> state_gets{0};
  std::atomic<int> state_gets_during_kv{0};

  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept {
    if (key.kind == EntryKind::state) {
      if (kv_gets_in_flight.load() > 0) state_gets_during_kv.fetch_add(1);
      state_gets.fetch_add(1);
      return inner.get(key, staging);
    }
    kv_gets_in_flight.fetch_add(1);
    if (gate_kv.load()) (void)kv_gate.pass();
    TierView view = inner.get(key, staging);
    kv_gets_in_flight.fetch_sub(1);
    return view;
  }
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept { return inner.put(key, bytes); }
  bool contains(const TierKey& key) const noexcept { return inner.contains(key); }
  bool erase(const TierKey& key) noexcept { return inner.erase(key); }
};

using Serial = KimiK3SerialConnector<WatchedTier, WatchedTier, SingleRank>;
using Fused = KimiK3Connector<WatchedTier, WatchedTier, SingleRank>;

static_assert(std::is_same_v<Serial::state_leg_type, StateAfterKv<RecurrentState<WatchedTier>>>);
static_assert(Serial::ordering == StateOrdering::after_kv && !Serial::has_state_lane && Serial::lane_count == 2);
static_assert(Fused::ordering == StateOrdering::concurrent && Fused::lane_count == 3);
static_assert(std::is_same_v<StateAfterKv<RecurrentState<Mem>>::tier_type, Mem>);
// Built from the leg, or in place from what the leg is built from; like the leg, never
// from a pointer (R14: a forgotten & does not compile into "no tier").
static_assert(std::is_constructible_v<StateAfterKv<RecurrentState<Mem>>, RecurrentState<Mem>>);
static_assert(std::is_constructible_v<StateAfterKv<RecurrentState<Mem>>, Mem&>);
static_assert(std::is_constructible_v<StateAfterKv<RecurrentState<Mem>>, NoStateTier>);
static_assert(!std::is_constructible_v<StateAfterKv<RecurrentState<Mem>>, Mem*>);
static_assert(!std::is_convertible_v<Mem&, StateAfterKv<RecurrentState<Mem>>>);  // explicit

/// One rank: pools, the watched tier, and a connector of type Conn over it.
template <class Conn>
struct OneRank {
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools{rt, small_geometry(0, 1)};
  WatchedTier tier;
  RecordLog log;
  Conn conn{pools.geo, rt, pools.memory(), PagedKv<WatchedTier>(tier),
            typename Conn::state_leg_type(RecurrentState<WatchedTier>(tier)), group};

  static constexpr TokenCount prompt = 2 * 64;  // two chunks
  static constexpr TokenCount boundary = prompt - 16;
  const std::vector<PrefixHash> keys = chunk_keys(3, 2);
  const PrefixHash state_hash{0x3e71a1};

  /// Saves two chunks and a checkpoint through the connector, then wipes the device.
  void save_all() {
    const auto blocks = block_range(0, prompt / pools.geo.block_tokens);
    pools.write_prompt(blocks, prompt);
    pools.write_state(SlotId{0}, state_hash);
    conn.save_kv(KvSave{SaveKey{keys.back(), Generation{1}}, keys, blocks});
    conn.save_state(StateSave{SaveKey{state_hash, Generation{2}}, SlotId{0}, boundary});
    REQUIRE(drain_until(group, log, [&] { return log.stores.size() == 4; }));
    for (const SaveRecord& rec : log.stores) REQUIRE(rec.ok);
    std::memset(pools.blocks, 0, pools.geo.num_blocks * pools.geo.block_bytes());
    std::memset(pools.slots, 0, pools.geo.num_slots * pools.geo.slot_bytes);
  }
  LoadRequest joint() const {
    LoadRequest r;
    r.key = LoadKey{RequestId{7}, Generation{3}};
    r.kv = KvSpec{0, prompt, keys, block_range(20, prompt / pools.geo.block_tokens)};
    r.state = StateSpec{boundary, state_hash, SlotId{3}, pools.geo.block_tokens, pools.geo.chunk_tokens};
    return r;
  }
  void check_restored(const LoadRequest& r) {
    REQUIRE(drain_until(group, log, [&] { return log.loads.size() == 1; }));
    CHECK(log.loads[0].key == r.key);
    CHECK(log.loads[0].kv == KvOutcome::ok);
    CHECK(log.loads[0].state == StateOutcome::restored);
    CHECK(pools.holds_prompt(r.kv->blocks, 0, prompt));
    CHECK(pools.holds_state(SlotId{3}, state_hash));
  }
};

/// Quiet for a short while: time for a broken implementation to start the state leg.
void settle_a_moment() { std::this_thread::sleep_for(std::chrono::milliseconds(30)); }

}  // namespace

TEST_CASE("serial K3: a joint load restores KV and state byte-exact with the state leg after the KV leg") {
  OneRank<Serial> rank;
  CHECK(rank.conn.stats().lanes == 2);  // no state lane
  CHECK(Serial::state_leg_type::entry_bytes(rank.pools.geo) == RecurrentState<WatchedTier>::entry_bytes(rank.pools.geo));
  rank.save_all();
  rank.tier.gate_kv = true;
  const LoadRequest r = rank.joint();
  rank.conn.load(r);
  REQUIRE(eventually([&] { return rank.tier.kv_gate.entered.load(); }));
  settle_a_moment();
  CHECK(rank.tier.state_gets.load() == 0);  // the KV leg is held: the state leg has not begun
  rank.group.drain(rank.log);
  CHECK(rank.log.loads.empty());
  rank.tier.kv_gate.open();
  rank.check_restored(r);
  CHECK(rank.tier.state_gets.load() == 1);
  CHECK(rank.tier.state_gets_during_kv.load() == 0);
}

TEST_CASE("serial K3: the control - KimiK3Connector runs the state leg while the KV leg is held") {
  OneRank<Fused> rank;
  CHECK(rank.conn.stats().lanes == 3);
  rank.save_all();
  rank.tier.gate_kv = true;
  const LoadRequest r = rank.joint();
  rank.conn.load(r);
  REQUIRE(eventually([&] { return rank.tier.kv_gate.entered.load(); }));
  // The state leg finishes its get while the KV leg is still held at the gate. (Whether it
  // began before or after the KV get is up to the scheduler, so state_gets_during_kv is not
  // checked here: its get may well have run before the KV leg entered the tier.)
  CHECK(eventually([&] { return rank.tier.state_gets.load() == 1; }));
  CHECK(rank.tier.kv_gate.entered.load());
  rank.tier.kv_gate.open();
  rank.check_restored(r);
}

TEST_CASE("serial K3: a state-only load and a missing checkpoint behave as on KimiK3Connector") {
  OneRank<Serial> rank;
  rank.save_all();
  LoadRequest state_only = rank.joint();
  state_only.kv.reset();
  rank.conn.load(state_only);
  REQUIRE(drain_until(rank.group, rank.log, [&] { return rank.log.loads.size() == 1; }));
  CHECK(rank.log.loads[0].kv == KvOutcome::none);
  CHECK(rank.log.loads[0].state == StateOutcome::restored);
  CHECK(rank.pools.holds_state(SlotId{3}, rank.state_hash));

  LoadRequest missing = rank.joint();
  missing.key = LoadKey{RequestId{8}, Generation{4}};
  missing.state->boundary_hash = PrefixHash{0xdead};
  rank.conn.load(missing);
  REQUIRE(drain_until(rank.group, rank.log, [&] { return rank.log.loads.size() == 2; }));
  CHECK(rank.log.loads[1].kv == KvOutcome::ok);
  CHECK(rank.log.loads[1].state == StateOutcome::missed);
}
