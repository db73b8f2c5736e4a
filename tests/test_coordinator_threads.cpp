// The engine loop end to end: a Coordinator over the OffloadIndex, a TpQuorum pump and 4
// ranks as threads (each connector on its own lanes), for every preset. Every byte a load
// writes is checked; every release is checked against what the ranks could still touch.
#include "coordinator_harness.hpp"

#include <kvfuse/testing/index_consistency.hpp>

#include <algorithm>
#include <memory>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;
using namespace std::chrono_literals;

namespace {

template <class Conn>
void run_scripted() {
  Engine<Conn> e;
  const Prompt p(7, 3);  // 3 whole chunks + 16 tokens: P = 208
  const TokenCount boundary = 3 * 64 - 16;  // 176: on the block grid, inside chunk 2
  const std::vector<BlockId> first_blocks = block_range(0, 13);

  // Turn 1: nothing in the tier: compute, then finish (saves KV and the checkpoint).
  AdmitDecision d = e.coord.admit(AdmitRequest{RequestId{1}, p.tokens, 0, p.keys, first_blocks, p.checkpoints, SlotId{0}});
  CHECK_FALSE(d.parked);
  CHECK(d.reason == ComputeReason::planned_no_load);
  forward(e, p, first_blocks, SlotId{0}, boundary);
  const std::size_t sent = e.coord.finish(FinishRequest{RequestId{1}, p.tokens, p.keys, first_blocks,
                                                         Checkpoint{boundary, p.hash_at(boundary)}, SlotId{0}});
  CHECK(sent == (Conn::has_state ? 2u : 1u));
  // Early release: the blocks come back once every rank released the source.
  REQUIRE(e.step_until([&] { return e.was_freed(RequestId{1}); }));
  REQUIRE(e.step_until([&] { return e.index.stats().saves_outstanding == 0; }));
  CHECK(e.index.stats().saves_stored == sent);
  if constexpr (Conn::has_state) CHECK(e.index.could_serve(p.hash_at(boundary)));

  // Evicted from HBM; the same prompt comes back as request 2 into other blocks and slot 2.
  for (auto& rank : e.ranks) std::memset(rank->pools.blocks, 0, rank->pools.geo.num_blocks * rank->pools.geo.block_bytes());
  const std::vector<BlockId> second_blocks = block_range(20, 13);
  d = e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, second_blocks, p.checkpoints, SlotId{2}});
  REQUIRE(d.parked);
  const TokenCount expected = Conn::has_state ? boundary : 3 * 64;  // joint claims B; dense claims whole chunks
  CHECK(d.claimed_tokens == expected);
  if constexpr (Conn::has_state) CHECK(std::holds_alternative<JointLoad>(d.plan));
  else CHECK(std::holds_alternative<KvOnlyLoad>(d.plan));
  CHECK(e.coord.stats().invariant_violations == 0);
  REQUIRE(e.step_until([&] { return e.unparks_of(RequestId{2}) == 1; }));
  const Unpark u = e.unparked.back();
  CHECK(u.tokens == expected);
  CHECK(u.kind == Resolution::completed);
  for (auto& rank : e.ranks) {
    CHECK(rank->pools.holds_prompt(second_blocks, 0, expected));
    if constexpr (Conn::has_state) CHECK(rank->pools.holds_state(SlotId{2}, p.hash_at(boundary)));
  }

  // Finish request 2: everything it could save is in the tier already (watermark), so
  // only the checkpoint is saved again (stateful), and the blocks come back.
  e.coord.finish(FinishRequest{RequestId{2}, p.tokens, p.keys, second_blocks, Checkpoint{boundary, p.hash_at(boundary)}, SlotId{2}});
  REQUIRE(e.step_until([&] { return e.was_freed(RequestId{2}) && e.index.stats().saves_outstanding == 0; }));
  const CoordinatorStats s = e.coord.stats();
  CHECK(s.invariant_violations == 0);
  CHECK(s.waiting_now == 0);
  CHECK(s.holding_now == 0);
  CHECK(s.unparked == 1);
  CHECK(e.unparks_of(RequestId{2}) == 1);
  CHECK(e.index.stats().slots_freed == 0);  // no orphan, no slot held by the index
  CHECK(check_consistency(e.index).ok);
}

}  // namespace

TEST_CASE("coordinator: a K3 prompt is saved and loads back with a joint load that claims B") { run_scripted<K3>(); }
TEST_CASE("coordinator: a DSV4 prompt is saved and loads back with a joint load that claims B") { run_scripted<Dsv4>(); }
TEST_CASE("coordinator: a dense prompt is saved and loads back whole chunks") { run_scripted<Dense>(); }

TEST_CASE("R8 coordinator: an abort while parked never unparks and is freed only after the ranks settled") {
  Engine<K3> e;
  const Prompt p(9, 3);
  save_prompt(e, RequestId{1}, p, 176);
  e.transport.skip_rank = 3;  // rank 3 has not reported yet: the load stays in flight
  AdmitDecision d = e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}});
  REQUIRE(d.parked);
  e.coord.teardown(RequestId{2});
  CHECK_FALSE(e.coord.is_parked(RequestId{2}));
  e.steps(20);
  CHECK_FALSE(e.was_freed(RequestId{2}));  // rank 3 may still write its blocks and slot
  CHECK(e.coord.stats().holding_now == 1);
  // Rank 3 finally reports (its dispatch arrives late): now the resources come back.
  REQUIRE(e.transport.last.has_value());
  CHECK(e.transport.last->key == d.key);
  e.ranks[3]->conn.load(*e.transport.last);
  REQUIRE(e.step_until([&] { return e.was_freed(RequestId{2}); }));
  CHECK(e.unparks_of(RequestId{2}) == 0);
  CHECK(e.freed.back() == Freed{RequestId{2}, d.admission});  // blocks and slot 2 together, one signal
  CHECK(e.index.stats().slots_freed == 1);  // the index held the slot for the orphan
  CHECK(e.coord.stats().invariant_violations == 0);
  CHECK(e.coord.stats().holding_now == 0);
}

TEST_CASE("R8 coordinator: a request torn down twice (preempted, then aborted) is freed once, after its orphan ends") {
  Engine<K3> e;
  const Prompt p(41, 3);
  save_prompt(e, RequestId{1}, p, 176);
  e.transport.skip_rank = 3;  // rank 3 has not received the load yet: it will still write the blocks
  const AdmitDecision d =
      e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}});
  REQUIRE(d.parked);
  e.coord.teardown(RequestId{2});  // preempted
  e.coord.teardown(RequestId{2});  // then aborted
  e.steps(20);
  CHECK(e.frees_of(RequestId{2}) == 0);  // rank 3 may still write its blocks and slot
  REQUIRE(e.transport.last.has_value());
  e.ranks[3]->conn.load(*e.transport.last);
  REQUIRE(e.step_until([&] { return e.was_freed(RequestId{2}); }));
  e.steps(10);
  CHECK(e.frees_of(RequestId{2}) == 1);
  CHECK(e.freed.back() == Freed{RequestId{2}, d.admission});
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("R8 coordinator: each admission of a re-admitted request is freed once, under its own admission id") {
  Engine<K3> e;
  const Prompt p(43, 3);
  save_prompt(e, RequestId{1}, p, 176);
  e.transport.skip_rank = 3;
  const std::vector<BlockId> first_blocks = block_range(20, 13), second_blocks = block_range(40, 13);
  const AdmitDecision first =
      e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, first_blocks, p.checkpoints, SlotId{2}});
  REQUIRE(first.parked);
  const LoadRequest first_load = *e.transport.last;
  e.coord.teardown(RequestId{2});  // preempted while rank 3 still owes its load: the orphan holds blocks 20.. and slot 2
  e.transport.skip_rank = kWorld;
  const AdmitDecision second =
      e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, second_blocks, p.checkpoints, SlotId{3}});
  REQUIRE(second.parked);
  CHECK(second.admission != first.admission);
  REQUIRE(e.step_until([&] { return e.unparks_of(RequestId{2}) == 1; }));
  e.steps(10);
  CHECK(e.frees_of(RequestId{2}) == 0);  // the new admission runs; the old orphan is still written
  e.ranks[3]->conn.load(first_load);        // rank 3 finally runs the old load
  REQUIRE(e.step_until([&] { return e.frees_of(RequestId{2}) == 1; }));
  CHECK(e.freed.back() == Freed{RequestId{2}, first.admission});  // the orphan's resources, not the running ones
  forward(e, p, second_blocks, SlotId{3}, 176);
  (void)e.coord.finish(FinishRequest{RequestId{2}, p.tokens, p.keys, second_blocks, Checkpoint{176, p.hash_at(176)}, SlotId{3}});
  REQUIRE(e.step_until([&] { return e.frees_of(RequestId{2}) == 2 && e.index.stats().saves_outstanding == 0; }));
  CHECK(e.freed.back() == Freed{RequestId{2}, second.admission});
  e.steps(10);
  CHECK(e.frees_of(RequestId{2}) == 2);
  CHECK(e.coord.stats().invariant_violations == 0);
  CHECK(e.coord.stats().holding_now == 0);
}

TEST_CASE("R8 coordinator: the Freed event is the one signal that a slot is free: an index with its own callback is refused") {
  Engine<K3> e;
  OffloadIndex<> with_callback(OffloadIndexOptions{.hash_capacity = 16, .slot_count = 4}, [](SlotId) {});
  SettlementPump<TpQuorum, OffloadIndex<>> pump(e.group, with_callback);
  try {
    Coordinator<TpQuorum, Transport<K3>, Lookup<K3>> two_owners(
        CoordinatorOptions{StateLayout::k3_recurrent, PlanGrids{16, 64}, 0, 8}, with_callback, pump, e.transport, e.lookup);
    FAIL("a Coordinator accepted an index that frees orphan slots through a callback of its own");
  } catch (const Error& err) {
    CHECK(err.code() == ErrorCode::invalid_argument);
    CHECK(std::string(err.what()).find("slot-free callback") != std::string::npos);
  }
}

TEST_CASE("R8 coordinator: preempted and re-admitted during its load gets a new generation and unparks once") {
  Engine<K3> e;
  const Prompt p(11, 3);
  save_prompt(e, RequestId{1}, p, 176);
  e.transport.skip_rank = 3;
  AdmitDecision first = e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}});
  REQUIRE(first.parked);
  e.coord.teardown(RequestId{2});  // preempted: the old load is an orphan holding slot 2
  e.transport.skip_rank = kWorld;
  AdmitDecision again = e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(40, 13), p.checkpoints, SlotId{3}});
  REQUIRE(again.parked);
  CHECK(again.key.generation != first.key.generation);
  REQUIRE(e.step_until([&] { return e.unparks_of(RequestId{2}) == 1; }));
  CHECK(e.unparked.back().tokens == 176);
  // The old orphan ages out; its late records (rank 3) would be late everywhere.
  const auto t = e.coord.tick(std::chrono::steady_clock::now() + 1h, 1s, 1h);
  CHECK(t.reclaimed == 1);
  REQUIRE(e.step_until([&] { return e.was_freed(RequestId{2}); }));
  CHECK(e.unparks_of(RequestId{2}) == 1);
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("R4 coordinator: a rank that dies mid-load unparks the request to recompute") {
  Engine<K3> e;
  const Prompt p(13, 3);
  save_prompt(e, RequestId{1}, p, 176);
  e.transport.skip_rank = 2;
  REQUIRE(e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}}).parked);
  e.steps(10);
  CHECK(e.unparks_of(RequestId{2}) == 0);
  e.pump.mark_rank_dead(2);
  REQUIRE(e.step_until([&] { return e.unparks_of(RequestId{2}) == 1; }));
  CHECK(e.unparked.back().tokens == 0);
  CHECK(e.unparked.back().kind == Resolution::failed);
  CHECK_FALSE(e.unparked.back().state_missed);  // a dead rank never retracts
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("coordinator: a load dropped at build time is a failed settlement in the next step") {
  Engine<K3> e;
  const Prompt p(15, 3);
  save_prompt(e, RequestId{1}, p, 176);
  e.transport.drop_next = true;
  const AdmitDecision d = e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}});
  REQUIRE(d.parked);  // parked on a load that will settle: it already did, as failed
  CHECK(e.coord.stats().invariant_violations == 0);
  const auto s = e.coord.step();
  REQUIRE(s.unparked.size() == 1);
  CHECK(s.unparked[0] == Unpark{RequestId{2}, 0, Resolution::failed, false});
  CHECK(e.coord.stats().transport_drops == 1);
  CHECK(e.coord.stats().waiting_now == 0);
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("coordinator: the tier losing the prefix between lookup and dispatch is a failed load and a recompute") {
  Engine<K3> e;
  const Prompt p(31, 3);
  save_prompt(e, RequestId{1}, p, 176);
  e.lookup.evict_after_next = true;
  REQUIRE(e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}}).parked);
  REQUIRE(e.step_until([&] { return e.unparks_of(RequestId{2}) == 1; }));
  CHECK(e.unparked.back().tokens == 0);
  CHECK(e.unparked.back().kind == Resolution::failed);
  CHECK_FALSE(e.unparked.back().state_missed);  // the KV went missing, the state did not: nothing retracted
  CHECK(e.index.could_serve(p.hash_at(176)));
  CHECK(e.coord.stats().invariant_violations == 0);
  // The failed load lowered the save watermark: finishing saves the chunks again.
  const std::vector<BlockId> blocks = block_range(20, 13);
  forward(e, p, blocks, SlotId{2}, 176);
  CHECK(e.coord.finish(FinishRequest{RequestId{2}, p.tokens, p.keys, blocks, Checkpoint{176, p.hash_at(176)}, SlotId{2}}) == 2);
  REQUIRE(e.step_until([&] { return e.was_freed(RequestId{2}) && e.index.stats().saves_outstanding == 0; }));
  CHECK(e.lookup(std::span<const PrefixHash>(p.keys).first(3)) == 3);  // the tier holds the prefix again
}

TEST_CASE("coordinator: a load that never hears back is reported by tick and never freed") {
  Engine<Dense> e;
  const Prompt p(17, 3);
  save_prompt(e, RequestId{1}, p, 176);
  e.transport.lose_next = true;
  REQUIRE(e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, std::nullopt}).parked);
  e.steps(5);
  const auto t = e.coord.tick(std::chrono::steady_clock::now() + 1h, 1s, 10min);
  CHECK(t.reclaimed == 0);
  REQUIRE(t.overdue.size() == 1);
  CHECK(t.overdue[0].key.request == RequestId{2});
  CHECK(e.coord.stats().overdue == 1);
  CHECK(e.coord.is_parked(RequestId{2}));  // still waiting: nothing is freed on a timer
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("coordinator: a state already past the HBM floor is a state-only load with no KV at all") {
  Engine<K3> e;
  const Prompt p(19, 3);
  save_prompt(e, RequestId{1}, p, 176);
  // KV of [0, 192) is resident (hbm = 192): only the state at 176 moves.
  std::vector<LoadRequest> seen;
  const AdmitDecision d = e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 192, p.keys, block_range(0, 13), p.checkpoints, SlotId{1}});
  REQUIRE(d.parked);
  REQUIRE(std::holds_alternative<StateOnlyLoad>(d.plan));
  CHECK(d.claimed_tokens == 176);
  REQUIRE(e.step_until([&] { return e.unparks_of(RequestId{2}) == 1; }));
  CHECK(e.unparked.back().tokens == 176);
  for (auto& rank : e.ranks) CHECK(rank->pools.holds_state(SlotId{1}, p.hash_at(176)));
}

TEST_CASE("coordinator: bad options are a kvfuse::Error naming the value") {
  Engine<Dense> e;
  Transport<Dense> t{&e.ranks};
  Lookup<Dense> l{&e.ranks};
  try {
    Coordinator<TpQuorum, Transport<Dense>, Lookup<Dense>> bad(CoordinatorOptions{StateLayout::none, PlanGrids{16, 40}, 0, 8},
                                                              e.index, e.pump, t, l);
    FAIL("a chunk that is not a multiple of the block was accepted");
  } catch (const Error& err) {
    CHECK(err.code() == ErrorCode::invalid_argument);
    CHECK(std::string(err.what()).find("40") != std::string::npos);
  }
  try {
    Coordinator<TpQuorum, Transport<Dense>, Lookup<Dense>> bad(
        CoordinatorOptions{static_cast<StateLayout>(7), PlanGrids{16, 64}, 0, 8}, e.index, e.pump, t, l);
    FAIL("a layout outside StateLayout was accepted");
  } catch (const Error& err) {
    CHECK(err.code() == ErrorCode::invalid_argument);
    const std::string what = err.what();
    CHECK(what.find("layout") != std::string::npos);
    CHECK(what.find("7") != std::string::npos);
  }
}
