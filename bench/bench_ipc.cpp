// Ranks as processes against ranks as threads (bench/README.md#processes), ratios taken in
// one run:
//   records drained and merged per second at 8 ranks: the same records wait either in 8
//     rank processes' shared-memory rings (ShmQuorum) or in the lanes (TpQuorum) of 8 rank
//     threads; either way another core wrote them. One pump.step() drains, merges and
//     settles a batch (timed: the consumer side only).
//     Target: processes >= 0.8 of threads.
//   one 4 KiB load's round trip: the engine sends a LoadRequest and steps the pump until the
//     load settled; the rank is a connector in this process (threads) or a rank process on
//     the segment (processes). Informative.
//
// The rank processes are forked from this one before any benchmark thread exists; each
// attaches with ShmRank like any rank process would.
#include <benchmark/benchmark.h>

#include <kvfuse/completion/settlement_pump.hpp>
#include <kvfuse/completion/tp_quorum.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/ipc/shm_engine.hpp>
#include <kvfuse/ipc/shm_rank.hpp>
#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/worker/connector.hpp>
#include <kvfuse/worker/paged_kv.hpp>
#include <kvfuse/worker/state_legs.hpp>

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "completion_fixtures.hpp"

using namespace kvfuse;
using kvfuse::bench::CountingIndex;
using kvfuse::bench::record;
using kvfuse::bench::settled_during;

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t drain_ranks = 8;
constexpr std::uint64_t keys_per_batch = 1024;

/// A geometry whose tier chunk is 4 KiB on each rank: 64 tokens of 64 bytes.
RankGeometry geometry(std::uint32_t rank, std::uint32_t world) {
  RankGeometry g;
  g.model = 7;
  g.rank = rank;
  g.world_size = world;
  g.block_tokens = 16;
  g.chunk_tokens = 64;
  g.kv_bytes_per_token = 64;
  g.num_blocks = 16;
  g.max_chunks_per_load = 4;
  return g;
}

ShmOptions shm_options(std::uint32_t world, std::uint32_t lanes) {
  ShmOptions o;
  o.name_prefix = "kvfuse-bench-" + std::to_string(::getpid());
  o.geometry = geometry(0, world);
  o.lanes_per_rank = lanes;
  o.record_ring_records = 4 * keys_per_batch;
  return o;
}

/// Rounds shared with the forked rank processes (an anonymous shared mapping made before
/// the fork): the parent opens round n, each child emits its batch and counts itself done.
struct Rounds {
  std::atomic<std::uint64_t> round{0};
  std::atomic<std::uint64_t> done{0};
  std::atomic<bool> stop{false};
  detail::SharedEventCount opened, finished;

  static Rounds* make() {
    void* p = ::mmap(nullptr, sizeof(Rounds), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    return new (p) Rounds{};
  }
  static void unmap(Rounds* r) { ::munmap(r, sizeof(Rounds)); }
};

/// Forks one process per rank running `body(rank)`; the children never return.
template <class Body>
std::vector<pid_t> fork_ranks(std::uint32_t ranks, Body body) {
  std::vector<pid_t> pids;
  for (std::uint32_t r = 0; r < ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int status = 0;
      try {
        body(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %u: %s\n", r, e.what());
        status = 1;
      }
      ::_exit(status);
    }
    pids.push_back(pid);
  }
  return pids;
}

void reap(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) ::waitpid(pid, nullptr, 0);
}

// ---- drain + merge: lanes against rings ---------------------------------------------------

/// A producer's side of the rounds: for each round, its rank's record for every key of the
/// round, through its lane (a LaneEmitter in a rank thread, a ShmEmitter in a rank process).
template <class Emitter>
void produce_rounds(Rounds& rounds, std::uint32_t rank, Emitter& lane) {
  for (std::uint64_t mine = 1;; ++mine) {
    rounds.opened.wait_until([&] { return rounds.round.load() >= mine || rounds.stop.load(); });
    if (rounds.stop.load()) return;
    const std::uint64_t first = (mine - 1) * keys_per_batch;
    for (std::uint64_t k = first; k < first + keys_per_batch; ++k) lane.emit(record(k, rank));
    rounds.done.fetch_add(1);
    rounds.finished.notify_all();
  }
}

/// The consumer's side: opens a round, waits (untimed) until every rank produced it, then
/// times the one pump.step() that drains, merges and settles it.
template <class Pump>
void time_rounds(benchmark::State& state, Rounds& rounds, Pump& pump, CountingIndex& index) {
  std::uint64_t round = 0;
  for (auto _ : state) {
    ++round;
    rounds.round.store(round);
    rounds.opened.notify_all();
    rounds.finished.wait_until([&] { return rounds.done.load() >= round * drain_ranks; });
    const auto t0 = Clock::now();
    const std::uint64_t settled = settled_during(index, [&] { (void)pump.step(); });
    const auto t1 = Clock::now();
    if (settled != keys_per_batch) state.SkipWithError("not every key settled");
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * keys_per_batch * drain_ranks));
  rounds.stop.store(true);
  rounds.opened.notify_all();
}

/// Rank threads: each fills its in-process lane (a Boost.Lockfree SPSC queue of TpQuorum).
void BM_DrainMergeThreads(benchmark::State& state) {
  Rounds* rounds = Rounds::make();
  if (rounds == nullptr) {
    state.SkipWithError("mmap failed");
    return;
  }
  TpQuorumOptions c;
  c.world_size = drain_ranks;
  c.lanes_per_rank = 1;
  c.lane_capacity = 4 * keys_per_batch;
  TpQuorum group(c);
  CountingIndex index;
  SettlementPump<TpQuorum, CountingIndex> pump(group, index);
  std::vector<std::thread> ranks;
  for (std::uint32_t r = 0; r < drain_ranks; ++r)
    ranks.emplace_back([rounds, r, lane = group.emitter(r, 0)]() mutable { produce_rounds(*rounds, r, lane); });
  time_rounds(state, *rounds, pump, index);
  for (std::thread& t : ranks) t.join();
  Rounds::unmap(rounds);
}
BENCHMARK(BM_DrainMergeThreads)->UseManualTime();

/// Rank processes: each fills its record ring in the segment (ShmQuorum).
void BM_DrainMergeProcesses(benchmark::State& state) {
  Rounds* rounds = Rounds::make();
  if (rounds == nullptr) {
    state.SkipWithError("mmap failed");
    return;
  }
  ShmEngine engine(shm_options(drain_ranks, 1));
  const std::string name = engine.name();
  const std::vector<pid_t> pids = fork_ranks(drain_ranks, [&](std::uint32_t r) {
    ShmRank rank(name, geometry(r, drain_ranks));
    ShmEmitter lane = rank.emitter(0);
    produce_rounds(*rounds, r, lane);
  });
  ShmQuorum group(engine);
  CountingIndex index;
  SettlementPump<ShmQuorum, CountingIndex> pump(group, index);
  if (!engine.wait_attached(std::chrono::seconds(10))) state.SkipWithError("the rank processes did not attach");
  (void)engine.watch(pump);
  time_rounds(state, *rounds, pump, index);
  reap(pids);
  Rounds::unmap(rounds);
}
BENCHMARK(BM_DrainMergeProcesses)->UseManualTime();

// ---- one 4 KiB load, round trip -----------------------------------------------------------

using Mem = MemoryTier<>;
template <class Group>
using DenseConnector = Connector<PagedKv<Mem>, NoState, Group>;

/// One rank's device memory and tier, and the chunk every load reads.
struct RankMemory {
  HostRuntime runtime;
  RankGeometry geo;
  void* blocks;
  Mem tier{std::size_t{1} << 20};
  explicit RankMemory(const RankGeometry& g)
      : geo(g), blocks(runtime.allocate_device(std::size_t{g.num_blocks} * g.block_bytes())) {
    std::memset(blocks, 0x5a, std::size_t{g.num_blocks} * g.block_bytes());
  }
  ~RankMemory() { runtime.free_device(blocks); }
  DeviceMemory memory() const { return DeviceMemory{static_cast<std::byte*>(blocks), nullptr}; }
};

constexpr PrefixHash chunk_key{0xC0FFEE};

KvSave save_of_the_chunk() {
  return KvSave{SaveKey{chunk_key, Generation{1}}, {chunk_key}, {BlockId{0}, BlockId{1}, BlockId{2}, BlockId{3}}};
}
LoadRequest load_of_the_chunk(std::uint64_t n) {
  return LoadRequest{LoadKey{RequestId{1}, Generation{n + 1}},
                     KvSpec{0, 64, {chunk_key}, {BlockId{4}, BlockId{5}, BlockId{6}, BlockId{7}}}, std::nullopt};
}

/// Sends the load with `send`, then steps the pump until it settled; times each round trip.
template <class Send, class Pump>
void time_round_trips(benchmark::State& state, Send send, Pump& pump, CountingIndex& index) {
  std::uint64_t n = 1;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    send(load_of_the_chunk(n++));
    while (settled_during(index, [&] { (void)pump.step(); }) == 0) {
    }
    const auto t1 = Clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  if (index.settled_ok != index.settled) state.SkipWithError("a load failed");
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * 4096));
}

/// Saves the chunk and steps until both phases of the save settled.
template <class Send, class Pump>
bool save_first(Send send, Pump& pump, CountingIndex& index) {
  send(save_of_the_chunk());
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (index.saves < 2 && Clock::now() < deadline) (void)pump.step();
  return index.saves >= 2;
}

void BM_LoadRoundTripThreads(benchmark::State& state) {
  TpQuorumOptions c;
  c.world_size = 1;
  c.lanes_per_rank = 2;
  c.lane_capacity = 64;
  TpQuorum group(c);
  CountingIndex index;
  SettlementPump<TpQuorum, CountingIndex> pump(group, index);
  RankMemory rank(geometry(0, 1));
  DenseConnector<TpQuorum> conn(rank.geo, rank.runtime, rank.memory(), PagedKv<Mem>(rank.tier), NoState{}, group);
  if (!save_first([&](KvSave s) { conn.save_kv(std::move(s)); }, pump, index)) state.SkipWithError("the save never settled");
  time_round_trips(state, [&](LoadRequest r) { conn.load(std::move(r)); }, pump, index);
}
BENCHMARK(BM_LoadRoundTripThreads)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_LoadRoundTripProcesses(benchmark::State& state) {
  std::vector<pid_t> pids;
  {
    ShmEngine engine(shm_options(1, 2));
    const std::string name = engine.name();
    pids = fork_ranks(1, [&](std::uint32_t r) {
      ShmRank rank(name, geometry(r, 1));
      RankMemory memory(geometry(r, 1));
      DenseConnector<ShmQuorum> conn(memory.geo, memory.runtime, memory.memory(), PagedKv<Mem>(memory.tier), NoState{},
                                     DenseConnector<ShmQuorum>::Emitters{rank.emitter(0), rank.emitter(1)});
      (void)rank.serve(conn);
      conn.drain();
    });
    ShmQuorum group(engine);
    CountingIndex index;
    SettlementPump<ShmQuorum, CountingIndex> pump(group, index);
    if (!engine.wait_attached(std::chrono::seconds(10))) state.SkipWithError("the rank process did not attach");
    (void)engine.watch(pump);
    if (!save_first([&](const KvSave& s) { (void)engine.send(s); }, pump, index))
      state.SkipWithError("the save never settled");
    time_round_trips(state, [&](const LoadRequest& r) { (void)engine.send(r); }, pump, index);
  }  // the engine going away ends the rank process
  reap(pids);
}
BENCHMARK(BM_LoadRoundTripProcesses)->UseManualTime()->Unit(benchmark::kMicrosecond);

// ---- the ratio report ---------------------------------------------------------------------

/// Prints the console table as usual and keeps each benchmark's figures for the summary.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  RatioReporter() : ConsoleReporter(OO_Tabular) {}
  std::map<std::string, double> items_per_second, seconds_per_iteration;
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration) continue;
      const std::string name = run.run_name.function_name;
      const auto it = run.counters.find("items_per_second");
      if (it != run.counters.end()) items_per_second[name] = it->second.value;
      if (run.iterations > 0) seconds_per_iteration[name] = run.real_accumulated_time / static_cast<double>(run.iterations);
    }
  }
};

double get(const std::map<std::string, double>& m, const std::string& name) {
  const auto it = m.find(name);
  return it == m.end() ? 0.0 : it->second;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  const double threads = get(reporter.items_per_second, "BM_DrainMergeThreads");
  const double processes = get(reporter.items_per_second, "BM_DrainMergeProcesses");
  std::printf("\n== ranks as processes summary ==\n");
  if (threads > 0 && processes > 0)
    std::printf("drain+merge at 8 ranks: rings %.1f M records/s, lanes %.1f M/s: %.2f of the lanes (target >= 0.8) -> %s\n",
                processes / 1e6, threads / 1e6, processes / threads, processes >= 0.8 * threads ? "met" : "NOT met");
  const double rt_threads = get(reporter.seconds_per_iteration, "BM_LoadRoundTripThreads");
  const double rt_processes = get(reporter.seconds_per_iteration, "BM_LoadRoundTripProcesses");
  if (rt_threads > 0 && rt_processes > 0)
    std::printf("4 KiB load round trip: rank process %.1f us, rank thread %.1f us: %.2fx\n", rt_processes * 1e6,
                rt_threads * 1e6, rt_processes / rt_threads);
  return 0;
}
