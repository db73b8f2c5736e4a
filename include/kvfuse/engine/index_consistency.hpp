// kvfuse/engine/index_consistency.hpp — the full consistency walk of an OffloadIndex: the
// production audit an engine runs at the end of a run (host/audit.hpp does), and tests run
// after every scenario.
//
// OffloadIndex::stats() audits its identities in O(1) on every read (R17); this walk is
// the slow, thorough check behind it: every structure against every counter. It lives in
// its own header, behind the index's access hook, so the class an engine calls per step
// carries no O(everything) member and no metrics path can reach it by accident.
// Scheduler thread only; allocates; O(everything).
#pragma once

#include <string>
#include <utility>

#include <kvfuse/engine/offload_index.hpp>

namespace kvfuse {

/// Result of check_consistency(index).
struct ConsistencyReport {
  bool ok = true;
  std::string problem;        ///< the first inconsistency found; empty when ok
  std::uint64_t visited = 0;  ///< entries, nodes and table slots the walk visited
};

namespace detail {
/// The tag through which the walk reaches the index's internals.
struct ConsistencyWalk {};
}  // namespace detail

template <>
struct detail::OffloadIndexAccess<detail::ConsistencyWalk> {
  template <class Index>
  static ConsistencyReport walk(const Index& ix) {
    const std::uint64_t before = ix.walk_steps();
    ConsistencyReport rep;
    auto fail_with = [&](std::string what) {
      if (rep.ok) {
        rep.ok = false;
        rep.problem = std::move(what);
      }
    };
    if (std::string p = ix.hashes_.check(); !p.empty()) fail_with("hash set: " + p);
    if (ix.hashes_.size() != ix.stats_.indexed) fail_with("indexed counter disagrees with the hash set");

    std::uint64_t ticketed = 0, in_flight = 0, orphans = 0, live = 0, with_state = 0;
    for (std::uint32_t e = 0; e < ix.entries_.size(); ++e) {
      ++ix.own_walks_;
      const typename Index::Entry& en = ix.entries_[e];
      if (en.status == Index::Status::free) continue;
      (en.status == Index::Status::ticketed ? ticketed : in_flight) += 1;
      if (ix.keys_.find(en.key.generation) != e) fail_with("an outstanding load is not in the key table: " + to_string(en.key));
      if (en.orphaned) {
        ++orphans;
        if (en.status != Index::Status::in_flight) fail_with("an orphan that was never dispatched: " + to_string(en.key));
        if (ix.requests_.find(en.key.request) == e) fail_with("an orphan still blocks its request: " + to_string(en.key));
      } else {
        ++live;
        if (ix.requests_.find(en.key.request) != e) fail_with("a live load is not its request's load: " + to_string(en.key));
      }
      if (en.has_state) {
        ++with_state;
        if (en.leg.slot.value >= ix.slot_owner_.size() || ix.slot_owner_[en.leg.slot.value] != e)
          fail_with("a state-leg load does not hold its slot: " + to_string(en.key));
      }
    }
    std::uint64_t held_slots = 0;
    for (const std::uint32_t owner : ix.slot_owner_) {
      ++ix.own_walks_;
      if (owner == kvfuse::detail::npos32) continue;
      ++held_slots;
      if (owner >= ix.entries_.size() || ix.entries_[owner].status == Index::Status::free || !ix.entries_[owner].has_state)
        fail_with("a slot is held by no outstanding state-leg load");
    }
    // Each state-leg load points at its own slot and each held slot points back at one
    // load, so equal counts mean no slot is held twice.
    if (held_slots != with_state) fail_with("slots held twice or leaked: held slots != state-leg loads");
    ix.keys_.for_each([&](Generation g, std::uint32_t e) {
      if (e >= ix.entries_.size() || ix.entries_[e].status == Index::Status::free || ix.entries_[e].key.generation != g)
        fail_with("the key table names a resolved load");
    });
    ix.requests_.for_each([&](RequestId r, std::uint32_t e) {
      if (e >= ix.entries_.size() || ix.entries_[e].status == Index::Status::free || ix.entries_[e].orphaned || ix.entries_[e].key.request != r)
        fail_with("the request table names a resolved or orphaned load");
    });
    // One walk for both time-ordered lists: links agree, time never goes back, no cycle,
    // the tail is the last entry, and every entry is one the list may hold. Returns its length.
    auto walk_list = [&](const auto& list, auto links, auto time, const char* name, auto belongs) {
      std::uint64_t length = 0;
      std::uint32_t prev = kvfuse::detail::npos32;
      for (std::uint32_t e = list.head; e != kvfuse::detail::npos32; e = (ix.entries_[e].*links).next) {
        ++ix.own_walks_;
        if (!belongs(ix.entries_[e])) fail_with(std::string("the ") + name + " list holds an entry it must not");
        if ((ix.entries_[e].*links).prev != prev) fail_with(std::string(name) + " list links disagree");
        if (prev != kvfuse::detail::npos32 && ix.entries_[e].*time < ix.entries_[prev].*time)
          fail_with(std::string("the ") + name + " list is not in time order");
        prev = e;
        if (++length > ix.entries_.size()) {
          fail_with(std::string("the ") + name + " list has a cycle");
          break;
        }
      }
      if (prev != list.tail) fail_with(std::string(name) + " list tail is not its last entry");
      if (length != list.count) fail_with(std::string(name) + " list count disagrees with its length");
      return length;
    };
    using Entry = typename Index::Entry;
    const std::uint64_t listed = walk_list(ix.orphans_, &Entry::orphan_links, &Entry::orphaned_at, "orphan",
                                           [](const Entry& en) { return en.orphaned && en.status == Index::Status::in_flight; });
    const std::uint64_t flying = walk_list(ix.flight_, &Entry::flight_links, &Entry::dispatched_at, "in-flight",
                                           [](const Entry& en) { return en.status == Index::Status::in_flight; });
    std::uint64_t free_entries = 0;
    for (std::uint32_t e = ix.free_entry_; e != kvfuse::detail::npos32 && free_entries <= ix.entries_.size(); e = ix.entries_[e].free_next) {
      ++ix.own_walks_;
      ++free_entries;
      if (ix.entries_[e].status != Index::Status::free) fail_with("the free list holds an outstanding load");
    }
    if (free_entries + ticketed + in_flight != ix.entries_.size()) fail_with("load entries leaked: neither outstanding nor free");
    if (ticketed + in_flight != ix.stats_.outstanding) fail_with("outstanding counter disagrees with the entries");
    if (in_flight != ix.stats_.in_flight) fail_with("in_flight counter disagrees with the entries");
    if (orphans != ix.stats_.orphaned || listed != ix.stats_.orphaned)
      fail_with("orphaned counter disagrees with the entries or the orphan list");
    if (ix.keys_.size() != ix.stats_.outstanding) fail_with("key table size disagrees with outstanding");
    if (ix.requests_.size() != live) fail_with("request table size disagrees with the live loads");
    if (ix.stats_.issued != ix.stats_.completed + ix.stats_.failed + ix.stats_.abandoned + ix.stats_.outstanding)
      fail_with("issued != completed + failed + abandoned + outstanding");
    if (ix.stats_.reclaimed > ix.stats_.abandoned) fail_with("reclaimed > abandoned");
    if (ix.stats_.saves_issued != ix.stats_.saves_stored + ix.stats_.saves_failed + ix.stats_.saves_abandoned + ix.saves_.size())
      fail_with("saves_issued != saves_stored + saves_failed + saves_abandoned + saves_outstanding");
    if (flying != ix.stats_.in_flight) fail_with("in_flight counter disagrees with the in-flight list");
    if (ix.resolutions_.capacity() < ix.resolutions_.size() + ix.stats_.outstanding)
      fail_with("the resolution queue could need to allocate on a settle path");
    if (ix.forgotten_.capacity() < ix.forgotten_.size() + ix.stats_.outstanding)
      fail_with("the forget list could need to allocate on a resolve path");
    rep.visited = ix.walk_steps() - before;
    return rep;
  }
};

/// Walks every structure of `index` and checks it against the counters: the hash buckets
/// and the LRU list agree, every outstanding entry is in the key table under its own key,
/// every live load is the one its request maps to, no slot is held by two loads and every
/// state-leg load (orphans included) holds its slot, the orphan and in-flight lists hold
/// exactly their loads in time order, and every counter matches the entries. Each entry it
/// visits counts in index.walk_steps(). Scheduler thread; O(everything), allocates: an
/// end-of-run audit, never a per-step call.
template <class Clock>
ConsistencyReport check_consistency(const OffloadIndex<Clock>& index) {
  return detail::OffloadIndexAccess<detail::ConsistencyWalk>::walk(index);
}

}  // namespace kvfuse
