// kvfuse/detail/flat_map.hpp — kvfuse's one open-addressing hash map, and the thin names
// its users see.
//
// FlatMap<K, V> is the core: linear probing and backward-shift deletion (the algorithm is
// detail/linear_probe.hpp, shared with the index's LruHashSet), load factor at most 1/2,
// growth split from insertion, and a count of the slots walked. Like abseil's raw_hash_set
// behind flat_hash_map and flat_hash_set, each user gets a thin name over it that shows
// only what it needs:
//
//   FlatMap<K, V>       the quorum's pending tables (completion/detail/quorum_table.hpp):
//                       try_emplace / find / erase / for_each
//   FlatIndexMap<K>     K -> std::uint32_t, find answers npos32 when absent: OffloadIndex's
//                       key, request and save tables (engine/offload_index.hpp)
//   FlatSet<K>          the quorum's tombstone set: reserved once, then noexcept inserts
//
// Why not std::unordered_map: a node container allocates on every insert. These tables
// see one insert and one erase per load or save, millions a second; they allocate only in
// reserve (or a try_emplace that grows past the high-water mark), so a steady state never
// touches the allocator, and a caller that reserves first turns an allocation failure into
// a clean refusal before it changes anything.
//
// Internal: not part of the public API. Not thread-safe: each table has one owner thread
// (the engine's scheduler thread, for every user above).
#pragma once

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvfuse/detail/linear_probe.hpp>
#include <kvfuse/detail/npos.hpp>

namespace kvfuse::detail {

/// Open-addressing map K -> V. Linear probing over a power-of-two slot array; deletion
/// shifts later members of the probe run back into the hole, so no tombstone slots are
/// left and lookups never slow down with churn. The load factor stays at or below 1/2.
/// Occupancy lives in a byte array beside the slots, so a probe that ends at an empty slot
/// reads one dense byte, not a whole slot.
///
/// Growth is split from insertion: `reserve` may allocate (and throw std::bad_alloc,
/// leaving the map unchanged); `insert` never allocates. `try_emplace` is the two in one.
///
/// Every slot visited by a rehash or a for_each adds one to `walks()`: OffloadIndex's R17
/// tests count these visits to prove that its O(1) paths walk nothing.
///
/// K and V must be default constructible and nothrow copy assignable; Hash must not throw.
/// Single owner thread; a default-constructed map holds no memory.
template <class K, class V, class Hash = std::hash<K>>
class FlatMap {
  static_assert(std::is_default_constructible_v<K> && std::is_nothrow_copy_assignable_v<K>);
  static_assert(std::is_default_constructible_v<V> && std::is_nothrow_copy_assignable_v<V>);
  static_assert(std::is_nothrow_invocable_r_v<std::size_t, const Hash&, const K&>);

 public:
  /// An empty map with no slots: nothing is allocated until the first reserve.
  FlatMap() noexcept = default;
  /// An empty map with room for `expected` entries (see reserve). May throw std::bad_alloc.
  explicit FlatMap(std::size_t expected) { reserve(expected); }

  /// Entries held. O(1), noexcept.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Whether no entry is held. O(1), noexcept.
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  /// Ensures the map holds `n` entries without allocating: the next `n - size()` inserts
  /// never allocate. Grows to at least 16 slots, doubling. May throw std::bad_alloc, and
  /// then the map is unchanged. A rehash counts one walk step per old slot.
  void reserve(std::size_t n) {
    if (n * 2 > capacity_) grow(n);
  }

  /// Inserts `key` -> `value` and returns the stored value. Preconditions: `key` is absent,
  /// and there is room: some reserve(n) with n > size() succeeded (erases only add room).
  /// Never allocates; noexcept.
  V* insert(const K& key, const V& value) noexcept {
    assert((size_ + 1) * 2 <= capacity_ && "FlatMap::insert without a reserve");
    assert(find(key) == nullptr && "FlatMap::insert of a key already present");
    ++size_;
    return place(used_.data(), slots_.data(), capacity_ - 1, key, value);
  }

  /// The value for `key`, inserting a value-initialised V first if absent. Returns {value,
  /// inserted}. Allocates only when it must grow (may throw std::bad_alloc, leaving the
  /// map unchanged).
  std::pair<V*, bool> try_emplace(const K& key) {
    if (V* v = find(key)) return {v, false};
    reserve(size_ + 1);
    return {insert(key, V{}), true};
  }

  /// The value for `key`, or nullptr. O(1) expected; noexcept. The pointer is valid until
  /// the next call that may move entries: erase, or a reserve or try_emplace that grows.
  [[nodiscard]] V* find(const K& key) noexcept {
    const std::size_t at = index_of(key);
    return at != capacity_ ? &slots_[at].value : nullptr;
  }
  /// As above, read-only.
  [[nodiscard]] const V* find(const K& key) const noexcept { return const_cast<FlatMap*>(this)->find(key); }
  /// Whether `key` is present. O(1) expected; noexcept.
  [[nodiscard]] bool contains(const K& key) const noexcept { return index_of(key) != capacity_; }

  /// Removes `key`; returns whether it was present. Never allocates; O(1) expected; noexcept.
  bool erase(const K& key) noexcept {
    const std::size_t at = index_of(key);
    if (at == capacity_) return false;
    Layout layout{used_.data(), slots_.data(), capacity_};
    const std::size_t hole = probe_erase(layout, at);
    used_[hole] = 0;
    slots_[hole] = Slot{};
    --size_;
    return true;
  }

  /// Calls f(key, value) for every entry, in no particular order; f must not insert or
  /// erase. O(capacity); each slot visited counts one walk step.
  template <class F>
  void for_each(F&& f) {
    for (std::size_t i = 0; i < capacity_; ++i) {
      ++walks_;
      if (used_[i] != 0) f(static_cast<const K&>(slots_[i].key), slots_[i].value);
    }
  }
  /// As above, read-only.
  template <class F>
  void for_each(F&& f) const {
    for (std::size_t i = 0; i < capacity_; ++i) {
      ++walks_;
      if (used_[i] != 0) f(slots_[i].key, slots_[i].value);
    }
  }

  /// Slots visited by walks (rehash, for_each) since construction. O(1), noexcept.
  [[nodiscard]] std::uint64_t walks() const noexcept { return walks_; }

 private:
  struct Slot {
    K key{};
    V value{};
  };

  // The slot array as linear_probe.hpp sees it: occupancy in the byte array, home = hash &
  // mask (the count is 0 or a power of two).
  struct Layout {
    const std::uint8_t* used;
    Slot* slots;
    std::size_t count;
    [[nodiscard]] std::size_t slot_count() const noexcept { return count; }
    [[nodiscard]] bool occupied(std::size_t i) const noexcept { return used[i] != 0; }
    [[nodiscard]] std::size_t home(const K& key) const noexcept { return Hash{}(key) & (count != 0 ? count - 1 : 0); }
    [[nodiscard]] std::size_t home_of(std::size_t i) const noexcept { return home(slots[i].key); }
    void move(std::size_t from, std::size_t to) const noexcept { slots[to] = slots[from]; }
  };

  // The slot holding `key`, or capacity_ when it is absent. An empty map probes a static
  // empty byte instead of testing for zero slots: one branch less on every lookup.
  [[nodiscard]] std::size_t index_of(const K& key) const noexcept {
    static constexpr std::uint8_t no_slots[1] = {0};
    const Layout layout{capacity_ != 0 ? used_.data() : no_slots, const_cast<Slot*>(slots_.data()), capacity_};
    return probe_find(layout, layout.home(key), [&](std::size_t i) noexcept { return layout.slots[i].key == key; });
  }

  // Kept apart from reserve so its "already big enough" test stays small enough to inline.
  void grow(std::size_t n) {
    std::size_t cap = std::max<std::size_t>(16, capacity_);
    while (cap < n * 2) cap *= 2;
    std::vector<std::uint8_t> used(cap, 0);
    std::vector<Slot> slots(cap);  // if this throws, `used` goes and nothing has changed
    for (std::size_t i = 0; i < capacity_; ++i) {
      ++walks_;
      if (used_[i] != 0) place(used.data(), slots.data(), cap - 1, slots_[i].key, slots_[i].value);
    }
    used_.swap(used);
    slots_.swap(slots);
    capacity_ = cap;
  }

  static V* place(std::uint8_t* used, Slot* slots, std::size_t mask, const K& key, const V& value) noexcept {
    const Layout layout{used, slots, mask + 1};
    const std::size_t i = probe_vacancy(layout, layout.home(key));
    used[i] = 1;
    slots[i].key = key;
    slots[i].value = value;
    return &slots[i].value;
  }

  std::vector<std::uint8_t> used_;  // 1 where the slot holds an entry
  std::vector<Slot> slots_;
  std::size_t capacity_ = 0;  // slots in both arrays: 0 or a power of two
  std::size_t size_ = 0;
  mutable std::uint64_t walks_ = 0;
};

/// K -> std::uint32_t index (OffloadIndex's tables): FlatMap with lookups that answer the
/// index itself, npos32 when absent. Values must not be npos32. Same contract as FlatMap:
/// reserve may allocate, insert never does; walks counted. Single owner thread.
template <class K, class Hash = std::hash<K>>
class FlatIndexMap {
 public:
  /// Entries held. O(1), noexcept.
  [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }
  /// Ensures the next `n - size()` inserts do not allocate. May throw std::bad_alloc, and
  /// then the map is unchanged.
  void reserve(std::size_t n) { map_.reserve(n); }
  /// Inserts a key that is not present. Preconditions: there is room (as FlatMap::insert)
  /// and value != npos32. Never allocates; noexcept.
  void insert(const K& key, std::uint32_t value) noexcept {
    assert(value != npos32);
    (void)map_.insert(key, value);
  }
  /// The value for `key`, or npos32. O(1) expected; noexcept.
  [[nodiscard]] std::uint32_t find(const K& key) const noexcept {
    const std::uint32_t* v = map_.find(key);
    return v != nullptr ? *v : npos32;
  }
  /// Removes `key`; returns whether it was present. Never allocates; noexcept.
  bool erase(const K& key) noexcept { return map_.erase(key); }
  /// Calls f(key, value) for every entry. O(capacity); each slot visited counts one walk step.
  template <class F>
  void for_each(F&& f) const {
    map_.for_each(std::forward<F>(f));
  }
  /// Slots visited by walks (rehash, for_each) since construction. O(1), noexcept.
  [[nodiscard]] std::uint64_t walks() const noexcept { return map_.walks(); }

 private:
  FlatMap<K, std::uint32_t, Hash> map_;
};

/// A set of K (the quorum's tombstones): FlatMap with no value. Same contract: reserve may
/// allocate, insert never does. Single owner thread.
template <class K, class Hash = std::hash<K>>
class FlatSet {
 public:
  /// An empty set with room for `expected` keys. May throw std::bad_alloc.
  explicit FlatSet(std::size_t expected = 0) : map_(expected) {}
  /// Keys held. O(1), noexcept.
  [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }
  /// Ensures the next `n - size()` inserts do not allocate. May throw std::bad_alloc, and
  /// then the set is unchanged.
  void reserve(std::size_t n) { map_.reserve(n); }
  /// Inserts a key that is not present. Precondition: there is room (as FlatMap::insert).
  /// Never allocates; noexcept.
  void insert(const K& key) noexcept { (void)map_.insert(key, Present{}); }
  /// Whether `key` is present. O(1) expected; noexcept.
  [[nodiscard]] bool contains(const K& key) const noexcept { return map_.contains(key); }
  /// Removes `key`; returns whether it was present. Never allocates; noexcept.
  bool erase(const K& key) noexcept { return map_.erase(key); }

 private:
  struct Present {};
  FlatMap<K, Present, Hash> map_;
};

}  // namespace kvfuse::detail
