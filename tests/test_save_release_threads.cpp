// Saves report twice per rank (docs/reference.md#save-path): `released` as soon as nothing reads the
// source, then `stored`. These tests watch the order of what really happens on the store
// lane — gather copies, the synchronize that covers them, the tier put, the records — with
// a runtime whose copies are slow on purpose and a tier whose put can be held open.
#include "connector_harness.hpp"
#include "test_support.hpp"

#include <kvfuse/completion/group_wrapper.hpp>

#include <mutex>
#include <string>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;
using namespace std::chrono_literals;

namespace {

/// What happened on the save lane, in order. Any thread appends.
struct EventLog {
  std::mutex mutex;
  std::vector<std::string> events;
  void add(std::string e) {
    std::lock_guard lock(mutex);
    events.push_back(std::move(e));
  }
  std::vector<std::string> snapshot() {
    std::lock_guard lock(mutex);
    return events;
  }
  void clear() {
    std::lock_guard lock(mutex);
    events.clear();
  }
};

/// Opens a gate when the scope ends, so a failed check does not leave a lane held there.
struct OpenAtExit {
  Gate& gate;
  ~OpenAtExit() { gate.open(); }
};

EventLog* g_log = nullptr;  // set by each test for the runtime, tier and emitter below

/// HostRuntime whose device-to-host copies (the gathers) sleep on the stream first, so a
/// reader that does not wait for the synchronize would read stale staging. Logs the gather
/// enqueue and every stream synchronize that returned.
class SlowGatherRuntime {
 public:
  using Stream = HostRuntime::Stream;
  using Event = HostRuntime::Event;
  void* allocate_pinned(std::size_t n) { return inner_.allocate_pinned(n); }
  void* allocate_device(std::size_t n) { return inner_.allocate_device(n); }
  Stream make_stream() { return inner_.make_stream(); }
  void free_pinned(void* p) noexcept { inner_.free_pinned(p); }
  void free_device(void* p) noexcept { inner_.free_device(p); }
  bool copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) noexcept {
    if (gathers_to_staging(dst)) {
      (void)inner_.launch_host_func(stream, &sleep_a_while, nullptr);
      log("gather");
    }
    return inner_.copy_async(dst, src, bytes, stream);
  }
  bool synchronize(Stream& stream) noexcept {
    const bool ok = inner_.synchronize(stream);
    log("sync");
    return ok;
  }
  bool create_event(Event& e) noexcept { return inner_.create_event(e); }
  bool record(Event& e, Stream& s) noexcept { return inner_.record(e, s); }
  bool wait(Stream& s, Event& e) noexcept { return inner_.wait(s, e); }
  bool synchronize(Event& e) noexcept { return inner_.synchronize(e); }
  bool device_synchronize() noexcept { return inner_.device_synchronize(); }
  HostRuntime& inner() noexcept { return inner_; }

  /// The device pools live in [device_lo, device_hi): a copy whose destination is outside
  /// is a gather into staging.
  std::byte* device_lo = nullptr;
  std::byte* device_hi = nullptr;

 private:
  bool gathers_to_staging(void* dst) const noexcept {
    auto* d = static_cast<std::byte*>(dst);
    return device_lo != nullptr && (d < device_lo || d >= device_hi);
  }
  static void sleep_a_while(void*) noexcept { std::this_thread::sleep_for(20ms); }
  static void log(const char* what) {
    if (g_log != nullptr) g_log->add(what);
  }
  HostRuntime inner_;
};
static_assert(Runtime<SlowGatherRuntime>);

/// A MemoryTier whose put logs itself and, when armed, waits at a gate first.
struct GatedTier {
  MemoryTier<> inner{std::size_t{1} << 20};
  Gate* gate = nullptr;
  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept { return inner.get(key, staging); }
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept {
    if (g_log != nullptr) g_log->add("put");
    if (gate != nullptr) (void)gate->pass();
    return inner.put(key, bytes);
  }
  bool contains(const TierKey& key) const noexcept { return inner.contains(key); }
  bool erase(const TierKey& key) noexcept { return inner.erase(key); }
};
static_assert(Tier<GatedTier>);

/// SingleRank whose emitters log the save records as the lane sends them.
class LoggingGroup : public GroupWrapper<SingleRank> {
 public:
  class Emitter {
   public:
    explicit Emitter(LaneEmitter inner) noexcept : inner_(std::move(inner)) {}
    void emit(const CompletionRecord& r) noexcept { inner_.emit(r); }
    void emit(const SaveRecord& r) noexcept {
      if (g_log != nullptr) g_log->add(r.phase == SavePhase::released ? "released" : "stored");
      inner_.emit(r);
    }

   private:
    LaneEmitter inner_;
  };
  [[nodiscard]] Emitter emitter(std::uint32_t rank, std::size_t lane) { return Emitter(inner_.emitter(rank, lane)); }
  template <class Visitor>
  std::size_t drain(Visitor& visitor) noexcept {
    return inner_.drain(visitor);
  }
};
static_assert(CompletionGroup<LoggingGroup>);

std::ptrdiff_t last_index_of(const std::vector<std::string>& events, const std::string& what) {
  for (std::size_t i = events.size(); i-- > 0;)
    if (events[i] == what) return static_cast<std::ptrdiff_t>(i);
  return -1;
}
std::ptrdiff_t first_index_of(const std::vector<std::string>& events, const std::string& what) {
  for (std::size_t i = 0; i < events.size(); ++i)
    if (events[i] == what) return static_cast<std::ptrdiff_t>(i);
  return -1;
}

/// One K3 rank over the slow runtime and the gated tier (KV and state share it).
struct OrderRank {
  EventLog log;
  SlowGatherRuntime rt;
  LoggingGroup group;
  DevicePools<SlowGatherRuntime> pools{rt, small_geometry(0, 1)};
  GatedTier tier;
  using Conn = KimiK3Connector<GatedTier, GatedTier, LoggingGroup, SlowGatherRuntime>;
  std::unique_ptr<Conn> conn;
  RecordLog records;
  explicit OrderRank(ConnectorOptions options = {}) {
    g_log = &log;
    rt.device_lo = pools.blocks;  // blocks and slots: two allocations; cover both
    rt.device_hi = pools.blocks + pools.geo.num_blocks * pools.geo.block_bytes();
    conn = std::make_unique<Conn>(pools.geo, rt, pools.memory(), PagedKv<GatedTier>(tier), RecurrentState<GatedTier>(tier),
                                  group, std::move(options));
  }
  ~OrderRank() {
    conn.reset();
    g_log = nullptr;
  }
  std::vector<std::string> store_lane_events() { return log.snapshot(); }
  /// Whether the tier holds chunk c of the prompt written by write_prompt under `key`.
  bool tier_holds_chunk(PrefixHash key, TokenCount c) {
    const RankGeometry& g = pools.geo;
    std::vector<std::byte> staging(g.chunk_bytes());
    const TierView v = tier.get(TierKey{g.model, key, 1, 0, EntryKind::kv_chunk}, staging);
    if (!v.hit() || v.bytes().size() != g.chunk_bytes()) return false;
    for (TokenCount t = 0; t < g.chunk_tokens; ++t)
      for (std::size_t j = 0; j < g.kv_bytes_per_token; ++j)
        if (v.bytes()[t * g.kv_bytes_per_token + j] != kv_byte(0, c * g.chunk_tokens + t, j)) return false;
    return true;
  }
};

std::ptrdiff_t count_of(const std::vector<std::string>& events, const std::string& what, std::ptrdiff_t before) {
  std::ptrdiff_t n = 0;
  for (std::ptrdiff_t i = 0; i < before && i < static_cast<std::ptrdiff_t>(events.size()); ++i)
    n += events[static_cast<std::size_t>(i)] == what ? 1 : 0;
  return n;
}

/// Blocks [first, first + count) followed by [then, then + more): two runs that meet
/// inside a chunk, so a batch's gather is more than one copy at offsets other than 0.
std::vector<BlockId> two_runs(std::uint32_t first, std::size_t count, std::uint32_t then, std::size_t more) {
  std::vector<BlockId> ids = block_range(first, count);
  for (const BlockId b : block_range(then, more)) ids.push_back(b);
  return ids;
}

}  // namespace

TEST_CASE("R13 a KV save's release and its put both come after the synchronize that covers its gather") {
  OrderRank rank;
  const RankGeometry& g = rank.pools.geo;
  rank.pools.write_prompt(block_range(0, 4), g.chunk_tokens);
  // Slots are a separate allocation: mark them device memory too by saving KV only here.
  rank.conn->save_kv(KvSave{SaveKey{PrefixHash{7}, Generation{1}}, {PrefixHash{7}}, block_range(0, 4)});
  REQUIRE(drain_until(rank.group, rank.records, [&] { return rank.records.stores.size() == 2; }));
  const auto events = rank.store_lane_events();
  CAPTURE(events.size());
  const auto gather = last_index_of(events, "gather");
  const auto released = first_index_of(events, "released");
  const auto put = first_index_of(events, "put");
  REQUIRE(gather >= 0);
  REQUIRE(released >= 0);
  REQUIRE(put >= 0);
  // A synchronize returned after the last gather was enqueued and before either.
  bool synced_before_release = false, synced_before_put = false;
  for (auto i = gather + 1; i < static_cast<std::ptrdiff_t>(events.size()); ++i) {
    if (events[static_cast<std::size_t>(i)] != "sync") continue;
    synced_before_release = synced_before_release || i < released;
    synced_before_put = synced_before_put || i < put;
  }
  CHECK(synced_before_release);
  CHECK(synced_before_put);
  CHECK(released < put);  // early release: before the put, not after it
  // The bytes that landed are the blocks' (the put never read staging before the gather).
  std::vector<std::byte> staging(g.chunk_bytes());
  const TierView v = rank.tier.get(TierKey{g.model, PrefixHash{7}, 1, 0, EntryKind::kv_chunk}, staging);
  REQUIRE(v.hit());
  for (TokenCount t = 0; t < g.chunk_tokens; ++t)
    for (std::size_t j = 0; j < g.kv_bytes_per_token; ++j)
      REQUIRE(v.bytes()[t * g.kv_bytes_per_token + j] == kv_byte(0, t, j));
}

TEST_CASE("R13 a state save's release and its put both come after the synchronize that covers its gather") {
  OrderRank rank;
  const RankGeometry& g = rank.pools.geo;
  rank.rt.device_lo = rank.pools.slots;  // this time the gather reads a slot
  rank.rt.device_hi = rank.pools.slots + g.num_slots * g.slot_bytes;
  rank.pools.write_state(SlotId{1}, PrefixHash{9});
  rank.conn->save_state(StateSave{SaveKey{PrefixHash{9}, Generation{1}}, SlotId{1}, 48});
  REQUIRE(drain_until(rank.group, rank.records, [&] { return rank.records.stores.size() == 2; }));
  const auto events = rank.store_lane_events();
  const auto gather = last_index_of(events, "gather");
  const auto sync_after = [&] {
    for (auto i = gather + 1; i < static_cast<std::ptrdiff_t>(events.size()); ++i)
      if (events[static_cast<std::size_t>(i)] == "sync") return i;
    return std::ptrdiff_t{-1};
  }();
  REQUIRE(gather >= 0);
  REQUIRE(sync_after > gather);
  CHECK(sync_after < first_index_of(events, "released"));
  CHECK(sync_after < first_index_of(events, "put"));
  CHECK(first_index_of(events, "released") < first_index_of(events, "put"));
  std::vector<std::byte> staging(g.slot_bytes);
  const TierView v = rank.tier.get(TierKey{g.model, PrefixHash{9}, 1, 0, EntryKind::state}, staging);
  REQUIRE(v.hit());
  for (std::size_t j = 0; j < g.slot_bytes; ++j) REQUIRE(v.bytes()[j] == state_byte(0, PrefixHash{9}, j));
}

TEST_CASE("R1 early block release: a save reports released while its put is still held open and stored after") {
  OrderRank rank;
  Gate gate;
  rank.tier.gate = &gate;
  rank.pools.write_prompt(block_range(0, 4), rank.pools.geo.chunk_tokens);
  const SaveKey key{PrefixHash{7}, Generation{1}};
  rank.conn->save_kv(KvSave{key, {PrefixHash{7}}, block_range(0, 4)});
  REQUIRE(eventually([&] { return gate.entered.load(); }));  // the put is in progress and held
  REQUIRE(drain_until(rank.group, rank.records, [&] { return rank.records.stores.size() == 1; }));
  CHECK(rank.records.stores[0] == SaveRecord{key, 0, SavePhase::released, true, Reason::none});
  std::this_thread::sleep_for(5ms);
  (void)rank.group.drain(rank.records);
  CHECK(rank.records.stores.size() == 1);  // no stored record while the put is held
  gate.open();
  REQUIRE(drain_until(rank.group, rank.records, [&] { return rank.records.stores.size() == 2; }));
  CHECK(rank.records.stores[1] == SaveRecord{key, 0, SavePhase::stored, true, Reason::none});
}

TEST_CASE("R1 early block release: a multi-chunk save reports released before its first put returns") {
  Gate gate;  // outlives the rank: the lane may still be in a put when a check fails
  OrderRank rank;  // default options: the save lane's staging holds 8 chunks
  rank.tier.gate = &gate;  // every put waits here until the test opens it
  const OpenAtExit let_puts_go{gate};
  const RankGeometry& g = rank.pools.geo;
  const std::vector<BlockId> blocks = two_runs(20, 6, 0, 6);  // 3 chunks of 4 blocks
  rank.pools.write_prompt(blocks, 3 * g.chunk_tokens);
  const SaveKey key{PrefixHash{9}, Generation{1}};
  rank.conn->save_kv(KvSave{key, {PrefixHash{7}, PrefixHash{8}, PrefixHash{9}}, blocks});
  REQUIRE(eventually([&] { return gate.entered.load(); }));  // the first put is in progress and held
  // The source is free while that put is still held: released comes before any put returns.
  REQUIRE(drain_until(rank.group, rank.records, [&] { return rank.records.stores.size() == 1; }));
  CHECK(rank.records.stores[0] == SaveRecord{key, 0, SavePhase::released, true, Reason::none});
  CHECK_FALSE(gate.is_open());
  const auto events = rank.store_lane_events();
  const auto released = first_index_of(events, "released");
  CHECK(count_of(events, "put", released) == 0);  // released before the first put even started
  CHECK(count_of(events, "put", static_cast<std::ptrdiff_t>(events.size())) == 1);  // held there
  gate.open();
  REQUIRE(drain_until(rank.group, rank.records, [&] { return rank.records.stores.size() == 2; }));
  CHECK(rank.records.stores[1] == SaveRecord{key, 0, SavePhase::stored, true, Reason::none});
  CHECK(rank.conn->stats().staging_fallbacks == 0);
  CHECK(rank.tier_holds_chunk(PrefixHash{7}, 0));
  CHECK(rank.tier_holds_chunk(PrefixHash{8}, 1));
  CHECK(rank.tier_holds_chunk(PrefixHash{9}, 2));
}

TEST_CASE("R1 a save larger than the save lane's staging is stored whole in batches, released before its last batch's puts, and counted") {
  OrderRank rank(ConnectorOptions{.save_staging_chunks = 2});
  const RankGeometry& g = rank.pools.geo;
  // 5 chunks through a 2-chunk staging: batches of 1, 2, 2.
  const std::vector<BlockId> blocks = two_runs(40, 6, 0, 14);
  rank.pools.write_prompt(blocks, 5 * g.chunk_tokens);
  const std::vector<PrefixHash> keys = chunk_keys(3, 5);
  const SaveKey key{keys.back(), Generation{1}};
  rank.conn->save_kv(KvSave{key, keys, blocks});
  const auto report = [&] {
    REQUIRE(drain_until(rank.group, rank.records, [&] { return rank.records.stores.size() == 2; }));
    return rank.records.stores;
  }();
  CHECK(report[0] == SaveRecord{key, 0, SavePhase::released, true, Reason::none});
  CHECK(report[1] == SaveRecord{key, 0, SavePhase::stored, true, Reason::none});
  CHECK(rank.conn->stats().staging_fallbacks == 1);
  for (TokenCount c = 0; c < 5; ++c) CHECK(rank.tier_holds_chunk(keys[c], c));
  const auto events = rank.store_lane_events();
  const auto released = first_index_of(events, "released");
  REQUIRE(released >= 0);
  CHECK(count_of(events, "put", released) == 3);  // the fewest a 2-chunk staging allows: 5 - 2
  CHECK(count_of(events, "put", static_cast<std::ptrdiff_t>(events.size())) == 5);
  CHECK(last_index_of(events, "gather") < released);

  // A save that fits is not a fallback and releases before its first put.
  rank.log.clear();
  rank.records.stores.clear();
  const std::vector<PrefixHash> fits = chunk_keys(4, 2);
  rank.conn->save_kv(KvSave{SaveKey{fits.back(), Generation{2}}, fits, block_range(40, 8)});
  REQUIRE(drain_until(rank.group, rank.records, [&] { return rank.records.stores.size() == 2; }));
  CHECK(rank.records.stores[1].ok);
  CHECK(rank.conn->stats().staging_fallbacks == 1);
  CHECK(count_of(rank.store_lane_events(), "put", first_index_of(rank.store_lane_events(), "released")) == 0);
}

namespace {
/// A KV leg whose save enqueues a (slow) gather and then throws before waiting for it.
struct ThrowingSaveKv {
  template <Runtime R>
  KvVerdict load(const KvSpec&, LaneContext<R>&) {
    return {true, Reason::none};
  }
  template <Runtime R>
  SaveVerdict save(const KvSave& save, LaneContext<R>& lane) {
    const std::byte* src = lane.memory.kv_blocks + std::size_t{save.blocks[0].value} * lane.geometry.block_bytes();
    (void)lane.runtime.copy_async(lane.staging.data(), src, lane.geometry.block_bytes(), lane.stream);
    throw std::runtime_error("the leg failed after issuing its gather");
  }
};
}  // namespace

TEST_CASE("R1 a save whose leg throws still reports released but only after the stream is synchronized") {
  EventLog log;
  g_log = &log;
  {
    SlowGatherRuntime rt;
    LoggingGroup group;
    DevicePools<SlowGatherRuntime> pools(rt, small_geometry(0, 1));
    rt.device_lo = pools.blocks;
    rt.device_hi = pools.blocks + pools.geo.num_blocks * pools.geo.block_bytes();
    Connector<ThrowingSaveKv, NoState, LoggingGroup, SlowGatherRuntime> conn(pools.geo, rt, pools.memory(), ThrowingSaveKv{},
                                                                              NoState{}, group);
    const SaveKey key{PrefixHash{3}, Generation{1}};
    conn.save_kv(KvSave{key, {PrefixHash{3}}, block_range(0, 4)});
    RecordLog records;
    REQUIRE(drain_until(group, records, [&] { return records.stores.size() == 2; }));
    CHECK(records.stores[0] == SaveRecord{key, 0, SavePhase::released, true, Reason::none});
    CHECK(records.stores[1] == SaveRecord{key, 0, SavePhase::stored, false, Reason::exception});
    const auto events = log.snapshot();
    const auto gather = first_index_of(events, "gather");
    const auto released = first_index_of(events, "released");
    REQUIRE(gather >= 0);
    bool synced = false;
    for (auto i = gather + 1; i < released; ++i) synced = synced || events[static_cast<std::size_t>(i)] == "sync";
    CHECK(synced);  // the source is free only once the thrown-away gather finished
  }
  g_log = nullptr;
}
