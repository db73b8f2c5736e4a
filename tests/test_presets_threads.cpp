// The three presets end to end: 4 ranks (each connector runs its own lane threads), a
// TpQuorum, the OffloadIndex and the SettlementPump. Every byte a load writes into blocks
// and slots is checked against what the forward wrote before the save.
#include "connector_harness.hpp"
#include <kvfuse/engine/index_consistency.hpp>

#include <filesystem>
#include <random>
#include <set>

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

constexpr std::uint32_t kWorld = 4;

/// The engine of these tests: index + quorum + pump, and the bookkeeping of a scheduler
/// that parks requests until their load settles.
struct Engine : PumpedEngine {
  explicit Engine(std::uint32_t slots) : PumpedEngine(kWorld, slots) {}
};

template <class Tier>
std::unique_ptr<Tier> make_tier(std::uint32_t rank, const std::filesystem::path& dir) {
  if constexpr (std::is_same_v<Tier, DiskTier>) {
    return std::make_unique<DiskTier>(dir / ("rank" + std::to_string(rank)));
  } else {
    return std::make_unique<Tier>(std::size_t{1} << 20);
  }
}

template <class Conn>
struct StateTierOf {
  using type = typename Conn::kv_leg_type::tier_type;  // dense: unused
};
template <class Conn>
  requires Conn::has_state
struct StateTierOf<Conn> {
  using type = typename Conn::state_leg_type::tier_type;
};

/// One rank: pools, its own tiers (ranks never share slices), its connector. When both
/// legs use one tier type they share one tier; otherwise each leg has its own.
template <class Conn>
struct Rank {
  using T = typename Conn::kv_leg_type::tier_type;
  using ST = typename StateTierOf<Conn>::type;
  static constexpr bool shared = std::is_same_v<T, ST>;
  DevicePools<HostRuntime> pools;
  std::unique_ptr<T> tier;
  std::unique_ptr<ST> own_state_tier;  // only when the state tier's type differs
  Conn conn;
  Rank(HostRuntime& rt, std::uint32_t rank, TpQuorum& group, const std::filesystem::path& dir)
      : pools(rt, small_geometry(rank, kWorld)),
        tier(make_tier<T>(rank, dir)),
        own_state_tier(shared ? nullptr : make_tier<ST>(rank, dir)),
        conn(make(rt, group)) {}
  ST& state_tier() {
    if constexpr (shared) return *tier;
    else return *own_state_tier;
  }
  Conn make(HostRuntime& rt, TpQuorum& group) {
    if constexpr (Conn::has_state) {
      using S = typename Conn::state_leg_type;
      return Conn(pools.geo, rt, pools.memory(), typename Conn::kv_leg_type(*tier), S(state_tier()), group);
    } else {
      return Conn(pools.geo, rt, pools.memory(), typename Conn::kv_leg_type(*tier), NoState{}, group);
    }
  }
};

/// Saves a 4-chunk prompt (and, for stateful presets, the checkpoint at `boundary`) from
/// blocks 0..15 / slot 0, wipes the device, loads it back into other blocks and slot 2,
/// and checks every byte on every rank.
template <class Conn>
void run_preset(const std::filesystem::path& dir = {}) {
  HostRuntime rt;
  Engine engine(4);
  std::vector<std::unique_ptr<Rank<Conn>>> ranks;
  for (std::uint32_t r = 0; r < kWorld; ++r) ranks.push_back(std::make_unique<Rank<Conn>>(rt, r, engine.group, dir));

  const RankGeometry geo = small_geometry(0, kWorld);
  const TokenCount prompt = 4 * geo.chunk_tokens;            // 256 tokens, 4 chunks
  const TokenCount boundary = prompt - geo.block_tokens;     // 240: on the block grid, its chunk ends at 256
  const auto keys = chunk_keys(7, 4);
  const auto saved_blocks = block_range(0, prompt / geo.block_tokens);
  const PrefixHash state_hash{0xabcdef};

  // The forward wrote KV (and state) on every rank; the engine saves it through tickets.
  auto kv_ticket = engine.index.request_save(KvSave{SaveKey{keys.back(), {}}, keys, saved_blocks}).take_ticket();
  auto state_ticket = engine.index.request_save(StateSave{SaveKey{state_hash, {}}, SlotId{0}, boundary}).take_ticket();
  const KvSave kv_save = kv_ticket.dispatch();
  const StateSave state_store = Conn::has_state ? state_ticket.dispatch() : StateSave{};
  for (auto& rank : ranks) {
    rank->pools.write_prompt(saved_blocks, prompt);
    if constexpr (Conn::has_state) rank->pools.write_state(SlotId{0}, state_hash);
    rank->conn.save_kv(kv_save);
    if constexpr (Conn::has_state) rank->conn.save_state(state_store);
  }
  const std::size_t saves = Conn::has_state ? 2 : 1;
  REQUIRE(engine.settle(0, 2 * saves));
  for (const SaveSettlement& s : engine.stores) CHECK(s.ok);
  if constexpr (Conn::has_state) CHECK(engine.index.could_serve(state_hash));
  CHECK_FALSE(engine.index.could_serve(keys.back()));  // a KV save is not a state checkpoint
  CHECK(engine.index.stats().saves_stored == saves);
  CHECK(engine.index.stats().saves_released == saves);

  // Wipe the device, then load into blocks 32.. in a scattered order and into slot 2.
  for (auto& rank : ranks) {
    std::memset(rank->pools.blocks, 0, geo.num_blocks * geo.block_bytes());
    std::memset(rank->pools.slots, 0, geo.num_slots * geo.slot_bytes);
  }
  std::vector<BlockId> load_blocks = block_range(32, prompt / geo.block_tokens);
  std::swap(load_blocks[3], load_blocks[9]);  // runs of consecutive ids are coalesced; these are not
  KvSpec kv{0, prompt, keys, load_blocks};
  std::optional<StateSpec> state;
  if constexpr (Conn::has_state) state = StateSpec{boundary, state_hash, SlotId{2}, geo.block_tokens, geo.chunk_tokens};
  LoadGrant grant = engine.index.request_load(RequestId{1}, kv, state);
  REQUIRE(grant.granted());
  const LoadRequest request = grant.ticket().dispatch();
  for (auto& rank : ranks) rank->conn.load(request);  // the transport copies the request to every rank
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().key == request.key);
  CHECK(engine.loads.back().kind == Resolution::completed);
  CHECK_FALSE(engine.loads.back().state_missed);

  for (auto& rank : ranks) {
    CHECK(rank->pools.holds_prompt(load_blocks, 0, prompt));
    if constexpr (Conn::has_state) {
      CHECK(rank->pools.holds_state(SlotId{2}, state_hash));
      CHECK(rank->pools.slot_is_zero(SlotId{0}));  // nothing else was written
    }
  }

  // A load of a prompt no rank holds fails everywhere and settles once, failed.
  const auto missing = chunk_keys(8, 1);
  LoadGrant miss = engine.index.request_load(RequestId{2}, KvSpec{0, geo.chunk_tokens, missing, block_range(40, 4)}, std::nullopt);
  REQUIRE(miss.granted());
  const LoadRequest miss_request = miss.ticket().dispatch();
  for (auto& rank : ranks) rank->conn.load(miss_request);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::failed);

  for (auto& rank : ranks) rank->conn.drain();
  const IndexStats stats = engine.index.stats();
  CHECK(stats.invariant_violations == 0);
  CHECK(stats.outstanding == 0);
  CHECK(stats.orphaned == 0);
  CHECK(stats.completed == 1);
  CHECK(stats.failed == 1);
  CHECK(engine.released_slots.empty());  // no slot is held by the index, none released twice
  CHECK(kvfuse::check_consistency(engine.index).ok);
  CHECK(engine.pump.stats().group.pending == 0);
}

using Mem = MemoryTier<>;

/// Builds `world` ranks of `Conn` on `group`, sends each the request an empty ticket
/// dispatches (neither a KV nor a state spec), and checks that every rank reports exactly
/// one record for it, with Reason::invalid_spec, and nothing else.
template <class Conn>
void legless_request_is_refused(typename Conn::group_type& group, std::uint32_t world) {
  using T = typename Conn::kv_leg_type::tier_type;
  HostRuntime rt;
  std::vector<std::unique_ptr<DevicePools<HostRuntime>>> pools;
  std::vector<std::unique_ptr<T>> tiers;
  std::vector<std::unique_ptr<Conn>> conns;
  for (std::uint32_t r = 0; r < world; ++r) {
    pools.push_back(std::make_unique<DevicePools<HostRuntime>>(rt, small_geometry(r, world)));
    tiers.push_back(std::make_unique<T>(std::size_t{1} << 20));
    auto state_leg = [&] {
      if constexpr (Conn::has_state) return typename Conn::state_leg_type(*tiers.back());
      else return NoState{};
    };
    conns.push_back(std::make_unique<Conn>(pools.back()->geo, rt, pools.back()->memory(),
                                           typename Conn::kv_leg_type(*tiers.back()), state_leg(), group));
  }
  const LoadRequest request = LoadTicket{}.dispatch();
  REQUIRE_FALSE(request.kv.has_value());
  REQUIRE_FALSE(request.state.has_value());
  for (auto& conn : conns) conn->load(request);
  for (auto& conn : conns) conn->drain();  // every lane idle: every record is queued
  RecordLog log;
  (void)group.drain(log);
  REQUIRE(log.loads.size() == world);
  std::set<std::uint32_t> ranks;
  for (const CompletionRecord& rec : log.loads) {
    CAPTURE(rec.rank);
    CHECK(rec.key == request.key);
    CHECK(rec.kv_reason == Reason::invalid_spec);
    CHECK(rec.state_reason == Reason::invalid_spec);
    CHECK(rec.kv == KvOutcome::none);
    CHECK(rec.state == StateOutcome::none);
    CHECK(ranks.insert(rec.rank).second);
  }
  CHECK(log.stores.empty());
  conns.clear();  // destruction finishes nothing more: no second record from any rank
  CHECK(group.drain(log) == 0);
}

}  // namespace

TEST_CASE("R1 a request with neither leg reports invalid_spec once per rank on every preset and group") {
  SUBCASE("DenseConnector") {
    SingleRank single;
    legless_request_is_refused<DenseConnector<Mem, SingleRank>>(single, 1);
    TpQuorum quorum{TpQuorumOptions{kWorld, 3, 1024}};
    legless_request_is_refused<DenseConnector<Mem, TpQuorum>>(quorum, kWorld);
  }
  SUBCASE("Dsv4Connector") {
    SingleRank single;
    legless_request_is_refused<Dsv4Connector<Mem, Mem, SingleRank>>(single, 1);
    TpQuorum quorum{TpQuorumOptions{kWorld, 3, 1024}};
    legless_request_is_refused<Dsv4Connector<Mem, Mem, TpQuorum>>(quorum, kWorld);
  }
  SUBCASE("KimiK3Connector") {
    SingleRank single;
    legless_request_is_refused<KimiK3Connector<Mem, Mem, SingleRank>>(single, 1);
    TpQuorum quorum{TpQuorumOptions{kWorld, 3, 1024}};
    legless_request_is_refused<KimiK3Connector<Mem, Mem, TpQuorum>>(quorum, kWorld);
  }
  SUBCASE("KimiK3SerialConnector") {
    SingleRank single;
    legless_request_is_refused<KimiK3SerialConnector<Mem, Mem, SingleRank>>(single, 1);
    TpQuorum quorum{TpQuorumOptions{kWorld, 3, 1024}};
    legless_request_is_refused<KimiK3SerialConnector<Mem, Mem, TpQuorum>>(quorum, kWorld);
  }
}

TEST_CASE("presets: DenseConnector loads and stores real bytes across 4 ranks") {
  run_preset<DenseConnector<Mem>>();
}

TEST_CASE("presets: Dsv4Connector loads and stores real bytes across 4 ranks") {
  run_preset<Dsv4Connector<Mem>>();
}

TEST_CASE("presets: KimiK3Connector loads and stores real bytes across 4 ranks") {
  run_preset<KimiK3Connector<Mem>>();
}

TEST_CASE("presets: KimiK3SerialConnector loads and stores real bytes across 4 ranks") {
  run_preset<KimiK3SerialConnector<Mem>>();
}

TEST_CASE("presets: KimiK3Connector over a DiskTier per rank") {
  const auto dir = std::filesystem::temp_directory_path() / ("kvfuse-presets-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  run_preset<KimiK3Connector<DiskTier>>(dir);
  std::filesystem::remove_all(dir);
}

TEST_CASE("presets: KimiK3Connector with KV in a MemoryTier and state in a DiskTier") {
  const auto dir = std::filesystem::temp_directory_path() / ("kvfuse-mixed-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  using Conn = KimiK3Connector<Mem, DiskTier>;
  static_assert(std::is_same_v<Conn::state_leg_type, RecurrentState<DiskTier>>);
  run_preset<Conn>(dir);
  // The state checkpoint went to disk, the KV chunks did not: each leg used its own tier.
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir / "rank0")) files += entry.is_regular_file();
  CHECK(files == 1);
  std::filesystem::remove_all(dir);
}

TEST_CASE("presets: Dsv4Connector with KV in a MemoryTier and state in a DiskTier") {
  const auto dir = std::filesystem::temp_directory_path() / ("kvfuse-mixed-dsv4-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  run_preset<Dsv4Connector<Mem, DiskTier>>(dir);
  std::filesystem::remove_all(dir);
}

TEST_CASE("R18 after a restart the index is re-seeded from the tiers and KV and state read back") {
  using Conn = KimiK3Connector<DiskTier>;
  const auto dir = std::filesystem::temp_directory_path() / ("kvfuse-restart-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const RankGeometry geo = small_geometry(0, kWorld);
  const TokenCount prompt = 2 * geo.chunk_tokens;
  const TokenCount boundary = prompt - geo.block_tokens;
  const auto keys = chunk_keys(11, 2);
  const PrefixHash state_hash{0x5eed}, partial_hash{0xbad};
  const auto saved_blocks = block_range(0, prompt / geo.block_tokens);

  {  // Before the restart: save KV and two checkpoints; one of them only reaches ranks 0-2.
    HostRuntime rt;
    Engine engine(4);
    std::vector<std::unique_ptr<Rank<Conn>>> ranks;
    for (std::uint32_t r = 0; r < kWorld; ++r) ranks.push_back(std::make_unique<Rank<Conn>>(rt, r, engine.group, dir));
    const KvSave kv_save = engine.index.request_save(KvSave{SaveKey{keys.back(), {}}, keys, saved_blocks}).take_ticket().dispatch();
    const StateSave st = engine.index.request_save(StateSave{SaveKey{state_hash, {}}, SlotId{0}, boundary}).take_ticket().dispatch();
    for (auto& rank : ranks) {
      rank->pools.write_prompt(saved_blocks, prompt);
      rank->pools.write_state(SlotId{0}, state_hash);
      rank->conn.save_kv(kv_save);
      rank->conn.save_state(st);
    }
    REQUIRE(engine.settle(0, 4));
    for (std::uint32_t r = 0; r + 1 < kWorld; ++r) {  // rank 3 crashed before storing this one
      std::vector<std::byte> bytes(geo.slot_bytes, std::byte{1});
      REQUIRE(ranks[r]->state_tier().put(TierKey{geo.model, partial_hash, kWorld, r, EntryKind::state}, bytes));
    }
  }

  // After the restart: new engine, new tiers over the same directories.
  HostRuntime rt;
  Engine engine(4);
  std::vector<std::unique_ptr<Rank<Conn>>> ranks;
  for (std::uint32_t r = 0; r < kWorld; ++r) ranks.push_back(std::make_unique<Rank<Conn>>(rt, r, engine.group, dir));
  CHECK_FALSE(engine.index.could_serve(state_hash));
  std::vector<std::vector<TierKey>> catalogues;
  for (auto& rank : ranks) catalogues.push_back(rank->state_tier().keys(EntryKind::state));
  CHECK(reseed_state_hashes(engine.index, catalogues, geo.model, kWorld) == 1);
  CHECK(engine.index.could_serve(state_hash));
  CHECK_FALSE(engine.index.could_serve(partial_hash));  // not every rank holds it

  const auto load_blocks = block_range(40, prompt / geo.block_tokens);
  LoadGrant a = engine.index.request_load(RequestId{5}, KvSpec{0, prompt, keys, load_blocks},
                                              StateSpec{boundary, state_hash, SlotId{3}, geo.block_tokens, geo.chunk_tokens});
  REQUIRE(a.granted());
  const LoadRequest request = a.ticket().dispatch();
  for (auto& rank : ranks) rank->conn.load(request);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::completed);
  for (auto& rank : ranks) {
    CHECK(rank->pools.holds_prompt(load_blocks, 0, prompt));
    CHECK(rank->pools.holds_state(SlotId{3}, state_hash));
  }
  ranks.clear();
  std::filesystem::remove_all(dir);
}
