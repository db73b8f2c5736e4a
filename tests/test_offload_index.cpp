// OffloadIndex and LoadTicket: the engine side's one owner (R3 index side, R5, R6, R7,
// R8, R17, R19 bad input).
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/engine/index_consistency.hpp>
#include <kvfuse/testing/alloc_counter.hpp>
#include <kvfuse/engine/offload_index.hpp>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;
using namespace std::chrono_literals;

namespace {

using ManualClock = testing::ManualClock<struct ManualClockTag>;

using Index = OffloadIndex<ManualClock>;

OffloadIndexOptions small_options(std::size_t hash_capacity = 64, std::uint32_t slots = 8) {
  OffloadIndexOptions o;
  o.hash_capacity = hash_capacity;
  o.slot_count = slots;
  return o;
}

// The engine's view of the slot allocator: every slot the index hands back.
struct Harness {
  std::vector<SlotId> released;
  Index index;
  explicit Harness(OffloadIndexOptions o = small_options())
      : index(o, [this](SlotId s) { released.push_back(s); }) {}
};

KvSpec kv_spec(TokenCount hbm, TokenCount end) {
  KvSpec kv;
  kv.hbm = hbm;
  kv.end = end;
  for (TokenCount t = hbm - hbm % 256; t < end; t += 256) kv.chunk_keys.push_back(PrefixHash{1000 + t});
  for (TokenCount t = hbm - hbm % 16; t < end; t += 16) kv.blocks.push_back(BlockId{static_cast<std::uint32_t>(t / 16)});
  return kv;
}

StateSpec leg(std::uint64_t hash, std::uint32_t slot, TokenCount boundary = 512) {
  return StateSpec{boundary, PrefixHash{hash}, SlotId{slot}, 16, 256};
}

// Admits and dispatches a load; fails the test if refused.
LoadKey start(Index& index, std::uint64_t request, std::optional<KvSpec> kv, std::optional<StateSpec> st) {
  LoadGrant a = index.request_load(RequestId{request}, std::move(kv), st);
  REQUIRE_MESSAGE(a.granted(), to_string(a.refusal()));
  return a.ticket().dispatch().key;
}

void check_identity(const Index& index) {
  const IndexStats s = index.stats();
  CHECK(s.issued == s.completed + s.failed + s.abandoned + s.outstanding);
  CHECK(s.invariant_violations == 0);
  const kvfuse::ConsistencyReport rep = kvfuse::check_consistency(index);
  CHECK_MESSAGE(rep.ok, rep.problem);
}

std::vector<std::uint64_t> lru_order(const Index& index) {
  std::vector<std::uint64_t> out;
  index.for_each_indexed([&](PrefixHash h) { out.push_back(h.value); });
  return out;
}

std::vector<LoadResolution> drain(Index& index) {
  std::vector<LoadResolution> out;
  index.drain_resolutions(out);
  return out;
}

struct AuditTag {};

}  // namespace

// Reaches the counters so a test can corrupt one and watch the audit catch it.
template <>
struct kvfuse::detail::OffloadIndexAccess<AuditTag> {
  static void bump_issued(Index& i) { ++i.stats_.issued; }
  static void unbump_issued(Index& i) { --i.stats_.issued; }
  static void bump_indexed(Index& i) { ++i.stats_.indexed; }
  static void unbump_indexed(Index& i) { --i.stats_.indexed; }
};

// ------------------------------------------------------------------------------ R5

TEST_CASE("R5 the lifecycle identity holds at every instant (a live unconsumed ticket included)") {
  Harness h;
  h.index.note_stored(PrefixHash{7});
  LoadGrant a = h.index.request_load(RequestId{1}, kv_spec(0, 512), leg(7, 1));
  REQUIRE(a.granted());
  // The ticket is alive and unconsumed: it already counts.
  IndexStats s = h.index.stats();
  CHECK(s.issued == 1);
  CHECK(s.outstanding == 1);
  CHECK(s.in_flight == 0);
  check_identity(h.index);

  const LoadKey k1 = a.ticket().dispatch().key;
  check_identity(h.index);
  CHECK(h.index.stats().in_flight == 1);
  CHECK(h.index.complete(k1));
  check_identity(h.index);

  const LoadKey k2 = start(h.index, 2, kv_spec(0, 256), std::nullopt);
  CHECK(h.index.fail(k2, false));
  const LoadKey k3 = start(h.index, 3, std::nullopt, leg(7, 2));
  CHECK(h.index.abandon(k3));
  { LoadGrant dropped = h.index.request_load(RequestId{4}, kv_spec(0, 256), std::nullopt); }
  const LoadKey k5 = start(h.index, 5, std::nullopt, leg(7, 3));
  REQUIRE(h.index.orphan(k5));
  ManualClock::current += 1h;
  CHECK(h.index.reclaim(ManualClock::now(), 1min) == 1);
  check_identity(h.index);

  s = h.index.stats();
  CHECK(s.issued == 5);
  CHECK(s.completed == 1);
  CHECK(s.failed == 1);
  CHECK(s.abandoned == 3);  // by key, by a dropped ticket, by reclaim
  CHECK(s.reclaimed == 1);
  CHECK(s.outstanding == 0);
  CHECK(s.invariant_violations == 0);
}

TEST_CASE("R5 stats() audits the identities on every read and counts each failed read") {
  Harness h;
  using Access = detail::OffloadIndexAccess<AuditTag>;
  CHECK(h.index.stats().invariant_violations == 0);
  Access::bump_issued(h.index);
  CHECK(h.index.stats().invariant_violations == 1);
  CHECK(h.index.stats().invariant_violations == 2);  // every read, no decimation
  CHECK_FALSE(kvfuse::check_consistency(h.index).ok);
  Access::unbump_issued(h.index);
  CHECK(h.index.stats().invariant_violations == 2);  // a clean read adds nothing

  h.index.note_stored(PrefixHash{1});
  Access::bump_indexed(h.index);  // the counter now disagrees with the LRU length
  CHECK(h.index.stats().invariant_violations == 3);
  CHECK_FALSE(kvfuse::check_consistency(h.index).ok);
  Access::unbump_indexed(h.index);
  CHECK(kvfuse::check_consistency(h.index).ok);
}

TEST_CASE("R5 the indexed hashes are LRU-capped with evictions counted as one structure") {
  Harness h(small_options(3));
  for (std::uint64_t x : {1, 2, 3}) h.index.note_stored(PrefixHash{x});
  CHECK(lru_order(h.index) == std::vector<std::uint64_t>{3, 2, 1});
  CHECK(h.index.could_serve(PrefixHash{1}));  // a query does not touch the order
  CHECK(lru_order(h.index) == std::vector<std::uint64_t>{3, 2, 1});

  h.index.note_stored(PrefixHash{4});  // evicts 1, the least recently used
  CHECK_FALSE(h.index.could_serve(PrefixHash{1}));
  CHECK(h.index.stats().hashes_evicted == 1);
  h.index.note_stored(PrefixHash{2});  // a repeat store touches, does not grow
  CHECK(lru_order(h.index) == std::vector<std::uint64_t>{2, 4, 3});
  CHECK(h.index.stats().indexed == 3);

  // Admitting a state load touches its hash: it is about to be used.
  const LoadKey k = start(h.index, 1, std::nullopt, leg(3, 0));
  CHECK(lru_order(h.index) == std::vector<std::uint64_t>{3, 2, 4});
  h.index.note_stored(PrefixHash{5});  // evicts 4
  CHECK(lru_order(h.index) == std::vector<std::uint64_t>{5, 3, 2});
  CHECK(h.index.stats().hashes_evicted == 2);
  CHECK(h.index.forget(PrefixHash{3}));
  CHECK_FALSE(h.index.forget(PrefixHash{3}));
  CHECK(h.index.stats().indexed == 2);
  CHECK(h.index.complete(k));
  check_identity(h.index);
}

TEST_CASE("R5 a hash is indexed only when a save settles stored on every rank and a save settles once") {
  Harness h;
  auto ta = h.index.request_save(StateSave{SaveKey{PrefixHash{11}, {}}, SlotId{0}, 256});
  auto tb = h.index.request_save(StateSave{SaveKey{PrefixHash{12}, {}}, SlotId{1}, 256});
  REQUIRE(ta.granted());
  REQUIRE(tb.granted());
  const SaveKey a = ta.ticket().dispatch().key;
  const SaveKey b = tb.ticket().dispatch().key;
  CHECK(a.hash == PrefixHash{11});
  CHECK(a.generation != b.generation);
  CHECK_FALSE(h.index.could_serve(PrefixHash{11}));  // never at submission
  CHECK(h.index.is_save_in_flight(a));
  CHECK_FALSE(h.index.is_save_in_flight(SaveKey{PrefixHash{11}, b.generation}));
  CHECK(h.index.settle_save(SaveSettlement{a, SavePhase::released, true}));
  CHECK_FALSE(h.index.could_serve(PrefixHash{11}));  // released is not stored
  CHECK(h.index.is_save_in_flight(a));
  CHECK(h.index.settle_save(SaveSettlement{a, SavePhase::stored, true}));
  CHECK(h.index.settle_save(SaveSettlement{b, SavePhase::stored, false}));
  CHECK(h.index.could_serve(PrefixHash{11}));
  CHECK_FALSE(h.index.could_serve(PrefixHash{12}));
  // A second settlement of a, or one for a save never issued, is late.
  CHECK_FALSE(h.index.is_save_in_flight(a));
  CHECK_FALSE(h.index.settle_save(SaveSettlement{a, SavePhase::stored, true}));
  CHECK_FALSE(h.index.settle_save(SaveSettlement{SaveKey{PrefixHash{13}, Generation{3}}, SavePhase::stored, true}));
  CHECK_FALSE(h.index.could_serve(PrefixHash{13}));
  const IndexStats s = h.index.stats();
  CHECK(s.saves_issued == 2);
  CHECK(s.saves_released == 1);
  CHECK(s.saves_stored == 1);
  CHECK(s.saves_failed == 1);
  CHECK(s.saves_outstanding == 0);
  CHECK(s.late_reports == 2);
  check_identity(h.index);
}

TEST_CASE("R5 a KV save settles and is counted but never enters the state-hash set") {
  Harness h;
  auto tkv = h.index.request_save(KvSave{SaveKey{PrefixHash{21}, {}}, {PrefixHash{21}}, {BlockId{0}}});
  auto tst = h.index.request_save(StateSave{SaveKey{PrefixHash{22}, {}}, SlotId{0}, 256});
  const SaveKey kv = tkv.ticket().dispatch().key;
  const SaveKey state = tst.ticket().dispatch().key;
  CHECK(h.index.settle_save(SaveSettlement{kv, SavePhase::stored, true}));
  CHECK(h.index.settle_save(SaveSettlement{state, SavePhase::stored, true}));
  CHECK_FALSE(h.index.could_serve(PrefixHash{21}));
  CHECK(h.index.could_serve(PrefixHash{22}));
  const IndexStats s = h.index.stats();
  CHECK(s.saves_stored == 2);
  CHECK(s.indexed == 1);
  check_identity(h.index);
}

TEST_CASE("R6 a save is ticketed like a load: its records count only once dispatched and a dropped ticket abandons it") {
  Harness h;
  SaveKey dropped_key;
  {
    auto grant = h.index.request_save(StateSave{SaveKey{PrefixHash{5}, {}}, SlotId{0}, 256});
    REQUIRE(grant.granted());
    dropped_key = grant.ticket().key();
    CHECK(dropped_key.generation != Generation{});
    CHECK_FALSE(h.index.is_save_in_flight(dropped_key));  // no rank has it: its records would be late
    CHECK(h.index.stats().saves_outstanding == 1);
  }  // dropped undispatched
  CHECK(h.index.stats().saves_abandoned == 1);
  CHECK(h.index.stats().saves_outstanding == 0);
  CHECK_FALSE(h.index.settle_save(SaveSettlement{dropped_key, SavePhase::stored, true}));
  CHECK_FALSE(h.index.could_serve(PrefixHash{5}));

  auto grant = h.index.request_save(KvSave{SaveKey{PrefixHash{6}, {}}, {PrefixHash{6}}, {BlockId{3}}});
  SaveTicket<KvSave> ticket = grant.take_ticket();
  const KvSave save = ticket.dispatch();
  CHECK_FALSE(ticket.valid());
  CHECK(save.key == ticket.key());
  CHECK(save.blocks == std::vector<BlockId>{BlockId{3}});
  CHECK(h.index.is_save_in_flight(save.key));
  ticket.abandon();  // consumed: a no-op
  CHECK(h.index.is_save_in_flight(save.key));
  CHECK(SaveTicket<KvSave>{}.dispatch().key == SaveKey{});  // an empty ticket yields nothing any index accepts
  // Loads and saves share one generation source.
  CHECK(start(h.index, 1, kv_spec(0, 256), std::nullopt).generation.value == save.key.generation.value + 1);
  check_identity(h.index);
}

TEST_CASE("R19 a save the index cannot record is refused and the caller learns it") {
  REQUIRE(detail::AllocationScope::hook_installed());
  Harness h;
  detail::AllocationScope::fail_next(1);  // the save table's first growth fails
  auto refused = h.index.request_save(StateSave{SaveKey{PrefixHash{5}, {}}, SlotId{0}, 256});
  detail::AllocationScope::fail_next(0);
  CHECK_FALSE(refused.granted());
  CHECK(refused.refusal() == SaveRefusal::out_of_memory);
  CHECK_FALSE(refused.ticket().valid());
  IndexStats s = h.index.stats();
  CHECK(s.saves_refused == 1);
  CHECK(s.saves_issued == 0);
  CHECK(s.saves_outstanding == 0);
  auto admitted = h.index.request_save(StateSave{SaveKey{PrefixHash{5}, {}}, SlotId{0}, 256});
  CHECK(admitted.granted());
  check_identity(h.index);
}

// ------------------------------------------------------------------------------ R6

TEST_CASE("R6 a ticket is consumed by exactly one of dispatch or abandon") {
  Harness h;
  LoadGrant a = h.index.request_load(RequestId{1}, kv_spec(0, 256), std::nullopt);
  LoadTicket t = a.take_ticket();
  CHECK_FALSE(a.ticket().valid());
  REQUIRE(t.valid());
  const LoadKey key = t.key();
  const LoadRequest req = t.dispatch();
  CHECK(req.key == key);
  CHECK_FALSE(t.valid());
  t.abandon();  // consumed: no effect
  const LoadRequest again = t.dispatch();
  CHECK_FALSE(again.kv.has_value());
  CHECK_FALSE(again.state.has_value());
  CHECK(again.key.generation == Generation{});
  IndexStats s = h.index.stats();
  CHECK(s.abandoned == 0);
  CHECK(s.in_flight == 1);
  CHECK(h.index.complete(key));

  LoadGrant b = h.index.request_load(RequestId{2}, kv_spec(0, 256), std::nullopt);
  b.ticket().abandon();
  CHECK_FALSE(b.ticket().valid());
  const LoadRequest none = b.ticket().dispatch();  // consumed by the abandon
  CHECK_FALSE(none.kv.has_value());
  s = h.index.stats();
  CHECK(s.abandoned == 1);
  CHECK(s.in_flight == 0);
  CHECK(s.outstanding == 0);
  check_identity(h.index);
}

TEST_CASE("R6 a ticket destroyed unconsumed abandons itself and the scheduler drains it") {
  Harness h;
  h.index.note_stored(PrefixHash{9});
  LoadKey dropped_key;
  {
    LoadGrant a = h.index.request_load(RequestId{1}, kv_spec(0, 512), leg(9, 3));
    REQUIRE(a.granted());
    dropped_key = a.ticket().key();
  }  // a path that forgot the load
  IndexStats s = h.index.stats();
  CHECK(s.abandoned == 1);
  CHECK(s.outstanding == 0);
  std::vector<LoadResolution> got = drain(h.index);
  REQUIRE(got.size() == 1);
  CHECK(got[0] == LoadResolution{dropped_key, Resolution::abandoned, false, false, false});
  CHECK(h.released.empty());                    // the live request still owns its slot
  CHECK(h.index.could_serve(PrefixHash{9}));    // an abandon is not a miss
  CHECK_FALSE(h.index.is_in_flight(dropped_key));
  // The request and the slot are free for a new load.
  CHECK(h.index.request_load(RequestId{1}, std::nullopt, leg(9, 3)).granted());  // dropped again here
  CHECK(drain(h.index).size() == 1);

  // Move-assigning over a live ticket abandons the one it held.
  LoadTicket t = h.index.request_load(RequestId{2}, kv_spec(0, 256), std::nullopt).take_ticket();
  const LoadKey first = t.key();
  t = h.index.request_load(RequestId{3}, kv_spec(0, 256), std::nullopt).take_ticket();
  got = drain(h.index);
  REQUIRE(got.size() == 1);
  CHECK(got[0].key == first);
  CHECK(got[0].kind == Resolution::abandoned);
  CHECK(t.valid());
  // Moving a ticket moves the claim; only the destination resolves it.
  LoadTicket moved = std::move(t);
  CHECK_FALSE(t.valid());  // NOLINT(bugprone-use-after-move): checking the moved-from state
  const LoadKey k3 = moved.dispatch().key;
  CHECK(h.index.complete(k3));
  got = drain(h.index);
  REQUIRE(got.size() == 1);
  CHECK(got[0] == LoadResolution{k3, Resolution::completed, false, false, true});
  check_identity(h.index);
}

TEST_CASE("R6 dispatch yields the whole LoadRequest and moves (never copies) the KV spec") {
  Harness h;
  h.index.note_stored(PrefixHash{5});
  KvSpec kv = kv_spec(256, 1024);
  const KvSpec expected = kv;
  const PrefixHash* keys_data = kv.chunk_keys.data();
  const BlockId* blocks_data = kv.blocks.data();
  LoadGrant a = h.index.request_load(RequestId{8}, std::move(kv), leg(5, 2, 1008));
  REQUIRE(a.granted());
  const LoadRequest req = a.ticket().dispatch();
  REQUIRE(req.kv.has_value());
  CHECK(*req.kv == expected);
  CHECK(req.kv->chunk_keys.data() == keys_data);
  CHECK(req.kv->blocks.data() == blocks_data);
  REQUIRE(req.state.has_value());
  CHECK(*req.state == StateSpec{1008, PrefixHash{5}, SlotId{2}, 16, 256});
  CHECK(req.key.request == RequestId{8});

  // A state-only load carries no KV spec at all (R10).
  const LoadRequest state_only = h.index.request_load(RequestId{9}, std::nullopt, leg(5, 3)).ticket().dispatch();
  CHECK_FALSE(state_only.kv.has_value());
  CHECK(state_only.state.has_value());
}

// ------------------------------------------------------------------------------ R7

TEST_CASE("R7 an abandon never retracts the hash - only a genuine miss does") {
  Harness h;
  h.index.note_stored(PrefixHash{42});

  const LoadKey by_key = start(h.index, 1, kv_spec(0, 512), leg(42, 1));
  CHECK(h.index.abandon(by_key));
  CHECK(h.index.could_serve(PrefixHash{42}));

  h.index.request_load(RequestId{2}, std::nullopt, leg(42, 2)).ticket().abandon();
  CHECK(h.index.could_serve(PrefixHash{42}));

  { LoadGrant dropped = h.index.request_load(RequestId{3}, std::nullopt, leg(42, 3)); }
  CHECK(h.index.could_serve(PrefixHash{42}));

  const LoadKey orphaned = start(h.index, 4, std::nullopt, leg(42, 4));
  REQUIRE(h.index.orphan(orphaned));
  ManualClock::current += 1h;
  CHECK(h.index.reclaim(ManualClock::now(), 1s) == 1);
  CHECK(h.index.could_serve(PrefixHash{42}));

  const LoadKey failed = start(h.index, 5, std::nullopt, leg(42, 5));
  CHECK(h.index.fail(failed, false));  // a transfer failure is not a miss
  CHECK(h.index.could_serve(PrefixHash{42}));
  CHECK(h.index.stats().hashes_retracted == 0);
  for (const LoadResolution& r : drain(h.index)) CHECK_FALSE(r.state_missed);

  const LoadKey kv_only = start(h.index, 6, kv_spec(0, 256), std::nullopt);
  CHECK(h.index.fail(kv_only, true));  // missing on a KV-only load just fails
  CHECK(h.index.could_serve(PrefixHash{42}));

  const LoadKey missed = start(h.index, 7, std::nullopt, leg(42, 6));
  CHECK(h.index.settle(Settlement{missed, false, true}));
  CHECK_FALSE(h.index.could_serve(PrefixHash{42}));
  CHECK(h.index.stats().hashes_retracted == 1);
  const std::vector<LoadResolution> got = drain(h.index);
  REQUIRE(got.size() == 2);
  CHECK_FALSE(got[0].state_missed);
  CHECK(got[1] == LoadResolution{missed, Resolution::failed, true, false, true});
  check_identity(h.index);
}

// ------------------------------------------------------------------------------ R8

TEST_CASE("R8 the index never releases the slot of a live request") {
  Harness h;
  h.index.note_stored(PrefixHash{1});
  const LoadKey a = start(h.index, 1, std::nullopt, leg(1, 1));
  const LoadKey b = start(h.index, 2, std::nullopt, leg(1, 2));
  const LoadKey c = start(h.index, 3, std::nullopt, leg(1, 3));
  const LoadKey d = start(h.index, 4, std::nullopt, leg(1, 4));
  ManualClock::current += 24h;  // however old a live load is, reclaim leaves it alone
  CHECK(h.index.reclaim(ManualClock::now(), 1ns) == 0);
  CHECK(h.index.is_in_flight(d));
  CHECK(h.index.complete(a));
  CHECK(h.index.fail(b, true));
  CHECK(h.index.abandon(c));
  CHECK(h.index.settle(Settlement{d, true, false}));
  CHECK(h.released.empty());
  CHECK(h.index.stats().slots_freed == 0);
}

TEST_CASE("R8 an orphan's slot goes back exactly once when its ranks settle it") {
  for (const bool ok : {true, false}) {
    CAPTURE(ok);
    Harness h;
    h.index.note_stored(PrefixHash{1});
    const LoadKey k = start(h.index, 1, kv_spec(0, 512), leg(1, 6));
    CHECK_FALSE(h.index.orphan(LoadKey{RequestId{1}, Generation{999}}));  // not a load of ours
    REQUIRE(h.index.orphan(k));
    CHECK_FALSE(h.index.orphan(k));  // already orphaned
    CHECK(h.index.is_orphaned(k));
    CHECK(h.index.stats().orphaned == 1);
    CHECK(h.released.empty());  // the rank may still be writing into it
    CHECK(h.index.settle(Settlement{k, ok, !ok}));
    CHECK(h.released == std::vector<SlotId>{SlotId{6}});
    CHECK_FALSE(h.index.settle(Settlement{k, true, false}));  // late: releases nothing
    CHECK_FALSE(h.index.fail(k, false));
    ManualClock::current += 1h;
    CHECK(h.index.reclaim(ManualClock::now(), 1s) == 0);
    CHECK(h.released.size() == 1);
    const std::vector<LoadResolution> got = drain(h.index);
    REQUIRE(got.size() == 1);
    CHECK(got[0].orphaned);
    check_identity(h.index);
  }
}

TEST_CASE("R8 complete and fail and fail_all and abandon by key never end an orphan: its ranks may still write its slot") {
  Harness h;
  h.index.note_stored(PrefixHash{1});
  const LoadKey k = start(h.index, 1, kv_spec(0, 512), leg(1, 6));
  REQUIRE(h.index.orphan(k));
  const IndexStats before = h.index.stats();
  CHECK_FALSE(h.index.complete(k));
  CHECK_FALSE(h.index.fail(k, true));
  CHECK_FALSE(h.index.abandon(k));
  CHECK(h.index.fail_all(std::span<const LoadKey>(&k, 1), true) == 0);
  CHECK(h.index.stats() == before);  // nothing resolved, nothing counted late
  CHECK(h.released.empty());
  CHECK(h.index.is_in_flight(k));
  CHECK(h.index.could_serve(PrefixHash{1}));
  CHECK(h.index.drain_forgotten([](const LoadKey&) noexcept {}) == 0);  // the group keeps waiting for its ranks
  // Reclaim is the other way out.
  ManualClock::current += 1h;
  CHECK(h.index.reclaim(ManualClock::now(), 1s) == 1);
  CHECK(h.released == std::vector<SlotId>{SlotId{6}});
  std::vector<LoadKey> forgotten;
  CHECK(h.index.drain_forgotten([&](const LoadKey& key) noexcept { forgotten.push_back(key); }) == 1);
  CHECK(forgotten == std::vector<LoadKey>{k});
  check_identity(h.index);
}

TEST_CASE("R8 a load that never hears back stays in flight and visible: report_overdue lists it without releasing anything") {
  Harness h;
  h.index.note_stored(PrefixHash{1});
  const LoadKey old_load = start(h.index, 1, kv_spec(0, 256), std::nullopt);
  ManualClock::current += 10s;
  const LoadKey orphan = start(h.index, 2, std::nullopt, leg(1, 2));
  REQUIRE(h.index.orphan(orphan));
  ManualClock::current += 10s;
  const LoadKey young = start(h.index, 3, kv_spec(0, 256), std::nullopt);
  LoadGrant undispatched = h.index.request_load(RequestId{4}, kv_spec(0, 256), std::nullopt);
  ManualClock::current += 5s;

  std::vector<OverdueLoad> seen;
  auto collect = [&](const OverdueLoad& o) noexcept { seen.push_back(o); };
  CHECK(h.index.report_overdue(ManualClock::now(), 12s, collect) == 2);
  REQUIRE(seen.size() == 2);
  CHECK(seen[0].key == old_load);  // oldest dispatch first
  CHECK(seen[0].age == std::chrono::nanoseconds(25s));
  CHECK_FALSE(seen[0].orphaned);
  CHECK(seen[1].key == orphan);
  CHECK(seen[1].orphaned);
  CHECK(h.index.stats().overdue == 2);
  CHECK(h.index.is_in_flight(old_load));  // nothing is released on a timer
  CHECK(h.released.empty());
  // The count follows the loads: settle one, and the next report has one fewer.
  CHECK(h.index.settle(Settlement{old_load, true, false}));
  seen.clear();
  CHECK(h.index.report_overdue(ManualClock::now(), 1s, collect) == 2);  // the orphan and the young load
  CHECK(seen[1].key == young);
  CHECK(h.index.stats().overdue == 2);
  CHECK(h.index.report_overdue(ManualClock::now(), 1h, collect) == 0);
  CHECK(h.index.stats().overdue == 0);
  CHECK(undispatched.ticket().valid());  // a ticket not yet dispatched is not in flight
  check_identity(h.index);
}

TEST_CASE("R3 generations survive a restart: last_issued() is what the next incarnation starts after") {
  OffloadIndexOptions o = small_options();
  Generation persisted;
  LoadKey before_restart;
  {
    Index first(o, [](SlotId) {});
    before_restart = start(first, 1, kv_spec(0, 256), std::nullopt);
    auto save = first.request_save(KvSave{SaveKey{PrefixHash{9}, {}}, {PrefixHash{9}}, {BlockId{0}}});
    REQUIRE(save.granted());
    CHECK(first.last_issued() == save.ticket().key().generation);
    persisted = first.last_issued();
  }
  o.last_issued = persisted;
  Index second(o, [](SlotId) {});
  CHECK(second.last_issued() == persisted);
  const LoadKey after_restart = start(second, 1, kv_spec(0, 256), std::nullopt);
  CHECK(after_restart.generation.value == persisted.value + 1);
  CHECK(after_restart != before_restart);
  CHECK_FALSE(second.settle(Settlement{before_restart, true, false}));  // the old incarnation's report is late
}

TEST_CASE("R8 orphan() of a load that is not in flight leaves the slot with the caller") {
  Harness h;
  h.index.note_stored(PrefixHash{1});
  LoadGrant a = h.index.request_load(RequestId{1}, std::nullopt, leg(1, 2));
  CHECK_FALSE(h.index.orphan(a.ticket().key()));  // never dispatched: nothing writes the slot
  const LoadKey k = a.ticket().dispatch().key;
  CHECK(h.index.complete(k));
  CHECK_FALSE(h.index.orphan(k));  // already settled
  CHECK(h.released.empty());
  CHECK(h.index.stats().orphaned == 0);
}

TEST_CASE("R8 reclaim ages orphans from orphan time and not dispatch time") {
  Harness h;
  h.index.note_stored(PrefixHash{1});
  const LoadKey slow = start(h.index, 1, std::nullopt, leg(1, 1));
  ManualClock::current += 10min;  // in flight a long time before the teardown
  REQUIRE(h.index.orphan(slow));
  const auto orphaned_at = ManualClock::now();
  CHECK(h.index.reclaim(orphaned_at, 1min) == 0);
  CHECK(h.index.reclaim(orphaned_at + 59s, 1min) == 0);
  CHECK(h.released.empty());
  CHECK(h.index.reclaim(orphaned_at + 1min, 1min) == 1);
  CHECK(h.released == std::vector<SlotId>{SlotId{1}});
  // A report after the reclaim is late and releases nothing.
  CHECK_FALSE(h.index.settle(Settlement{slow, true, false}));
  CHECK(h.released.size() == 1);
  const IndexStats s = h.index.stats();
  CHECK(s.reclaimed == 1);
  CHECK(s.abandoned == 1);
  CHECK(s.late_reports == 1);
  CHECK(s.slots_freed == 1);
  const std::vector<LoadResolution> got = drain(h.index);
  REQUIRE(got.size() == 1);
  CHECK(got[0] == LoadResolution{slow, Resolution::reclaimed, false, true, true});
  check_identity(h.index);
}

TEST_CASE("R8 reclaim takes only orphans old enough and oldest first even if the clock went back") {
  Harness h;
  h.index.note_stored(PrefixHash{1});
  const auto t0 = ManualClock::now();
  const LoadKey a = start(h.index, 1, std::nullopt, leg(1, 1));
  const LoadKey b = start(h.index, 2, std::nullopt, leg(1, 2));
  const LoadKey c = start(h.index, 3, std::nullopt, leg(1, 3));
  ManualClock::current = t0 + 30s;
  REQUIRE(h.index.orphan(a));
  ManualClock::current = t0 + 10s;  // a clock set back: c is orphaned "before" a
  REQUIRE(h.index.orphan(c));
  ManualClock::current = t0 + 50s;
  REQUIRE(h.index.orphan(b));
  CHECK(kvfuse::check_consistency(h.index).ok);
  CHECK(h.index.reclaim(t0 + 40s, 20s) == 1);  // only c (age 30s); a is 10s old
  CHECK(h.released == std::vector<SlotId>{SlotId{3}});
  CHECK(h.index.reclaim(t0 + 60s, 20s) == 1);  // a (30s); b is 10s old
  CHECK(h.released == std::vector<SlotId>{SlotId{3}, SlotId{1}});
  CHECK(h.index.is_in_flight(b));
  check_identity(h.index);
}

TEST_CASE("R8 a timeout of zero or less disables reclaim") {
  Harness h;
  h.index.note_stored(PrefixHash{1});
  const LoadKey k = start(h.index, 1, std::nullopt, leg(1, 1));
  REQUIRE(h.index.orphan(k));
  ManualClock::current += 1000h;
  CHECK(h.index.reclaim(ManualClock::now(), 0s) == 0);
  CHECK(h.index.reclaim(ManualClock::now(), -5s) == 0);
  CHECK(h.released.empty());
  CHECK(h.index.is_in_flight(k));
}

TEST_CASE("R8 a re-admitted request gets a new generation and its own slot - the old orphan neither blocks nor is touched") {
  Harness h;
  h.index.note_stored(PrefixHash{1});
  const LoadKey first = start(h.index, 7, kv_spec(0, 512), leg(1, 1));
  CHECK(h.index.request_load(RequestId{7}, kv_spec(0, 256), std::nullopt).refusal() == LoadRefusal::load_in_flight);
  REQUIRE(h.index.orphan(first));  // preempted while loading
  // The orphan's slot stays held until the old load settles.
  CHECK(h.index.request_load(RequestId{8}, std::nullopt, leg(1, 1)).refusal() == LoadRefusal::slot_in_use);
  LoadGrant again = h.index.request_load(RequestId{7}, kv_spec(0, 512), leg(1, 2));
  REQUIRE(again.granted());
  const LoadKey second = again.ticket().dispatch().key;
  CHECK(second.request == first.request);
  CHECK(second.generation != first.generation);
  CHECK(h.index.live_load(RequestId{7}) == second);
  CHECK(h.index.slot_of(second) == SlotId{2});
  CHECK(h.index.complete(second));  // the new admission's report
  CHECK(h.released.empty());        // did not touch the old orphan's slot
  CHECK(h.index.is_in_flight(first));
  CHECK(h.index.settle(Settlement{first, false, false}));  // the old load's ranks report at last
  CHECK(h.released == std::vector<SlotId>{SlotId{1}});
  check_identity(h.index);
}

TEST_CASE("R8 a slot-free callback that throws is counted and never propagated") {
  OffloadIndexOptions o = small_options();
  Index index(o, [](SlotId) { throw std::runtime_error("allocator said no"); });
  index.note_stored(PrefixHash{1});
  const LoadKey k = start(index, 1, std::nullopt, leg(1, 1));
  REQUIRE(index.orphan(k));
  CHECK(index.settle(Settlement{k, true, false}));
  const IndexStats s = index.stats();
  CHECK(s.slot_free_errors == 1);
  CHECK(s.slots_freed == 1);
  CHECK(s.invariant_violations == 0);
}

// ------------------------------------------------------------------------------ R3

TEST_CASE("R3 reports for unknown / settled / reclaimed / undispatched keys are late and change nothing") {
  Harness h;
  h.index.note_stored(PrefixHash{1});
  const LoadKey live = start(h.index, 1, std::nullopt, leg(1, 1));
  const LoadKey settled = start(h.index, 2, kv_spec(0, 256), std::nullopt);
  REQUIRE(h.index.complete(settled));
  const LoadKey reclaimed = start(h.index, 3, std::nullopt, leg(1, 3));
  REQUIRE(h.index.orphan(reclaimed));
  ManualClock::current += 1h;
  REQUIRE(h.index.reclaim(ManualClock::now(), 1s) == 1);
  LoadGrant waiting = h.index.request_load(RequestId{4}, std::nullopt, leg(1, 4));
  const LoadKey undispatched = waiting.ticket().key();
  const std::size_t released_before = h.released.size();
  drain(h.index);

  const std::vector<LoadKey> late = {
      LoadKey{RequestId{99}, Generation{12345}},      // unknown
      settled,                                        // settled
      reclaimed,                                      // reclaimed
      undispatched,                                   // no rank has it yet
      LoadKey{RequestId{2}, live.generation},         // right generation, wrong request
      LoadKey{live.request, Generation{live.generation.value + 100}},  // right request, wrong generation
  };
  CHECK_FALSE(h.index.is_in_flight(undispatched));
  CHECK(h.index.is_in_flight(live));
  for (const LoadKey& k : late) {
    CAPTURE(to_string(k));
    CHECK_FALSE(h.index.is_in_flight(k));
    IndexStats before = h.index.stats();
    CHECK_FALSE(h.index.complete(k));
    CHECK_FALSE(h.index.fail(k, true));
    CHECK_FALSE(h.index.abandon(k));
    CHECK_FALSE(h.index.settle(Settlement{k, false, true}));
    IndexStats after = h.index.stats();
    CHECK(after.late_reports == before.late_reports + 4);
    after.late_reports = before.late_reports;
    CHECK(after == before);
    CHECK(h.index.could_serve(PrefixHash{1}));  // a late miss retracts nothing
    CHECK(h.released.size() == released_before);
    CHECK(h.index.pending_resolutions() == 0);
  }
  CHECK(h.index.is_in_flight(live));
  CHECK(h.index.hash_of(live) == PrefixHash{1});
  CHECK(h.index.hash_of(settled) == std::nullopt);
  CHECK(waiting.ticket().valid());  // the undispatched load is untouched
  check_identity(h.index);
}

TEST_CASE("R3 the index issues one fresh generation per load ticket continuing after last_issued") {
  OffloadIndexOptions o = small_options();
  o.last_issued = Generation{41};
  std::vector<SlotId> released;
  Index index(o, [&](SlotId s) { released.push_back(s); });
  const LoadKey a = start(index, 1, kv_spec(0, 256), std::nullopt);
  CHECK(a.generation == Generation{42});
  CHECK(index.complete(a));
  const LoadKey b = start(index, 1, kv_spec(0, 256), std::nullopt);  // same request again
  CHECK(b.generation == Generation{43});
  CHECK_FALSE(index.complete(a));  // the old key never settles the new load
  CHECK(index.is_in_flight(b));
  // A refusal issues no generation.
  CHECK(index.request_load(RequestId{1}, kv_spec(0, 256), std::nullopt).refusal() == LoadRefusal::load_in_flight);
  CHECK(index.complete(b));
  CHECK(start(index, 2, kv_spec(0, 256), std::nullopt).generation == Generation{44});
}

// ------------------------------------------------------------------------------ R17

TEST_CASE("R17 stats() and hash_of and a failing batch visit no entry at any size - the consistency walk visits all") {
  Harness h(small_options(std::size_t{1} << 17, 4));
  h.index.note_stored(PrefixHash{1});
  const LoadKey one = start(h.index, 1, kv_spec(0, 256), std::nullopt);

  auto visits_of = [&](auto&& f) {
    const std::uint64_t before = h.index.walk_steps();
    f();
    return h.index.walk_steps() - before;
  };
  CHECK(visits_of([&] { (void)h.index.stats(); }) == 0);
  const std::uint64_t small_walk = kvfuse::check_consistency(h.index).visited;
  CHECK(small_walk >= 2);

  constexpr std::uint64_t n = 100'000;
  for (std::uint64_t i = 2; i <= n; ++i) h.index.note_stored(PrefixHash{i});
  std::vector<LoadKey> keys;
  keys.reserve(n);
  for (std::uint64_t r = 2; r <= n; ++r)
    keys.push_back(h.index.request_load(RequestId{r}, kv_spec(0, 256), std::nullopt).ticket().dispatch().key);
  REQUIRE(h.index.stats().indexed == n);
  REQUIRE(h.index.stats().outstanding == n);

  CHECK(visits_of([&] { (void)h.index.stats(); }) == 0);
  CHECK(visits_of([&] {
          for (int i = 0; i < 100; ++i) {
            (void)h.index.hash_of(keys[static_cast<std::size_t>(i)]);
            (void)h.index.is_in_flight(keys[static_cast<std::size_t>(i)]);
            (void)h.index.could_serve(PrefixHash{static_cast<std::uint64_t>(i)});
          }
        }) == 0);
  CHECK(visits_of([&] { CHECK(h.index.fail_all(std::span<const LoadKey>(keys.data(), 2048), false) == 2048); }) == 0);
  // The counter is real: the full walk visits every hash and every load entry.
  const kvfuse::ConsistencyReport big = kvfuse::check_consistency(h.index);
  CHECK(big.ok);
  CHECK(big.visited >= 2 * n);
  CHECK(h.index.stats().invariant_violations == 0);
  CHECK(h.index.complete(one));
}

// ------------------------------------------------------------------------------ R19

TEST_CASE("R19 bad input to the index is refused and leaves every counter and slot and hash as it was") {
  Harness h;
  h.index.note_stored(PrefixHash{1});
  h.index.note_stored(PrefixHash{2});
  const LoadKey held = start(h.index, 1, kv_spec(0, 512), leg(1, 1));

  struct Case {
    const char* what;
    std::uint64_t request;
    bool with_kv;
    std::optional<StateSpec> state;
    LoadRefusal expected;
  };
  const std::vector<Case> cases = {
      {"invalid slot", 2, false, leg(1, 8), LoadRefusal::invalid_slot},
      {"slot far out of range", 2, true, leg(1, 0xFFFF'FFFFu), LoadRefusal::invalid_slot},
      {"a hash never stored", 2, false, leg(77, 2), LoadRefusal::hash_not_servable},
      {"a second load for the same request", 1, true, std::nullopt, LoadRefusal::load_in_flight},
      {"a slot another load holds", 2, false, leg(2, 1), LoadRefusal::slot_in_use},
      {"no legs at all", 2, false, std::nullopt, LoadRefusal::empty_load},
      {"a boundary off the checkpoint grid", 2, false, leg(1, 2, 500), LoadRefusal::invalid_state_leg},
      {"a zero chunk size", 2, false, StateSpec{512, PrefixHash{1}, SlotId{2}, 16, 0}, LoadRefusal::invalid_state_leg},
      {"a zero block size", 2, false, StateSpec{512, PrefixHash{1}, SlotId{2}, 0, 256}, LoadRefusal::invalid_state_leg},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const IndexStats before = h.index.stats();
    const std::vector<std::uint64_t> order_before = lru_order(h.index);
    const std::optional<KvSpec> kv = c.with_kv ? std::optional<KvSpec>(kv_spec(0, 512)) : std::nullopt;
    LoadGrant a = h.index.request_load(RequestId{c.request}, kv, c.state);
    CHECK_FALSE(a.granted());
    CHECK(a.refusal() == c.expected);
    CHECK_FALSE(a.ticket().valid());
    IndexStats after = h.index.stats();
    CHECK(after.refused == before.refused + 1);
    after.refused = before.refused;
    CHECK(after == before);
    CHECK(lru_order(h.index) == order_before);  // not even the LRU order moved
    CHECK(h.released.empty());
    CHECK(h.index.pending_resolutions() == 0);
  }
  CHECK(h.index.is_in_flight(held));
  CHECK(h.index.slot_of(held) == SlotId{1});
  check_identity(h.index);

  // Role and tier refusals.
  OffloadIndexOptions no_load = small_options();
  no_load.role_loads = false;
  Index producer(no_load, [](SlotId) {});
  producer.note_stored(PrefixHash{1});
  CHECK(producer.request_load(RequestId{1}, kv_spec(0, 256), std::nullopt).refusal() == LoadRefusal::role_cannot_load);
  CHECK(producer.request_load(RequestId{1}, std::nullopt, leg(1, 1)).refusal() == LoadRefusal::role_cannot_load);
  OffloadIndexOptions dense = small_options();
  dense.state_tier = false;
  Index dense_index(dense, [](SlotId) {});
  dense_index.note_stored(PrefixHash{1});
  CHECK(dense_index.request_load(RequestId{1}, kv_spec(0, 256), leg(1, 1)).refusal() == LoadRefusal::no_state_tier);
  CHECK(dense_index.request_load(RequestId{1}, kv_spec(0, 256), std::nullopt).granted());
  CHECK(producer.stats().issued == 0);
  CHECK(producer.stats().refused == 2);
}

TEST_CASE("R19 construction errors throw kvfuse::Error naming the value") {
  OffloadIndexOptions zero = small_options(0);
  try {
    Index index(zero, [](SlotId) {});
    FAIL("a zero hash capacity was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("hash_capacity") != std::string::npos);
    CHECK(std::string(e.what()).find("got 0") != std::string::npos);
  }
  OffloadIndexOptions huge = small_options((std::size_t{1} << 31) + 1);
  CHECK_THROWS_AS(Index(huge, [](SlotId) {}), Error);
  OffloadIndexOptions slots = small_options(64, (1u << 24) + 1);
  try {
    Index index(slots, [](SlotId) {});
    FAIL("a slot pool above 2^24 was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("got 16777217") != std::string::npos);
  }
  try {
    Index index(small_options(), SlotFree{});
    FAIL("an empty slot-free callback was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
  }
  OffloadIndexOptions eviction = small_options();
  eviction.hash_eviction = static_cast<HashEviction>(7);
  try {
    Index index(eviction);
    FAIL("an unknown hash eviction was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("hash_eviction=7") != std::string::npos);
  }
  try {
    (void)TokenGrid::make(0);
    FAIL("a zero chunk size was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("got 0") != std::string::npos);
  }
}

TEST_CASE("R19 the load / settle / drain paths are noexcept") {
  Harness h;
  LoadTicket t;
  std::vector<LoadResolution> out;
  const std::vector<LoadKey> keys;
  CHECK(noexcept(h.index.request_load(RequestId{}, std::nullopt, std::nullopt)));
  CHECK(noexcept(t.dispatch()));
  CHECK(noexcept(t.abandon()));
  CHECK(noexcept(h.index.complete(LoadKey{})));
  CHECK(noexcept(h.index.fail(LoadKey{}, true)));
  CHECK(noexcept(h.index.abandon(LoadKey{})));
  CHECK(noexcept(h.index.settle(Settlement{})));
  CHECK(noexcept(h.index.fail_all(keys, true)));
  CHECK(noexcept(h.index.orphan(LoadKey{})));
  const ManualClock::time_point now = ManualClock::now();
  const ManualClock::duration timeout{1};
  CHECK(noexcept(h.index.reclaim(now, timeout)));
  CHECK(noexcept(h.index.drain_resolutions(out)));
  CHECK(noexcept(h.index.settle_save(SaveSettlement{})));
  CHECK(noexcept(h.index.note_stored(PrefixHash{})));
  CHECK(noexcept(h.index.stats()));
}

TEST_CASE("index: preallocated hashes - drain by visitor - queries on resolved keys") {
  OffloadIndexOptions o = small_options(1024);
  o.preallocate_hashes = true;
  std::vector<SlotId> released;
  Index index(o, [&](SlotId s) { released.push_back(s); });
  for (std::uint64_t i = 0; i < 2000; ++i) index.note_stored(PrefixHash{i});
  CHECK(index.stats().indexed == 1024);
  CHECK(index.stats().hashes_evicted == 2000 - 1024);
  CHECK(index.could_serve(PrefixHash{1999}));
  CHECK_FALSE(index.could_serve(PrefixHash{975}));
  const LoadKey k = start(index, 1, std::nullopt, leg(1500, 0));
  CHECK(index.live_load(RequestId{1}) == k);
  CHECK(index.complete(k));
  CHECK(index.live_load(RequestId{1}) == std::nullopt);
  CHECK(index.slot_of(k) == std::nullopt);
  std::size_t seen = 0;
  CHECK(index.drain_resolutions([&](const LoadResolution& r) noexcept { seen += r.key == k ? 1 : 0; }) == 1);
  CHECK(seen == 1);
  CHECK(index.pending_resolutions() == 0);
  CHECK(kvfuse::check_consistency(index).ok);
}

TEST_CASE("index: with spared_tokens eviction a cold checkpoint sparing a long prefill outlives a cold short one") {
  // Three checkpoints stored through saves (their boundaries travel with them), then a
  // fourth at the cap of 3: the plain LRU index drops the oldest, the weighted one drops
  // the one that spares the least prefill among its least recently used.
  for (const HashEviction eviction : {HashEviction::lru, HashEviction::spared_tokens}) {
    CAPTURE(to_string(eviction));
    OffloadIndexOptions o = small_options(3);
    o.hash_eviction = eviction;
    Index index(o);
    auto store = [&](std::uint64_t hash, TokenCount boundary) {
      auto a = index.request_save(StateSave{SaveKey{PrefixHash{hash}, {}}, SlotId{0}, boundary});
      REQUIRE(a.granted());
      const StateSave dispatched = a.ticket().dispatch();
      REQUIRE(index.settle_save(SaveSettlement{dispatched.key, SavePhase::released, true}));
      REQUIRE(index.settle_save(SaveSettlement{dispatched.key, SavePhase::stored, true}));
    };
    store(1, 4096);  // the oldest, and it spares the most
    store(2, 64);
    store(3, 1024);
    store(4, 512);
    CHECK(index.stats().hashes_evicted == 1);
    CHECK(index.stats().indexed == 3);
    if (eviction == HashEviction::lru) {
      CHECK_FALSE(index.could_serve(PrefixHash{1}));
      CHECK(index.could_serve(PrefixHash{2}));
    } else {
      CHECK(index.could_serve(PrefixHash{1}));
      CHECK_FALSE(index.could_serve(PrefixHash{2}));
    }
    CHECK(index.stats().invariant_violations == 0);
    CHECK(kvfuse::check_consistency(index).ok);
  }
}
