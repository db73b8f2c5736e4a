// kvfuse/completion/detail/flat_table.hpp — the two small containers the engine-side
// merge is built from: an open-addressing hash map and a growable ring (FIFO).
//
// Why not std::unordered_map / std::deque: the merge inserts and erases one entry per key
// at millions of keys per second. A node container allocates on every insert; these
// allocate only when they grow past their high-water mark, so the steady state of an
// engine's settle loop does not touch the allocator.
//
// Neither is thread-safe: both belong to the scheduler thread that drains and settles.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace kvfuse::detail {

/// Open-addressing hash map, linear probing, backward-shift deletion (no tombstone slots,
/// so lookups never slow down with churn). Load factor kept at or below 1/2. K and V must
/// be default constructible and copy assignable. Single thread only.
template <class K, class V, class Hash = std::hash<K>>
class FlatMap {
 public:
  explicit FlatMap(std::size_t expected = 16) { rehash(capacity_for(expected)); }

  /// The value for `key`, or nullptr. O(1) expected. noexcept.
  [[nodiscard]] V* find(const K& key) noexcept {
    std::size_t i = home(key);
    while (used_[i]) {
      if (slots_[i].key == key) return &slots_[i].value;
      i = (i + 1) & mask_;
    }
    return nullptr;
  }
  [[nodiscard]] const V* find(const K& key) const noexcept { return const_cast<FlatMap*>(this)->find(key); }
  [[nodiscard]] bool contains(const K& key) const noexcept { return find(key) != nullptr; }

  /// Inserts a value-initialised V for `key` unless present. Returns {value, inserted}.
  /// Allocates only when the table grows (may throw std::bad_alloc then).
  std::pair<V*, bool> try_emplace(const K& key) {
    if (V* v = find(key)) return {v, false};
    if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);
    std::size_t i = home(key);
    while (used_[i]) i = (i + 1) & mask_;
    used_[i] = 1;
    slots_[i].key = key;
    slots_[i].value = V{};
    ++size_;
    return {&slots_[i].value, true};
  }

  /// Removes `key`; returns whether it was present. Moves later probe-chain entries back
  /// so no deleted markers are left behind. noexcept, O(1) expected.
  bool erase(const K& key) noexcept {
    std::size_t i = home(key);
    while (used_[i]) {
      if (slots_[i].key == key) {
        erase_at(i);
        return true;
      }
      i = (i + 1) & mask_;
    }
    return false;
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  /// Calls f(key, value&) for every entry. f must not insert or erase. O(capacity).
  template <class F>
  void for_each(F&& f) {
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (used_[i]) f(static_cast<const K&>(slots_[i].key), slots_[i].value);
  }

 private:
  struct Slot {
    K key{};
    V value{};
  };

  static std::size_t capacity_for(std::size_t expected) {
    return std::bit_ceil(expected < 8 ? std::size_t{16} : expected * 2);
  }

  [[nodiscard]] std::size_t home(const K& key) const noexcept { return Hash{}(key) & mask_; }

  void erase_at(std::size_t hole) noexcept {
    std::size_t j = hole;
    for (;;) {
      j = (j + 1) & mask_;
      if (!used_[j]) break;
      const std::size_t want = home(slots_[j].key);
      // Entry j may fill the hole only if its home does not lie cyclically in (hole, j].
      const bool home_in_between = hole <= j ? (hole < want && want <= j) : (hole < want || want <= j);
      if (!home_in_between) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    used_[hole] = 0;
    slots_[hole] = Slot{};
    --size_;
  }

  void rehash(std::size_t capacity) {
    std::vector<Slot> old_slots(capacity);
    std::vector<std::uint8_t> old_used(capacity, 0);
    old_slots.swap(slots_);  // slots_ / used_ are now the empty new arrays
    old_used.swap(used_);
    mask_ = capacity - 1;
    size_ = 0;
    for (std::size_t i = 0; i < old_slots.size(); ++i) {
      if (!old_used[i]) continue;
      std::size_t j = home(old_slots[i].key);
      while (used_[j]) j = (j + 1) & mask_;
      used_[j] = 1;
      slots_[j] = old_slots[i];
      ++size_;
    }
  }

  std::vector<Slot> slots_;
  std::vector<std::uint8_t> used_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

/// FIFO over a power-of-two ring that doubles when full. Single thread only.
template <class T>
class Ring {
 public:
  explicit Ring(std::size_t capacity = 16) : buf_(std::bit_ceil(capacity < 2 ? std::size_t{2} : capacity)) {}

  /// Appends; allocates only when the ring is full (may throw std::bad_alloc then).
  void push_back(const T& v) {
    if (size_ == buf_.size()) grow();
    buf_[(head_ + size_) & (buf_.size() - 1)] = v;
    ++size_;
  }
  /// Precondition: !empty(). noexcept.
  void pop_front() noexcept {
    head_ = (head_ + 1) & (buf_.size() - 1);
    --size_;
  }
  [[nodiscard]] const T& front() const noexcept { return buf_[head_]; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  /// Keeps, in order, only the elements for which keep(element) is true. O(size), no allocation.
  template <class Pred>
  void retain(Pred&& keep) noexcept {
    std::size_t kept = 0;
    const std::size_t m = buf_.size() - 1;
    for (std::size_t i = 0; i < size_; ++i) {
      const T& v = buf_[(head_ + i) & m];
      if (keep(v)) buf_[(head_ + kept++) & m] = v;
    }
    size_ = kept;
  }

 private:
  void grow() {
    std::vector<T> bigger(buf_.size() * 2);
    for (std::size_t i = 0; i < size_; ++i) bigger[i] = buf_[(head_ + i) & (buf_.size() - 1)];
    buf_.swap(bigger);
    head_ = 0;
  }

  std::vector<T> buf_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

}  // namespace kvfuse::detail
