// The engine loop end to end: a Coordinator over the OffloadIndex, a TpQuorum pump and 4
// ranks as threads (each connector on its own lanes), for every preset. Every byte a load
// writes is checked; every release is checked against what the ranks could still touch.
#include "coordinator_harness.hpp"

#include <kvfuse/engine/index_consistency.hpp>

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <utility>
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
  // The KV again; the checkpoint at 176 is still indexed, so it is not sent twice.
  CHECK(e.coord.finish(FinishRequest{RequestId{2}, p.tokens, p.keys, blocks, Checkpoint{176, p.hash_at(176)}, SlotId{2}}) == 1);
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
  // A break-even time that is negative, infinite or NaN is refused, naming the field.
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  for (const auto& [field, bad_cost] : {std::pair{"recompute_ns_per_token", BreakEven{-1, 0, 0, 0, 0}},
                                        std::pair{"tier_ns_per_byte", BreakEven{1, inf, 0, 0, 0}},
                                        std::pair{"tier_latency_ns", BreakEven{1, 0, nan, 0, 0}}}) {
    CoordinatorOptions o{StateLayout::none, PlanGrids{16, 64}, 0, 8};
    o.break_even = bad_cost;
    try {
      Coordinator<TpQuorum, Transport<Dense>, Lookup<Dense>> bad(o, e.index, e.pump, t, l);
      FAIL((std::string("a bad break-even time was accepted: ") + field));
    } catch (const Error& err) {
      CHECK(err.code() == ErrorCode::invalid_argument);
      CHECK(std::string(err.what()).find(std::string("break_even.") + field) != std::string::npos);
    }
  }
}

TEST_CASE("coordinator: a load slower than recomputing its tokens is not made, and is counted") {
  // The rank's slice of one 64-token chunk is what the tier moves per chunk; at 1 ns per byte
  // and 1 ns of prefill per token, a chunk of more than 64 bytes costs more than it spares.
  const std::uint64_t chunk_bytes = small_geometry(0, kWorld).kv_bytes_per_token * 64;
  REQUIRE(chunk_bytes > 64);
  CoordinatorOptions slow = Engine<Dense>::options();
  slow.break_even = BreakEven{1.0, 1.0, 0, chunk_bytes, 0};
  Engine<Dense> e(slow);
  const Prompt p(9, 3);
  save_prompt(e, RequestId{1}, p, 64);
  const std::vector<BlockId> blocks = block_range(20, 13);
  AdmitDecision d = e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, blocks, p.checkpoints, SlotId{0}});
  CHECK_FALSE(d.parked);
  CHECK(d.reason == ComputeReason::planned_no_load);
  CHECK(d.no_load == NoLoadReason::slower_than_recompute);
  CHECK(e.coord.stats().slower_than_recompute == 1);
  CHECK(e.coord.plan(AdmitRequest{RequestId{3}, p.tokens, 0, p.keys, blocks, p.checkpoints, SlotId{0}}).load ==
        LoadPlan{NoLoad{NoLoadReason::slower_than_recompute}});
  CHECK(e.coord.stats().slower_than_recompute == 1);  // plan() has no side effect, the counter included
  (void)e.coord.finish(FinishRequest{RequestId{2}, p.tokens, p.keys, blocks, std::nullopt, std::nullopt});
  REQUIRE(e.step_until([&] { return e.was_freed(RequestId{2}); }));

  // The same tier at 64x the bandwidth: the load pays and is made.
  CoordinatorOptions fast = slow;
  fast.break_even.tier_ns_per_byte = 1.0 / 64;
  Engine<Dense> f(fast);
  save_prompt(f, RequestId{1}, p, 64);
  d = f.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, blocks, p.checkpoints, SlotId{0}});
  CHECK(d.parked);
  CHECK(std::holds_alternative<KvOnlyLoad>(d.plan));
  CHECK(f.coord.stats().slower_than_recompute == 0);
  REQUIRE(f.step_until([&] { return f.unparks_of(RequestId{2}) == 1; }));
  (void)f.coord.finish(FinishRequest{RequestId{2}, p.tokens, p.keys, blocks, std::nullopt, std::nullopt});
  REQUIRE(f.step_until([&] { return f.was_freed(RequestId{2}) && f.index.stats().saves_outstanding == 0; }));
}

// ---- checkpoints (the hybrid-reuse machinery) ---------------------------------------------

TEST_CASE("coordinator: admit hands a stateful request its prefill checkpoints, and plan() answers the same with no side effect") {
  Engine<K3> e;
  const Prompt first(51, 5);  // P = 336
  save_prompt(e, RequestId{1}, first, 304);
  // A prompt sharing the first 3 chunks (192 tokens) with the saved one, then its own.
  Prompt branching(52, 5);
  for (std::size_t c = 0; c < 3; ++c) branching.keys[c] = first.keys[c];
  const AdmitRequest req{RequestId{2}, branching.tokens, 0, branching.keys, block_range(20, 22), branching.checkpoints, SlotId{2}};
  const IndexStats before = e.index.stats();
  const std::uint64_t planned_before = e.coord.stats().checkpoints_planned;
  const AdmissionPlan p = e.coord.plan(req);
  CHECK(e.index.stats() == before);  // no ticket, nothing touched
  CHECK(p.lookup_tokens == 192);
  CHECK(std::holds_alternative<NoLoad>(p.load));  // no checkpoint of this prompt is servable yet
  // Branch point 192, prompt end floor_chunk(335) = 320, every 2 chunks: 128, 256; at most 3,
  // the branch point and the prompt end first, then the highest every-N.
  CHECK(p.checkpoints == std::vector<TokenCount>{192, 256, 320});
  const AdmitDecision d = e.coord.admit(req);
  CHECK_FALSE(d.parked);
  CHECK(d.plan == p.load);
  CHECK(d.checkpoints == p.checkpoints);
  CHECK(e.coord.stats().checkpoints_planned - planned_before == 3);
  // A dense model plans no checkpoints.
  Engine<Dense> dense;
  CHECK(dense.coord.admit(AdmitRequest{RequestId{1}, branching.tokens, 0, branching.keys, block_range(0, 22), {}, std::nullopt})
            .checkpoints.empty());
}

TEST_CASE("coordinator: mid-prefill checkpoints are saved from snapshot slots that come back on released, and a later prompt resumes from one") {
  Engine<K3> e;
  const Prompt p(53, 5);  // P = 336
  const std::vector<BlockId> blocks = block_range(0, 22);
  const AdmitDecision d = e.coord.admit(AdmitRequest{RequestId{1}, p.tokens, 0, p.keys, blocks, p.checkpoints, SlotId{0}});
  REQUIRE_FALSE(d.parked);
  REQUIRE_FALSE(d.checkpoints.empty());
  forward(e, p, blocks, SlotId{0}, p.tokens - 16);
  const SlotId snapshot{3};
  for (const TokenCount b : d.checkpoints) {
    // The prefill stops at b: the state there goes into the snapshot slot, then to the tier.
    for (auto& rank : e.ranks) rank->pools.write_state(snapshot, p.hash_at(b));
    REQUIRE(e.coord.checkpoint(Checkpoint{b, p.hash_at(b)}, snapshot) == CheckpointResult::saved);
    CHECK(e.coord.stats().snapshots_held == 1);
    REQUIRE(e.step_until([&] { return e.snapshots_back == 1; }));  // every rank released it: reusable
    e.snapshots_back = 0;
    CHECK(e.frees_of(RequestId{1}) == 0);  // the request goes on: a snapshot frees none of its blocks
  }
  (void)e.coord.finish(FinishRequest{RequestId{1}, p.tokens, p.keys, blocks, std::nullopt, std::nullopt});
  REQUIRE(e.step_until([&] { return e.was_freed(RequestId{1}) && e.index.stats().saves_outstanding == 0; }));
  for (const TokenCount b : d.checkpoints) CHECK(e.index.could_serve(p.hash_at(b)));
  CHECK(e.coord.stats().checkpoints_saved == d.checkpoints.size());
  CHECK(e.coord.stats().snapshots_returned == d.checkpoints.size());
  CHECK(e.coord.stats().snapshots_held == 0);

  // A later prompt that shares the first 4 chunks resumes at the highest checkpoint within them.
  Prompt later(54, 5);
  for (std::size_t c = 0; c < 4; ++c) later.keys[c] = p.keys[c];
  for (Checkpoint& c : later.checkpoints)
    if (c.boundary <= 256) c.hash = p.hash_at(c.boundary);
  for (auto& rank : e.ranks) std::memset(rank->pools.blocks, 0, rank->pools.geo.num_blocks * rank->pools.geo.block_bytes());
  const AdmitDecision resumed =
      e.coord.admit(AdmitRequest{RequestId{2}, later.tokens, 0, later.keys, block_range(30, 22), later.checkpoints, SlotId{1}});
  REQUIRE(resumed.parked);
  CHECK(resumed.claimed_tokens == 256);
  REQUIRE(e.step_until([&] { return e.unparks_of(RequestId{2}) == 1; }));
  CHECK(e.unparked.back().tokens == 256);
  for (auto& rank : e.ranks) {
    CHECK(rank->pools.holds_state(SlotId{1}, p.hash_at(256)));
    CHECK(rank->pools.holds_prompt(block_range(30, 22), 0, 256));
  }
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("coordinator: a checkpoint the index serves or is already saving is not saved again") {
  Engine<K3> e;
  const Prompt p(55, 3);
  const std::vector<BlockId> blocks = block_range(0, 13);
  (void)e.coord.admit(AdmitRequest{RequestId{1}, p.tokens, 0, p.keys, blocks, p.checkpoints, SlotId{0}});
  for (auto& rank : e.ranks) rank->pools.write_state(SlotId{3}, p.hash_at(128));
  e.transport.skip_rank = 3;  // the first save stays in flight: rank 3 has not received it
  REQUIRE(e.coord.checkpoint(Checkpoint{128, p.hash_at(128)}, SlotId{3}) == CheckpointResult::saved);
  CHECK(e.coord.checkpoint(Checkpoint{128, p.hash_at(128)}, SlotId{2}) == CheckpointResult::already_indexed);
  e.transport.skip_rank = kWorld;
  e.pump.mark_rank_dead(3);  // the save settles without it
  REQUIRE(e.step_until([&] { return e.snapshots_back == 1 && e.index.stats().saves_outstanding == 0; }));
  REQUIRE(e.index.could_serve(p.hash_at(128)));
  CHECK(e.coord.checkpoint(Checkpoint{128, p.hash_at(128)}, SlotId{2}) == CheckpointResult::already_indexed);
  // finish's own checkpoint is deduplicated the same way.
  CHECK(e.coord.finish(FinishRequest{RequestId{1}, 0, p.keys, blocks, Checkpoint{128, p.hash_at(128)}, SlotId{0}}) == 0);
  CHECK(e.coord.stats().checkpoints_deduplicated == 3);
  CHECK(e.coord.stats().checkpoints_saved == 1);
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("coordinator: a request torn down mid-prefill leaks no snapshot slot") {
  Engine<K3> e;
  const Prompt p(57, 3);
  (void)e.coord.admit(AdmitRequest{RequestId{1}, p.tokens, 0, p.keys, block_range(0, 13), p.checkpoints, SlotId{0}});
  for (auto& rank : e.ranks) rank->pools.write_state(SlotId{3}, p.hash_at(64));
  REQUIRE(e.coord.checkpoint(Checkpoint{64, p.hash_at(64)}, SlotId{3}) == CheckpointResult::saved);
  e.coord.teardown(RequestId{1});  // aborted between two checkpoints
  REQUIRE(e.step_until([&] { return e.snapshots_back == 1 && e.was_freed(RequestId{1}); }));
  REQUIRE(e.step_until([&] { return e.index.stats().saves_outstanding == 0; }));
  CHECK(e.coord.stats().snapshots_held == 0);
  CHECK(e.index.could_serve(p.hash_at(64)));  // the checkpoint it left is still good
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("coordinator: a progress save frees nothing the request still uses, and finish saves only what is new") {
  Engine<K3> e;
  const Prompt p(59, 5);
  const std::vector<BlockId> blocks = block_range(0, 22);
  (void)e.coord.admit(AdmitRequest{RequestId{1}, p.tokens, 0, p.keys, blocks, p.checkpoints, SlotId{0}});
  forward(e, p, blocks, SlotId{0}, 176);
  for (auto& rank : e.ranks) rank->pools.write_state(SlotId{3}, p.hash_at(128));
  CHECK(e.coord.save_progress(ProgressSave{RequestId{1}, 176, p.keys, blocks, Checkpoint{128, p.hash_at(128)}, SlotId{3}}) == 2);
  REQUIRE(e.step_until([&] { return e.snapshots_back == 1 && e.index.stats().saves_outstanding == 0; }));
  e.steps(5);
  CHECK(e.frees_of(RequestId{1}) == 0);  // still running: its blocks and slot stay its own
  CHECK(e.lookup(std::span<const PrefixHash>(p.keys).first(2)) == 2);  // the two whole chunks below 176
  CHECK(e.coord.stats().progress_saves == 1);
  // finish saves the chunks above the progress save only: [128, 320).
  forward(e, p, blocks, SlotId{0}, 320);
  CHECK(e.coord.finish(FinishRequest{RequestId{1}, p.tokens, p.keys, blocks, Checkpoint{320, p.hash_at(320)}, SlotId{0}}) == 2);
  REQUIRE(e.step_until([&] { return e.was_freed(RequestId{1}) && e.index.stats().saves_outstanding == 0; }));
  CHECK(e.frees_of(RequestId{1}) == 1);
  CHECK(e.lookup(std::span<const PrefixHash>(p.keys).first(5)) == 5);
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("R11 coordinator: a DSV4 request over a nonzero HBM floor gets a joint load and every byte it restores is right") {
  Engine<Dsv4> e;
  const Prompt p(61, 3);
  save_prompt(e, RequestId{1}, p, 176);
  for (auto& rank : e.ranks) std::memset(rank->pools.blocks, 0, rank->pools.geo.num_blocks * rank->pools.geo.block_bytes());
  // The prefix cache holds [0, 32) in blocks 20 and 21; the rest comes from the tier.
  const std::vector<BlockId> blocks = block_range(20, 13);
  for (auto& rank : e.ranks) rank->pools.write_prompt(blocks, 32);
  const AdmitDecision d = e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 32, p.keys, blocks, p.checkpoints, SlotId{2}});
  REQUIRE(d.parked);
  CHECK(d.plan == LoadPlan{JointLoad{32, 192, 176}});
  REQUIRE(e.step_until([&] { return e.unparks_of(RequestId{2}) == 1; }));
  CHECK(e.unparked.back().tokens == 176);
  CHECK(e.unparked.back().kind == Resolution::completed);
  for (auto& rank : e.ranks) {
    CHECK(rank->pools.holds_state(SlotId{2}, p.hash_at(176)));
    CHECK(rank->pools.holds_prompt(blocks, 0, 192));
  }
}
