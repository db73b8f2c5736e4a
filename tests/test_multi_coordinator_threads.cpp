// R16 applied end to end: the Coordinator admits through Multi<LoopbackPd, OffloadSub> —
// the production shape [P/D sub, offload sub] — over 4 ranks as threads. A second
// in-process "engine" (a producer's block pools) serves prefixes through the P/D sub.
#include "coordinator_harness.hpp"

#include <kvfuse/compose/loopback_pd.hpp>
#include <kvfuse/compose/multi.hpp>

#include <memory>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

/// The consumer engine plus a producer's block pools, the P/D sub over both, the tier as a
/// sub, and the composition in the production order [P/D, offload].
template <class Conn>
struct Composed {
  Engine<Conn> e;
  std::vector<std::unique_ptr<DevicePools<HostRuntime>>> producer;
  std::unique_ptr<LoopbackPd> pd;
  OffloadSub tier;
  std::unique_ptr<Multi<LoopbackPd, OffloadSub>> multi;
  Composed() {
    std::vector<LoopbackRank> pairs;
    for (std::uint32_t r = 0; r < kWorld; ++r) {
      producer.push_back(std::make_unique<DevicePools<HostRuntime>>(e.rt, small_geometry(r, kWorld)));
      pairs.push_back(LoopbackRank{producer.back()->blocks, e.ranks[r]->pools.blocks});
    }
    pd = std::make_unique<LoopbackPd>(std::move(pairs), 16, small_geometry(0, kWorld).block_bytes());
    multi = std::make_unique<Multi<LoopbackPd, OffloadSub>>(*pd, tier);
  }
  /// The producer prefilled `p` for `id` into its blocks 0..: publish it to the P/D sub.
  void prefill_on_producer(RequestId id, const Prompt& p) {
    const std::vector<BlockId> blocks = block_range(0, 13);
    for (auto& pools : producer) pools->write_prompt(blocks, p.tokens);
    pd->publish(id, p.tokens, blocks);
  }
  template <class Pred>
  bool step_until(Pred pred) {
    return eventually([&] {
      const auto s = e.coord.step(*multi);
      e.unparked.insert(e.unparked.end(), s.unparked.begin(), s.unparked.end());
      e.freed.insert(e.freed.end(), s.freed.begin(), s.freed.end());
      return pred();
    });
  }
};

static_assert(KvArbiter<Multi<LoopbackPd, OffloadSub>>);
static_assert(Multi<LoopbackPd, OffloadSub>::tier_sub == std::optional<std::size_t>(1));

}  // namespace

TEST_CASE("R16 a P/D winner releases the state leg: no ticket is taken and the request recomputes from 0") {
  Composed<K3> c;
  const Prompt p(21, 3);
  save_prompt(c.e, RequestId{1}, p, 176);  // the tier could serve a joint load at B = 176
  c.prefill_on_producer(RequestId{2}, p);
  const std::uint64_t dispatched = c.e.index.stats().issued;
  const std::vector<BlockId> blocks = block_range(20, 13);
  const AdmitDecision d = c.e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, blocks, p.checkpoints, SlotId{2}},
                                          *c.multi);
  REQUIRE(d.parked);
  CHECK(d.sub == std::optional<std::size_t>(0));  // the P/D sub owns the KV load
  CHECK(d.state_waived);
  CHECK(d.claimed_tokens == 0);
  CHECK(c.e.index.stats().issued == dispatched);  // the state load was never ticketed (R7: nothing to retract)
  CHECK(c.tier.cancelled == 1);                       // the tier offered and lost
  CHECK(c.e.coord.stats().state_legs_waived == 1);
  CHECK(c.e.index.could_serve(p.hash_at(176)));       // a waived leg retracts nothing
  REQUIRE(c.step_until([&] { return c.e.unparks_of(RequestId{2}) == 1; }));
  CHECK(c.e.unparked.back() == Unpark{RequestId{2}, 0, Resolution::completed, false});
  // The transfer really moved the producer's KV into this engine's blocks.
  for (auto& rank : c.e.ranks) CHECK(rank->pools.holds_prompt(blocks, 0, 192));
  CHECK(c.pd->stats().transfers == 1);
  CHECK(c.e.coord.stats().invariant_violations == 0);
}

TEST_CASE("R16 a P/D winner on a dense model resumes from the tokens it transferred") {
  Composed<Dense> c;
  const Prompt p(23, 3);
  c.prefill_on_producer(RequestId{2}, p);
  const std::vector<BlockId> blocks = block_range(20, 13);
  const AdmitDecision d =
      c.e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 32, p.keys, blocks, p.checkpoints, std::nullopt}, *c.multi);
  REQUIRE(d.parked);
  CHECK(d.sub == std::optional<std::size_t>(0));
  CHECK_FALSE(d.state_waived);
  CHECK(d.claimed_tokens == 192);  // P - 1 floored to the block grid: the last token is computed
  REQUIRE(c.step_until([&] { return c.e.unparks_of(RequestId{2}) == 1; }));
  CHECK(c.e.unparked.back().tokens == 192);
  const std::vector<BlockId> from_block_2(blocks.begin() + 2, blocks.end());  // block i holds [32 + 16i, ...)
  for (auto& rank : c.e.ranks) CHECK(rank->pools.holds_prompt(from_block_2, 32, 192));
}

TEST_CASE("R16 with nothing on the P/D side the tier wins and its joint load carries the state") {
  Composed<K3> c;
  const Prompt p(25, 3);
  save_prompt(c.e, RequestId{1}, p, 176);
  const std::vector<BlockId> blocks = block_range(20, 13);
  const AdmitDecision d =
      c.e.coord.admit(AdmitRequest{RequestId{3}, p.tokens, 0, p.keys, blocks, p.checkpoints, SlotId{2}}, *c.multi);
  REQUIRE(d.parked);
  CHECK(d.sub == std::optional<std::size_t>(1));
  CHECK(std::holds_alternative<JointLoad>(d.plan));
  REQUIRE(c.step_until([&] { return c.e.unparks_of(RequestId{3}) == 1; }));
  CHECK(c.e.unparked.back().tokens == 176);
  for (auto& rank : c.e.ranks) CHECK(rank->pools.holds_state(SlotId{2}, p.hash_at(176)));
  CHECK(c.pd->stats().transfers == 0);
}

TEST_CASE("R16 no sub owns KV but the state is servable: a live state-only load through the tier sub") {
  Composed<K3> c;
  const Prompt p(27, 3);
  save_prompt(c.e, RequestId{1}, p, 176);
  // KV of [0, 192) is resident; nothing above it anywhere: only the state at 176 moves.
  const AdmitDecision d = c.e.coord.admit(
      AdmitRequest{RequestId{4}, p.tokens, 192, p.keys, block_range(0, 13), p.checkpoints, SlotId{3}}, *c.multi);
  REQUIRE(d.parked);
  CHECK_FALSE(d.sub.has_value());
  REQUIRE(std::holds_alternative<StateOnlyLoad>(d.plan));
  REQUIRE(c.step_until([&] { return c.e.unparks_of(RequestId{4}) == 1; }));
  CHECK(c.e.unparked.back().tokens == 176);
  for (auto& rank : c.e.ranks) CHECK(rank->pools.holds_state(SlotId{3}, p.hash_at(176)));  // restored, not recomputed
}

TEST_CASE("R16 a state-only plan with no slot is no_slot through a composition too, as through admit") {
  Composed<K3> c;
  const Prompt p(31, 3);
  save_prompt(c.e, RequestId{1}, p, 176);
  const AdmitRequest req{RequestId{6}, p.tokens, 192, p.keys, block_range(0, 13), p.checkpoints, std::nullopt};
  const AdmitDecision plain = c.e.coord.admit(req);
  CHECK_FALSE(plain.parked);
  CHECK(plain.reason == ComputeReason::no_slot);
  c.e.coord.teardown(RequestId{6});
  const AdmitDecision composed = c.e.coord.admit(req, *c.multi);
  CHECK_FALSE(composed.parked);
  CHECK(composed.reason == ComputeReason::no_slot);
  CHECK(std::holds_alternative<StateOnlyLoad>(composed.plan));
}

TEST_CASE("R16 a request torn down during its P/D transfer never unparks and is freed when the transfer ends") {
  Composed<Dense> c;
  const Prompt p(29, 3);
  c.prefill_on_producer(RequestId{5}, p);
  REQUIRE(c.e.coord.admit(AdmitRequest{RequestId{5}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, std::nullopt},
                          *c.multi).parked);
  c.e.coord.teardown(RequestId{5});
  CHECK(c.e.coord.stats().holding_now == 1);
  REQUIRE(c.step_until([&] { return c.e.was_freed(RequestId{5}); }));
  CHECK(c.e.unparks_of(RequestId{5}) == 0);
  CHECK(c.e.coord.stats().holding_now == 0);
  CHECK(c.e.coord.stats().invariant_violations == 0);
}
