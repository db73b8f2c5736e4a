// Tier read throughput against raw memcpy, measured in one run and printed as ratios.
//
//   memcpy_64MiB          raw memcpy of 64 MiB (the physical limit)
//   memory_tier_hit_64MiB MemoryTier get of one 64 MiB entry + copy out + view release
//   memory_tier_chunks    32 gets of 2 MiB chunks (a 64 MiB chunked KV load) + copies
//   xxh3_4MiB             the entry checksum alone (XXH3-64: format version 2, what is written)
//   xxh64_4MiB            XXH64, format version 1's checksum (still read), for comparison
//   disk_tier_hit_4MiB    DiskTier get of a 4 MiB entry (page cache) into staging, checksum included
//
// Run: kvfuse_bench_tiers --benchmark_min_time=0.3 --benchmark_repetitions=5
//
// A memory-tier hit is one copy out of the tier's own pinned bytes, so its ratio to memcpy
// is the cost of the lookup and the pin: it should sit at ~1.0.
#include <benchmark/benchmark.h>

#include "run_values.hpp"

#include <kvfuse/detail/checksum.hpp>
#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/memory_tier.hpp>

#include <stdlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

using namespace kvfuse;

namespace {

constexpr std::size_t kTotal = std::size_t{64} << 20;
constexpr std::size_t kChunk = std::size_t{2} << 20;
constexpr std::size_t kDiskEntry = std::size_t{4} << 20;

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

void memcpy_64MiB(benchmark::State& state) {
  const auto src = filled(kTotal);
  std::vector<std::byte> dst(kTotal);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), kTotal);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kTotal));
}

void memory_tier_hit_64MiB(benchmark::State& state) {
  MemoryTier<> tier(kTotal);
  if (!tier.put(key_of(1), filled(kTotal))) state.SkipWithError("put failed");
  std::vector<std::byte> dst(kTotal);
  for (auto _ : state) {
    const TierView v = tier.get(key_of(1), {});
    std::memcpy(dst.data(), v.bytes().data(), v.bytes().size());
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kTotal));
}

void memory_tier_chunks(benchmark::State& state) {
  MemoryTier<> tier(kTotal);
  const auto chunk = filled(kChunk);
  for (std::uint64_t c = 0; c < kTotal / kChunk; ++c)
    if (!tier.put(key_of(c), chunk)) state.SkipWithError("put failed");
  std::vector<std::byte> dst(kTotal);
  for (auto _ : state) {
    for (std::uint64_t c = 0; c < kTotal / kChunk; ++c) {
      const TierView v = tier.get(key_of(c), {});
      std::memcpy(dst.data() + c * kChunk, v.bytes().data(), v.bytes().size());
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kTotal));
}

void xxh3_4MiB(benchmark::State& state) {
  const auto src = filled(kDiskEntry);
  for (auto _ : state) benchmark::DoNotOptimize(detail::xxh3_64(src));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kDiskEntry));
}

void xxh64_4MiB(benchmark::State& state) {
  const auto src = filled(kDiskEntry);
  for (auto _ : state) benchmark::DoNotOptimize(detail::xxh64(src));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kDiskEntry));
}

void disk_tier_hit_4MiB(benchmark::State& state) {
  std::string templ = (std::filesystem::temp_directory_path() / "kvfuse-bench-XXXXXX").string();
  if (::mkdtemp(templ.data()) == nullptr) {
    state.SkipWithError("mkdtemp failed");
    return;
  }
  {
    DiskTier tier(templ);
    if (!tier.put(key_of(1), filled(kDiskEntry))) state.SkipWithError("put failed");
    std::vector<std::byte> staging(kDiskEntry);
    for (auto _ : state) {
      const TierView v = tier.get(key_of(1), staging);
      if (!v.hit()) state.SkipWithError("miss");
      benchmark::DoNotOptimize(v.bytes().data());
    }
  }
  std::filesystem::remove_all(templ);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kDiskEntry));
}

BENCHMARK(memcpy_64MiB)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(memory_tier_hit_64MiB)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(memory_tier_chunks)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(xxh3_4MiB)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(xxh64_4MiB)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(disk_tier_hit_4MiB)->Unit(benchmark::kMillisecond)->UseRealTime();

// Prints the usual table, then the ratios bench/README.md sets targets for.
// With --benchmark_repetitions=N the ratios use the medians, else the single run.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  RatioReporter() : ConsoleReporter(OO_Tabular) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    rate_.note(runs, [](const Run& run) -> std::optional<double> {
      const auto it = run.counters.find("bytes_per_second");
      if (it == run.counters.end()) return std::nullopt;
      return it->second.value;
    });
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    const double base = rate_["memcpy_64MiB"].value_or(0);
    if (base <= 0) return;
    std::printf("\nratios against memcpy_64MiB (%.2f GB/s):\n", base / 1e9);
    for (const char* name : {"memory_tier_hit_64MiB", "memory_tier_chunks", "xxh3_4MiB", "xxh64_4MiB",
                             "disk_tier_hit_4MiB"})
      if (const std::optional<double> r = rate_[name]) std::printf("  %-24s %6.2f GB/s  ratio %.3f\n", name, *r / 1e9, *r / base);
  }

 private:
  kvfuse_bench::RunValues rate_;
};

}  // namespace

int main(int argc, char** argv) {
  RatioReporter reporter;
  return kvfuse_bench::run_benchmarks(argc, argv, reporter);
}
