// OffloadIndex costs against the targets table (bench/README.md):
//   stats() with the full audit at 2^20 indexed hashes      < 1 us, every read
//   request_load + settle pair                               < 200 ns median
//   failing 2048 outstanding loads in one step               < 0.5 ms
// Run: ./kvfuse_bench_offload_index --benchmark_min_time=0.3
#include <benchmark/benchmark.h>

#include <kvfuse/engine/offload_index.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

using namespace kvfuse;

namespace {

constexpr std::uint32_t kSlots = 4096;

std::unique_ptr<OffloadIndex<>> make_index(std::size_t indexed, std::size_t capacity = std::size_t{1} << 20) {
  OffloadIndexOptions o;
  o.hash_capacity = capacity;
  o.slot_count = kSlots;
  auto index = std::make_unique<OffloadIndex<>>(o, [](SlotId) {});
  for (std::uint64_t h = 0; h < indexed; ++h) index->note_stored(PrefixHash{h});
  return index;
}

StateSpec leg(std::uint64_t hash, std::uint32_t slot) { return StateSpec{512, PrefixHash{hash}, SlotId{slot}, 16, 256}; }

// stats() with its audit, at 1K, 64K and 1M indexed hashes plus 2048 outstanding loads.
void BM_Stats(benchmark::State& state) {
  const auto indexed = static_cast<std::size_t>(state.range(0));
  auto index = make_index(indexed);
  for (std::uint32_t r = 0; r < 2048; ++r)
    (void)index->request_load(RequestId{r}, std::nullopt, leg(r, r)).ticket().dispatch();
  for (auto _ : state) {
    IndexStats s = index->stats();
    benchmark::DoNotOptimize(s);
  }
  if (index->stats().invariant_violations != 0) state.SkipWithError("invariant violated");
  state.counters["indexed"] = static_cast<double>(index->stats().indexed);
}
BENCHMARK(BM_Stats)->Arg(1 << 10)->Arg(1 << 16)->Arg(1 << 20);

// One joint (state-leg) load admitted, dispatched and completed, against 2^log2_hashes indexed
// hashes and 1024 other loads in flight; resolutions drained every 256 pairs, as a
// scheduler step would. Arg 0: the hash is one of the 4096 most recently stored (hot, the
// usual case: a prefix stored or loaded recently). Arg 1: the hash is drawn uniformly from
// all of them (cold: every lookup and LRU relink misses the caches). log2_hashes: 20, the
// default cap (a 32 MiB table, which a large last-level cache may hold), or 23 (256 MiB,
// beyond most last-level caches: compare with BM_PointerChase2/MiB:256). The hot hashes were
// stored one after another at set-up, but the index's hash slots are placed by hash, so
// they lie scattered over the whole slot array, as any hot set does there (compare the
// cold pair with BM_PointerChase2, its floor).
void BM_RequestLoadCompletePair(benchmark::State& state) {
  const bool cold = state.range(0) != 0;
  const std::uint64_t n = std::uint64_t{1} << state.range(1);
  const int shift = 64 - static_cast<int>(state.range(1));
  auto index = make_index(n, n);
  for (std::uint32_t r = 0; r < 1024; ++r)
    (void)index->request_load(RequestId{(std::uint64_t{1} << 40) + r}, std::nullopt, leg(r, kSlots - 1 - r))
        .ticket()
        .dispatch();
  std::vector<LoadResolution> drained;
  drained.reserve(256);
  std::uint64_t i = 0;
  for (auto _ : state) {
    const std::uint32_t slot = static_cast<std::uint32_t>(i % 1024);
    const std::uint64_t hash = cold ? (i * 0x9E3779B97F4A7C15ULL) >> shift : n - 4096 + (i * 7919) % 4096;
    LoadGrant a = index->request_load(RequestId{i}, std::nullopt, leg(hash, slot));
    const LoadRequest req = a.ticket().dispatch();
    benchmark::DoNotOptimize(index->settle(Settlement{req.key, true, false}));
    if (++i % 256 == 0) {
      drained.clear();
      index->drain_resolutions(drained);
    }
  }
  if (index->stats().invariant_violations != 0 || index->stats().completed != i) state.SkipWithError("bad counters");
}
double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

BENCHMARK(BM_RequestLoadCompletePair)
    ->ArgNames({"cold", "log2_hashes"})
    ->Args({0, 20})
    ->Args({1, 20})
    ->Args({1, 23})
    ->Repetitions(5)
    ->ComputeStatistics("min", min_of)
    ->ComputeStatistics("max", max_of)
    ->ReportAggregatesOnly(true);

// A random cyclic permutation of `mib` MiB of uint32 indices (Sattolo's algorithm: one
// cycle through every element), for the pointer-chase floors below.
std::vector<std::uint32_t> random_cycle(std::size_t mib) {
  const std::size_t n = (mib << 20) / sizeof(std::uint32_t);
  std::vector<std::uint32_t> next(n);
  for (std::size_t i = 0; i < n; ++i) next[i] = static_cast<std::uint32_t>(i);
  std::uint64_t x = 0x9E3779B97F4A7C15ULL;
  for (std::size_t i = n - 1; i > 0; --i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::swap(next[i], next[x % i]);
  }
  return next;
}

// The floor of one cold miss: one dependent load from a random place in a 1 GiB array (a
// random cyclic permutation walked by index), i.e. one DRAM miss plus its TLB miss, on this
// machine in this run. Arg 32: the same in 32 MiB, the size of the index's hash slots at
// 2^20 hashes, whose page tables stay cached and which a large L3 may partly hold: the
// floor at the index's own footprint (the cold pair can beat the 1 GiB row).
void BM_PointerChase(benchmark::State& state) {
  const std::vector<std::uint32_t> next = random_cycle(static_cast<std::size_t>(state.range(0)));
  std::uint32_t p = 0;
  for (auto _ : state) p = next[p];
  benchmark::DoNotOptimize(p);
}
// The chases: 1 GiB (DRAM plus a page walk), 256 MiB and 32 MiB (the index's table at 2^23
// and 2^20 hashes), five repetitions with their spread.
void chase_args(benchmark::internal::Benchmark* b) {
  b->ArgName("MiB")->Arg(1024)->Arg(256)->Arg(32)->Repetitions(5);
  b->ComputeStatistics("min", min_of)->ComputeStatistics("max", max_of)->ReportAggregatesOnly(true);
}
BENCHMARK(BM_PointerChase)->Apply(chase_args);

// The floor of the cold pair: the same chase with TWO dependent loads per iteration. An
// exact-LRU lookup in one structure cannot cost less: it must find the hash's node (one
// miss at best, with the node kept in the hash table's own slot), then relink the node's
// two LRU neighbours (a second level, the two fetched in parallel). Compare the cold pair
// with this row, measured in the same run. Args as BM_PointerChase.
void BM_PointerChase2(benchmark::State& state) {
  const std::vector<std::uint32_t> next = random_cycle(static_cast<std::size_t>(state.range(0)));
  std::uint32_t p = 0;
  for (auto _ : state) p = next[next[p]];
  benchmark::DoNotOptimize(p);
}
BENCHMARK(BM_PointerChase2)->Apply(chase_args);

// The anchor for the cold case: one std::unordered_set<uint64_t>::find over 2^20 keys, each
// key depending on the last find so lookups cannot overlap: the latency of one cold lookup
// on this machine. A cold joint pair needs one
// such lookup plus the LRU relink of the hash's node and its two neighbours.
void BM_AnchorUnorderedSetFind(benchmark::State& state) {
  constexpr std::uint64_t n = std::uint64_t{1} << 20;
  std::unordered_set<std::uint64_t> set;
  set.reserve(n);
  for (std::uint64_t h = 0; h < n; ++h) set.insert(h);
  std::uint64_t i = 0;
  std::uint64_t key = 0;
  for (auto _ : state) {
    const auto it = set.find(key);
    key = ((*it + ++i) * 0x9E3779B97F4A7C15ULL) >> 44;
  }
  benchmark::DoNotOptimize(key);
}
BENCHMARK(BM_AnchorUnorderedSetFind)->Repetitions(5)->ReportAggregatesOnly(true);

// The same pair for a KV-only load (the KV spec is moved through the ticket).
void BM_RequestLoadCompletePairKvOnly(benchmark::State& state) {
  auto index = make_index(1024);
  std::uint64_t i = 0;
  std::vector<LoadResolution> drained;
  drained.reserve(256);
  for (auto _ : state) {
    LoadGrant a = index->request_load(RequestId{i}, KvSpec{}, std::nullopt);
    const LoadRequest req = a.ticket().dispatch();
    benchmark::DoNotOptimize(index->complete(req.key));
    if (++i % 256 == 0) {
      drained.clear();
      index->drain_resolutions(drained);
    }
  }
}
BENCHMARK(BM_RequestLoadCompletePairKvOnly)->Repetitions(5)->ReportAggregatesOnly(true);

// A tier outage: 2048 outstanding joint loads fail in one step (with a miss, so each also
// retracts its hash), against 2^20 indexed hashes. Only fail_all is timed.
void BM_FailAll2048(benchmark::State& state) {
  auto index = make_index(std::size_t{1} << 20);
  std::vector<LoadKey> keys(2048);
  std::vector<LoadResolution> drained;
  std::uint64_t request = 0;
  std::uint64_t hash = 0;
  for (auto _ : state) {
    for (std::uint32_t r = 0; r < 2048; ++r) {
      keys[r] = index->request_load(RequestId{request++}, std::nullopt, leg(hash, r)).ticket().dispatch().key;
      index->note_stored(PrefixHash{hash + 1});  // keep the next load's hash indexed
      ++hash;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t failed = index->fail_all(keys, true);
    const auto t1 = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    if (failed != keys.size()) state.SkipWithError("not every load failed");
    drained.clear();
    index->drain_resolutions(drained);
    benchmark::DoNotOptimize(drained.data());
  }
  state.counters["loads"] = 2048;
}
BENCHMARK(BM_FailAll2048)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
