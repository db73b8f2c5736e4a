// LoadCostMeter (engine/load_cost.hpp) and the Coordinator's measured break-even
// (CoordinatorOptions::measure_load_cost): the tier's latency and time per byte learnt from
// the loads themselves, on a manual clock, then used by the planner.
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/kvfuse.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

using namespace kvfuse;
using namespace std::chrono_literals;

TEST_CASE("load cost meter: a line through the samples gives the latency and the time per byte") {
  LoadCostMeter m(1.0);
  CHECK(m.estimate() == LoadCostEstimate{});
  for (std::uint64_t bytes : {1000u, 4000u, 16000u, 64000u}) m.add(bytes, 50'000 + 2.5 * static_cast<double>(bytes));
  const LoadCostEstimate e = m.estimate();
  CHECK(e.samples == 4);
  CHECK(e.latency_ns == doctest::Approx(50'000).epsilon(1e-6));
  CHECK(e.ns_per_byte == doctest::Approx(2.5).epsilon(1e-6));
  // Bad samples are ignored.
  m.add(10, -1);
  m.add(10, std::numeric_limits<double>::quiet_NaN());
  m.add(10, std::numeric_limits<double>::infinity());
  CHECK(m.estimate() == e);
}

TEST_CASE("load cost meter: degenerate fits fall back to a cost that never shrinks with bytes") {
  LoadCostMeter one_size(1.0);
  for (int i = 0; i < 5; ++i) one_size.add(2000, 10'000);
  CHECK(one_size.estimate().ns_per_byte == doctest::Approx(5.0));  // all of it per byte
  CHECK(one_size.estimate().latency_ns == 0);
  LoadCostMeter no_bytes(1.0);
  no_bytes.add(0, 7'000);
  no_bytes.add(0, 9'000);
  CHECK(no_bytes.estimate().latency_ns == doctest::Approx(8'000));  // state-free, chunk-free: latency only
  CHECK(no_bytes.estimate().ns_per_byte == 0);
  LoadCostMeter falling(1.0);  // noise: bigger loads were faster
  falling.add(1000, 9'000);
  falling.add(9000, 1'000);
  CHECK(falling.estimate().ns_per_byte == 0);
  CHECK(falling.estimate().latency_ns == doctest::Approx(5'000));
  LoadCostMeter steep(1.0);  // the line would cross below zero: through the origin instead
  steep.add(1000, 100);
  steep.add(2000, 10'000);
  CHECK(steep.estimate().latency_ns == 0);
  CHECK(steep.estimate().ns_per_byte == doctest::Approx((1000.0 * 100 + 2000.0 * 10'000) / (1e6 + 4e6)));
}

TEST_CASE("load cost meter: older samples weigh less, so a tier that slowed down is followed") {
  LoadCostMeter m(0.5);
  for (int i = 0; i < 20; ++i) {
    m.add(1000, 1'000 + 1.0 * 1000);
    m.add(3000, 1'000 + 1.0 * 3000);
  }
  CHECK(m.estimate().ns_per_byte == doctest::Approx(1.0).epsilon(1e-6));
  for (int i = 0; i < 20; ++i) {
    m.add(1000, 1'000 + 4.0 * 1000);
    m.add(3000, 1'000 + 4.0 * 3000);
  }
  CHECK(m.estimate().ns_per_byte == doctest::Approx(4.0).epsilon(1e-3));
  // applied_to: the configured break-even until min_samples, then the fit's tier times.
  const BreakEven configured{10, 0.25, 99, 4096, 8192};
  LoadCostMeter few;
  few.add(100, 1000);
  CHECK(few.applied_to(configured, 2) == configured);
  few.add(300, 3000);
  const BreakEven measured = few.applied_to(configured, 2);
  CHECK(measured.recompute_ns_per_token == 10);
  CHECK(measured.kv_chunk_bytes == 4096);
  CHECK(measured.tier_ns_per_byte == doctest::Approx(10.0));
  CHECK(measured.tier_latency_ns == doctest::Approx(0.0).epsilon(1e-9));
}

namespace {

using Clock = testing::ManualClock<struct LoadCostTag>;
constexpr std::uint32_t kBlock = 16, kChunk = 64;

struct Capture {
  std::vector<LoadRequest> loads;
  bool send(const LoadRequest& r) {
    loads.push_back(r);
    return true;
  }
  template <class Save>
  bool send(const Save&) {
    return true;
  }
};

struct AllHeld {
  std::size_t operator()(std::span<const PrefixHash> keys) const { return keys.size(); }
};

/// One rank, played by the test: each load completes when the test says, on a manual clock.
struct Engine {
  OffloadIndex<Clock> index{OffloadIndexOptions{.hash_capacity = 64, .slot_count = 4}};
  TpQuorum group{TpQuorumOptions{1, 0, 64, 256}};
  SettlementPump<TpQuorum, OffloadIndex<Clock>> pump{group, index};
  Capture transport;
  AllHeld lookup;
  Coordinator<TpQuorum, Capture, AllHeld, Clock> coord;
  explicit Engine(const CoordinatorOptions& o) : coord(o, index, pump, transport, lookup) {}

  /// Admits a dense request of `chunks` whole chunks (and a few tokens more); the load, if
  /// one is made, takes `took` and completes.
  AdmitDecision serve(std::uint64_t id, std::uint64_t chunks, std::chrono::nanoseconds took) {
    std::vector<PrefixHash> keys;
    std::vector<BlockId> blocks;
    for (std::uint64_t c = 0; c <= chunks; ++c) keys.push_back(PrefixHash{id * 100 + c});
    for (std::uint32_t b = 0; b < (chunks + 1) * (kChunk / kBlock); ++b) blocks.push_back(BlockId{b});
    const AdmitDecision d =
        coord.admit(AdmitRequest{RequestId{id}, chunks * kChunk + 5, 0, keys, blocks, {}, std::nullopt});
    if (d.parked) {
      Clock::current += took;
      const LoadRequest& r = transport.loads.back();
      const CompletionRecord rec{r.key, 0, KvOutcome::ok, StateOutcome::none, Reason::none, Reason::none,
                                 static_cast<std::uint32_t>(r.kv->chunk_keys.size())};
      pump.ingest(0, std::span<const CompletionRecord>(&rec, 1));
      (void)coord.step();
    }
    (void)coord.finish(FinishRequest{RequestId{id}, 0, {}, {}, std::nullopt, std::nullopt});
    (void)coord.step();
    return d;
  }
};

CoordinatorOptions measuring(std::uint64_t chunk_bytes) {
  CoordinatorOptions o{.layout = StateLayout::none, .grids = PlanGrids{kBlock, kChunk}, .expected_requests = 64};
  // 10 ns of prefill per token; the tier's times are not configured (0: reading is free).
  o.break_even = BreakEven{10, 0, 0, chunk_bytes, 0};
  o.measure_load_cost = true;
  o.min_timed_loads = 4;
  return o;
}

}  // namespace

TEST_CASE("coordinator: with measure_load_cost it learns the tier's speed from its loads and stops making slow ones") {
  // A tier of 20 us per load plus 1 ns per byte, 4 KiB a chunk. Recomputing a chunk costs
  // 640 ns: every load here costs more than it spares, but nothing says so until measured.
  constexpr std::uint64_t chunk_bytes = 4096;
  Engine e(measuring(chunk_bytes));
  auto tier_time = [](std::uint64_t chunks) { return std::chrono::nanoseconds(20'000 + chunks * chunk_bytes); };
  std::uint64_t id = 1;
  for (const std::uint64_t chunks : {2u, 5u, 3u, 8u}) {
    const AdmitDecision d = e.serve(id++, chunks, tier_time(chunks));
    CHECK(d.parked);  // configured as free: made
  }
  CHECK(e.coord.stats().loads_timed == 4);
  const LoadCostEstimate est = e.coord.load_cost();
  CHECK(est.samples == 4);
  CHECK(est.latency_ns == doctest::Approx(20'000).epsilon(1e-6));
  CHECK(est.ns_per_byte == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(e.coord.break_even().tier_latency_ns == doctest::Approx(20'000).epsilon(1e-6));
  // Now the planner knows: the same load is slower than its prefill, and is not made.
  const AdmitDecision d = e.serve(id++, 4, tier_time(4));
  CHECK_FALSE(d.parked);
  CHECK(d.no_load == NoLoadReason::slower_than_recompute);
  CHECK(e.coord.stats().slower_than_recompute == 1);
  CHECK(e.coord.options().break_even.tier_latency_ns == 0);  // the options stay as built

  // The same loads from a fast tier (1 us, 0.01 ns per byte) keep paying once measured.
  Engine fast(measuring(chunk_bytes));
  for (std::uint64_t i = 1; i <= 6; ++i)
    CHECK(fast.serve(i, 2 + i % 3, std::chrono::nanoseconds(1'000 + (2 + i % 3) * chunk_bytes / 100)).parked);
  CHECK(fast.coord.stats().slower_than_recompute == 0);
  CHECK(fast.coord.load_cost().latency_ns == doctest::Approx(1'000).epsilon(1e-3));
}

TEST_CASE("coordinator: measure_load_cost without the bytes a load reads is refused, naming the field") {
  OffloadIndex<Clock> index(OffloadIndexOptions{.hash_capacity = 16, .slot_count = 4});
  TpQuorum group(TpQuorumOptions{1, 0, 64, 64});
  SettlementPump<TpQuorum, OffloadIndex<Clock>> pump(group, index);
  Capture t;
  AllHeld l;
  auto refused = [&](CoordinatorOptions o) {
    try {
      Coordinator<TpQuorum, Capture, AllHeld, Clock> c(o, index, pump, t, l);
    } catch (const Error& err) {
      CHECK(err.code() == ErrorCode::invalid_argument);
      return std::string(err.what());
    }
    return std::string("accepted");
  };
  CoordinatorOptions o = measuring(0);
  CHECK(refused(o).find("break_even.kv_chunk_bytes > 0") != std::string::npos);
  o = measuring(4096);
  o.layout = StateLayout::k3_recurrent;
  CHECK(refused(o).find("break_even.state_bytes > 0") != std::string::npos);
  o = measuring(4096);
  o.min_timed_loads = 0;
  CHECK(refused(o).find("min_timed_loads must be > 0") != std::string::npos);
  CHECK(refused(measuring(4096)) == "accepted");
}
