// What the completion-path benchmarks share (bench_completion.cpp, bench_ipc.cpp): an index
// that holds every key outstanding, and the record each rank reports for a key.
#pragma once

#include <benchmark/benchmark.h>

#include <kvfuse/bridge/records.hpp>
#include <kvfuse/completion/settlement_pump.hpp>

#include <cstdint>
#include <vector>

namespace kvfuse::bench {

/// Holds every key outstanding and accepts every settlement: isolates the completion path
/// (the real index is benchmarked in bench_offload_index). It queues no resolutions:
/// `settled` counts the loads settled (and `settled_ok` the ok ones), `saves` the save
/// phases, so a benchmark checks what it timed really happened.
struct CountingIndex {
  std::uint64_t settled = 0;
  std::uint64_t settled_ok = 0;
  std::uint64_t saves = 0;
  bool is_in_flight(LoadKey) const noexcept { return true; }
  bool is_save_in_flight(SaveKey) const noexcept { return true; }
  bool settle(const Settlement& s) noexcept {
    benchmark::DoNotOptimize(s.ok);
    ++settled;
    settled_ok += s.ok ? 1 : 0;
    return true;
  }
  bool settle_save(const SaveSettlement&) noexcept {
    ++saves;
    return true;
  }
  std::size_t drain_resolutions(std::vector<LoadResolution>&) noexcept { return 0; }
  template <class F>
  std::size_t drain_forgotten(F&&) noexcept {
    return 0;
  }
  Generation last_issued() const noexcept { return Generation{}; }
  // No rank dies in these benchmarks: nothing is ever offered to settle_if_unowed.
  template <class F>
  void for_each_load_in_flight(F&&) const noexcept {}
  template <class F>
  void for_each_save_in_flight(F&&) const noexcept {}
};

/// Loads the index settled during `f()`.
template <class F>
std::uint64_t settled_during(CountingIndex& index, F&& f) {
  const std::uint64_t before = index.settled;
  f();
  return index.settled - before;
}

/// Rank `rank`'s ok record for key number `key`.
inline CompletionRecord record(std::uint64_t key, std::uint32_t rank) {
  return CompletionRecord{LoadKey{RequestId{key}, Generation{key + 1}}, rank, KvOutcome::ok, StateOutcome::restored,
                          Reason::none, Reason::none};
}

/// A drain visitor that keeps nothing.
struct Discard {
  void operator()(const CompletionRecord& r) noexcept { benchmark::DoNotOptimize(r); }
  void operator()(const SaveRecord& r) noexcept { benchmark::DoNotOptimize(r); }
};

}  // namespace kvfuse::bench
