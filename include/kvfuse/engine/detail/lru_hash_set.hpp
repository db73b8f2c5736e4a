// kvfuse/engine/detail/lru_hash_set.hpp — the indexed state hashes: a hash set and its LRU
// order as ONE intrusive structure (R5).
//
// Each slot of one open-addressed table is at once the hash's place in the set and its node
// in the LRU list, so there is no second container whose contents could drift from the
// first: inserting, touching, evicting and erasing all act on the one slot. Internal: not
// part of the public API. Not thread-safe; OffloadIndex calls it from the engine's
// scheduler thread only.
//
// Why the node lives in the slot (and not in a pool the table points into): a cold lookup
// is then one cache miss (the slot's line holds the hash and both links), and the LRU
// relink that follows is one more level (the two neighbours, fetched in parallel). A bucket
// array of node indices costs a dependent miss more on every cold load admission.
//
// Why this is not MemoryTier's LRU (tier/memory_tier.hpp), on purpose: the two share the
// word and little else. This one is a set of 8-byte hashes with no value, capped by count,
// owned by the scheduler thread with no lock; it never throws (short of memory it evicts
// its coldest hash) and reports the hash it evicted so the index can count it. The memory
// tier maps a 32-byte TierKey to a pinned byte buffer, is capped by bytes, is shared by every
// lane of its rank under a mutex, allocates on every put anyway, and must skip and defer
// freeing entries a TierView is still reading. One structure for both would bring the lock,
// reference counts and byte accounting into the index's hot path.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/detail/linear_probe.hpp>
#include <kvfuse/detail/npos.hpp>

namespace kvfuse::detail {

/// A capped set of PrefixHash with least-recently-used eviction.
///
/// Storage is one slot array, open-addressed with linear probing: a slot is a node {hash,
/// prev, next} of the LRU list, whose links are slot indices. Probing and deletion are
/// detail/linear_probe.hpp, the algorithm FlatMap runs too: deletion (erase, eviction)
/// shifts later members of the probe run back into the hole and repoints the moved node's
/// list neighbours at its new slot; no tombstones, so lookups never slow down with churn. The load factor stays at or below 1/2: the array holds 2 * bit_ceil(cap)
/// slots when full size (above a cap of 2^30, 2^32 - 2 slots, so that no slot index collides
/// with the two reserved link values). It starts at 32 slots and doubles, or is allocated
/// whole at construction with `preallocate`.
///
/// Growth never throws out of `insert_or_touch`: if a larger array cannot be allocated, the
/// least recently used hash is evicted to make room (the set then holds fewer than `cap`
/// hashes until a later growth succeeds), because a fixed array cannot take a higher load
/// factor without long probe runs. The array holds at least two slots from construction, so
/// the first hash always fits and the set never fails to index a hash.
///
/// Eviction. With an eviction window of 1 (the default) the least recently used hash goes.
/// With a window w > 1, each hash carries a weight (the tokens its checkpoint spares) in an
/// array beside the slots, read only when evicting: the victim is the lightest of the w least
/// recently used hashes (the least recent among equals), so a cold checkpoint that spares a
/// long prefill outlives a cold one that spares a short one (Marconi's rule; every state entry
/// of a model has the same size, so tokens per byte orders them as tokens do). Lookups never
/// touch the weights.
///
/// Two counts are kept by different code: `size()` by the slots filled and emptied,
/// `lru_length()` by the list links. OffloadIndex compares them (and its own counter) on
/// every stats() read, an O(1) cross-check that the two views of the one structure still
/// agree.
///
/// Every member: the scheduler thread only (the thread that owns the OffloadIndex).
class LruHashSet {
 public:
  /// What insert_or_touch did.
  enum class Outcome : std::uint8_t {
    inserted,  ///< the hash is new and now most recently used
    touched,   ///< the hash was present; it is now most recently used
  };
  /// What insert_or_touch did, and which hash it evicted to do it.
  struct InsertResult {
    Outcome outcome = Outcome::inserted;
    bool evicted = false;         ///< the least recently used hash was evicted to make room
    PrefixHash evicted_hash{};    ///< which one, when `evicted`
  };

  /// A set holding at most `capacity` hashes (1 <= capacity <= 2^31; the caller checks),
  /// evicting the lightest of its `eviction_window` least recently used hashes (1: plain
  /// LRU; >= 1, the caller checks). With `preallocate`, the whole slot array is allocated
  /// here and no later call allocates. May throw std::bad_alloc (construction only).
  LruHashSet(std::size_t capacity, bool preallocate, std::uint32_t eviction_window = 1)
      : capacity_(capacity), max_slots_(max_slots_for(capacity)), window_(eviction_window) {
    slots_.assign(preallocate ? max_slots_ : std::min<std::size_t>(kMinSlots, max_slots_), kEmptySlot);
    if (weighted()) weights_.assign(slots_.size(), 0);
  }

  /// The most hashes the set holds. O(1).
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// Hashes held in the slots. O(1).
  [[nodiscard]] std::size_t size() const noexcept { return filled_; }
  /// Nodes on the LRU list. O(1).
  [[nodiscard]] std::size_t lru_length() const noexcept { return listed_; }

  /// Whether `h` is in the set. Does not change the LRU order. O(1) expected: one slot's
  /// cache line when cold.
  [[nodiscard]] bool contains(PrefixHash h) const noexcept { return find_slot(h) != npos32; }

  /// Makes `h` most recently used if present; returns whether it was. O(1) expected: the
  /// slot, then its two list neighbours.
  bool touch(PrefixHash h) noexcept {
    const std::uint32_t n = find_slot(h);
    if (n == npos32) return false;
    move_to_front(n);
    return true;
  }

  /// Inserts `h` as most recently used, or touches it if present; `weight` (the tokens its
  /// checkpoint spares) is kept for a weighted eviction and ignored otherwise. At the cap,
  /// evicts first (see Eviction above; also when the array must grow and cannot). Never
  /// throws. O(1) amortised, plus the window when it evicts; a growth re-inserts every hash
  /// (counted as walk steps).
  InsertResult insert_or_touch(PrefixHash h, std::uint32_t weight = 0) noexcept {
    InsertResult r;
    // One probe answers both questions: is h here, and if not, which slot would take it
    // (the empty slot that ended the probe).
    const Layout layout = view();
    const std::size_t home = home_of(h, slots_.size());
    std::size_t probe_end = home;  // the last member compared; the vacancy is the next empty slot
    const std::size_t found = probe_find(layout, home, [&](std::size_t i) noexcept {
      probe_end = i;
      return slots_[i].hash == h;
    });
    if (found != slots_.size()) {
      move_to_front(static_cast<std::uint32_t>(found));
      if (weighted()) weights_[found] = weight;
      r.outcome = Outcome::touched;
      return r;
    }
    std::uint32_t at = static_cast<std::uint32_t>(probe_vacancy(layout, probe_end));
    // At most one eviction: a set at its cap already has its full-size array (growth
    // keeps the load at or below 1/2, so reaching the cap took 2 * cap slots), and a set
    // that needs to grow holds at least one hash (it holds at least half of >= 2 slots).
    bool moved = false;
    if (filled_ >= capacity_) {
      evict_lru(r);
      moved = true;
    } else if ((filled_ + 1) * 2 > slots_.size() && slots_.size() < max_slots_) {
      if (!grow()) evict_lru(r);  // keep the load at 1/2 rather than lengthen probe runs
      moved = true;
    }
    if (moved) at = first_empty(slots_.data(), slots_.size(), h);
    slots_[at].hash = h;
    if (weighted()) weights_[at] = weight;
    ++filled_;
    list_push_front(at);
    return r;
  }

  /// Removes `h`; returns whether it was present. O(1) expected.
  bool erase(PrefixHash h) noexcept {
    const std::uint32_t n = find_slot(h);
    if (n == npos32) return false;
    remove_slot(n);
    return true;
  }

  /// Calls f(hash) from most to least recently used; each node visited counts one walk step.
  template <class F>
  void for_each_mru(F&& f) const {
    for (std::uint32_t n = head_; n != npos32; n = slots_[n].next) {
      ++walks_;
      f(slots_[n].hash);
    }
  }

  /// Full structural check for tests: the list is well linked in both directions and only
  /// through filled slots, every listed node is found by its own hash at its own slot,
  /// every filled slot is listed, no hash appears twice, no probe run has a hole between a
  /// member's home slot and the member, the load factor is kept, and the counts agree.
  /// Returns "" when consistent, else the first problem. O(size + slots); every node and
  /// slot visited counts one walk step.
  [[nodiscard]] std::string check() const {
    const std::size_t slot_count = slots_.size();
    if (slot_count < 2 || slot_count > max_slots_) return "slot array size out of range";
    if (slot_count != max_slots_ && !std::has_single_bit(slot_count)) return "slot array size is not a power of two";
    std::size_t listed = 0;
    std::uint32_t prev = npos32;
    for (std::uint32_t n = head_; n != npos32; n = slots_[n].next) {
      ++walks_;
      if (n >= slot_count) return "LRU link points outside the slot array";
      if (slots_[n].prev == kEmpty) return "an empty slot is on the LRU list";
      if (slots_[n].prev != prev) return "LRU prev link disagrees with next link";
      if (find_slot(slots_[n].hash) != n) return "an LRU node is not reachable by its hash (or a duplicate hides it)";
      if (++listed > slot_count) return "LRU list has a cycle";
      prev = n;
    }
    if (prev != tail_) return "LRU tail is not the last node";
    // Scan every slot once, starting just after an empty one so that each probe run is seen
    // whole: a member's home must lie in its run, at or before the member.
    std::size_t start = 0;
    while (start < slot_count && slots_[start].prev != kEmpty) ++start;
    if (start == slot_count) return "no empty slot: probes for an absent hash would not end";
    std::size_t filled = 0;
    std::size_t run_start = 1;  // first slot of the current run, counted from `start`
    for (std::size_t k = 1; k <= slot_count; ++k) {
      ++walks_;
      const auto i = static_cast<std::uint32_t>((start + k) % slot_count);
      const Slot& s = slots_[i];
      if (s.prev == kEmpty) {
        run_start = k + 1;
        continue;
      }
      ++filled;
      if ((s.prev != npos32 && (s.prev >= slot_count || slots_[s.prev].next != i)) ||
          (s.prev == npos32 && head_ != i))
        return "a filled slot's prev link is not returned by its neighbour";
      if ((s.next != npos32 && (s.next >= slot_count || slots_[s.next].prev != i)) ||
          (s.next == npos32 && tail_ != i))
        return "a filled slot's next link is not returned by its neighbour";
      const std::size_t home_k = (home_of(s.hash, slot_count) + slot_count - start) % slot_count;
      if (home_k < run_start || home_k > k) return "a probe run has a hole between a member's home and the member";
      if (find_slot(s.hash) != i) return "a hash is held in two slots";
    }
    if (listed != listed_) return "LRU length counter disagrees with the list";
    if (filled != filled_) return "filled counter disagrees with the slots";
    if (listed != filled) return "the LRU list and the slots hold different node counts";
    if (filled_ > capacity_) return "more hashes than the cap";
    if (filled_ * 2 > slot_count && slot_count != max_slots_) return "load factor above 1/2 in a growable array";
    return {};
  }

  /// Nodes and slots visited by walks (check, for_each_mru, growth) since construction.
  [[nodiscard]] std::uint64_t walks() const noexcept { return walks_; }

 private:
  // prev == kEmpty marks an empty slot (a live node's prev is npos32 or a slot index, and
  // slot indices stay below kEmpty). One 16-byte slot: four to a cache line, never split.
  static constexpr std::uint32_t kEmpty = 0xFFFF'FFFEu;
  static constexpr std::size_t kMinSlots = 32;

  struct Slot {
    PrefixHash hash;
    std::uint32_t prev;  // LRU list: towards most recently used; kEmpty when the slot is empty
    std::uint32_t next;  // LRU list: towards least recently used
  };
  static_assert(sizeof(Slot) == 16);
  static constexpr Slot kEmptySlot{PrefixHash{}, kEmpty, npos32};

  // 2 * bit_ceil(capacity) keeps the load at or below 1/2 at the cap. Above a cap of 2^30
  // that would be 2^32 slots, whose indices would include npos32 and kEmpty: the array
  // stops two short (load just over 1/2 at a cap of 2^31), which is why slots are found by
  // multiply-shift rather than by mask.
  static std::size_t max_slots_for(std::size_t capacity) noexcept {
    return capacity <= (std::size_t{1} << 30) ? 2 * std::bit_ceil(capacity) : (std::size_t{1} << 32) - 2;
  }

  // The home slot of `h` among `slot_count`: the top 32 bits of the mixed hash scaled to the
  // array (multiply-shift), valid for any count up to 2^32.
  static std::uint32_t home_of(PrefixHash h, std::size_t slot_count) noexcept {
    return static_cast<std::uint32_t>(((std::hash<PrefixHash>{}(h) >> 32) * slot_count) >> 32);
  }

  // The slot array as linear_probe.hpp sees it: a slot is empty when its prev link says
  // so; home = multiply-shift; a move repoints the node's list neighbours (relocate).
  struct Layout {
    LruHashSet* set;
    Slot* slots;
    std::size_t count;
    [[nodiscard]] std::size_t slot_count() const noexcept { return count; }
    [[nodiscard]] bool occupied(std::size_t i) const noexcept { return slots[i].prev != kEmpty; }
    [[nodiscard]] std::size_t home_of(std::size_t i) const noexcept { return LruHashSet::home_of(slots[i].hash, count); }
    void move(std::size_t from, std::size_t to) const noexcept {
      set->relocate(static_cast<std::uint32_t>(from), static_cast<std::uint32_t>(to));
    }
  };
  [[nodiscard]] Layout view() const noexcept {
    return Layout{const_cast<LruHashSet*>(this), const_cast<Slot*>(slots_.data()), slots_.size()};
  }

  static std::uint32_t first_empty(Slot* slots, std::size_t slot_count, PrefixHash h) noexcept {
    return static_cast<std::uint32_t>(probe_vacancy(Layout{nullptr, slots, slot_count}, home_of(h, slot_count)));
  }

  [[nodiscard]] std::uint32_t find_slot(PrefixHash h) const noexcept {
    const Layout layout = view();
    const std::size_t at =
        probe_find(layout, home_of(h, layout.count), [&](std::size_t i) noexcept { return layout.slots[i].hash == h; });
    return at == layout.count ? npos32 : static_cast<std::uint32_t>(at);
  }

  void move_to_front(std::uint32_t n) noexcept {
    if (n == head_) return;
    list_unlink(n);
    list_push_front(n);
  }

  [[nodiscard]] bool weighted() const noexcept { return window_ > 1; }

  // The least recently used hash, or with a window the lightest of the window's least
  // recently used ones (the least recent among equals).
  void evict_lru(InsertResult& r) noexcept {
    std::uint32_t victim = tail_;
    if (weighted()) {
      std::uint32_t n = slots_[tail_].prev;
      for (std::uint32_t seen = 1; seen < window_ && n != npos32; ++seen, n = slots_[n].prev)
        if (weights_[n] < weights_[victim]) victim = n;
    }
    r.evicted = true;
    r.evicted_hash = slots_[victim].hash;
    remove_slot(victim);
  }

  // Unlinks slot n and empties it by backward shift (probe_erase); each move repoints the
  // moved node's list neighbours (or head_/tail_).
  void remove_slot(std::uint32_t n) noexcept {
    list_unlink(n);
    // The unlinked node still reads as occupied (list_unlink leaves prev = npos32, not
    // kEmpty), so the probe run stays whole while the shift walks it.
    Layout layout = view();
    const std::size_t hole = probe_erase(layout, n);
    slots_[hole] = kEmptySlot;
    --filled_;
  }

  void relocate(std::uint32_t from, std::uint32_t to) noexcept {
    const Slot s = slots_[from];
    slots_[to] = s;
    if (weighted()) weights_[to] = weights_[from];
    if (s.prev != npos32) slots_[s.prev].next = to; else head_ = to;
    if (s.next != npos32) slots_[s.next].prev = to; else tail_ = to;
  }

  // Doubles the array (up to max_slots_) and re-inserts every hash, walking the list from
  // most recently used so the new list is built in the same order. Returns false, with
  // nothing changed, when the new array cannot be allocated.
  bool grow() noexcept {
    const std::size_t count = std::min(slots_.size() * 2, max_slots_);
    std::vector<Slot> fresh;
    std::vector<std::uint32_t> fresh_weights;
    try {
      fresh.assign(count, kEmptySlot);
      if (weighted()) fresh_weights.assign(count, 0);
    } catch (...) {
      return false;
    }
    std::uint32_t head = npos32;
    std::uint32_t prev = npos32;
    for (std::uint32_t n = head_; n != npos32; n = slots_[n].next) {
      ++walks_;
      const std::uint32_t m = first_empty(fresh.data(), count, slots_[n].hash);
      fresh[m] = Slot{slots_[n].hash, prev, npos32};
      if (weighted()) fresh_weights[m] = weights_[n];
      if (prev != npos32) fresh[prev].next = m; else head = m;
      prev = m;
    }
    slots_.swap(fresh);
    weights_.swap(fresh_weights);
    head_ = head;
    tail_ = prev;
    return true;
  }

  void list_push_front(std::uint32_t n) noexcept {
    slots_[n].prev = npos32;
    slots_[n].next = head_;
    if (head_ != npos32) slots_[head_].prev = n;
    head_ = n;
    if (tail_ == npos32) tail_ = n;
    ++listed_;
  }

  void list_unlink(std::uint32_t n) noexcept {
    Slot& node = slots_[n];
    if (node.prev != npos32) slots_[node.prev].next = node.next; else head_ = node.next;
    if (node.next != npos32) slots_[node.next].prev = node.prev; else tail_ = node.prev;
    node.prev = node.next = npos32;
    --listed_;
  }

  std::size_t capacity_;
  std::size_t max_slots_;  // the full-size array: 2 * bit_ceil(capacity_), or 2^32 - 2
  std::uint32_t window_;   // 1: LRU; more: the weighted eviction's window
  std::vector<Slot> slots_;
  std::vector<std::uint32_t> weights_;  // beside slots_, same indices; empty unless weighted
  std::uint32_t head_ = npos32;  // most recently used
  std::uint32_t tail_ = npos32;  // least recently used
  std::size_t filled_ = 0;
  std::size_t listed_ = 0;
  mutable std::uint64_t walks_ = 0;
};

}  // namespace kvfuse::detail
