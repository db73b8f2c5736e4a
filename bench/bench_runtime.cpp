// HostRuntime and Lane costs, as ratios measured in one run.
//
//   BM_CopyAsyncVsMemcpy/<chunk KiB>/<mode>: 64 MiB pinned -> "device" through copy_async in
//     chunks, then synchronize; each iteration also times one plain memcpy of the same
//     bytes. Counter vs_memcpy = memcpy time / copy time (bytes/s ratio, 1.0 = memcpy speed).
//   BM_LaneRoundTrip: submit one task that arrives on a LegLatch, wait on it (the join of
//     a joint load's state leg).
//   BM_LaneThroughput: submit 1024 small tasks, wait_idle; items/s.
//   BM_EventHandoff: record on one stream, wait on it from another, synchronize.
#include <benchmark/benchmark.h>

#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/worker/lane.hpp>

#include <chrono>
#include <cstddef>
#include <cstring>

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kBytes = 64u << 20;

void BM_CopyAsyncVsMemcpy(benchmark::State& state) {
  const auto chunk = static_cast<std::size_t>(state.range(0)) << 10;
  const auto mode = static_cast<kvfuse::HostStreamMode>(state.range(1));
  kvfuse::HostRuntime rt;
  auto* src = static_cast<std::byte*>(rt.allocate_pinned(kBytes));
  auto* dst = static_cast<std::byte*>(rt.allocate_device(kBytes));
  std::memset(src, 0x5a, kBytes);
  std::memset(dst, 0, kBytes);
  auto stream = rt.make_stream(mode);
  double memcpy_s = 0, copy_s = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    std::memcpy(dst, src, kBytes);
    benchmark::ClobberMemory();
    const auto t1 = Clock::now();
    for (std::size_t off = 0; off < kBytes; off += chunk) rt.copy_async(dst + off, src + off, chunk, stream);
    rt.synchronize(stream);
    benchmark::ClobberMemory();
    const auto t2 = Clock::now();
    memcpy_s += std::chrono::duration<double>(t1 - t0).count();
    const double c = std::chrono::duration<double>(t2 - t1).count();
    copy_s += c;
    state.SetIterationTime(c);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kBytes));
  state.counters["vs_memcpy"] = memcpy_s / copy_s;
  rt.free_pinned(src);
  rt.free_device(dst);
}
BENCHMARK(BM_CopyAsyncVsMemcpy)
    ->ArgNames({"chunk_KiB", "inline"})
    ->Args({256, 0})
    ->Args({1024, 0})
    ->Args({4096, 0})
    ->Args({1024, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

void BM_LaneRoundTrip(benchmark::State& state) {
  kvfuse::Lane lane("bench-lane", 64);
  for (auto _ : state) {
    kvfuse::LegLatch join;
    lane.submit([done = join.arrival()]() mutable noexcept { done.arrive(); });
    join.wait();
  }
}
BENCHMARK(BM_LaneRoundTrip)->Unit(benchmark::kMicrosecond);

void BM_LaneThroughput(benchmark::State& state) {
  kvfuse::Lane lane("bench-lane", 256);
  std::size_t sink = 0;
  for (auto _ : state) {
    for (int i = 0; i < 1024; ++i) lane.submit([&sink]() noexcept { ++sink; });
    lane.wait_idle();
  }
  benchmark::DoNotOptimize(sink);
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * 1024));
}
BENCHMARK(BM_LaneThroughput)->Unit(benchmark::kMicrosecond);

void BM_EventHandoff(benchmark::State& state) {
  kvfuse::HostRuntime rt;
  auto a = rt.make_stream();
  auto b = rt.make_stream();
  kvfuse::HostRuntime::Event e;
  rt.create_event(e);
  std::byte x[64]{}, y[64]{};
  for (auto _ : state) {
    rt.copy_async(y, x, sizeof x, a);
    rt.record(e, a);
    rt.wait(b, e);
    rt.copy_async(x, y, sizeof x, b);
    rt.synchronize(b);
  }
}
BENCHMARK(BM_EventHandoff)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
