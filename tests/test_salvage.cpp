// Salvage: a load that failed part way keeps what every live rank restored. The KV leg's
// record says how many chunks it restored from the HBM floor, the quorum keeps the minimum
// over the live ranks, and the Coordinator resumes a dense request there and a stateful one
// at the highest checkpoint it can still restore (a second, state-only load, at most once),
// else at the engine's own state at hbm, else from 0.
//
// The randomized test drives the real index, quorum, pump and Coordinator through 10^5
// loads (1..8 ranks, 1..64 chunks, a failure point per rank, dead ranks, a missed or
// failed state, a second load that may fail too) and holds every resume point to a
// brute-force oracle of the fewest tokens that must be recomputed; after each load the
// host kit's audit is clean. The directed tests pin the pieces down one at a time.
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/host/admission_book.hpp>
#include <kvfuse/host/audit.hpp>
#include <kvfuse/kvfuse.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <vector>

using namespace kvfuse;

namespace {

constexpr std::uint32_t kBlock = 16, kChunk = 64;

/// Keeps what the Coordinator hands the ranks; the test plays the ranks.
struct Capture {
  std::vector<LoadRequest> loads;
  std::vector<SaveKey> saves;
  bool send(const LoadRequest& r) {
    loads.push_back(r);
    return true;
  }
  template <class Save>
  bool send(const Save& s) {
    saves.push_back(s.key);
    return true;
  }
};

struct AllHeld {
  std::size_t operator()(std::span<const PrefixHash> keys) const { return keys.size(); }
};

/// One engine: index, quorum over `world` ranks, pump, Coordinator, book.
struct Engine {
  std::uint32_t world;
  OffloadIndex<> index{OffloadIndexOptions{.hash_capacity = 1u << 16, .slot_count = 8}};
  TpQuorum group;
  SettlementPump<TpQuorum, OffloadIndex<>> pump{group, index};
  Capture transport;
  AllHeld lookup;
  Coordinator<TpQuorum, Capture, AllHeld> coord;
  AdmissionBook<> book;
  Engine(std::uint32_t w, StateLayout layout)
      : world(w),
        group(TpQuorumOptions{w, 0, 64, 256}),
        coord(CoordinatorOptions{.layout = layout, .grids = PlanGrids{kBlock, kChunk}, .expected_requests = 64}, index,
              pump, transport, lookup) {}

  /// Every rank's record for `key` except the dead ones: `restored[r]` chunks (all of them:
  /// ok), the state leg's outcome alike for every live rank but `state_rank`.
  void report(const LoadRequest& r, const std::vector<std::uint32_t>& restored, const std::set<std::uint32_t>& dead,
              StateOutcome state, std::uint32_t state_rank) {
    const auto chunks = static_cast<std::uint32_t>(r.kv ? r.kv->chunk_keys.size() : 0);
    for (std::uint32_t k = 0; k < world; ++k) {
      if (dead.contains(k)) continue;
      CompletionRecord rec{r.key, k, KvOutcome::none, StateOutcome::none, Reason::none, Reason::none, 0};
      if (r.kv) {
        const bool whole = restored[k] >= chunks;
        rec.kv = whole ? KvOutcome::ok : KvOutcome::failed;
        rec.kv_reason = whole ? Reason::none : Reason::kv_chunk_missing;
        rec.kv_restored = std::min(restored[k], chunks);
      }
      if (r.state) {
        rec.state = k == state_rank ? state : StateOutcome::restored;
        rec.state_reason = rec.state == StateOutcome::failed ? Reason::state_transfer_failed : Reason::none;
      }
      pump.ingest(k, std::span<const CompletionRecord>(&rec, 1));
    }
  }
};

struct Returned {
  void release(BlockId) {}
  bool give(SlotId) { return true; }
};

}  // namespace

TEST_CASE("R4 salvage: the quorum keeps the fewest chunks any rank restored, and a rank that never reported counts as none") {
  OffloadIndex<> index(OffloadIndexOptions{.hash_capacity = 16, .slot_count = 4});
  TpQuorum group(TpQuorumOptions{3, 0, 64, 64});
  std::vector<Settlement> out;
  struct Sink {
    std::vector<Settlement>* out;
    void operator()(const Settlement& s) noexcept { out->push_back(s); }
    void operator()(const SaveSettlement&) noexcept {}
  } sink{&out};
  struct Admit {
    bool operator()(LoadKey) const noexcept { return true; }
    bool operator()(SaveKey) const noexcept { return true; }
  } admit;
  const LoadKey key{RequestId{1}, Generation{1}};
  const std::uint32_t restored[] = {7, 3, 5};
  for (std::uint32_t r = 0; r < 3; ++r) {
    const CompletionRecord rec{key, r, KvOutcome::failed, StateOutcome::none, Reason::kv_chunk_missing, Reason::none,
                               restored[r]};
    (void)group.merge(r, rec, admit, sink);
  }
  REQUIRE(out.size() == 1);
  CHECK_FALSE(out[0].ok);
  CHECK(out[0].kv_restored == 3);
  // A rank that dies before reporting may hold nothing of the blocks: nothing to salvage.
  out.clear();
  const LoadKey second{RequestId{2}, Generation{2}};
  for (std::uint32_t r = 0; r < 2; ++r) {
    const CompletionRecord rec{second, r, KvOutcome::ok, StateOutcome::none, Reason::none, Reason::none, 9};
    (void)group.merge(r, rec, admit, sink);
  }
  group.mark_rank_dead(2, sink);
  REQUIRE(out.size() == 1);
  CHECK(out[0].kv_restored == 0);
}

TEST_CASE("salvage: a dense load that failed part way resumes at the HBM floor plus what every rank restored") {
  Engine e(4, StateLayout::none);
  std::vector<PrefixHash> keys;
  std::vector<BlockId> blocks;
  for (std::uint64_t c = 0; c < 8; ++c) keys.push_back(PrefixHash{100 + c});
  for (std::uint32_t b = 0; b < 32; ++b) blocks.push_back(BlockId{b});
  const TokenCount P = 8 * kChunk + 5, hbm = 2 * kChunk;
  const AdmitDecision d = e.coord.admit(AdmitRequest{RequestId{1}, P, hbm, keys, blocks, {}, std::nullopt});
  REQUIRE(d.parked);
  REQUIRE(e.transport.loads.size() == 1);
  CHECK(e.transport.loads[0].kv->chunk_keys.size() == 6);
  // Rank 2 lost the fourth chunk of the load; the others restored all six.
  e.report(e.transport.loads[0], {6, 6, 3, 6}, {}, StateOutcome::none, 0);
  const auto s = e.coord.step();
  REQUIRE(s.unparked.size() == 1);
  CHECK(s.unparked[0].kind == Resolution::failed);
  CHECK(s.unparked[0].salvaged);
  CHECK(s.unparked[0].tokens == hbm + 3 * kChunk);  // chunks 2, 3, 4 of the prompt: every rank has them
  const CoordinatorStats cs = e.coord.stats();
  CHECK(cs.salvaged_loads == 1);
  CHECK(cs.salvaged_tokens == 3 * kChunk);
  // Nothing restored anywhere: nothing to salvage, the request resumes from its own floor.
  const AdmitDecision d2 = e.coord.admit(AdmitRequest{RequestId{2}, P, hbm, keys, blocks, {}, std::nullopt});
  REQUIRE(d2.parked);
  e.report(e.transport.loads.back(), {0, 6, 6, 6}, {}, StateOutcome::none, 0);
  const auto s2 = e.coord.step();
  REQUIRE(s2.unparked.size() == 1);
  CHECK(s2.unparked[0].tokens == 0);
  CHECK_FALSE(s2.unparked[0].salvaged);
}

TEST_CASE("salvage: a stateful load that failed part way resumes through one second load, or the engine's own state, or 0") {
  Engine e(2, StateLayout::k3_recurrent);
  std::vector<PrefixHash> keys;
  std::vector<BlockId> blocks;
  std::vector<Checkpoint> checkpoints;
  for (std::uint64_t c = 0; c < 8; ++c) keys.push_back(PrefixHash{200 + c});
  for (std::uint32_t b = 0; b < 32; ++b) blocks.push_back(BlockId{b});
  for (TokenCount b = kChunk; b < 8 * kChunk; b += kChunk) {
    checkpoints.push_back(Checkpoint{b, PrefixHash{3000 + b}});
    e.index.note_stored(PrefixHash{3000 + b});
  }
  const TokenCount P = 8 * kChunk - 3;
  const AdmitDecision d = e.coord.admit(AdmitRequest{RequestId{1}, P, 0, keys, blocks, checkpoints, SlotId{1}});
  REQUIRE(d.parked);
  REQUIRE(std::holds_alternative<JointLoad>(d.plan));
  CHECK(d.claimed_tokens == 7 * kChunk);
  // Rank 1 restored 4 chunks and its tier lacked the state: B = 448 is retracted, and the
  // best checkpoint both ranks' blocks reach is 256.
  e.report(e.transport.loads[0], {7, 4}, {}, StateOutcome::missed, 1);
  auto s = e.coord.step();
  CHECK(s.unparked.empty());  // parked on the second load
  REQUIRE(e.transport.loads.size() == 2);
  const LoadRequest& second = e.transport.loads[1];
  CHECK_FALSE(second.kv.has_value());
  REQUIRE(second.state.has_value());
  CHECK(second.state->boundary_tokens == 4 * kChunk);
  CHECK(second.state->slot == SlotId{1});
  e.report(second, {0, 0}, {}, StateOutcome::restored, 0);
  s = e.coord.step();
  REQUIRE(s.unparked.size() == 1);
  CHECK(s.unparked[0].tokens == 4 * kChunk);
  CHECK(s.unparked[0].kind == Resolution::completed);
  CHECK(s.unparked[0].salvaged);
  CHECK(e.coord.stats().second_loads == 1);

  // The second load fails too: no third; the engine holds its own state at hbm, so it resumes there.
  const AdmitDecision d2 =
      e.coord.admit(AdmitRequest{RequestId{2}, P, kChunk, keys, blocks, checkpoints, SlotId{2}, /*hbm_state_held=*/true});
  REQUIRE(d2.parked);
  e.report(e.transport.loads.back(), {6, 2}, {}, StateOutcome::failed, 0);
  (void)e.coord.step();
  REQUIRE(e.transport.loads.size() == 4);
  CHECK(e.transport.loads.back().state->boundary_tokens == 3 * kChunk);  // hbm + 2 chunks
  e.report(e.transport.loads.back(), {0, 0}, {}, StateOutcome::failed, 1);
  s = e.coord.step();
  REQUIRE(s.unparked.size() == 1);
  CHECK(s.unparked[0].tokens == kChunk);
  CHECK(s.unparked[0].salvaged);
  CHECK(e.transport.loads.size() == 4);
  CHECK(e.coord.stats().second_loads == 2);
}

// The vLLM #49250 shape: two requests parked on the same prefix, one load failing mid-way.
// Each admission has its own blocks (a prefix-caching pool shares only blocks that hold
// computed tokens, never a load's destination), so the failed load's unfilled blocks are
// nobody else's, and each request resumes from what its own load filled.
TEST_CASE("salvage: two requests parked on the same prefix, one load failing mid-way, each resume from their own load") {
  Engine e(2, StateLayout::none);
  PrefixBlockPool pool(64);
  std::vector<PrefixHash> keys;
  for (std::uint64_t c = 0; c < 6; ++c) keys.push_back(PrefixHash{500 + c});
  std::vector<std::uint64_t> identities;
  for (std::uint64_t b = 0; b < 24; ++b) identities.push_back(900 + b);
  const TokenCount P = 6 * kChunk - 1;
  std::vector<BlockId> a_blocks, b_blocks;
  REQUIRE(pool.match(identities, 23, a_blocks) == 0);
  REQUIRE(pool.allocate(24, a_blocks));
  REQUIRE(pool.match(identities, 23, b_blocks) == 0);  // nothing published: A's blocks are A's alone
  REQUIRE(pool.allocate(24, b_blocks));
  const AdmitDecision da = e.coord.admit(AdmitRequest{RequestId{1}, P, 0, keys, a_blocks, {}, std::nullopt});
  const AdmitDecision db = e.coord.admit(AdmitRequest{RequestId{2}, P, 0, keys, b_blocks, {}, std::nullopt});
  REQUIRE(da.parked);
  REQUIRE(db.parked);
  e.book.open(RequestId{1}, da, a_blocks, std::nullopt);
  e.book.open(RequestId{2}, db, b_blocks, std::nullopt);
  const std::set<BlockId> b_set(b_blocks.begin(), b_blocks.end());
  for (const BlockId blk : e.transport.loads[0].kv->blocks) CHECK_FALSE(b_set.contains(blk));  // no shared destination
  e.report(e.transport.loads[0], {5, 2}, {}, StateOutcome::none, 0);  // A: rank 1 fails at chunk 2
  e.report(e.transport.loads[1], {5, 5}, {}, StateOutcome::none, 0);  // B: complete
  std::map<RequestId, Unpark> got;
  Returned returned;
  (void)e.book.apply(e.coord.step(), pool, returned, returned, [&](auto&, const Unpark& u) { got[u.request] = u; });
  REQUIRE(got.size() == 2);
  CHECK(got[RequestId{1}].tokens == 2 * kChunk);
  CHECK(got[RequestId{1}].salvaged);
  CHECK(got[RequestId{2}].tokens == 5 * kChunk);
  CHECK_FALSE(got[RequestId{2}].salvaged);
  // A publishes only what it holds computed: the restored prefix and what it prefills, never
  // a block above its resume point before it computed it. Here it computes nothing before
  // B would look, so a third request shares only A's two restored chunks.
  for (std::size_t b = 0; b < 2 * kChunk / kBlock; ++b) pool.publish(a_blocks[b], identities[b]);
  std::vector<BlockId> c_blocks;
  CHECK(pool.match(identities, 23, c_blocks) == 2 * kChunk / kBlock);
  CHECK(e.coord.stats().invariant_violations == 0);
  CHECK(e.book.stats().protocol_errors() == 0);
}

TEST_CASE("salvage: 10^5 random partly failed loads resume where a brute-force oracle says, and every invariant holds") {
  std::mt19937_64 rng(20261201);
  auto pick = [&](std::uint64_t n) { return rng() % n; };
  std::vector<std::unique_ptr<Engine>> engines;  // [world - 1][stateful]
  for (std::uint32_t w = 1; w <= 8; ++w) {
    engines.push_back(std::make_unique<Engine>(w, StateLayout::none));
    engines.push_back(std::make_unique<Engine>(w, StateLayout::k3_recurrent));
  }
  std::vector<BlockId> blocks;
  for (std::uint32_t b = 0; b < 4 * 64 + 8; ++b) blocks.push_back(BlockId{b});
  std::uint64_t salvaged = 0, second = 0, from_zero = 0, whole = 0, dead_cases = 0, missed = 0;
  for (std::uint64_t n = 0; n < 100'000; ++n) {
    CAPTURE(n);
    const auto world = static_cast<std::uint32_t>(1 + pick(8));
    const bool stateful = pick(2) == 1;
    Engine& e = *engines[(world - 1) * 2 + (stateful ? 1 : 0)];
    const RequestId id{n + 1};
    const auto chunks = static_cast<std::uint32_t>(1 + pick(64));
    const TokenCount hbm = kChunk * pick(3);
    const TokenCount P = hbm + TokenCount{chunks} * kChunk + 1 + pick(kChunk - 1);
    std::vector<PrefixHash> keys;
    for (std::uint64_t c = 0; c * kChunk < P; ++c) keys.push_back(PrefixHash{n * 1000 + c});
    std::vector<Checkpoint> checkpoints;
    if (stateful)
      for (TokenCount b = kChunk; b < P; b += kChunk) {
        checkpoints.push_back(Checkpoint{b, PrefixHash{(n << 20) + b}});
        e.index.note_stored(checkpoints.back().hash);
      }
    const bool held = stateful && hbm > 0 && pick(3) == 0;
    const std::size_t sent_before = e.transport.loads.size();
    const AdmitDecision d = e.coord.admit(AdmitRequest{id, P, hbm, keys, blocks, checkpoints,
                                                       stateful ? std::optional<SlotId>(SlotId{1}) : std::nullopt, held});
    REQUIRE(d.parked);
    REQUIRE(e.transport.loads.size() == sent_before + 1);
    const LoadRequest first = e.transport.loads.back();
    REQUIRE(first.kv.has_value());
    REQUIRE(first.kv->chunk_keys.size() == chunks);
    const TokenCount claims = hbm + TokenCount{chunks} * kChunk;
    REQUIRE(d.claimed_tokens == claims);

    // The ranks: some die before reporting, each restores a prefix (or all), one rank's
    // state leg misses or fails.
    std::set<std::uint32_t> dead;
    for (std::uint32_t k = 0; k < world; ++k)
      if (pick(12) == 0) dead.insert(k);
    std::vector<std::uint32_t> restored(world);
    for (std::uint32_t k = 0; k < world; ++k) restored[k] = pick(3) == 0 ? static_cast<std::uint32_t>(pick(chunks)) : chunks;
    const std::uint64_t state_roll = pick(6);
    const StateOutcome state = !stateful ? StateOutcome::none
                               : state_roll == 0 ? StateOutcome::missed
                               : state_roll == 1 ? StateOutcome::failed
                                                 : StateOutcome::restored;
    const auto state_rank = static_cast<std::uint32_t>(pick(world));
    const bool second_fails = pick(4) == 0;

    // The oracle, by brute force over what is known: which ranks reported, what each
    // restored; a rank that never reported holds nothing anyone can count on.
    std::uint32_t min_restored = UINT32_MAX;
    bool load_ok = dead.empty();
    for (std::uint32_t k = 0; k < world; ++k) {
      if (dead.contains(k)) {
        min_restored = 0;
        continue;
      }
      min_restored = std::min(min_restored, restored[k]);
      if (restored[k] < chunks) load_ok = false;
      if (stateful && k == state_rank && state != StateOutcome::restored) load_ok = false;
    }
    if (min_restored == UINT32_MAX) min_restored = 0;
    const bool b_missed = stateful && state == StateOutcome::missed && !dead.contains(state_rank);
    TokenCount want = 0;
    bool want_second = false;
    if (load_ok) {
      want = claims;
    } else {
      const TokenCount frontier = hbm + TokenCount{min_restored} * kChunk;
      if (!stateful) {
        want = frontier > hbm ? frontier : 0;
      } else {
        const TokenCount own = held ? hbm : 0;
        TokenCount best = 0;  // the highest checkpoint every rank could restore, above the engine's own
        for (TokenCount b = kChunk; b <= frontier && b <= claims; b += kChunk)
          if (b > own && !(b == claims && b_missed)) best = b;
        want_second = best > 0;
        // A second load is sent to every live rank; with a rank dead it cannot succeed.
        want = want_second ? (dead.empty() && !second_fails ? best : own) : own;
      }
    }

    // Play it: records in, ranks marked dead, a step; a second load answered; a step.
    e.report(first, restored, dead, state, state_rank);
    for (const std::uint32_t k : dead) e.pump.mark_rank_dead(k);
    std::vector<Unpark> unparked;
    auto collect = [&](const CoordinatorStep& s) { unparked.insert(unparked.end(), s.unparked.begin(), s.unparked.end()); };
    collect(e.coord.step());
    const bool sent_second = e.transport.loads.size() == sent_before + 2;
    CHECK(sent_second == want_second);
    if (sent_second) {
      const LoadRequest& again = e.transport.loads.back();
      REQUIRE(again.state.has_value());
      CHECK_FALSE(again.kv.has_value());
      e.report(again, std::vector<std::uint32_t>(world, 0), dead,
               second_fails ? StateOutcome::failed : StateOutcome::restored, 0);
      collect(e.coord.step());
      collect(e.coord.step());  // every rank dead: the sweep at the next step settles it
    }
    REQUIRE(unparked.size() == 1);
    const Unpark& u = unparked[0];
    CHECK(u.tokens == want);
    // Tokens recomputed: the oracle's minimum (a dense request never recomputes below its floor).
    const TokenCount resume = stateful ? u.tokens : std::max(u.tokens, hbm);
    const TokenCount oracle_resume = stateful ? want : std::max(want, hbm);
    CHECK(P - resume == P - oracle_resume);
    CHECK(u.salvaged == (!load_ok && u.tokens > 0));

    salvaged += u.salvaged ? 1 : 0;
    second += sent_second ? 1 : 0;
    from_zero += u.tokens == 0 ? 1 : 0;
    whole += load_ok ? 1 : 0;
    dead_cases += dead.empty() ? 0 : 1;
    missed += b_missed ? 1 : 0;

    // The request ends; its admission comes back; the ranks come back.
    (void)e.coord.finish(FinishRequest{id, 0, {}, {}, std::nullopt, std::nullopt});
    std::size_t freed = 0;
    for (int i = 0; i < 2 && freed == 0; ++i) freed += e.coord.step().freed.size();
    CHECK(freed == 1);
    for (const std::uint32_t k : dead) e.pump.mark_rank_alive(k);
  }
  for (auto& e : engines) {
    const CoordinatorStats cs = e->coord.stats();
    CHECK(cs.invariant_violations == 0);
    CHECK(cs.waiting_now == 0);
    CHECK(cs.holding_now == 0);
    const IndexStats is = e->index.stats();
    CHECK(is.invariant_violations == 0);
    CHECK(is.outstanding == 0);
    CHECK(check_consistency(e->index).ok);
  }
  // The mix did what it is for.
  CHECK(salvaged > 10'000);
  CHECK(second > 5'000);
  CHECK(from_zero > 1'000);
  CHECK(whole > 10'000);
  CHECK(dead_cases > 10'000);
  CHECK(missed > 3'000);
  MESSAGE("salvaged " << salvaged << ", second loads " << second << ", from zero " << from_zero << ", whole " << whole
                      << ", with a dead rank " << dead_cases << ", state missed " << missed);
}
