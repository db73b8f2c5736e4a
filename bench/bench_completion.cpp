// Completion path throughput (bench/README.md targets: >= 10 M records/s drained and merged at 8
// ranks) and the cost of a lane push against a bare boost::lockfree::spsc_queue push.
//
// Prints, after the Google Benchmark table, the ratios the targets are stated in:
//   lane push / bare spsc push         (same 32-byte element, same queue, one thread)
//   records/s drained + merged          per world size, consumer side only and end to end
#include <benchmark/benchmark.h>

#include <kvfuse/completion/settlement_pump.hpp>
#include <kvfuse/completion/single_rank.hpp>
#include <kvfuse/completion/tp_quorum.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <boost/lockfree/spsc_queue.hpp>

#include "completion_fixtures.hpp"

using namespace kvfuse;
using kvfuse::bench::CountingIndex;
using kvfuse::bench::Discard;
using kvfuse::bench::record;
using kvfuse::bench::settled_during;

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t push_batch = 256;
constexpr std::uint64_t keys_per_batch = 1024;


// ---- push cost ----------------------------------------------------------------------------

void BM_BareSpscPush(benchmark::State& state) {
  boost::lockfree::spsc_queue<RecordEnvelope> queue(push_batch);
  std::uint64_t key = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < push_batch; ++i) {
      if (!queue.push(RecordEnvelope::wrap(record(key++, 0)))) [[unlikely]]
        state.SkipWithError("queue full");
    }
    const auto t1 = Clock::now();
    queue.consume_all([](const RecordEnvelope& e) { benchmark::DoNotOptimize(e); });
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * push_batch));
}
BENCHMARK(BM_BareSpscPush)->UseManualTime();

void BM_LanePush(benchmark::State& state) {
  RankQueue queue(0, RankQueueOptions{1, push_batch, {}});
  LaneEmitter lane = queue.emitter(0);
  Discard discard;
  std::uint64_t key = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < push_batch; ++i) lane.emit(record(key++, 0));
    const auto t1 = Clock::now();
    queue.drain(discard);
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * push_batch));
}
BENCHMARK(BM_LanePush)->UseManualTime();

// ---- drain + merge ------------------------------------------------------------------------

TpQuorumOptions quorum_config(std::uint32_t ranks) {
  TpQuorumOptions c;
  c.world_size = ranks;
  c.lanes_per_rank = 1;
  c.lane_capacity = keys_per_batch;
  return c;
}

/// A quorum of `ranks`, its pump, and one lane per rank; fill() pushes one record per
/// rank for each of the next keys_per_batch keys.
struct SingleThreadRig {
  std::uint32_t ranks;
  TpQuorum group{quorum_config(ranks)};
  CountingIndex index;
  SettlementPump<TpQuorum, CountingIndex> pump{group, index};
  std::vector<LaneEmitter> lanes = claim();
  std::uint64_t key = 0;
  explicit SingleThreadRig(std::uint32_t world) : ranks(world) {}
  std::vector<LaneEmitter> claim() {
    std::vector<LaneEmitter> out;
    for (std::uint32_t r = 0; r < ranks; ++r) out.push_back(group.emitter(r, 0));
    return out;
  }
  void fill() noexcept {
    for (std::uint64_t k = 0; k < keys_per_batch; ++k, ++key)
      for (std::uint32_t r = 0; r < ranks; ++r) lanes[r].emit(record(key, r));
  }
};

/// Consumer side: the lanes are filled (untimed) with one record per rank per key, then one
/// pump.step() drains, merges and settles them all (timed).
void BM_DrainMerge(benchmark::State& state) {
  SingleThreadRig rig(static_cast<std::uint32_t>(state.range(0)));
  auto& pump = rig.pump;
  const std::uint32_t ranks = rig.ranks;
  for (auto _ : state) {
    rig.fill();
    const std::uint64_t before = rig.index.settled;
    const auto t0 = Clock::now();
    (void)pump.step();
    const auto t1 = Clock::now();
    if (rig.index.settled - before != keys_per_batch) state.SkipWithError("not every key settled");
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * keys_per_batch * ranks));
}
BENCHMARK(BM_DrainMerge)->Arg(1)->Arg(2)->Arg(8)->UseManualTime();

/// End to end on one thread: every record is pushed through its lane, drained, merged and
/// settled — the total CPU cost of one record on the completion path.
void BM_PushDrainMerge(benchmark::State& state) {
  SingleThreadRig rig(static_cast<std::uint32_t>(state.range(0)));
  auto& pump = rig.pump;
  const std::uint32_t ranks = rig.ranks;
  for (auto _ : state) {
    rig.fill();
    if (settled_during(rig.index, [&] { (void)pump.step(); }) != keys_per_batch)
      state.SkipWithError("not every key settled");
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * keys_per_batch * ranks));
}
BENCHMARK(BM_PushDrainMerge)->Arg(1)->Arg(2)->Arg(8);

/// Two threads: one producer thread owns every rank's lane (a lane may be driven by any
/// one thread), the benchmark thread steps the pump until every key settled. Includes the
/// cross-core traffic and any full-queue back-off; on a shared machine this one is noisy.
void BM_Threaded(benchmark::State& state) {
  const auto ranks = static_cast<std::uint32_t>(state.range(0));
  constexpr std::uint64_t keys = 1 << 16;
  TpQuorumOptions c = quorum_config(ranks);
  c.lane_capacity = keys;  // room for a whole batch: measures the hand-off, not the back-off
  TpQuorum group(c);
  CountingIndex index;
  SettlementPump<TpQuorum, CountingIndex> pump(group, index);
  std::vector<LaneEmitter> lanes;
  for (std::uint32_t r = 0; r < ranks; ++r) lanes.push_back(group.emitter(r, 0));
  std::uint64_t base = 0;
  for (auto _ : state) {
    const std::uint64_t first = base;
    std::thread producer([&lanes, first, ranks] {
      for (std::uint64_t k = first; k < first + keys; ++k)
        for (std::uint32_t r = 0; r < ranks; ++r) lanes[r].emit(record(k, r));
    });
    std::uint64_t settled = 0;
    while (settled < keys) settled += settled_during(index, [&] { (void)pump.step(); });
    producer.join();
    base += keys;
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * keys * ranks));
  state.counters["full_waits"] = static_cast<double>(group.stats().queues.full_waits);
}
BENCHMARK(BM_Threaded)->Arg(1)->Arg(2)->Arg(8)->UseRealTime()->Unit(benchmark::kMillisecond);

/// SingleRank for comparison: no quorum table at all.
void BM_SingleRankDrain(benchmark::State& state) {
  SingleRank group(SingleRankOptions{1, keys_per_batch, {}});
  CountingIndex index;
  SettlementPump<SingleRank, CountingIndex> pump(group, index);
  LaneEmitter lane = group.emitter(0, 0);
  std::uint64_t key = 0;
  for (auto _ : state) {
    for (std::uint64_t k = 0; k < keys_per_batch; ++k) lane.emit(record(key++, 0));
    const std::uint64_t before = index.settled;
    const auto t0 = Clock::now();
    (void)pump.step();
    const auto t1 = Clock::now();
    if (index.settled - before != keys_per_batch) state.SkipWithError("not every key settled");
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * keys_per_batch));
}
BENCHMARK(BM_SingleRankDrain)->UseManualTime();

// ---- the ratio report ---------------------------------------------------------------------

/// Prints the console table as usual and remembers items/s per benchmark for the summary.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  RatioReporter() : ConsoleReporter(OO_Tabular) {}  // plain text: the output is meant for logs
  std::map<std::string, double> items_per_second;
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      const auto it = run.counters.find("items_per_second");
      if (it != run.counters.end()) items_per_second[run.benchmark_name()] = it->second.value;
    }
  }
};

double find(const std::map<std::string, double>& m, const std::string& prefix) {
  for (const auto& [name, value] : m)
    if (name.rfind(prefix, 0) == 0) return value;
  return 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  const auto& ips = reporter.items_per_second;
  const double bare = find(ips, "BM_BareSpscPush");
  const double lane = find(ips, "BM_LanePush");
  std::printf("\n== completion path summary ==\n");
  if (bare > 0 && lane > 0)
    std::printf("lane push / bare spsc push (time per record): %.2f  (%.2f ns vs %.2f ns)\n", bare / lane, 1e9 / lane,
                1e9 / bare);
  for (const char* ranks : {"1", "2", "8"}) {
    const double drain = find(ips, std::string("BM_DrainMerge/") + ranks + "/");
    const double e2e = find(ips, std::string("BM_PushDrainMerge/") + ranks);
    const double threaded = find(ips, std::string("BM_Threaded/") + ranks + "/");
    std::printf("%s rank(s): drain+merge %.1f M records/s | push+drain+merge, one thread %.1f M/s | two threads %.1f M/s\n",
                ranks, drain / 1e6, e2e / 1e6, threaded / 1e6);
  }
  const double at8 = find(ips, "BM_DrainMerge/8/");
  if (at8 > 0)
    std::printf("target (bench/README.md): >= 10 M records/s drained and merged at 8 ranks: %.1f M/s -> %s\n", at8 / 1e6,
                at8 >= 10e6 ? "met" : "NOT met");
  return 0;
}
