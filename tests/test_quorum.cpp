// The merge: TpQuorum, SingleRank and the SettlementPump that feeds an index (R2, R3, R4).
#include "fake_index.hpp"
#include <doctest/doctest.h>

#include <kvfuse/worker/completion_guard.hpp>
#include <kvfuse/completion/settlement_pump.hpp>
#include <kvfuse/completion/single_rank.hpp>
#include <kvfuse/completion/tp_quorum.hpp>
#include <kvfuse/engine/offload_index.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

using namespace kvfuse;
using namespace std::chrono_literals;

namespace {

using Time = std::chrono::steady_clock::time_point;

LoadKey lk(std::uint64_t request, std::uint64_t generation) { return LoadKey{RequestId{request}, Generation{generation}}; }
SaveKey sk(std::uint64_t hash, std::uint64_t generation) { return SaveKey{PrefixHash{hash}, Generation{generation}}; }

CompletionRecord rec(LoadKey key, std::uint32_t rank, KvOutcome kv = KvOutcome::ok,
                     StateOutcome state = StateOutcome::none) {
  return CompletionRecord{key, rank, kv, state, Reason::none, Reason::none};
}
SaveRecord srec(SaveKey key, std::uint32_t rank, SavePhase phase, bool ok = true) {
  return SaveRecord{key, rank, phase, ok, ok ? Reason::none : Reason::kv_transfer_failed};
}
SaveSettlement released_phase(SaveKey key, bool ok = true) { return SaveSettlement{key, SavePhase::released, ok}; }
SaveSettlement stored_phase(SaveKey key, bool ok = true) { return SaveSettlement{key, SavePhase::stored, ok}; }

/// Collects settlements in order.
struct Collect {
  std::vector<Settlement> loads;
  std::vector<SaveSettlement> stores;
  void operator()(const Settlement& s) noexcept { loads.push_back(s); }
  void operator()(const SaveSettlement& s) noexcept { stores.push_back(s); }
};

using testing::FakeIndex;

static_assert(SettlementIndex<FakeIndex>);
struct NotAnIndex {
  bool settle(const Settlement&) { return true; }
};
static_assert(!SettlementIndex<NotAnIndex>);
static_assert(!CompletionGroup<FakeIndex>);

TpQuorumOptions config(std::uint32_t world, std::size_t tombstones = 4096, std::size_t lanes = 0) {
  TpQuorumOptions c;
  c.world_size = world;
  c.lanes_per_rank = lanes;
  c.tombstones = tombstones;
  c.lane_capacity = 64;
  return c;
}

/// Feeds one record to a quorum with no index in front (AdmitAll).
template <class Record>
MergeResult feed(TpQuorum& q, const Record& r, Collect& out) {
  AdmitAll all;
  return q.merge(r.rank, r, all, out);
}

/// Feeds one rank's whole save report: `released`, then `stored`, as a rank sends them.
void feed_save(TpQuorum& q, SaveKey key, std::uint32_t rank, Collect& out, bool stored_ok = true,
               bool released_ok = true) {
  feed(q, srec(key, rank, SavePhase::released, released_ok), out);
  feed(q, srec(key, rank, SavePhase::stored, stored_ok), out);
}

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    return e.what();
  }
  return "no error";
}

}  // namespace

// ---- R4: quorum and failure-dominant merge ------------------------------------------------

TEST_CASE("R4 a key settles only when every rank reported once") {
  TpQuorum q(config(4));
  Collect out;
  const LoadKey k = lk(1, 1);
  for (std::uint32_t r = 0; r < 3; ++r) CHECK(feed(q, rec(k, r), out) == MergeResult::counted);
  CHECK(out.loads.empty());
  CHECK(q.stats().pending == 1);
  CHECK(feed(q, rec(k, 3), out) == MergeResult::settled);
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0] == Settlement{k, true, false});
  CHECK(q.stats().pending == 0);
  CHECK(q.stats().settled == 1);
}

TEST_CASE("R4 the load is ok only if every rank's record is ok") {
  TpQuorum q(config(3));
  Collect out;
  feed(q, rec(lk(1, 1), 0), out);
  feed(q, rec(lk(1, 1), 1, KvOutcome::failed), out);
  feed(q, rec(lk(1, 1), 2), out);
  feed(q, rec(lk(2, 2), 0, KvOutcome::none, StateOutcome::restored), out);
  feed(q, rec(lk(2, 2), 1, KvOutcome::none, StateOutcome::restored), out);
  feed(q, rec(lk(2, 2), 2, KvOutcome::none, StateOutcome::refused), out);
  REQUIRE(out.loads.size() == 2);
  CHECK(out.loads[0] == Settlement{lk(1, 1), false, false});
  CHECK(out.loads[1] == Settlement{lk(2, 2), false, false});
}

TEST_CASE("R2 a miss on one rank and a KV failure on another settle together and the miss retracts") {
  TpQuorum q(config(2));
  Collect out;
  feed(q, rec(lk(1, 1), 0, KvOutcome::ok, StateOutcome::missed), out);
  feed(q, rec(lk(1, 1), 1, KvOutcome::failed, StateOutcome::restored), out);
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0] == Settlement{lk(1, 1), false, true});
}

TEST_CASE("R2 a KV-only failure / a transfer failure / a refusal / `none` never retract") {
  for (StateOutcome other : {StateOutcome::restored, StateOutcome::failed, StateOutcome::refused, StateOutcome::none}) {
    TpQuorum q(config(2));
    Collect out;
    feed(q, rec(lk(1, 1), 0, KvOutcome::failed, StateOutcome::restored), out);
    feed(q, rec(lk(1, 1), 1, KvOutcome::ok, other), out);
    REQUIRE(out.loads.size() == 1);
    CHECK_FALSE(out.loads[0].ok);
    CHECK_FALSE(out.loads[0].state_missed);
  }
}

TEST_CASE("R4 a duplicate from a rank never counts twice") {
  TpQuorum q(config(2));
  Collect out;
  CHECK(feed(q, rec(lk(1, 1), 0), out) == MergeResult::counted);
  CHECK(feed(q, rec(lk(1, 1), 0), out) == MergeResult::duplicate);
  CHECK(feed(q, rec(lk(1, 1), 0), out) == MergeResult::duplicate);
  CHECK(out.loads.empty());
  CHECK(q.stats().duplicate_reports == 2);
  CHECK(feed(q, rec(lk(1, 1), 1), out) == MergeResult::settled);
  CHECK(out.loads.size() == 1);
}

TEST_CASE("R4 contradictory reports from one rank: a failure is never overwritten by its later success") {
  TpQuorum q(config(2));
  Collect out;
  feed(q, rec(lk(1, 1), 0, KvOutcome::ok, StateOutcome::missed), out);
  feed(q, rec(lk(1, 1), 0, KvOutcome::ok, StateOutcome::restored), out);  // the same rank, now "fine"
  feed(q, rec(lk(1, 1), 1, KvOutcome::ok, StateOutcome::restored), out);
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0] == Settlement{lk(1, 1), false, true});
}

TEST_CASE("R4 a partial quorum waits: no expiry and visible in stats with its age") {
  TpQuorum q(config(8));
  Collect out;
  const Time t0 = Time{} + 1000s;
  q.set_time(t0);
  for (std::uint32_t r = 0; r < 7; ++r) feed(q, rec(lk(1, 1), r), out);
  q.set_time(t0 + 3600s);
  for (int i = 0; i < 1000; ++i) feed(q, rec(lk(100 + i, 1), 0), out);  // lots of later traffic
  GroupStats s = q.stats();
  CHECK(out.loads.empty());
  CHECK(s.pending == 1001);
  REQUIRE(s.oldest_pending_since.has_value());
  CHECK(*s.oldest_pending_since == t0);
  CHECK(s.oldest_pending_age(t0 + 7200s) == 7200s);
  feed(q, rec(lk(1, 1), 7), out);
  CHECK(out.loads.size() == 1);
  s = q.stats();
  REQUIRE(s.oldest_pending_since.has_value());
  CHECK(*s.oldest_pending_since == t0 + 3600s);
}

TEST_CASE("R4 the oldest-pending gauge follows settlements out of order") {
  TpQuorum q(config(2));
  Collect out;
  const Time t0 = Time{} + 10s;
  for (int i = 0; i < 3; ++i) {
    q.set_time(t0 + std::chrono::seconds(i));
    feed(q, rec(lk(i, 1), 0), out);
  }
  feed(q, rec(lk(1, 1), 1), out);  // the middle key settles first
  CHECK(*q.stats().oldest_pending_since == t0);
  feed(q, rec(lk(0, 1), 1), out);  // the oldest settles: the gauge skips the settled middle key
  CHECK(*q.stats().oldest_pending_since == t0 + 2s);
  feed(q, rec(lk(2, 1), 1), out);
  CHECK_FALSE(q.stats().oldest_pending_since.has_value());
  CHECK(q.stats().oldest_pending_age(t0 + 100s) == std::chrono::steady_clock::duration::zero());
}

TEST_CASE("R4 a dead rank unblocks every key waiting on it as failed and never retracts for it") {
  TpQuorum q(config(3));
  Collect out;
  feed(q, rec(lk(1, 1), 0), out);  // A: waits only on rank 2
  feed(q, rec(lk(1, 1), 1), out);
  feed(q, rec(lk(2, 1), 0, KvOutcome::ok, StateOutcome::missed), out);  // B: waits on ranks 1 and 2
  feed(q, rec(lk(3, 1), 2), out);  // C: rank 2 already reported, waits on 0 and 1
  q.mark_rank_dead(2, out);
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0] == Settlement{lk(1, 1), false, false});
  CHECK(q.stats().live_ranks == 2);
  // B still waits on live rank 1 (which may still be writing the destination), then fails.
  CHECK(feed(q, rec(lk(2, 1), 1), out) == MergeResult::settled);
  CHECK(out.loads[1] == Settlement{lk(2, 1), false, true});  // rank 0's genuine miss still retracts
  // C keeps rank 2's real report and settles on the live ranks' reports.
  feed(q, rec(lk(3, 1), 0), out);
  CHECK(feed(q, rec(lk(3, 1), 1), out) == MergeResult::settled);
  CHECK(out.loads[2] == Settlement{lk(3, 1), true, false});
  // A key first seen after the death waits only on the live ranks and is failed.
  feed(q, rec(lk(4, 1), 0), out);
  CHECK(feed(q, rec(lk(4, 1), 1), out) == MergeResult::settled);
  CHECK(out.loads[3] == Settlement{lk(4, 1), false, false});
  // The dead rank's stragglers are dropped and counted.
  CHECK(feed(q, rec(lk(5, 1), 2), out) == MergeResult::dead_rank);
  CHECK(q.stats().dead_rank_reports == 1);
  CHECK(q.stats().pending == 0);
  // Idempotent.
  q.mark_rank_dead(2, out);
  CHECK(out.loads.size() == 4);
}

TEST_CASE("R19 bad quorum configuration is a kvfuse::Error naming the value") {
  CHECK(error_of([] { TpQuorum q(config(0)); }).find("world_size") != std::string::npos);
  CHECK(error_of([] { TpQuorum q(config(65)); }).find("65") != std::string::npos);
  CHECK(error_of([] { TpQuorum q(config(2, 0)); }).find("tombstones") != std::string::npos);
  CHECK(error_of([] {
          TpQuorumOptions c = config(2, 16, 2);
          c.lane_capacity = 0;
          TpQuorum q(c);
        }).find("lane_capacity") != std::string::npos);
  TpQuorum q(config(2));
  Collect out;
  CHECK(error_of([&] { q.mark_rank_dead(7, out); }).find("7") != std::string::npos);
  CHECK(error_of([&] { (void)q.emitter(0, 0); }).find("lanes_per_rank") != std::string::npos);
  TpQuorum with_lanes(config(2, 16, 1));
  CHECK(error_of([&] { (void)with_lanes.emitter(2, 0); }).find("rank 2") != std::string::npos);
  CHECK(error_of([&] { (void)with_lanes.emitter(0, 1); }).find("lane 1") != std::string::npos);
  LaneEmitter held = with_lanes.emitter(0, 0);
  CHECK(error_of([&] { (void)with_lanes.emitter(0, 0); }).find("already has a producer") != std::string::npos);
}

TEST_CASE("R3 records naming a rank out of range or not their source are invalid and dropped") {
  TpQuorum q(config(2));
  Collect out;
  AdmitAll all;
  CHECK(q.merge(0, rec(lk(1, 1), 5), all, out) == MergeResult::invalid);
  CHECK(q.merge(1, rec(lk(1, 1), 0), all, out) == MergeResult::invalid);
  CHECK(q.stats().invalid_reports == 2);
  CHECK(q.stats().pending == 0);
}

// ---- R3: late reports, generations and tombstones -----------------------------------------

TEST_CASE("R3 late duplicates after settlement are dropped and counted") {
  TpQuorum q(config(2));
  Collect out;
  feed(q, rec(lk(1, 1), 0), out);
  feed(q, rec(lk(1, 1), 1), out);
  CHECK(feed(q, rec(lk(1, 1), 0, KvOutcome::failed), out) == MergeResult::late);
  CHECK(feed(q, rec(lk(1, 1), 1), out) == MergeResult::late);
  CHECK(out.loads.size() == 1);
  CHECK(q.stats().late_reports == 2);
  CHECK(q.stats().pending == 0);
}

TEST_CASE("R3 the tombstone FIFO is bounded") {
  TpQuorum q(config(1, 8));
  Collect out;
  for (int i = 0; i < 100; ++i) feed(q, rec(lk(i, 1), 0), out);
  CHECK(out.loads.size() == 100);
  CHECK(q.stats().tombstones == 8);
  CHECK(feed(q, rec(lk(99, 1), 0), out) == MergeResult::late);  // recent: still tombstoned
}

namespace {
struct PumpFixture {
  TpQuorum group;
  FakeIndex index;
  SettlementPump<TpQuorum, FakeIndex> pump{group, index};
  explicit PumpFixture(TpQuorumOptions c) : group(c) {}
  void send(const CompletionRecord& r) { pump.ingest(r.rank, std::span<const CompletionRecord>(&r, 1)); }
  void send(const SaveRecord& r) { pump.ingest(r.rank, std::span<const SaveRecord>(&r, 1)); }
  std::size_t seen = 0;
  /// One step; the load settlements that reached the index since the last (in order).
  std::vector<Settlement> step_loads() {
    const auto step = pump.step();
    CHECK(step.resolutions.size() == index.settled.size() - seen);  // one resolution per settled load
    std::vector<Settlement> out(index.settled.begin() + static_cast<std::ptrdiff_t>(seen), index.settled.end());
    seen = index.settled.size();
    return out;
  }
};
}  // namespace

TEST_CASE("R3 a tombstone that aged out cannot turn a late report into a partial key") {
  PumpFixture f(config(2, 2));
  for (int i = 1; i <= 3; ++i) {
    f.index.outstanding.insert(lk(i, 1));
    f.send(rec(lk(i, 1), 0));
    f.send(rec(lk(i, 1), 1));
  }
  CHECK(f.step_loads().size() == 3);
  CHECK(f.group.stats().tombstones == 2);  // key 1's tombstone aged out
  f.send(rec(lk(1, 1), 0));                // a late report for it
  const PumpStats s = f.pump.stats();
  CHECK(s.group.pending == 0);  // the index said "not outstanding": no partial entry
  CHECK(s.late_reports == 1);
  CHECK(f.step_loads().empty());
}

TEST_CASE("R3 records for a key the index does not hold are late before they reach the quorum") {
  PumpFixture f(config(2));
  f.send(rec(lk(9, 9), 0));  // never dispatched
  CHECK(f.pump.stats().group.pending == 0);
  CHECK(f.pump.stats().late_reports == 1);
  // The index is asked only for a key's first record; later ones join the entry.
  f.index.outstanding.insert(lk(1, 1));
  f.index.outstanding_queries = 0;
  f.send(rec(lk(1, 1), 0));
  f.send(rec(lk(1, 1), 1));
  CHECK(f.index.outstanding_queries == 1);
  CHECK(f.step_loads().size() == 1);
}

TEST_CASE("R3 cross-generation reports never settle another generation") {
  PumpFixture f(config(2));
  f.index.outstanding.insert(lk(1, 2));  // generation 2 is in flight, generation 1 is not
  f.send(rec(lk(1, 1), 0));
  f.send(rec(lk(1, 1), 1));
  CHECK(f.step_loads().empty());
  CHECK(f.index.outstanding.contains(lk(1, 2)));
  f.send(rec(lk(1, 2), 0, KvOutcome::failed));
  f.send(rec(lk(1, 2), 1));
  const auto loads = f.step_loads();
  REQUIRE(loads.size() == 1);
  CHECK(loads[0] == Settlement{lk(1, 2), false, false});
  CHECK(f.pump.stats().late_reports == 2);
}

TEST_CASE("R3 a re-admitted request's reports settle only its own load and the old orphan's are late") {
  PumpFixture f(config(2));
  f.index.outstanding.insert(lk(7, 1));
  f.send(rec(lk(7, 1), 0, KvOutcome::ok, StateOutcome::restored));  // rank 0 of generation 1 reports
  f.index.outstanding.erase(lk(7, 1));                              // orphaned, then reclaimed
  f.index.outstanding.insert(lk(7, 2));                             // re-admitted: a new generation
  f.send(rec(lk(7, 2), 0, KvOutcome::ok, StateOutcome::restored));
  f.send(rec(lk(7, 1), 1, KvOutcome::ok, StateOutcome::missed));    // the old load's last report
  f.send(rec(lk(7, 2), 1, KvOutcome::ok, StateOutcome::restored));
  const auto loads = f.step_loads();
  REQUIRE(loads.size() == 1);
  CHECK(loads[0] == Settlement{lk(7, 2), true, false});
  REQUIRE(f.index.settled.size() == 1);  // the old generation's quorum never touched the index's new load
  CHECK(f.pump.stats().late_settlements == 1);
  CHECK(f.pump.stats().group.pending == 0);
}

TEST_CASE("R4 a dead rank settles through the pump into the index") {
  PumpFixture f(config(2));
  f.index.outstanding.insert(lk(1, 1));
  f.send(rec(lk(1, 1), 0));
  f.pump.mark_rank_dead(1);
  const auto loads = f.step_loads();
  REQUIRE(loads.size() == 1);
  CHECK(loads[0] == Settlement{lk(1, 1), false, false});
  CHECK(f.index.outstanding.empty());
}

TEST_CASE("R4 pump results survive until the next step and ingest results ride the step") {
  PumpFixture f(config(1));
  f.index.outstanding.insert(lk(1, 1));
  f.index.outstanding.insert(lk(2, 1));
  f.send(rec(lk(1, 1), 0));
  auto step = f.pump.step();
  REQUIRE(step.resolutions.size() == 1);
  f.send(rec(lk(2, 1), 0));
  CHECK(step.resolutions.size() == 1);  // still the first step's answer until the next step
  CHECK(step.resolutions[0].key == lk(1, 1));
  step = f.pump.step();
  REQUIRE(step.resolutions.size() == 1);
  CHECK(step.resolutions[0].key == lk(2, 1));
  CHECK(f.pump.step().resolutions.empty());
}

// ---- saves: two phases ----------------------------------------------------------------------

TEST_CASE("R4 a save's source is released only if every rank released and stored only if every rank stored") {
  TpQuorum q(config(3));
  Collect out;
  for (std::uint32_t r = 0; r < 3; ++r) feed_save(q, sk(1, 1), r, out);
  for (std::uint32_t r = 0; r < 3; ++r) feed_save(q, sk(2, 1), r, out, r != 1, true);
  for (std::uint32_t r = 0; r < 3; ++r) feed_save(q, sk(3, 1), r, out, true, r != 2);
  REQUIRE(out.stores.size() == 6);
  CHECK(out.stores[0] == released_phase(sk(1, 1)));
  CHECK(out.stores[1] == stored_phase(sk(1, 1)));
  CHECK(out.stores[2] == released_phase(sk(2, 1)));
  CHECK(out.stores[3] == stored_phase(sk(2, 1), false));
  CHECK(out.stores[4] == released_phase(sk(3, 1), false));
  CHECK(out.stores[5] == stored_phase(sk(3, 1)));
  CHECK(q.stats().save_settled == 6);
  CHECK(q.stats().pending_saves == 0);
}

TEST_CASE("R4 early block release: the released phase settles while no rank has stored yet") {
  TpQuorum q(config(2));
  Collect out;
  feed(q, srec(sk(1, 1), 0, SavePhase::released), out);
  CHECK(out.stores.empty());
  CHECK(feed(q, srec(sk(1, 1), 1, SavePhase::released), out) == MergeResult::settled);
  REQUIRE(out.stores.size() == 1);
  CHECK(out.stores[0] == released_phase(sk(1, 1)));
  CHECK(q.stats().pending_saves == 1);  // waits for the stored phase
  feed(q, srec(sk(1, 1), 0, SavePhase::stored), out);
  feed(q, srec(sk(1, 1), 1, SavePhase::stored), out);
  REQUIRE(out.stores.size() == 2);
  CHECK(out.stores[1] == stored_phase(sk(1, 1)));
  CHECK(q.stats().pending_saves == 0);
}

TEST_CASE("R4 a save duplicate never counts twice and a failed phase is never overwritten") {
  TpQuorum q(config(2));
  Collect out;
  feed(q, srec(sk(1, 1), 0, SavePhase::released, false), out);
  CHECK(feed(q, srec(sk(1, 1), 0, SavePhase::released, true), out) == MergeResult::duplicate);
  feed(q, srec(sk(1, 1), 0, SavePhase::stored, false), out);
  CHECK(feed(q, srec(sk(1, 1), 0, SavePhase::stored, true), out) == MergeResult::duplicate);
  CHECK(out.stores.empty());
  CHECK(q.stats().pending_saves == 1);
  feed_save(q, sk(1, 1), 1, out);
  REQUIRE(out.stores.size() == 2);
  CHECK(out.stores[0] == released_phase(sk(1, 1), false));
  CHECK(out.stores[1] == stored_phase(sk(1, 1), false));
  CHECK(feed(q, srec(sk(1, 1), 1, SavePhase::stored), out) == MergeResult::late);
}

TEST_CASE("R4 a rank that died mid-save releases its source, and the save is stored if every live rank stored") {
  TpQuorum q(config(3));
  Collect out;
  feed_save(q, sk(1, 1), 0, out);  // ranks 0 and 1 stored key 1, rank 2 dies before it does
  feed_save(q, sk(1, 1), 1, out);
  feed(q, srec(sk(2, 1), 0, SavePhase::released), out);  // key 2: rank 0 released, nobody stored yet
  feed_save(q, sk(3, 1), 0, out, false);                   // key 3: rank 0 failed to store
  feed_save(q, sk(3, 1), 1, out);
  q.mark_rank_dead(2, out);
  auto position = [&](const SaveSettlement& s) {
    return std::find(out.stores.begin(), out.stores.end(), s) - out.stores.begin();
  };
  const auto n = static_cast<std::ptrdiff_t>(out.stores.size());
  CHECK(position(released_phase(sk(1, 1))) < position(stored_phase(sk(1, 1))));  // every live rank stored: indexed (docs/reference.md#save-quorum)
  CHECK(position(stored_phase(sk(1, 1))) < n);
  CHECK(position(stored_phase(sk(3, 1), false)) < n);  // a live rank's failure still fails it
  CHECK(position(released_phase(sk(2, 1))) == n);      // key 2 still waits for rank 1's released report
  feed(q, srec(sk(2, 1), 1, SavePhase::released), out);
  CHECK(out.stores.back() == released_phase(sk(2, 1)));
  feed(q, srec(sk(2, 1), 0, SavePhase::stored), out);
  feed(q, srec(sk(2, 1), 1, SavePhase::stored), out);
  CHECK(out.stores.back() == stored_phase(sk(2, 1)));
  CHECK(q.stats().pending_saves == 0);
}

TEST_CASE("R4 a save no live rank stored is never stored: every rank died before storing it") {
  TpQuorum q(config(2));
  Collect out;
  feed(q, srec(sk(1, 1), 0, SavePhase::released), out);
  q.mark_rank_dead(0, out);
  q.mark_rank_dead(1, out);
  REQUIRE(out.stores.size() == 2);
  CHECK(out.stores[0] == released_phase(sk(1, 1)));
  CHECK(out.stores[1] == stored_phase(sk(1, 1), false));
}

TEST_CASE("R4 a load no rank reported settles, failed, once every rank that owed it is dead") {
  PumpFixture f(config(3));
  f.index.outstanding.insert(lk(1, 1));  // in flight, no record from anyone yet
  f.index.saves.insert(sk(9, 2));        // a save in flight, likewise
  f.index.last = Generation{2};
  f.pump.mark_rank_dead(0);
  f.pump.mark_rank_dead(2);
  CHECK(f.step_loads().empty());  // rank 1 still owes both
  CHECK(f.index.save_settlements.empty());
  f.pump.mark_rank_dead(1);
  const auto loads = f.step_loads();
  REQUIRE(loads.size() == 1);
  CHECK(loads[0] == Settlement{lk(1, 1), false, false});  // failed, never a miss
  REQUIRE(f.index.save_settlements.size() == 2);
  CHECK(f.index.save_settlements[0] == released_phase(sk(9, 2)));    // a dead rank reads nothing
  CHECK(f.index.save_settlements[1] == stored_phase(sk(9, 2), false));  // nobody stored it
  CHECK(f.index.outstanding.empty());
  CHECK(f.index.saves.empty());
}

TEST_CASE("R4 a rolling restart settles the loads issued before it, and no load a returned rank still owes") {
  PumpFixture f(config(2));
  f.index.outstanding.insert(lk(1, 1));  // dispatched before anything went wrong; nobody reported
  f.index.last = Generation{1};
  f.pump.mark_rank_dead(0);
  f.pump.mark_rank_alive(0);  // back: counts for generations 2 and later only
  f.index.outstanding.insert(lk(2, 2));  // dispatched after rank 0 came back: rank 0 owes it
  f.index.last = Generation{2};
  CHECK(f.step_loads().empty());
  f.pump.mark_rank_dead(1);
  f.pump.mark_rank_alive(1);
  const auto loads = f.step_loads();
  REQUIRE(loads.size() == 1);
  CHECK(loads[0] == Settlement{lk(1, 1), false, false});
  CHECK(f.index.outstanding.contains(lk(2, 2)));
  f.send(rec(lk(2, 2), 0));  // rank 0 reports; rank 1 stands substituted for generation 2
  const auto later = f.step_loads();
  REQUIRE(later.size() == 1);
  CHECK(later[0] == Settlement{lk(2, 2), false, false});
}

TEST_CASE("R4 a load dispatched while every rank is dead settles, failed, at the next step") {
  PumpFixture f(config(2));
  f.pump.mark_rank_dead(0);
  f.pump.mark_rank_dead(1);
  f.index.outstanding.insert(lk(1, 1));
  f.index.last = Generation{1};
  const auto loads = f.step_loads();
  REQUIRE(loads.size() == 1);
  CHECK(loads[0] == Settlement{lk(1, 1), false, false});
}

// The returning rank counts only for keys issued after it returned, so a key dispatched
// while every rank was dead is owed by nobody; had the return cleared "every rank dead"
// before a step swept it, nothing would ever settle it (found by model/load_protocol.pml).
TEST_CASE("R4 a load dispatched while every rank is dead settles even when a rank returns before the next step") {
  PumpFixture f(config(2));
  f.pump.mark_rank_dead(0);
  f.pump.mark_rank_dead(1);
  f.index.outstanding.insert(lk(1, 1));
  f.index.saves.insert(sk(4, 2));
  f.index.last = Generation{2};
  f.pump.mark_rank_alive(1);  // back before any step swept the load and the save
  const auto step = f.pump.step();
  REQUIRE(f.index.settled.size() == 1);
  CHECK(f.index.settled[0] == Settlement{lk(1, 1), false, false});
  REQUIRE(step.saves.size() == 2);
  CHECK(step.saves[1] == stored_phase(sk(4, 2), false));
  // A key issued after the return is owed by the returned rank, and waits for it.
  f.index.outstanding.insert(lk(3, 3));
  f.index.last = Generation{3};
  CHECK(f.pump.step().resolutions.empty());
}

TEST_CASE("R4 SingleRank: a load in flight when the only rank dies settles failed") {
  SingleRank group(SingleRankOptions{0, 16, {}});
  FakeIndex index;
  SettlementPump<SingleRank, FakeIndex> pump(group, index);
  index.outstanding.insert(lk(1, 1));
  index.saves.insert(sk(2, 2));
  index.last = Generation{2};
  pump.mark_rank_dead(0);
  const auto step = pump.step();
  REQUIRE(index.settled.size() == 1);
  CHECK(index.settled[0] == Settlement{lk(1, 1), false, false});
  CHECK(step.resolutions.size() == 1);
  REQUIRE(step.saves.size() == 2);
  CHECK(step.saves[1] == stored_phase(sk(2, 2), false));
  pump.mark_rank_alive(0);
  index.outstanding.insert(lk(3, 3));
  index.last = Generation{3};
  CHECK(pump.step().resolutions.empty());  // the rank is back and owes it
}

TEST_CASE("R3 save records settle only for saves the index has in flight and once per phase") {
  PumpFixture f(config(2));
  f.send(srec(sk(5, 1), 0, SavePhase::released));  // never issued
  f.send(srec(sk(5, 1), 1, SavePhase::released));
  CHECK(f.pump.step().saves.empty());
  CHECK(f.pump.stats().late_reports == 2);
  f.index.saves.insert(sk(5, 2));
  for (std::uint32_t r = 0; r < 2; ++r) f.send(srec(sk(5, 2), r, SavePhase::released));
  auto step = f.pump.step();
  REQUIRE(step.saves.size() == 1);
  CHECK(step.saves[0] == released_phase(sk(5, 2)));
  CHECK_FALSE(f.index.indexed.contains(PrefixHash{5}));
  for (std::uint32_t r = 0; r < 2; ++r) f.send(srec(sk(5, 2), r, SavePhase::stored));
  step = f.pump.step();
  REQUIRE(step.saves.size() == 1);
  CHECK(step.saves[0] == stored_phase(sk(5, 2)));
  CHECK(f.index.indexed.contains(PrefixHash{5}));
  f.send(srec(sk(5, 2), 0, SavePhase::stored));  // late duplicate
  CHECK(f.pump.step().saves.empty());
  CHECK(f.pump.stats().group.pending_saves == 0);
  CHECK(f.pump.stats().late_reports == 3);
}

// ---- SingleRank -----------------------------------------------------------------------------

TEST_CASE("R3 SingleRank settles each admitted record at once and drops the rest as late") {
  SingleRank group(SingleRankOptions{2, 16, {}});
  FakeIndex index;
  SettlementPump<SingleRank, FakeIndex> pump(group, index);
  index.outstanding.insert(lk(1, 1));
  index.outstanding.insert(lk(2, 1));
  index.saves.insert(sk(3, 1));
  LaneEmitter load_lane = group.emitter(0, 0);
  LaneEmitter save_lane = group.emitter(0, 1);
  load_lane.emit(rec(lk(1, 1), 0, KvOutcome::ok, StateOutcome::missed));
  load_lane.emit(rec(lk(1, 1), 0));  // a duplicate: late, the index already settled the key
  load_lane.emit(rec(lk(2, 1), 0));
  load_lane.emit(rec(lk(4, 1), 0));  // never dispatched
  save_lane.emit(srec(sk(3, 1), 0, SavePhase::released));
  save_lane.emit(srec(sk(3, 1), 0, SavePhase::stored));
  const auto step = pump.step();
  CHECK(step.records == 6);
  REQUIRE(index.settled.size() == 2);
  CHECK(index.settled[0] == Settlement{lk(1, 1), false, true});
  CHECK(index.settled[1] == Settlement{lk(2, 1), true, false});
  CHECK(step.resolutions.size() == 2);
  REQUIRE(step.saves.size() == 2);
  CHECK(step.saves[0] == released_phase(sk(3, 1)));
  CHECK(step.saves[1] == stored_phase(sk(3, 1)));
  const PumpStats s = pump.stats();
  CHECK(s.group.late_reports == 2);
  CHECK(s.group.pending == 0);
  CHECK(s.group.queues.drained == 6);
  CHECK(error_of([&] { (void)group.emitter(1, 0); }).find("rank 1") != std::string::npos);
}

TEST_CASE("R3 TpQuorum lane queues feed the pump in one step") {
  TpQuorum group(config(2, 64, 2));
  FakeIndex index;
  SettlementPump<TpQuorum, FakeIndex> pump(group, index);
  LaneEmitter r0 = group.emitter(0, 0);
  LaneEmitter r1 = group.emitter(1, 1);
  for (int i = 1; i <= 10; ++i) index.outstanding.insert(lk(i, 1));
  for (int i = 1; i <= 10; ++i) {
    r0.emit(rec(lk(i, 1), 0));
    r1.emit(rec(lk(i, 1), 1, i % 2 == 0 ? KvOutcome::ok : KvOutcome::failed));
  }
  r1.emit(rec(lk(1, 1), 0));  // rank 0's record in rank 1's queue: invalid
  const auto step = pump.step();
  CHECK(step.records == 21);
  CHECK(step.resolutions.size() == 10);
  REQUIRE(index.settled.size() == 10);
  for (const Settlement& s : index.settled) CHECK(s.ok == (s.key.request.value % 2 == 0));
  CHECK(pump.stats().group.invalid_reports == 1);
  CHECK(index.outstanding.empty());
}

// ---- against the real OffloadIndex -------------------------------------------------------

static_assert(SettlementIndex<OffloadIndex<>>);

TEST_CASE("R2 guards on two ranks with the quorum and the pump settle a joint load into OffloadIndex") {
  std::vector<SlotId> released;
  OffloadIndexOptions options;
  options.hash_capacity = 64;
  options.slot_count = 8;
  OffloadIndex<> index(options, [&](SlotId s) { released.push_back(s); });
  TpQuorum group(config(2, 64, 2));
  SettlementPump<TpQuorum, OffloadIndex<>> pump(group, index);
  LaneEmitter load0 = group.emitter(0, 0);
  LaneEmitter load1 = group.emitter(1, 0);
  LaneEmitter store0 = group.emitter(0, 1);
  LaneEmitter store1 = group.emitter(1, 1);

  // A save of hash 42 lands on both ranks: only then is it indexed.
  auto save_grant = index.request_save(StateSave{SaveKey{PrefixHash{42}, {}}, SlotId{0}, 256});
  REQUIRE(save_grant.granted());
  const SaveKey save = save_grant.ticket().dispatch().key;
  { SaveGuard g(save, 0, store0); g.release_source(); g.stored_ok(); }
  CHECK(pump.step().saves.empty());  // rank 0 alone settles nothing
  CHECK_FALSE(index.could_serve(PrefixHash{42}));
  {
    SaveGuard g(save, 1, store1);
    g.release_source();
    g.stored_ok();
  }
  auto step = pump.step();
  REQUIRE(step.saves.size() == 2);
  CHECK(step.saves[0] == released_phase(save));
  CHECK(step.saves[1] == stored_phase(save));
  CHECK(index.could_serve(PrefixHash{42}));

  // A joint load of it: rank 0 restores, rank 1's tier genuinely misses.
  KvSpec kv{0, 256, {PrefixHash{1}}, {BlockId{0}}};
  LoadGrant grant = index.request_load(RequestId{5}, kv, StateSpec{256, PrefixHash{42}, SlotId{1}, 16, 256});
  REQUIRE(grant.granted());
  const LoadRequest req = grant.ticket().dispatch();
  CHECK(index.is_in_flight(req.key));
  {
    CompletionGuard g(req, 0, load0);
    g.kv_ok();
    g.state(StateOutcome::restored);
  }
  {
    CompletionGuard g(req, 1, load1);
    g.kv_ok();
    g.state(StateOutcome::missed);
  }
  step = pump.step();
  CHECK_FALSE(index.is_in_flight(req.key));
  CHECK_FALSE(index.could_serve(PrefixHash{42}));  // the miss retracted the hash
  REQUIRE(step.resolutions.size() == 1);
  CHECK(step.resolutions[0].key == req.key);
  CHECK(step.resolutions[0].kind == Resolution::failed);
  CHECK(step.resolutions[0].state_missed);
  CHECK(index.pending_resolutions() == 0);  // the pump drained the one stream

  // A straggler for the settled key is late everywhere.
  { CompletionGuard g(req, 0, load0); }
  CHECK(pump.step().resolutions.empty());
  CHECK(pump.stats().late_reports == 1);
  const IndexStats s = index.stats();
  CHECK(s.issued == s.completed + s.failed + s.abandoned + s.outstanding);
  CHECK(s.invariant_violations == 0);
}

// ---- the index resolves, the group forgets; ranks come back --------------------------------

TEST_CASE("R3 a key the index resolved without its ranks leaves the quorum and its later records are late") {
  OffloadIndexOptions options;
  options.slot_count = 4;
  OffloadIndex<> index(options, [](SlotId) {});
  TpQuorum group(config(8));
  SettlementPump<TpQuorum, OffloadIndex<>> pump(group, index);
  auto report = [&](LoadKey key, std::uint32_t rank) {
    const CompletionRecord r = rec(key, rank);
    pump.ingest(rank, std::span<const CompletionRecord>(&r, 1));
  };
  const KvSpec kv{0, 256, {PrefixHash{1}}, {BlockId{0}}};

  SUBCASE("an orphan reclaimed after four of eight ranks reported") {
    auto grant = index.request_load(RequestId{1}, kv, std::nullopt);
    const LoadKey key = grant.ticket().dispatch().key;
    for (std::uint32_t r = 0; r < 4; ++r) report(key, r);
    CHECK(pump.step().resolutions.empty());
    CHECK(group.stats().pending == 1);
    REQUIRE(index.orphan(key));
    CHECK(index.reclaim(std::chrono::steady_clock::now() + 1h, 1s) == 1);
    const auto step = pump.step();
    REQUIRE(step.resolutions.size() == 1);
    CHECK(step.resolutions[0].kind == Resolution::reclaimed);
    CHECK(group.stats().pending == 0);
    CHECK(pump.stats().forgotten == 1);
    for (std::uint32_t r = 4; r < 8; ++r) report(key, r);  // the silent ranks finally speak
    CHECK(group.stats().pending == 0);
    CHECK(group.stats().late_reports == 4);
  }
  SUBCASE("a live load the engine failed or abandoned by key") {
    auto a1 = index.request_load(RequestId{1}, kv, std::nullopt);
    auto a2 = index.request_load(RequestId{2}, kv, std::nullopt);
    const LoadKey k1 = a1.ticket().dispatch().key;
    const LoadKey k2 = a2.ticket().dispatch().key;
    for (std::uint32_t r = 0; r < 4; ++r) {
      report(k1, r);
      report(k2, r);
    }
    CHECK(group.stats().pending == 2);
    CHECK(index.fail_all(std::span<const LoadKey>(&k1, 1), false) == 1);
    CHECK(index.abandon(k2));
    (void)pump.step();
    CHECK(group.stats().pending == 0);
    for (std::uint32_t r = 4; r < 8; ++r) {
      report(k1, r);
      report(k2, r);
    }
    CHECK(group.stats().pending == 0);  // never re-created: `pending` cannot stay 1 forever
    CHECK(pump.stats().late_reports == 8);
  }
  CHECK(index.stats().invariant_violations == 0);
}

TEST_CASE("R4 a rank that came back counts for loads issued after its return and never for a record from before") {
  PumpFixture f(config(2));
  f.index.outstanding.insert(lk(1, 3));
  f.index.outstanding.insert(lk(2, 4));
  f.index.outstanding.insert(lk(3, 6));
  f.send(rec(lk(1, 3), 0));
  f.pump.mark_rank_dead(1);
  auto loads = f.step_loads();
  REQUIRE(loads.size() == 1);
  CHECK(loads[0] == Settlement{lk(1, 3), false, false});

  f.index.last = Generation{5};  // generations up to 5 were issued while rank 1 was down
  f.pump.mark_rank_alive(1);
  CHECK(f.group.stats().live_ranks == 2);
  f.send(rec(lk(2, 4), 1));  // sent before the death: does not count
  CHECK(f.group.stats().dead_rank_reports == 1);
  CHECK(f.group.stats().pending == 0);
  f.send(rec(lk(2, 4), 0));  // rank 0 alone settles it, failed: rank 1 stood substituted
  loads = f.step_loads();
  REQUIRE(loads.size() == 1);
  CHECK(loads[0] == Settlement{lk(2, 4), false, false});

  f.send(rec(lk(3, 6), 0));  // issued after the return: waits for rank 1
  CHECK(f.step_loads().empty());
  f.send(rec(lk(3, 6), 1));
  loads = f.step_loads();
  REQUIRE(loads.size() == 1);
  CHECK(loads[0] == Settlement{lk(3, 6), true, false});
  CHECK(error_of([&] { f.pump.mark_rank_alive(2); }).find("rank 2") != std::string::npos);
}
