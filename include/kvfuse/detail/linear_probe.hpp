// kvfuse/detail/linear_probe.hpp — the one open-addressing algorithm behind kvfuse's hash
// tables: linear probing over a slot array kept at most half full, and backward-shift
// deletion, so no tombstone slot is ever left and lookups never slow down with churn.
//
// Two tables lay their slots out differently and share this code, as abseil's raw_hash_set
// serves flat_hash_map and flat_hash_set:
//   FlatMap (detail/flat_map.hpp): {key, value} slots beside a dense occupancy byte array,
//     so a probe that ends at an empty slot reads one byte; home slot = hash & mask.
//   LruHashSet (engine/detail/lru_hash_set.hpp): 16-byte {hash, prev, next} nodes whose link
//     marks emptiness, so a cold lookup is one cache line; home slot = multiply-shift, for
//     arrays that are not a power of two; moving a node repoints its LRU neighbours.
// Each shows its layout through a ProbeLayout; the algorithms below never see a slot.
//
// Internal: not part of the public API. Pure functions over the layout they are given:
// thread-safe as far as the layout is (each table has one owner thread).
#pragma once

#include <concepts>
#include <cstddef>

namespace kvfuse::detail {

/// What a table shows the probe algorithms:
///   slot_count()   slots in the array (> 0 for probe_vacancy and probe_erase)
///   occupied(i)    whether slot i holds an entry
///   home_of(i)     the home slot of the entry held in slot i
///   move(from, to) relocate the entry of slot `from` into the empty slot `to` (probe_erase
///                  only; the table then treats `from` as the hole)
template <class T>
concept ProbeLayout = requires(const T& t, std::size_t i) {
  { t.slot_count() } noexcept -> std::convertible_to<std::size_t>;
  { t.occupied(i) } noexcept -> std::convertible_to<bool>;
  { t.home_of(i) } noexcept -> std::convertible_to<std::size_t>;
};

/// The slot after `i` in an array of `count`, wrapping to 0.
constexpr std::size_t probe_next(std::size_t i, std::size_t count) noexcept { return i + 1 == count ? 0 : i + 1; }

/// The slot whose entry `matches(i)` says is the one sought, probing from `home`; or
/// slot_count() when the probe meets an empty slot first (the entry is absent). A layout
/// with no slots must still answer occupied(home) == false. noexcept if `matches` is.
template <ProbeLayout T, class Matches>
constexpr std::size_t probe_find(const T& t, std::size_t home, Matches&& matches) noexcept {
  const std::size_t count = t.slot_count();
  for (std::size_t i = home;; i = probe_next(i, count)) {
    if (!t.occupied(i)) return count;
    if (matches(i)) return i;
  }
}

/// The first empty slot at or after `home`: where a new entry with that home goes.
/// Precondition: some slot is empty (the load factor is kept below 1).
template <ProbeLayout T>
constexpr std::size_t probe_vacancy(const T& t, std::size_t home) noexcept {
  const std::size_t count = t.slot_count();
  std::size_t i = home;
  while (t.occupied(i)) i = probe_next(i, count);
  return i;
}

/// Deletes the entry in slot `hole` by backward shift: each later member of its probe run
/// moves back into the hole unless its home lies cyclically in (hole, j], where moving it
/// would put it before its home. Returns the slot left empty, which the caller clears (the
/// entry at `hole` itself is the caller's to have unlinked or copied out first).
template <ProbeLayout T>
constexpr std::size_t probe_erase(T& t, std::size_t hole) noexcept {
  const std::size_t count = t.slot_count();
  for (std::size_t j = probe_next(hole, count); t.occupied(j); j = probe_next(j, count)) {
    const std::size_t want = t.home_of(j);
    const bool home_between = hole <= j ? (hole < want && want <= j) : (hole < want || want <= j);
    if (!home_between) {
      t.move(j, hole);
      hole = j;
    }
  }
  return hole;
}

}  // namespace kvfuse::detail
