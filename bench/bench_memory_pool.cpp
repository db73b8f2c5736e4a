// MemoryTier put with a pool (MemoryTierPool, slabs made at construction) against put
// without one (one allocate_pinned + free_pinned per entry), for two pinned sources, in
// one run, printed as ratios:
//
//   put_<source>_no_pool  a put of a 256 KiB chunk into a full tier: allocate, copy, evict (free)
//   put_<source>_pool     the same puts into a pooled tier of the same capacity: take a block, copy
//
//   heap   HeapPinnedSource (operator new: cheap, what tests and device-less engines use)
//   mmap   MmapSource: mmap(MAP_POPULATE) + munmap per allocation. It models what makes
//          hipHostMalloc / cudaHostAlloc expensive: the kernel maps, zeroes and faults in
//          every page of each allocation (pinning adds page-table and IOMMU work on top, so
//          the real cost is higher still) and unmaps them on free, with TLB shootdowns.
//
// Run: kvfuse_bench_memory_pool --benchmark_min_time=0.3 --benchmark_repetitions=3
//
// Every put copies 256 KiB in both variants, so the ratio no_pool / pool is the cost of the
// allocation and the free per put; with the heap source it should sit near 1.
#include <benchmark/benchmark.h>

#include "run_values.hpp"

#include <kvfuse/tier/memory_tier.hpp>

#include <sys/mman.h>

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

using namespace kvfuse;

namespace {

constexpr std::size_t kChunk = std::size_t{256} << 10;
constexpr std::size_t kEntries = 64;  // the tier holds 64 chunks: 16 MiB
constexpr std::size_t kCapacity = kChunk * kEntries;

// Page-mapped memory, populated on allocation: the stand-in for an expensive pinned
// allocator (see the file comment). Thread-safe; free_pinned needs the size, kept in a header page.
struct MmapSource {
  static constexpr std::size_t header = 4096;
  void* allocate_pinned(std::size_t bytes) {
    const std::size_t total = header + (bytes == 0 ? 1 : bytes);
    void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) throw Error(ErrorCode::device_failure, "mmap of " + std::to_string(total) + " bytes failed");
    std::memcpy(p, &total, sizeof total);
    return static_cast<std::byte*>(p) + header;
  }
  void free_pinned(void* pointer) noexcept {
    void* base = static_cast<std::byte*>(pointer) - header;
    std::size_t total = 0;
    std::memcpy(&total, base, sizeof total);
    ::munmap(base, total);
  }
};
static_assert(PinnedMemorySource<MmapSource>);

TierKey key_of(std::uint64_t hash) {
  TierKey k;
  k.model = 1;
  k.hash = PrefixHash{hash};
  return k;
}

std::vector<std::byte> filled(std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>(i * 131 + 7);
  return v;
}

// Fills the tier, then times puts of new keys: each one evicts the coldest entry.
template <class Source>
void run_puts(benchmark::State& state, MemoryTier<Source>& tier) {
  const auto chunk = filled(kChunk);
  std::uint64_t next = 0;
  for (; next < kEntries; ++next)
    if (!tier.put(key_of(next), chunk)) state.SkipWithError("fill put failed");
  for (auto _ : state) {
    if (!tier.put(key_of(next++), chunk)) state.SkipWithError("put failed");
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kChunk));
}

template <class Source>
void put_no_pool(benchmark::State& state) {
  Source source;
  MemoryTier<Source> tier(kCapacity, source);
  run_puts(state, tier);
}

template <class Source>
void put_pool(benchmark::State& state) {
  Source source;
  MemoryTier<Source> tier(kCapacity, source, MemoryTierPool{{kChunk, kEntries}});
  run_puts(state, tier);
}

void put_heap_no_pool(benchmark::State& state) { put_no_pool<HeapPinnedSource>(state); }
void put_heap_pool(benchmark::State& state) { put_pool<HeapPinnedSource>(state); }
void put_mmap_no_pool(benchmark::State& state) { put_no_pool<MmapSource>(state); }
void put_mmap_pool(benchmark::State& state) { put_pool<MmapSource>(state); }

BENCHMARK(put_heap_no_pool)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(put_heap_pool)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(put_mmap_no_pool)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(put_mmap_pool)->Unit(benchmark::kMicrosecond)->UseRealTime();

// Prints the usual table, then no_pool / pool time per put for each source.
// With --benchmark_repetitions=N the ratios use the medians, else the single run.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  RatioReporter() : ConsoleReporter(OO_Tabular) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    time_.note(runs, [](const Run& run) { return std::optional<double>(run.GetAdjustedRealTime()); });
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\nput time without the pool / with it (256 KiB chunks, full 16 MiB tier):\n");
    for (const char* source : {"heap", "mmap"}) {
      const std::optional<double> plain = time_[std::string("put_") + source + "_no_pool"];
      const std::optional<double> pooled = time_[std::string("put_") + source + "_pool"];
      if (plain && pooled && *pooled > 0)
        std::printf("  %-5s %9.2f us / %9.2f us  ratio %.2f\n", source, *plain, *pooled, *plain / *pooled);
    }
  }

 private:
  kvfuse_bench::RunValues time_;
};

}  // namespace

int main(int argc, char** argv) {
  RatioReporter reporter;
  return kvfuse_bench::run_benchmarks(argc, argv, reporter);
}
