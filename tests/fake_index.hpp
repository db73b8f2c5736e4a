// A stand-in for OffloadIndex that models SettlementPump's SettlementIndex with plain
// sets, for the completion-path tests: the outstanding and in-flight-save sets are the
// truth (R3), and everything settled is recorded for the test to read.
#pragma once

#include <kvfuse/bridge/records.hpp>
#include <kvfuse/bridge/resolution.hpp>

#include <cstddef>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace kvfuse::testing {

/// A stand-in for OffloadIndex: the outstanding and in-flight-save sets are the truth (R3).
struct FakeIndex {
  std::unordered_set<LoadKey> outstanding;
  std::unordered_set<SaveKey> saves;
  std::vector<Settlement> settled;
  std::vector<SaveSettlement> save_settlements;
  std::unordered_set<PrefixHash> indexed;
  std::vector<LoadResolution> queue;
  std::vector<LoadKey> forgotten;
  Generation last{};
  std::unordered_map<LoadKey, int> settle_count;  // settle() calls per key, accepted or not
  mutable int outstanding_queries = 0;
  bool is_in_flight(LoadKey key) const noexcept {
    ++outstanding_queries;
    return outstanding.contains(key);
  }
  bool is_save_in_flight(SaveKey key) const noexcept { return saves.contains(key); }
  bool settle(const Settlement& s) {
    ++settle_count[s.key];
    if (outstanding.erase(s.key) == 0) return false;
    settled.push_back(s);
    queue.push_back(LoadResolution{s.key, s.ok ? Resolution::completed : Resolution::failed, s.state_missed, false, true});
    return true;
  }
  bool settle_save(const SaveSettlement& s) {
    if (!saves.contains(s.key)) return false;
    save_settlements.push_back(s);
    if (s.phase == SavePhase::stored) {
      saves.erase(s.key);
      if (s.ok) indexed.insert(s.key.hash);
    }
    return true;
  }
  std::size_t drain_resolutions(std::vector<LoadResolution>& out) noexcept {
    const std::size_t n = queue.size();
    out.insert(out.end(), queue.begin(), queue.end());
    queue.clear();
    return n;
  }
  template <class F>
  std::size_t drain_forgotten(F&& forget) noexcept {
    const std::size_t n = forgotten.size();
    for (const LoadKey& k : forgotten) forget(k);
    forgotten.clear();
    return n;
  }
  Generation last_issued() const noexcept { return last; }
  template <class F>
  void for_each_load_in_flight(F&& f) const noexcept {
    for (const LoadKey& k : outstanding) f(k);
  }
  template <class F>
  void for_each_save_in_flight(F&& f) const noexcept {
    for (const SaveKey& k : saves) f(k);
  }
};

}  // namespace kvfuse::testing
