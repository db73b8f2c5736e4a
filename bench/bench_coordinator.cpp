// The engine loop's scheduler-thread cost per request (bench/README.md target: <= 1 us per
// request): admit -> dispatch -> 8 ranks' records -> step -> unpark, for a 16-chunk Kimi-K3
// joint load, with connectors that copy nothing.
//
// The rig is the real engine side: OffloadIndex + TpQuorum (8 ranks, 3 lanes each, as a K3
// connector claims) + SettlementPump + Coordinator (k3_recurrent, grids 16/256). Only the
// ranks are replaced: the transport does not run connectors, it emits the record each rank
// would send for a successful joint load (kv ok, state restored) straight into that rank's
// load lane (group.emitter(rank, 0)). The lookup says the tier holds the whole prompt.
//
// One request: a 4112-token prompt (16 whole chunks of 256 plus 16 tokens; 17 chunk keys,
// a 257-block table), a slot of its own, and a servable state checkpoint at B = 4096 (its
// hash note_stored into the index up front). The plan is JointLoad{hbm 0, end 4096, B 4096}:
// 16 chunk keys and 256 block ids are copied into the LoadRequest (two vectors: heap
// allocations, counted below). One iteration is a batch of 256 such requests, each with a
// fresh RequestId (the same 256 prompts, slots and block tables every batch):
//   admit      coord.admit() for each: lookup, note, could_serve, plan, KvSpec build, index
//              ticket, dispatch, transport.send (the 8 record pushes in the `inline` mode), park
//   step       coord.step() until all 256 unparked: drain 24 lane queues, merge 8 records
//              per key in the quorum, settle into the index, drain resolutions, unpark
//   finish     coord.finish() for each, with nothing new to save (the tier already holds
//              the 16 chunks it loaded, and no checkpoint is passed): it only releases the
//              request (its release event comes out of the next batch's step). That is what
//              keeps the steady state bounded; the save path is not part of this row.
// Every figure is per request: ns_per_request (all three phases), admit_ns, step_ns,
// finish_ns, allocs_per_request (operator new calls on the scheduler thread, counted by the
// replacement operator new below: a thread_local increment, no atomic), steps_per_batch.
//
// Where the ranks' record pushes run (the `ranks` argument of the benchmark name):
//   inline     the transport pushes the 8 records inside send(), on the scheduler thread,
//              and they are timed: the headline (one thread does all the work, so nothing
//              here is hidden on another core).
//   untimed    the transport only remembers the key; the 8 pushes per request run on the
//              scheduler thread between admit and step, outside the timed phases: the
//              scheduler's own cost, without the ranks' side.
//   thread     the transport hands the key to a producer thread (an SPSC queue) that owns
//              every rank's lane and pushes the 8 records; the scheduler steps until all
//              unparked (yielding after a step that found no record). Wall time of the
//              scheduler thread, so it includes waiting for the producer, empty steps and
//              the cache lines the two threads pass back and forth; on a shared 2-CPU
//              machine, where the two threads often share one CPU, it is noisy.
// `checkpoints`: how many candidate boundaries admit() is handed: 1 (only B = 4096), or 16
// (one per chunk boundary, 256 .. 4096; only 4096 is indexed, so 15 could_serve misses).
//
// Run: ./kvfuse_bench_coordinator --benchmark_min_time=0.3
#include <benchmark/benchmark.h>

#include <kvfuse/completion/settlement_pump.hpp>
#include <kvfuse/completion/tp_quorum.hpp>
#include <kvfuse/engine/coordinator.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include <boost/lockfree/spsc_queue.hpp>

// ---- allocation count (this binary only) --------------------------------------------------
// A plain thread_local counter: the scheduler thread's operator new calls. Array and nothrow
// forms route through this one in libstdc++; the aligned forms are not replaced (not counted;
// nothing on the measured path uses them).
namespace {
thread_local std::uint64_t t_news = 0;
[[gnu::noinline]] void plain_free(void* p) noexcept { std::free(p); }
}  // namespace

void* operator new(std::size_t n) {
  ++t_news;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { plain_free(p); }
void operator delete(void* p, std::size_t) noexcept { plain_free(p); }

using namespace kvfuse;

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kRanks = 8;
constexpr std::size_t kLanes = 3;  // KimiK3Connector::lane_count: load, state, save lanes
constexpr std::size_t kBatch = 256;
constexpr PlanGrids kGrids{16, 256};
constexpr std::size_t kChunks = 16;
constexpr TokenCount kPrompt = kChunks * 256 + 16;  // 4112: 16 whole chunks and a partial 17th
constexpr TokenCount kBoundary = kChunks * 256;     // B = 4096, on the block grid, <= P - 1
constexpr std::size_t kKeys = kChunks + 1;          // chunk keys covering the prompt
constexpr std::size_t kBlocks = kPrompt / 16 + 1;   // 257 blocks cover 4112 tokens

enum class RanksMode : int { inline_push = 0, untimed = 1, thread = 2 };

CompletionRecord joint_ok(LoadKey key, std::uint32_t rank) noexcept {
  return CompletionRecord{key, rank, KvOutcome::ok, StateOutcome::restored, Reason::none, Reason::none};
}

/// What an engine holds for one prompt: its chunk keys, block table, slot and checkpoints.
struct Prompt {
  std::vector<PrefixHash> keys;
  std::vector<BlockId> blocks;
  std::vector<Checkpoint> checkpoints;
  SlotId slot;
  Checkpoint servable;
};

std::vector<Prompt> make_prompts(std::size_t candidates) {
  std::vector<Prompt> prompts(kBatch);
  for (std::uint32_t p = 0; p < kBatch; ++p) {
    Prompt& pr = prompts[p];
    const std::uint64_t base = (std::uint64_t{p} + 1) << 32;
    for (std::uint64_t c = 0; c < kKeys; ++c) pr.keys.push_back(PrefixHash{base | c});
    for (std::uint32_t b = 0; b < kBlocks; ++b) pr.blocks.push_back(BlockId{p * static_cast<std::uint32_t>(kBlocks) + b});
    pr.slot = SlotId{p};
    pr.servable = Checkpoint{kBoundary, PrefixHash{base | 0x8000'0000ULL}};
    // Candidates in ascending order, the servable one last; the others are not indexed.
    for (std::size_t i = 1; i < candidates; ++i)
      pr.checkpoints.push_back(Checkpoint{i * 256, PrefixHash{base | (0x4000'0000ULL + i)}});
    pr.checkpoints.push_back(pr.servable);
  }
  return prompts;
}

/// "Connectors that do no copies": each rank's record for a successful joint load, emitted
/// into its load lane, wherever the mode says.
struct Ranks {
  RanksMode mode = RanksMode::inline_push;
  std::vector<LaneEmitter> lanes;                     // inline and untimed: owned here
  std::vector<LoadKey> sent;                          // untimed: keys waiting for their records
  boost::lockfree::spsc_queue<LoadKey> to_thread{kBatch * 2};  // thread mode
  std::uint64_t saves = 0;                            // never expected (see finish above)

  void push_records(LoadKey key) noexcept {
    for (std::uint32_t r = 0; r < kRanks; ++r) lanes[r].emit(joint_ok(key, r));
  }
  bool send(const LoadRequest& request) noexcept {
    switch (mode) {
      case RanksMode::inline_push: push_records(request.key); break;
      case RanksMode::untimed: sent.push_back(request.key); break;  // reserved: never allocates
      case RanksMode::thread:
        while (!to_thread.push(request.key)) detail::cpu_relax();
        break;
    }
    return true;
  }
  bool send(const KvSave&) noexcept {
    ++saves;
    return true;
  }
  bool send(const StateSave&) noexcept {
    ++saves;
    return true;
  }
};

/// The tier holds every chunk of the prompt.
struct TierHoldsPrompt {
  std::size_t operator()(std::span<const PrefixHash> keys) const noexcept { return keys.size(); }
};

using Coord = Coordinator<TpQuorum, Ranks, TierHoldsPrompt>;

TpQuorumOptions quorum_options() {
  TpQuorumOptions o;
  o.world_size = kRanks;
  o.lanes_per_rank = kLanes;
  o.lane_capacity = 4096;
  return o;
}

OffloadIndexOptions index_options() {
  OffloadIndexOptions o;
  o.slot_count = kBatch;  // one slot per request of a batch: every slot is free again after its unpark
  return o;
}

/// The whole engine side, and the producer thread of the `thread` mode.
struct Rig {
  TpQuorum group{quorum_options()};
  OffloadIndex<> index{index_options()};  // the coordinator's Release events free slots
  SettlementPump<TpQuorum, OffloadIndex<>> pump{group, index};
  Ranks ranks;
  TierHoldsPrompt lookup;
  Coord coord{CoordinatorOptions{StateLayout::k3_recurrent, kGrids, 0, 2 * kBatch}, index, pump, ranks, lookup};
  std::atomic<bool> stop{false};
  std::thread producer;

  explicit Rig(RanksMode mode) {
    ranks.mode = mode;
    ranks.sent.reserve(kBatch);
    std::vector<LaneEmitter> lanes;
    for (std::uint32_t r = 0; r < kRanks; ++r) lanes.push_back(group.emitter(r, 0));
    if (mode != RanksMode::thread) {
      ranks.lanes = std::move(lanes);
      return;
    }
    producer = std::thread([this, lanes = std::move(lanes)]() mutable {
      std::uint32_t idle = 0;
      LoadKey key;
      while (!stop.load(std::memory_order_relaxed)) {
        if (ranks.to_thread.pop(key)) {
          idle = 0;
          for (std::uint32_t r = 0; r < kRanks; ++r) lanes[r].emit(joint_ok(key, r));
        } else if (++idle < 1024) {
          detail::cpu_relax();
        } else {
          std::this_thread::yield();
        }
      }
    });
  }
  ~Rig() {
    stop.store(true, std::memory_order_relaxed);
    if (producer.joinable()) producer.join();
  }
};

double ns(Clock::duration d) { return std::chrono::duration<double, std::nano>(d).count(); }

void BM_CoordinatorRequest(benchmark::State& state, RanksMode mode) {
  const auto candidates = static_cast<std::size_t>(state.range(0));
  const std::vector<Prompt> prompts = make_prompts(candidates);
  Rig rig(mode);
  for (const Prompt& p : prompts) rig.index.note_stored(p.servable.hash);

  std::uint64_t next_id = 1;
  double admit_ns = 0, step_ns = 0, finish_ns = 0;
  std::uint64_t allocs = 0, steps = 0, unparked_total = 0, wrong_unparks = 0, freed = 0, requests = 0;
  std::vector<RequestId> ids(kBatch);
  for (auto _ : state) {
    const std::uint64_t news_before = t_news;
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < kBatch; ++i) {
      const Prompt& p = prompts[i];
      ids[i] = RequestId{next_id++};
      const AdmitDecision d = rig.coord.admit(AdmitRequest{ids[i], kPrompt, 0, p.keys, p.blocks, p.checkpoints, p.slot});
      if (!d.parked) [[unlikely]] {
        state.SkipWithError("a request was not parked on a joint load");
        return;
      }
    }
    const auto t1 = Clock::now();
    const std::uint64_t news_admit = t_news;
    if (mode == RanksMode::untimed) {  // the ranks' side, outside the timed phases
      for (const LoadKey& key : rig.ranks.sent) rig.ranks.push_records(key);
      rig.ranks.sent.clear();
    }
    const std::uint64_t news_step_before = t_news;
    const auto t2 = Clock::now();
    std::size_t unparked = 0;
    while (unparked < kBatch) {
      const auto s = rig.coord.step();
      ++steps;
      unparked += s.unparked.size();
      freed += s.freed.size();
      for (const Unpark& u : s.unparked) wrong_unparks += u.tokens != kBoundary ? 1 : 0;
      if (mode != RanksMode::thread && s.unparked.size() != kBatch) [[unlikely]] {
        state.SkipWithError("one step did not unpark the whole batch");
        return;
      }
      if (s.records == 0) std::this_thread::yield();  // thread mode: let the producer run if it shares our CPU
    }
    const auto t3 = Clock::now();
    for (std::size_t i = 0; i < kBatch; ++i) {
      const Prompt& p = prompts[i];
      (void)rig.coord.finish(FinishRequest{ids[i], kPrompt, p.keys, p.blocks, std::nullopt, p.slot});
    }
    const auto t4 = Clock::now();
    allocs += (news_admit - news_before) + (t_news - news_step_before);
    admit_ns += ns(t1 - t0);
    step_ns += ns(t3 - t2);
    finish_ns += ns(t4 - t3);
    state.SetIterationTime(std::chrono::duration<double>((t1 - t0) + (t4 - t2)).count());
    unparked_total += unparked;
    requests += kBatch;
  }
  freed += rig.coord.step().freed.size();  // the last batch's frees

  const CoordinatorStats cs = rig.coord.stats();
  const IndexStats is = rig.index.stats();
  const PumpStats ps = rig.pump.stats();
  if (wrong_unparks != 0) state.SkipWithError("an unpark did not resume from B = 4096");
  else if (cs.invariant_violations != 0 || is.invariant_violations != 0) state.SkipWithError("invariant violated");
  else if (cs.waiting_now != 0 || cs.holding_now != 0 || is.outstanding != 0 || ps.group.pending != 0)
    state.SkipWithError("state left behind: not a steady state");
  else if (freed != requests || unparked_total != requests || cs.unparked_with_tokens != requests)
    state.SkipWithError("not every request unparked with tokens and was freed");
  else if (rig.ranks.saves != 0 || ps.late_reports != 0 || rig.index.stats().slots_freed != 0)
    state.SkipWithError("unexpected saves, late reports or orphan slots");

  const double n = requests > 0 ? static_cast<double>(requests) : 1.0;
  state.SetItemsProcessed(static_cast<std::int64_t>(requests));
  state.counters["ns_per_request"] = (admit_ns + step_ns + finish_ns) / n;
  state.counters["admit_ns"] = admit_ns / n;
  state.counters["step_ns"] = step_ns / n;
  state.counters["finish_ns"] = finish_ns / n;
  state.counters["allocs_per_request"] = static_cast<double>(allocs) / n;
  state.counters["steps_per_batch"] = static_cast<double>(steps) * static_cast<double>(kBatch) / n;
}

double min_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); }
double max_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }

void shape(benchmark::internal::Benchmark* b) {
  b->ArgName("checkpoints")->Arg(1)->Arg(16)->UseManualTime()->Unit(benchmark::kMicrosecond)->Repetitions(5)
      ->ComputeStatistics("min", min_of)->ComputeStatistics("max", max_of)->ReportAggregatesOnly(true);
}

BENCHMARK_CAPTURE(BM_CoordinatorRequest, ranks_inline, RanksMode::inline_push)->Apply(shape);
BENCHMARK_CAPTURE(BM_CoordinatorRequest, ranks_untimed, RanksMode::untimed)->Apply(shape);
BENCHMARK_CAPTURE(BM_CoordinatorRequest, ranks_thread, RanksMode::thread)->Apply(shape);

}  // namespace

BENCHMARK_MAIN();
