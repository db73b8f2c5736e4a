// The worker side: one rank's Connector under SingleRank, with scripted legs where a rule
// is about structure (R9) and the shipped legs where it is about bytes (R10-R14).
#define KVFUSE_TEST_COUNTS_ALLOCATIONS 1
#include "connector_harness.hpp"
#include <kvfuse/testing/faulty_runtime.hpp>

#include <kvfuse/testing/alloc_counter.hpp>

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <stdexcept>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

/// A KV leg whose behaviour the test scripts. Models KvLegFor like any user-written leg.
struct ScriptedKv {
  std::function<KvVerdict()> on_load;
  std::atomic<int>* calls = nullptr;
  template <Runtime R>
  KvVerdict load(const KvSpec&, LaneContext<R>&) {
    if (calls) calls->fetch_add(1);
    return on_load ? on_load() : KvVerdict{true, Reason::none};
  }
  template <Runtime R>
  SaveVerdict save(const KvSave&, LaneContext<R>&) {
    return {true, Reason::none};
  }
};

/// A concurrent state leg whose behaviour the test scripts.
struct ScriptedState {
  static constexpr StateOrdering ordering = StateOrdering::concurrent;
  static constexpr StateLayout layout = StateLayout::k3_recurrent;
  std::function<StateVerdict()> on_load;
  template <Runtime R>
  StateVerdict load(const StateSpec&, const KvSpec*, LaneContext<R>&) {
    return on_load ? on_load() : StateVerdict{StateOutcome::restored, Reason::none};
  }
  template <Runtime R>
  SaveVerdict save(const StateSave&, LaneContext<R>&) {
    return {true, Reason::none};
  }
  static constexpr std::size_t entry_bytes(const RankGeometry& g) noexcept { return g.slot_bytes; }
};

using ScriptedConnector = Connector<ScriptedKv, ScriptedState, SingleRank>;

/// One rank with scripted legs.
struct ScriptedRank {
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools{rt, small_geometry(0, 1)};
  RecordLog log;
  ScriptedConnector conn;
  ScriptedRank(ScriptedKv kv, ScriptedState state)
      : conn(pools.geo, rt, pools.memory(), std::move(kv), std::move(state), group) {}
  bool wait_records(std::size_t n) {
    return drain_until(group, log, [&] { return log.loads.size() >= n; });
  }
};

LoadRequest joint_request(std::uint64_t id) {
  const RankGeometry g = small_geometry(0, 1);
  LoadRequest r;
  r.key = LoadKey{RequestId{id}, Generation{id}};
  r.kv = KvSpec{0, g.chunk_tokens, chunk_keys(id, 1), block_range(0, 4)};
  r.state = StateSpec{48, PrefixHash{id}, SlotId{0}, g.block_tokens, g.chunk_tokens};
  return r;
}

/// Quiet for a short while: gives a broken implementation time to emit a record it
/// should not have. Not a timing assertion: a correct one never emits in this window.
void settle_a_moment() { std::this_thread::sleep_for(std::chrono::milliseconds(30)); }

}  // namespace

TEST_CASE("R9 in a joint load the two legs run at the same time") {
  // Each leg waits (up to 10 s) until the other has started. Run one after the other,
  // the first leg gives up and reports a failure.
  Gate kv_started, state_started;
  ScriptedRank rank(ScriptedKv{[&] {
                      kv_started.open();
                      return KvVerdict{state_started.pass(), Reason::kv_transfer_failed};
                    }},
                    ScriptedState{[&] {
                      state_started.open();
                      return kv_started.pass() ? StateVerdict{StateOutcome::restored, Reason::none}
                                               : StateVerdict{StateOutcome::failed, Reason::state_transfer_failed};
                    }});
  rank.conn.load(joint_request(1));
  REQUIRE(rank.wait_records(1));
  REQUIRE(rank.log.loads.size() == 1);
  CHECK(rank.log.loads[0].kv == KvOutcome::ok);
  CHECK(rank.log.loads[0].state == StateOutcome::restored);
}

TEST_CASE("R2 salvage: the record says how many chunks the KV leg restored, all of them when it succeeded") {
  LoadRequest three = joint_request(7);
  const RankGeometry g = small_geometry(0, 1);
  three.kv = KvSpec{0, 3 * g.chunk_tokens, chunk_keys(7, 3), block_range(0, 12)};
  ScriptedRank failing(ScriptedKv{[] { return KvVerdict{false, Reason::kv_chunk_missing, 2}; }}, ScriptedState{});
  failing.conn.load(three);
  REQUIRE(failing.wait_records(1));
  CHECK(failing.log.loads[0].kv == KvOutcome::failed);
  CHECK(failing.log.loads[0].kv_restored == 2);
  ScriptedRank whole(ScriptedKv{}, ScriptedState{});
  whole.conn.load(three);
  REQUIRE(whole.wait_records(1));
  CHECK(whole.log.loads[0].kv == KvOutcome::ok);
  CHECK(whole.log.loads[0].kv_restored == 3);
  // A KV leg that throws restored nothing anyone can count on.
  ScriptedRank throwing(ScriptedKv{[]() -> KvVerdict { throw std::runtime_error("leg"); }}, ScriptedState{});
  throwing.conn.load(three);
  REQUIRE(throwing.wait_records(1));
  CHECK(throwing.log.loads[0].kv_restored == 0);
}

TEST_CASE("R9 the record is emitted only after both legs finished") {
  Gate kv_done, release_state;
  ScriptedRank rank(ScriptedKv{[&] {
                      kv_done.open();
                      return KvVerdict{true, Reason::none};
                    }},
                    ScriptedState{[&] {
                      (void)release_state.pass();
                      return StateVerdict{StateOutcome::missed, Reason::none};
                    }});
  rank.conn.load(joint_request(1));
  REQUIRE(kv_done.pass());
  settle_a_moment();
  rank.group.drain(rank.log);
  CHECK(rank.log.loads.empty());  // the KV leg is done, the state leg is not: no record yet
  release_state.open();
  REQUIRE(rank.wait_records(1));
  CHECK(rank.log.loads[0].kv == KvOutcome::ok);
  CHECK(rank.log.loads[0].state == StateOutcome::missed);  // the verdict rides the completion (R2)
}

TEST_CASE("R9 an exception in the KV leg still joins the state leg before reporting") {
  Gate state_started, release_state;
  ScriptedRank rank(ScriptedKv{[&]() -> KvVerdict {
                      (void)state_started.pass();
                      throw std::runtime_error("tier exploded");
                    }},
                    ScriptedState{[&] {
                      state_started.open();
                      (void)release_state.pass();
                      return StateVerdict{StateOutcome::restored, Reason::none};
                    }});
  rank.conn.load(joint_request(1));
  REQUIRE(state_started.pass());
  settle_a_moment();
  rank.group.drain(rank.log);
  CHECK(rank.log.loads.empty());
  release_state.open();
  REQUIRE(rank.wait_records(1));
  REQUIRE(rank.log.loads.size() == 1);
  CHECK(rank.log.loads[0].kv == KvOutcome::failed);
  CHECK(rank.log.loads[0].kv_reason == Reason::exception);
  CHECK(rank.log.loads[0].state == StateOutcome::restored);
}

TEST_CASE("R9 a state-only load completes while the load lane is busy with another request") {
  Gate release_kv;
  ScriptedRank rank(ScriptedKv{[&] { return KvVerdict{release_kv.pass(), Reason::kv_transfer_failed}; }},
                    ScriptedState{});
  LoadRequest kv_only = joint_request(1);
  kv_only.state.reset();
  rank.conn.load(std::move(kv_only));  // holds the load lane until release_kv opens
  LoadRequest state_only = joint_request(2);
  state_only.kv.reset();
  rank.conn.load(std::move(state_only));
  REQUIRE(rank.wait_records(1));
  CHECK_FALSE(release_kv.is_open());
  CHECK(rank.log.loads[0].key.request == RequestId{2});
  CHECK(rank.log.loads[0].state == StateOutcome::restored);
  release_kv.open();
  REQUIRE(rank.wait_records(2));
  CHECK(rank.log.loads[1].kv == KvOutcome::ok);
}

TEST_CASE("R1 every accepted load reports once even when the connector is destroyed with loads queued") {
  std::atomic<int> kv_calls{0};
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools(rt, small_geometry(0, 1));
  {
    ScriptedConnector conn(pools.geo, rt, pools.memory(), ScriptedKv{{}, &kv_calls}, ScriptedState{}, group,
                           ConnectorOptions{.lane_capacity = 4});
    for (std::uint64_t i = 1; i <= 20; ++i) {
      LoadRequest r = joint_request(i);
      if (i % 3 == 0) r.kv.reset();
      if (i % 4 == 0) r.state.reset();
      conn.load(std::move(r));
    }
  }  // the destructor finishes every queued task
  RecordLog log;
  group.drain(log);
  CHECK(log.loads.size() == 20);
  std::set<std::uint64_t> seen;
  for (const auto& r : log.loads) CHECK(seen.insert(r.key.request.value).second);
}

// ---- the shipped legs: bytes, refusals, staging, fences ---------------------------------

namespace {

using Mem = MemoryTier<>;
using K3 = KimiK3Connector<Mem, Mem, SingleRank>;
using Dsv4 = Dsv4Connector<Mem, Mem, SingleRank>;
using Dense = DenseConnector<Mem, SingleRank>;

/// One rank with the shipped legs over a MemoryTier.
template <class Conn>
struct RealRank {
  using R = typename Conn::runtime_type;
  R rt;
  SingleRank group;
  DevicePools<R> pools{rt, small_geometry(0, 1)};
  Mem tier{std::size_t{1} << 20};
  RecordLog log;
  Conn conn{make()};
  Conn make() {
    if constexpr (Conn::has_state)
      return Conn(pools.geo, rt, pools.memory(), PagedKv<Mem>(tier), typename Conn::state_leg_type(tier), group);
    else
      return Conn(pools.geo, rt, pools.memory(), PagedKv<Mem>(tier), NoState{}, group);
  }
  const CompletionRecord& load(LoadRequest r) {
    const std::size_t before = log.loads.size();
    conn.load(std::move(r));
    REQUIRE(drain_until(group, log, [&] { return log.loads.size() > before; }));
    return log.loads.back();
  }
  /// A save's two records, in the order the rank sent them.
  struct SaveReport {
    SaveRecord released;
    SaveRecord stored;
  };
  SaveReport await_save() {
    const std::size_t before = log.stores.size();
    REQUIRE(drain_until(group, log, [&] { return log.stores.size() >= before + 2; }));
    REQUIRE(log.stores.size() == before + 2);
    const SaveReport report{log.stores[before], log.stores[before + 1]};
    CHECK(report.released.phase == SavePhase::released);
    CHECK(report.stored.phase == SavePhase::stored);
    return report;
  }
  /// Puts a state entry of `bytes` bytes for `hash` straight into the tier.
  void put_state(PrefixHash hash, std::size_t bytes) {
    std::vector<std::byte> entry(bytes);
    for (std::size_t j = 0; j < bytes; ++j) entry[j] = state_byte(0, hash, j);
    REQUIRE(tier.put(TierKey{pools.geo.model, hash, 1, 0, EntryKind::state}, entry));
  }
  /// Saves the prompt's first chunk from blocks 0..3 through the connector.
  void save_chunk(PrefixHash key) {
    pools.write_prompt(block_range(0, 4), pools.geo.chunk_tokens);
    conn.save_kv(KvSave{SaveKey{key, Generation{99}}, {key}, block_range(0, 4)});
    REQUIRE(await_save().stored.ok);
  }
};

// A KV save names its chunks by their keys alone: no position field that nothing reads.
template <class Save>
constexpr bool has_first_chunk = requires(const Save& s) { s.first_chunk; };
static_assert(!has_first_chunk<KvSave>);

StateSpec state_spec(PrefixHash hash, SlotId slot, TokenCount boundary = 48) {
  const RankGeometry g = small_geometry(0, 1);
  return StateSpec{boundary, hash, slot, g.block_tokens, g.chunk_tokens};
}

}  // namespace

TEST_CASE("R10 a state-only load ships no KV spec and moves no KV and marks no KV block") {
  std::atomic<int> kv_calls{0};
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools(rt, small_geometry(0, 1));
  Connector<ScriptedKv, ScriptedState, SingleRank> conn(
      pools.geo, rt, pools.memory(), ScriptedKv{{}, &kv_calls},
      ScriptedState{[] { return StateVerdict{StateOutcome::missed, Reason::none}; }}, group);

  std::vector<SlotId> released;
  OffloadIndex<> index(OffloadIndexOptions{.hash_capacity = 16, .slot_count = 4},
                       [&](SlotId s) { released.push_back(s); });
  index.note_stored(PrefixHash{5});
  LoadGrant a = index.request_load(RequestId{1}, std::nullopt,
                                       StateSpec{48, PrefixHash{5}, SlotId{1}, 16, 64});
  REQUIRE(a.granted());
  LoadRequest request = a.ticket().dispatch();
  CHECK_FALSE(request.kv.has_value());  // no zero-length sentinel, no block table, no token ids
  conn.load(std::move(request));
  RecordLog log;
  REQUIRE(drain_until(group, log, [&] { return log.loads.size() == 1; }));
  CHECK(kv_calls.load() == 0);
  CHECK(log.loads[0].kv == KvOutcome::none);  // a failed state-only load marks no KV block as errored
  CHECK(log.loads[0].state == StateOutcome::missed);
}

TEST_CASE("R10 a state-only load with the shipped legs touches only its slot") {
  RealRank<K3> rank;
  rank.put_state(PrefixHash{5}, rank.pools.geo.slot_bytes);
  LoadRequest r;
  r.key = LoadKey{RequestId{1}, Generation{1}};
  r.state = state_spec(PrefixHash{5}, SlotId{3});
  const CompletionRecord rec = rank.load(std::move(r));
  CHECK(rec.kv == KvOutcome::none);
  CHECK(rec.state == StateOutcome::restored);
  CHECK(rank.pools.holds_state(SlotId{3}, PrefixHash{5}));
  for (std::size_t i = 0; i < rank.pools.geo.num_blocks * rank.pools.geo.block_bytes(); ++i)
    REQUIRE(rank.pools.blocks[i] == std::byte{0});
}

TEST_CASE("R11 specs the rank disagrees with are refused with a reason and never clamped") {
  RealRank<K3> rank;
  const RankGeometry& g = rank.pools.geo;
  rank.put_state(PrefixHash{5}, g.slot_bytes);
  rank.put_state(PrefixHash{6}, g.slot_bytes + 8);  // an entry that does not fit the slot

  auto state_only = [&](StateSpec spec) {
    LoadRequest r;
    r.key = LoadKey{RequestId{spec.slot.value + 100ull}, Generation{spec.boundary_tokens + 1}};
    r.state = spec;
    return rank.load(std::move(r));
  };
  SUBCASE("a slot outside the pool") {
    const auto rec = state_only(state_spec(PrefixHash{5}, SlotId{g.num_slots}));
    CHECK(rec.state == StateOutcome::refused);
    CHECK(rec.state_reason == Reason::slot_out_of_range);
  }
  SUBCASE("a boundary off the checkpoint grid") {
    const auto rec = state_only(state_spec(PrefixHash{5}, SlotId{1}, 50));
    CHECK(rec.state == StateOutcome::refused);
    CHECK(rec.state_reason == Reason::grid_mismatch);
  }
  SUBCASE("engine grids that differ from the rank's") {
    StateSpec spec = state_spec(PrefixHash{5}, SlotId{1});
    spec.chunk_tokens = 256;
    const auto rec = state_only(spec);
    CHECK(rec.state == StateOutcome::refused);
    CHECK(rec.state_reason == Reason::grid_mismatch);
  }
  SUBCASE("a KV end that is not the chunk covering the boundary") {
    const auto keys = chunk_keys(7, 2);
    rank.save_chunk(keys[0]);
    rank.save_chunk(keys[1]);
    LoadRequest r = joint_request(7);
    r.kv = KvSpec{0, 2 * g.chunk_tokens, keys, block_range(8, 8)};
    r.state = state_spec(PrefixHash{5}, SlotId{1}, 48);  // covered by chunk 0, not chunk 1
    const auto rec = rank.load(std::move(r));
    CHECK(rec.kv == KvOutcome::ok);  // legs do not gate each other
    CHECK(rec.state == StateOutcome::refused);
    CHECK(rec.state_reason == Reason::kv_end_mismatch);
  }
  SUBCASE("an entry whose size does not match the slot") {
    const auto rec = state_only(state_spec(PrefixHash{6}, SlotId{1}));
    CHECK(rec.state == StateOutcome::refused);
    CHECK(rec.state_reason == Reason::entry_size_mismatch);
  }
  SUBCASE("a KV spec naming a block outside the pool") {
    rank.save_chunk(PrefixHash{77});
    LoadRequest r;
    r.key = LoadKey{RequestId{9}, Generation{9}};
    r.kv = KvSpec{0, g.chunk_tokens, {PrefixHash{77}}, {BlockId{0}, BlockId{1}, BlockId{2}, BlockId{g.num_blocks}}};
    const auto rec = rank.load(std::move(r));
    CHECK(rec.kv == KvOutcome::failed);
    CHECK(rec.kv_reason == Reason::invalid_spec);
  }
  // Nothing was written anywhere: every slot is still zero.
  for (std::uint32_t s = 0; s < g.num_slots; ++s) CHECK(rank.pools.slot_is_zero(SlotId{s}));
}

TEST_CASE("R11 a DSV4 joint load from a nonzero HBM floor restores its state and fills the blocks above the floor") {
  RealRank<Dsv4> rank;
  const RankGeometry& g = rank.pools.geo;
  LoadRequest r;
  r.key = LoadKey{RequestId{1}, Generation{1}};
  rank.save_chunk(chunk_keys(1, 1)[0]);  // the KV of [0, 64) in the tier
  const TokenCount boundary = g.chunk_tokens - g.block_tokens;  // 48: above the 16-token floor
  rank.pools.write_state(SlotId{0}, PrefixHash{5});
  rank.conn.save_state(StateSave{SaveKey{PrefixHash{5}, Generation{98}}, SlotId{0}, boundary});
  REQUIRE(rank.await_save().stored.ok);
  // Evicted from HBM: the blocks that will take [16, 64) hold nothing of the prompt.
  for (const BlockId b : block_range(9, 3)) std::memset(rank.pools.block(b), 0, g.block_bytes());
  r.kv = KvSpec{g.block_tokens, g.chunk_tokens, chunk_keys(1, 1), block_range(9, 3)};  // hbm = 16: [0, 16) resident
  r.state = state_spec(PrefixHash{5}, SlotId{1}, boundary);
  const auto rec = rank.load(std::move(r));
  CHECK(rec.kv == KvOutcome::ok);
  CHECK(rec.state == StateOutcome::restored);
  CHECK(rec.state_reason == Reason::none);
  CHECK(rank.pools.holds_state(SlotId{1}, PrefixHash{5}));
  CHECK(rank.pools.holds_prompt(block_range(9, 3), g.block_tokens, g.chunk_tokens));
}

TEST_CASE("R12 standing staging bytes are every lane's buffer, the save lane's sized for a whole save, allocated at construction") {
  const std::size_t chunk = small_geometry(0, 1).chunk_bytes();
  const std::size_t save_chunks = ConnectorOptions{}.save_staging_chunks;
  CHECK(save_chunks == 8);
  SUBCASE("dense: a load lane and a save lane") {
    RealRank<Dense> rank;
    const ConnectorStats s = rank.conn.stats();
    CHECK(s.lanes == 2);
    CHECK(s.standing_staging_bytes == chunk + save_chunks * chunk);
    CHECK(rank.rt.pinned_bytes() == s.standing_staging_bytes);
  }
  SUBCASE("K3: plus a state lane") {
    RealRank<K3> rank;
    const ConnectorStats s = rank.conn.stats();
    CHECK(s.lanes == 3);
    CHECK(s.standing_staging_bytes == 2 * chunk + save_chunks * chunk);
    CHECK(rank.rt.pinned_bytes() == s.standing_staging_bytes);
  }
  SUBCASE("save_staging_chunks = 1: every lane the same one-chunk buffer") {
    HostRuntime rt;
    SingleRank group;
    DevicePools<HostRuntime> pools(rt, small_geometry(0, 1));
    Mem tier(1 << 20);
    K3 conn(pools.geo, rt, pools.memory(), PagedKv<Mem>(tier), RecurrentState<Mem>(tier), group,
            ConnectorOptions{.save_staging_chunks = 1});
    CHECK(conn.stats().standing_staging_bytes == 3 * chunk);
    CHECK(rt.pinned_bytes() == conn.stats().standing_staging_bytes);
  }
}

namespace {
/// A concurrent state leg that does not say how big its entries are: not a StateLegFor.
struct SizelessState {
  static constexpr StateOrdering ordering = StateOrdering::concurrent;
  static constexpr StateLayout layout = StateLayout::k3_recurrent;
  template <Runtime R>
  StateVerdict load(const StateSpec&, const KvSpec*, LaneContext<R>&) { return {}; }
  template <Runtime R>
  SaveVerdict save(const StateSave&, LaneContext<R>&) { return {}; }
};

/// A state leg whose layout contradicts its ordering: stateful scheduling, no layout.
struct MislabelledState : ScriptedState {
  static constexpr StateLayout layout = StateLayout::none;
};
/// No ordering's worth of state, a stateful layout.
struct MislabelledNoState {
  static constexpr StateOrdering ordering = StateOrdering::none;
  static constexpr StateLayout layout = StateLayout::dsv4_slot;
};

/// Builds a `Conn` rank on `g` and returns its standing staging bytes; a stateful one
/// also stores the checkpoint in slot 0 and restores it into slot 1 through that staging.
template <class Conn>
std::size_t standing_staging(const RankGeometry& g, ConnectorOptions options = {}) {
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools(rt, g);
  Mem tier(1 << 20);
  auto state_leg = [&] {
    if constexpr (Conn::has_state) return typename Conn::state_leg_type(tier);
    else return NoState{};
  };
  Conn conn(pools.geo, rt, pools.memory(), PagedKv<Mem>(tier), state_leg(), group, std::move(options));
  const ConnectorStats stats = conn.stats();
  CHECK(stats.lanes == Conn::lane_count);
  CHECK(rt.pinned_bytes() == stats.standing_staging_bytes);
  if constexpr (Conn::has_state) {
    pools.write_state(SlotId{0}, PrefixHash{5});
    conn.save_state(StateSave{SaveKey{PrefixHash{5}, Generation{1}}, SlotId{0}, 48});
    RecordLog log;
    REQUIRE(drain_until(group, log, [&] { return log.stores.size() == 2; }));
    CHECK(log.stores[1].phase == SavePhase::stored);
    CHECK(log.stores[1].ok);
    LoadRequest r;
    r.key = LoadKey{RequestId{1}, Generation{2}};
    r.state = state_spec(PrefixHash{5}, SlotId{1});
    conn.load(std::move(r));
    REQUIRE(drain_until(group, log, [&] { return log.loads.size() == 1; }));
    CHECK(log.loads[0].state == StateOutcome::restored);
    CHECK(pools.holds_state(SlotId{1}, PrefixHash{5}));
  }
  return stats.standing_staging_bytes;
}
}  // namespace

TEST_CASE("policies: every state leg names the model's layout and each preset exposes it, the serial K3 one included") {
  static_assert(!StateLegFor<MislabelledState, HostRuntime>);
  static_assert(!StateLegFor<MislabelledNoState, HostRuntime>);
  static_assert(StateLegFor<ScriptedState, HostRuntime>);
  static_assert(DenseConnector<Mem, SingleRank>::layout == StateLayout::none);
  static_assert(Dsv4Connector<Mem, Mem, SingleRank>::layout == StateLayout::dsv4_slot);
  static_assert(KimiK3Connector<Mem, Mem, SingleRank>::layout == StateLayout::k3_recurrent);
  // Scheduled like DSV4 (after KV, one lane), planned like K3: the layout is the model's.
  using Serial = KimiK3SerialConnector<Mem, Mem, SingleRank>;
  static_assert(Serial::ordering == StateOrdering::after_kv && Serial::layout == StateLayout::k3_recurrent);
  CHECK(to_string(Serial::layout) == "k3_recurrent");
}

TEST_CASE("R12 staging per lane is the larger of a KV chunk and the preset's state entry, the save lane's at least save_staging_chunks chunks") {
  static_assert(!StateLegFor<SizelessState, HostRuntime>);
  static_assert(sizeof(SlotSidecar) == 24);
  for (const std::size_t slot_bytes : {std::size_t{512}, std::size_t{4096}, std::size_t{40000}}) {  // below, above a chunk and above 8
    CAPTURE(slot_bytes);
    RankGeometry g = small_geometry(0, 1);
    g.slot_bytes = slot_bytes;
    const std::size_t chunk = g.chunk_bytes();  // 2048
    const std::size_t save = 8 * chunk;         // the default save_staging_chunks
    CHECK(RecurrentState<Mem>::entry_bytes(g) == slot_bytes);
    CHECK(SlotState<Mem>::entry_bytes(g) == 24 + slot_bytes);
    const std::size_t dsv4 = std::max(chunk, 24 + slot_bytes), k3 = std::max(chunk, slot_bytes);
    CHECK(standing_staging<Dense>(g) == chunk + save);
    CHECK(standing_staging<Dsv4>(g) == dsv4 + std::max(dsv4, save));
    CHECK(standing_staging<K3>(g) == 2 * k3 + std::max(k3, save));
    // One chunk on the save lane: the state entry still fits there.
    CHECK(standing_staging<Dsv4>(g, ConnectorOptions{.save_staging_chunks = 1}) == 2 * dsv4);
    CHECK(standing_staging<K3>(g, ConnectorOptions{.save_staging_chunks = 3}) == 2 * k3 + std::max(k3, 3 * chunk));
  }
}

TEST_CASE("connector: save_staging_chunks of 0, or one whose bytes overflow, is refused naming the option") {
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools(rt, small_geometry(0, 1));
  Mem tier(1 << 20);
  for (const std::size_t chunks : {std::size_t{0}, SIZE_MAX / 1024}) {
    CAPTURE(chunks);
    try {
      Dense conn(pools.geo, rt, pools.memory(), PagedKv<Mem>(tier), NoState{}, group,
                 ConnectorOptions{.save_staging_chunks = chunks});
      FAIL("a bad save_staging_chunks must be refused");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      const std::string what = e.what();
      CHECK(what.find("ConnectorOptions::save_staging_chunks") != std::string::npos);
      CHECK(what.find(std::to_string(chunks)) != std::string::npos);
    }
  }
  CHECK(rt.pinned_bytes() == 0);
  CHECK_NOTHROW(Dense(pools.geo, rt, pools.memory(), PagedKv<Mem>(tier), NoState{}, group));  // lanes still free
}

TEST_CASE("R12 nothing is allocated on the load path") {
  REQUIRE(detail::AllocationScope::hook_installed());
  RealRank<K3> rank;
  rank.save_chunk(PrefixHash{77});
  rank.put_state(PrefixHash{5}, rank.pools.geo.slot_bytes);
  rank.log.loads.reserve(16);
  for (int round = 0; round < 3; ++round) {
    LoadRequest joint = joint_request(10 + round);
    joint.kv->chunk_keys = {PrefixHash{77}};
    joint.kv->blocks = block_range(8, 4);
    joint.state->boundary_hash = PrefixHash{5};
    LoadRequest state_only = joint_request(20 + round);
    state_only.kv.reset();
    state_only.state->boundary_hash = PrefixHash{5};
    detail::AllocationScope scope;
    rank.conn.load(std::move(joint));
    rank.conn.load(std::move(state_only));
    rank.conn.drain();
    CHECK(scope.all_threads() == 0);
  }
  rank.group.drain(rank.log);
  REQUIRE(rank.log.loads.size() == 6);
  for (const auto& rec : rank.log.loads) CHECK(rec.state == StateOutcome::restored);
  CHECK(rank.pools.holds_prompt(block_range(8, 4), 0, rank.pools.geo.chunk_tokens));
}

namespace {
/// A tier that keeps nothing and allocates nothing: its put checks the bytes are the
/// chunk written under that key and counts it. A save through it allocates only what the
/// connector and the leg do.
struct CheckingTier {
  const DevicePools<HostRuntime>* pools = nullptr;
  std::vector<PrefixHash> keys;  // chunk c of the prompt is saved under keys[c]
  std::atomic<std::uint64_t> good_puts{0}, bad_puts{0};
  TierView get(const TierKey&, std::span<std::byte>) noexcept { return TierView(GetStatus::miss); }
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept {
    const RankGeometry& g = pools->geo;
    bool good = bytes.size() == g.chunk_bytes();
    const auto at = std::find(keys.begin(), keys.end(), key.hash);
    const TokenCount c = static_cast<TokenCount>(at - keys.begin());
    good = good && at != keys.end();
    for (TokenCount t = 0; good && t < g.chunk_tokens; ++t)
      for (std::size_t j = 0; j < g.kv_bytes_per_token; ++j)
        good = good && bytes[t * g.kv_bytes_per_token + j] == kv_byte(0, c * g.chunk_tokens + t, j);
    (good ? good_puts : bad_puts).fetch_add(1);
    return true;
  }
  bool contains(const TierKey&) const noexcept { return false; }
  bool erase(const TierKey&) noexcept { return false; }
};
}  // namespace

TEST_CASE("R12 a multi-chunk save allocates nothing, gathered whole or in batches") {
  REQUIRE(detail::AllocationScope::hook_installed());
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools(rt, small_geometry(0, 1));
  CheckingTier tier;
  tier.pools = &pools;
  tier.keys = chunk_keys(6, 6);
  const std::vector<BlockId> blocks = block_range(10, 24);
  pools.write_prompt(blocks, 6 * pools.geo.chunk_tokens);
  Connector<PagedKv<CheckingTier>, NoState, SingleRank> conn(pools.geo, rt, pools.memory(), PagedKv<CheckingTier>(tier),
                                                              NoState{}, group, ConnectorOptions{.save_staging_chunks = 4});
  // 4 chunks fit the save lane's staging; 6 do not (batches of 2 and 4).
  KvSave fits{SaveKey{tier.keys[3], Generation{1}}, {tier.keys.begin(), tier.keys.begin() + 4}, block_range(10, 16)};
  KvSave larger{SaveKey{tier.keys[5], Generation{2}}, tier.keys, blocks};
  {
    detail::AllocationScope scope;
    conn.save_kv(std::move(fits));
    conn.save_kv(std::move(larger));
    conn.drain();
    CHECK(scope.all_threads() == 0);
  }
  RecordLog log;
  REQUIRE(drain_until(group, log, [&] { return log.stores.size() == 4; }));
  for (const SaveRecord& r : log.stores) CHECK(r.ok);
  CHECK(tier.good_puts.load() == 10);
  CHECK(tier.bad_puts.load() == 0);
  CHECK(conn.stats().staging_fallbacks == 1);
}

TEST_CASE("R13 a step whose event cannot be created still saves through a device synchronize") {
  RealRank<KimiK3Connector<Mem, Mem, SingleRank, FaultyRuntime<HostRuntime>>> rank;
  rank.rt.fail(RuntimeCall::create_event);
  auto compute = rank.rt.make_stream();
  rank.conn.begin_step(compute);
  rank.pools.write_state(SlotId{1}, PrefixHash{9});
  rank.conn.save_state(StateSave{SaveKey{PrefixHash{9}, Generation{1}}, SlotId{1}, 48});
  const auto rec = rank.await_save();
  CHECK(rec.stored.ok);
  CHECK(rec.released.ok);
  CHECK(rank.conn.stats().fence_fallbacks == 1);
  CHECK(rank.rt.calls(RuntimeCall::device_synchronize) >= 1);
  // The bytes in the tier are the slot's.
  std::vector<std::byte> staging(rank.pools.geo.slot_bytes);
  const TierView v = rank.tier.get(TierKey{rank.pools.geo.model, PrefixHash{9}, 1, 0, EntryKind::state}, staging);
  REQUIRE(v.hit());
  for (std::size_t j = 0; j < v.bytes().size(); ++j) REQUIRE(v.bytes()[j] == state_byte(0, PrefixHash{9}, j));
}

TEST_CASE("R13 when nothing can order the gather the save fails and never reads the source") {
  RealRank<KimiK3Connector<Mem, Mem, SingleRank, FaultyRuntime<HostRuntime>>> rank;
  rank.rt.fail(RuntimeCall::create_event);
  rank.rt.fail(RuntimeCall::device_synchronize);
  auto compute = rank.rt.make_stream();
  rank.conn.begin_step(compute);
  const auto copies_before = rank.rt.calls(RuntimeCall::copy_async);
  rank.conn.save_state(StateSave{SaveKey{PrefixHash{9}, Generation{1}}, SlotId{1}, 48});
  const auto rec = rank.await_save();
  CHECK_FALSE(rec.stored.ok);
  CHECK(rec.released.ok);
  CHECK(rank.rt.calls(RuntimeCall::copy_async) == copies_before);
}

namespace {
/// A rank of `Conn` built on `no_state_tier`: one state save and one state-only load.
template <class Conn>
void without_a_state_tier() {
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools(rt, small_geometry(0, 1));
  Mem kv_tier(1 << 20);
  Conn conn(pools.geo, rt, pools.memory(), PagedKv<Mem>(kv_tier), typename Conn::state_leg_type(no_state_tier), group);
  conn.save_state(StateSave{SaveKey{PrefixHash{9}, Generation{1}}, SlotId{1}, 48});
  LoadRequest r;
  r.key = LoadKey{RequestId{1}, Generation{2}};
  r.state = state_spec(PrefixHash{9}, SlotId{1});
  conn.load(std::move(r));
  RecordLog log;
  REQUIRE(drain_until(group, log, [&] { return log.loads.size() == 1 && log.stores.size() == 2; }));
  CHECK(log.stores[0] == SaveRecord{SaveKey{PrefixHash{9}, Generation{1}}, 0, SavePhase::released, true, Reason::none});
  CHECK(log.stores[1] == SaveRecord{SaveKey{PrefixHash{9}, Generation{1}}, 0, SavePhase::stored, false, Reason::no_tier});
  CHECK(log.loads[0].state == StateOutcome::failed);  // failed never retracts; missed would
  CHECK(log.loads[0].state_reason == Reason::no_tier);
}
}  // namespace

TEST_CASE("R14 a rank without a state tier reports stored false with source released and never a miss") {
  // "No tier" is written at the call site: a tier pointer, null or not, builds no leg.
  static_assert(std::is_constructible_v<RecurrentState<Mem>, Mem&>);
  static_assert(std::is_constructible_v<RecurrentState<Mem>, NoStateTier>);
  static_assert(!std::is_constructible_v<RecurrentState<Mem>, Mem*>);
  static_assert(!std::is_constructible_v<RecurrentState<Mem>, std::nullptr_t>);
  static_assert(std::is_constructible_v<SlotState<Mem>, Mem&>);
  static_assert(std::is_constructible_v<SlotState<Mem>, NoStateTier>);
  static_assert(!std::is_constructible_v<SlotState<Mem>, Mem*>);
  static_assert(!std::is_constructible_v<SlotState<Mem>, std::nullptr_t>);
  SUBCASE("Kimi-K3") { without_a_state_tier<K3>(); }
  SUBCASE("DSV4") { without_a_state_tier<Dsv4>(); }
}

TEST_CASE("R19 a bad geometry is a typed error naming the value") {
  HostRuntime rt;
  SingleRank group;
  RankGeometry g = small_geometry(0, 1);
  DevicePools<HostRuntime> pools(rt, g);
  Mem tier(1 << 20);
  g.chunk_tokens = 40;  // not a multiple of block_tokens
  try {
    Dense conn(g, rt, pools.memory(), PagedKv<Mem>(tier), NoState{}, group);
    FAIL("a chunk size off the block grid must be refused");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("40") != std::string::npos);
  }
}

TEST_CASE("connector: a negative lane_spin is refused naming the option and claims nothing from the group") {
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools(rt, small_geometry(0, 1));
  Mem tier(1 << 20);
  try {
    Dense conn(pools.geo, rt, pools.memory(), PagedKv<Mem>(tier), NoState{}, group,
               ConnectorOptions{.lane_spin = std::chrono::microseconds{-3}});
    FAIL("a negative lane_spin must be refused");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    const std::string what = e.what();
    CHECK(what.find("ConnectorOptions::lane_spin") != std::string::npos);
    CHECK(what.find("-3000") != std::string::npos);
  }
  CHECK(ConnectorOptions{}.lane_spin == std::chrono::nanoseconds{0});  // off by default
  CHECK_NOTHROW(Dense(pools.geo, rt, pools.memory(), PagedKv<Mem>(tier), NoState{}, group));  // lanes still free
}

TEST_CASE("connector: lane_cpus place every lane on them and a CPU the machine lacks is refused before any claim") {
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools(rt, small_geometry(0, 1));
  try {
    ScriptedConnector conn(pools.geo, rt, pools.memory(), ScriptedKv{}, ScriptedState{}, group,
                           ConnectorOptions{.lane_cpus = {0, 9999}});
    FAIL("a CPU the machine does not have must be refused");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    const std::string what = e.what();
    CHECK(what.find("ConnectorOptions::lane_cpus") != std::string::npos);
    CHECK(what.find("CPU 9999") != std::string::npos);
  }
  CHECK(ConnectorOptions{}.lane_cpus.empty());  // OS placement by default

  const unsigned last = std::thread::hardware_concurrency() > 0 ? std::thread::hardware_concurrency() - 1 : 0;
  // 1: this thread may run on `last` only; 0: anywhere else too.
  auto confined = [last]() -> int {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (pthread_getaffinity_np(pthread_self(), sizeof set, &set) != 0) return -2;
    return CPU_COUNT(&set) == 1 && CPU_ISSET(last, &set) ? 1 : 0;
  };
  std::atomic<int> kv_cpu{-1}, state_cpu{-1};
  ScriptedKv kv;
  kv.on_load = [&] {
    kv_cpu = confined();
    return KvVerdict{true, Reason::none};
  };
  ScriptedState state;
  state.on_load = [&] {
    state_cpu = confined();
    return StateVerdict{StateOutcome::restored, Reason::none};
  };
  RecordLog log;
  ScriptedConnector conn(pools.geo, rt, pools.memory(), std::move(kv), std::move(state), group,
                         ConnectorOptions{.lane_cpus = {last}});  // the lanes were still free
  conn.load(joint_request(1));
  REQUIRE(drain_until(group, log, [&] { return log.loads.size() == 1; }));
  CHECK(log.loads[0].kv == KvOutcome::ok);
  CHECK(kv_cpu.load() == 1);     // the load lane
  CHECK(state_cpu.load() == 1);  // the concurrent state lane
}

TEST_CASE("connector: with lane_spin on every load reports once and saves still report and drain and stop") {
  using namespace std::chrono_literals;
  std::atomic<int> kv_calls{0};
  HostRuntime rt(HostRuntimeOptions{.stream_spin = 5s});
  SingleRank group;
  DevicePools<HostRuntime> pools(rt, small_geometry(0, 1));
  RecordLog log;
  constexpr std::uint64_t loads = 150;
  // A spin far longer than the test: the lanes spin whenever they are idle, so a destructor
  // that waited it out would show.
  std::optional<ScriptedConnector> conn;
  conn.emplace(pools.geo, rt, pools.memory(), ScriptedKv{{}, &kv_calls}, ScriptedState{}, group,
               ConnectorOptions{.lane_capacity = 8, .lane_spin = 5s});
  for (std::uint64_t i = 1; i <= loads; ++i) {
    LoadRequest r = joint_request(i);
    if (i % 3 == 0) r.kv.reset();     // state-only: the state lane's own task
    if (i % 5 == 0) r.state.reset();  // KV-only
    conn->load(std::move(r));
    if (i % 50 == 0) {
      conn->save_kv(KvSave{SaveKey{PrefixHash{i}, Generation{i}}, {PrefixHash{i}}, block_range(0, 4)});
      REQUIRE(drain_until(group, log, [&] { return log.loads.size() >= i; }));
    }
  }
  conn->drain();
  REQUIRE(drain_until(group, log, [&] { return log.loads.size() >= loads && log.stores.size() >= 6; }));
  for (std::uint64_t i = loads + 1; i <= loads + 20; ++i) conn->load(joint_request(i));  // queued at destruction
  const auto t0 = std::chrono::steady_clock::now();
  conn.reset();  // finishes every queued task, then joins: the spin ends at once
  CHECK(std::chrono::steady_clock::now() - t0 < 4s);
  group.drain(log);
  CHECK(log.loads.size() == loads + 20);
  std::set<std::uint64_t> seen;
  for (const auto& r : log.loads) CHECK(seen.insert(r.key.request.value).second);
  CHECK(log.stores.size() == 6);
}

TEST_CASE("R19 a rank cut for another world size does not join the group") {
  HostRuntime rt;
  Mem tier(1 << 20);
  // Runs `make`, which must throw kvfuse::Error(invalid_argument); returns the message.
  auto refusal = [](auto make) -> std::string {
    try {
      make();
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      return e.what();
    }
    FAIL("a rank of another world joined the group");
    return {};
  };
  SUBCASE("rank 0 of 8 into a 4-rank TpQuorum") {
    TpQuorum quorum{TpQuorumOptions{4, 3, 64}};
    DevicePools<HostRuntime> of8(rt, small_geometry(0, 8));
    const std::string msg = refusal([&] {
      DenseConnector<Mem, TpQuorum> conn(of8.geo, rt, of8.memory(), PagedKv<Mem>(tier), NoState{}, quorum);
    });
    CHECK(msg.find("world_size (8)") != std::string::npos);
    CHECK(msg.find("world_size (4)") != std::string::npos);
    // Nothing was claimed: rank 0 cut for 4 still joins.
    DevicePools<HostRuntime> of4(rt, small_geometry(0, 4));
    CHECK_NOTHROW(DenseConnector<Mem, TpQuorum>(of4.geo, rt, of4.memory(), PagedKv<Mem>(tier), NoState{}, quorum));
  }
  SUBCASE("rank 0 of 4 into a SingleRank group") {
    SingleRank single;
    DevicePools<HostRuntime> of4(rt, small_geometry(0, 4));
    const std::string msg = refusal([&] {
      K3 conn(of4.geo, rt, of4.memory(), PagedKv<Mem>(tier), RecurrentState<Mem>(tier), single);
    });
    CHECK(msg.find("world_size (4)") != std::string::npos);
    CHECK(msg.find("world_size (1)") != std::string::npos);
    DevicePools<HostRuntime> of1(rt, small_geometry(0, 1));
    CHECK_NOTHROW(K3(of1.geo, rt, of1.memory(), PagedKv<Mem>(tier), RecurrentState<Mem>(tier), single));
  }
}

TEST_CASE("PagedKv retrieve reports a per-chunk mask - the KV leg is ok only if every chunk arrived") {
  HostRuntime rt;
  const RankGeometry geo = small_geometry(0, 1);
  DevicePools<HostRuntime> pools(rt, geo);
  Mem tier(1 << 20);
  auto stream = rt.make_stream();
  std::vector<std::byte> staging(geo.chunk_bytes());
  std::vector<std::uint8_t> mask(geo.max_chunks_per_load, 7);
  LaneContext<HostRuntime> lane{rt, stream, staging, mask, geo, pools.memory()};
  const auto keys = chunk_keys(3, 3);
  const PagedKv<Mem> leg(tier);
  auto put_chunk = [&](std::size_t i) {
    std::vector<std::byte> bytes(geo.chunk_bytes(), std::byte(i + 1));
    REQUIRE(tier.put(TierKey{geo.model, keys[i], 1, 0, EntryKind::kv_chunk}, bytes));
  };
  const KvSpec spec{0, 3 * geo.chunk_tokens, keys, block_range(0, 12)};
  auto as_vector = [](std::span<const std::uint8_t> m) { return std::vector<std::uint8_t>(m.begin(), m.end()); };

  put_chunk(0);
  put_chunk(2);
  RetrieveResult r = leg.retrieve(spec, lane);
  CHECK(as_vector(r.mask) == std::vector<std::uint8_t>{1, 2, 0});  // stops at the hole (2: missed) in the prefix
  CHECK(r.reason == Reason::kv_chunk_missing);
  CHECK_FALSE(r.complete());
  CHECK(r.restored() == 1);  // salvage: the leading run in its blocks
  const KvVerdict partial = leg.load(spec, lane);
  CHECK_FALSE(partial.ok);
  CHECK(partial.restored == 1);

  put_chunk(1);
  r = leg.retrieve(spec, lane);
  CHECK(as_vector(r.mask) == std::vector<std::uint8_t>{1, 1, 1});
  CHECK(r.complete());
  CHECK(r.restored() == 3);
  CHECK(leg.load(spec, lane).ok);
  CHECK(pools.block(BlockId{11})[0] == std::byte{3});  // chunk 2 landed in its last block

  KvSpec refused = spec;
  refused.blocks.pop_back();
  r = leg.retrieve(refused, lane);
  CHECK(r.mask.empty());
  CHECK(r.reason == Reason::invalid_spec);
}

namespace {
/// A BatchedTier over a MemoryTier whose answers the test scripts per hash: a hash in
/// `fail` answers failed, in `slow` timed_out; `stream` says whether it calls the sink.
struct ScriptedBatchTier {
  MemoryTier<> inner{std::size_t{1} << 20};
  std::set<std::uint64_t> fail, slow;
  bool stream = true;
  int batches = 0, singles = 0;
  TierView get(const TierKey& k, std::span<std::byte> staging) noexcept {
    ++singles;
    return inner.get(k, staging);
  }
  void get_batch(const TierKey& first, std::span<const PrefixHash> hashes, std::span<TierView> out, BatchSink sink) noexcept {
    ++batches;
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      TierKey k = first;
      k.hash = hashes[i];
      if (fail.contains(hashes[i].value)) out[i] = TierView(GetStatus::failed);
      else if (slow.contains(hashes[i].value)) out[i] = TierView(GetStatus::timed_out);
      else out[i] = inner.get(k, {});
      if (stream) sink(i, out[i]);
    }
  }
  bool put(const TierKey& k, std::span<const std::byte> b) noexcept { return inner.put(k, b); }
  bool contains(const TierKey& k) const noexcept { return inner.contains(k); }
  bool erase(const TierKey& k) noexcept { return inner.erase(k); }
};
static_assert(BatchedTier<ScriptedBatchTier>);
static_assert(!BatchedTier<MemoryTier<>>);
}  // namespace

TEST_CASE("PagedKv asks a BatchedTier once per load and the mask says which chunks missed failed or timed out") {
  HostRuntime rt;
  const RankGeometry geo = small_geometry(0, 1);
  DevicePools<HostRuntime> pools(rt, geo);
  ScriptedBatchTier tier;
  auto stream = rt.make_stream();
  std::vector<std::byte> staging(geo.chunk_bytes());
  std::vector<std::uint8_t> mask(geo.max_chunks_per_load, 7);
  std::vector<TierView> views(geo.max_chunks_per_load);
  LaneContext<HostRuntime> lane{rt, stream, staging, mask, geo, pools.memory(), views};
  const auto keys = chunk_keys(5, 4);
  const PagedKv<ScriptedBatchTier> leg(tier);
  for (std::size_t i = 0; i < keys.size(); ++i)
    if (i != 2) REQUIRE(tier.put(TierKey{geo.model, keys[i], 1, 0, EntryKind::kv_chunk}, std::vector<std::byte>(geo.chunk_bytes(), std::byte(i + 1))));
  const KvSpec spec{0, 4 * geo.chunk_tokens, keys, block_range(0, 16)};
  auto as_vector = [](std::span<const std::uint8_t> m) { return std::vector<std::uint8_t>(m.begin(), m.end()); };

  for (const bool stream_answers : {true, false}) {
    CAPTURE(stream_answers);
    tier.stream = stream_answers;
    tier.fail = {keys[3].value};
    tier.batches = tier.singles = 0;
    RetrieveResult r = leg.retrieve(spec, lane);
    CHECK(tier.batches == 1);
    CHECK(tier.singles == 0);
    CHECK(as_vector(r.mask) == std::vector<std::uint8_t>{1, 1, 2, 3});  // arrived, arrived, missed, failed
    CHECK(r.reason == Reason::kv_chunk_missing);
    CHECK(pools.block(BlockId{7})[0] == std::byte{2});  // chunk 1 landed

    tier.fail = {keys[0].value};
    tier.slow = {keys[1].value};
    r = leg.retrieve(spec, lane);
    CHECK(as_vector(r.mask) == std::vector<std::uint8_t>{3, 4, 2, 0});  // failed, timed out, missed, a hit after the hole
    CHECK(r.reason == Reason::kv_transfer_failed);
    tier.slow.clear();
    std::memset(pools.blocks, 0, geo.num_blocks * geo.block_bytes());
  }
  // A lane without held views for the whole load falls back to the per-chunk gets.
  LaneContext<HostRuntime> no_views{rt, stream, staging, mask, geo, pools.memory()};
  tier.fail.clear();
  tier.batches = tier.singles = 0;
  (void)leg.retrieve(spec, no_views);
  CHECK(tier.batches == 0);
  CHECK(tier.singles == 3);  // stops at the hole
  CHECK(tier.inner.stats().retired_bytes == 0);  // every view was released
}

namespace {
/// A BatchedTier whose hits are heap buffers that count themselves: `live` is how many
/// views it handed out are not released yet, `most_live` the most there were when it
/// produced an answer.
struct CountingBatchTier {
  std::size_t chunk_bytes = 0;
  int live = 0, most_live = 0;
  static void release(void* owner, void* buffer) noexcept {
    --static_cast<CountingBatchTier*>(owner)->live;
    delete[] static_cast<std::byte*>(buffer);
  }
  TierView get(const TierKey&, std::span<std::byte>) noexcept { return TierView(GetStatus::failed); }
  void get_batch(const TierKey&, std::span<const PrefixHash> hashes, std::span<TierView> out, BatchSink sink) noexcept {
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      most_live = std::max(most_live, live);
      auto* buffer = new std::byte[chunk_bytes];
      std::memset(buffer, static_cast<int>(i + 1), chunk_bytes);
      ++live;
      out[i] = TierView(std::span<const std::byte>(buffer, chunk_bytes), &release, this, buffer);
      sink(i, out[i]);
    }
  }
  bool put(const TierKey&, std::span<const std::byte>) noexcept { return false; }
  bool contains(const TierKey&) const noexcept { return false; }
  bool erase(const TierKey&) noexcept { return false; }
};
static_assert(BatchedTier<CountingBatchTier>);

/// HostRuntime without its stream query: PagedKv cannot tell when a copy ran.
struct UnqueryableRuntime : HostRuntime {
  bool query(Stream&) noexcept = delete;
};
static_assert(Runtime<UnqueryableRuntime> && !QueryableRuntime<UnqueryableRuntime>);

template <class R>
int most_views_held(R& rt) {
  const RankGeometry geo = small_geometry(0, 1);
  DevicePools<HostRuntime> pools(rt, geo);
  CountingBatchTier tier{geo.chunk_bytes()};
  auto stream = rt.make_stream(HostStreamMode::inline_calls);
  std::vector<std::byte> staging(geo.chunk_bytes());
  std::vector<std::uint8_t> mask(geo.max_chunks_per_load);
  std::vector<TierView> views(geo.max_chunks_per_load);
  LaneContext<R> lane{rt, stream, staging, mask, geo, pools.memory(), views};
  const KvSpec spec{0, 4 * geo.chunk_tokens, chunk_keys(5, 4), block_range(0, 16)};
  const RetrieveResult r = PagedKv<CountingBatchTier>(tier).retrieve(spec, lane);
  CHECK(r.complete());
  CHECK(pools.block(BlockId{15})[0] == std::byte{4});  // the last chunk landed
  CHECK(tier.live == 0);                                // every view released by the end
  return tier.most_live;
}
}  // namespace

TEST_CASE("PagedKv hands each batched hit back to its tier as soon as the runtime says its copy ran") {
  HostRuntime queryable;
  CHECK(most_views_held(queryable) == 0);  // each answer finds the previous one released
  UnqueryableRuntime unqueryable;
  CHECK(most_views_held(unqueryable) == 3);  // a runtime that cannot be asked holds all until the synchronize
}

TEST_CASE("PagedKv synchronizes once for memory-tier hits and before each reuse of staging") {
  using Faulty = FaultyRuntime<HostRuntime>;
  Faulty rt;
  const RankGeometry geo = small_geometry(0, 1);
  DevicePools<Faulty> pools(rt, geo);
  auto stream = rt.make_stream();
  std::vector<std::byte> staging(geo.chunk_bytes());
  std::vector<std::uint8_t> mask(geo.max_chunks_per_load);
  std::vector<TierView> views(geo.max_chunks_per_load);
  LaneContext<Faulty> lane{rt, stream, staging, mask, geo, pools.memory(), views};
  const auto keys = chunk_keys(4, 3);
  const KvSpec spec{0, 3 * geo.chunk_tokens, keys, block_range(0, 12)};
  auto fill = [&](auto& tier) {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      std::vector<std::byte> bytes(geo.chunk_bytes(), std::byte(i + 1));
      REQUIRE(tier.put(TierKey{geo.model, keys[i], 1, 0, EntryKind::kv_chunk}, bytes));
    }
  };
  auto check_blocks = [&] {
    for (std::uint32_t b = 0; b < 12; ++b)
      for (std::size_t j = 0; j < geo.block_bytes(); ++j) REQUIRE(pools.block(BlockId{b})[j] == std::byte(b / 4 + 1));
  };

  SUBCASE("memory tier: the views stay pinned until one synchronize covers every copy") {
    Mem tier(1 << 20);
    fill(tier);
    const auto before = rt.calls(RuntimeCall::synchronize_stream);
    CHECK(PagedKv<Mem>(tier).load(spec, lane).ok);
    CHECK(rt.calls(RuntimeCall::synchronize_stream) - before == 1);
    check_blocks();
    CHECK(tier.stats().retired_bytes == 0);  // every held view was released
  }
  SUBCASE("disk tier: staging is reused so each chunk is synchronized before the next read") {
    const auto dir = std::filesystem::temp_directory_path() / ("kvfuse-paged-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    {
      DiskTier tier(dir);
      fill(tier);
      const auto before = rt.calls(RuntimeCall::synchronize_stream);
      CHECK(PagedKv<DiskTier>(tier).load(spec, lane).ok);
      CHECK(rt.calls(RuntimeCall::synchronize_stream) - before == 3);
      check_blocks();
    }
    std::filesystem::remove_all(dir);
  }
  SUBCASE("memory tier: an entry overwritten while its copy is queued is still read whole") {
    // The stream is held by a host function, so the copies queue up and retrieve blocks in
    // its one synchronize; meanwhile every entry is overwritten. The held views keep the
    // old entries alive, so the blocks get the old bytes (ASan would see a freed entry).
    Mem tier(1 << 20);
    fill(tier);
    std::atomic<bool> open{false};
    REQUIRE(rt.inner().launch_host_func(
        stream,
        [](void* flag) noexcept {
          while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
        },
        &open));
    const auto before = rt.calls(RuntimeCall::synchronize_stream);
    std::atomic<bool> ok{false};
    std::thread loader([&] { ok = PagedKv<Mem>(tier).load(spec, lane).ok; });
    while (rt.calls(RuntimeCall::synchronize_stream) == before) std::this_thread::yield();
    for (std::size_t i = 0; i < keys.size(); ++i) {
      std::vector<std::byte> fresh(geo.chunk_bytes(), std::byte{0xee});
      REQUIRE(tier.put(TierKey{geo.model, keys[i], 1, 0, EntryKind::kv_chunk}, fresh));
    }
    open = true;
    loader.join();
    CHECK(ok.load());
    check_blocks();
  }
  SUBCASE("a failed synchronize marks none of the batch as arrived") {
    Mem tier(1 << 20);
    fill(tier);
    rt.fail(RuntimeCall::synchronize_stream, 1);
    const RetrieveResult r = PagedKv<Mem>(tier).retrieve(spec, lane);
    CHECK(r.reason == Reason::kv_transfer_failed);
    CHECK(std::vector<std::uint8_t>(r.mask.begin(), r.mask.end()) == std::vector<std::uint8_t>{0, 0, 0});
  }
}
