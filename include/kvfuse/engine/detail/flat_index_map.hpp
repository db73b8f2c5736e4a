// kvfuse/engine/detail/flat_index_map.hpp — an open-addressing map from a small key to a
// 32-bit index, for OffloadIndex's O(1) lookups without a heap node per entry.
//
// Internal: not part of the public API. Not thread-safe; OffloadIndex calls it from the
// engine's scheduler thread only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace kvfuse::detail {

/// The "no index" value used by every detail structure of the engine side.
inline constexpr std::uint32_t npos32 = 0xFFFF'FFFFu;

/// Linear-probing map K -> std::uint32_t with backward-shift deletion (no tombstones, so a
/// long-lived map never degrades). The load factor stays at or below 1/2.
///
/// Growth is split from insertion on purpose: `reserve` may allocate (and throw
/// std::bad_alloc, leaving the map unchanged), `insert` never does. OffloadIndex reserves
/// before it changes any state, so an allocation failure becomes a clean refusal.
///
/// Every slot visited by a rehash or a `for_each` adds one to `walks()`: R17's tests count
/// these visits to prove the metrics path visits none.
template <class K, class Hash = std::hash<K>>
class FlatIndexMap {
 public:
  /// Entries currently held. O(1), noexcept.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// Ensures the next `n - size()` inserts do not allocate. May throw std::bad_alloc, in
  /// which case the map is unchanged.
  void reserve(std::size_t n) {
    if (n * 2 <= slots_.size()) return;
    std::size_t cap = std::max<std::size_t>(16, slots_.size());
    while (cap < n * 2) cap *= 2;
    std::vector<Slot> fresh(cap);
    for (const Slot& s : slots_) {
      ++walks_;
      if (s.value != npos32) place(fresh, s.key, s.value);
    }
    slots_.swap(fresh);
  }

  /// Inserts a key that is not present. Precondition: `reserve(size() + 1)` succeeded
  /// since the last insert. Never allocates.
  void insert(const K& key, std::uint32_t value) noexcept {
    place(slots_, key, value);
    ++size_;
  }

  /// The value for `key`, or npos32. O(1) expected, noexcept.
  [[nodiscard]] std::uint32_t find(const K& key) const noexcept {
    if (slots_.empty()) return npos32;
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = Hash{}(key)&mask;; i = (i + 1) & mask) {
      const Slot& s = slots_[i];
      if (s.value == npos32) return npos32;
      if (s.key == key) return s.value;
    }
  }

  /// Removes `key`; returns whether it was present. Never allocates.
  bool erase(const K& key) noexcept {
    if (slots_.empty()) return false;
    const std::size_t mask = slots_.size() - 1;
    std::size_t i = Hash{}(key)&mask;
    for (;; i = (i + 1) & mask) {
      if (slots_[i].value == npos32) return false;
      if (slots_[i].key == key) break;
    }
    // Backward shift: pull later members of the probe run into the hole so every
    // remaining key stays reachable from its home slot.
    std::size_t hole = i;
    for (std::size_t j = (hole + 1) & mask; slots_[j].value != npos32; j = (j + 1) & mask) {
      const std::size_t home = Hash{}(slots_[j].key) & mask;
      const bool home_between = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!home_between) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole].value = npos32;
    --size_;
    return true;
  }

  /// Calls f(key, value) for every entry; each slot visited counts one walk step. O(capacity).
  template <class F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_) {
      ++walks_;
      if (s.value != npos32) f(s.key, s.value);
    }
  }

  /// Slots visited by walks (rehash, for_each) since construction.
  [[nodiscard]] std::uint64_t walks() const noexcept { return walks_; }

 private:
  struct Slot {
    K key{};
    std::uint32_t value = npos32;
  };

  static void place(std::vector<Slot>& slots, const K& key, std::uint32_t value) noexcept {
    const std::size_t mask = slots.size() - 1;
    std::size_t i = Hash{}(key)&mask;
    while (slots[i].value != npos32) i = (i + 1) & mask;
    slots[i].key = key;
    slots[i].value = value;
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
  mutable std::uint64_t walks_ = 0;
};

}  // namespace kvfuse::detail
