// kvfuse-replay: the engine's paged block pool, with vLLM-style prefix caching: blocks of
// computed prompts are published under the identity of the tokens they hold and stay
// cached, least recently used first out, until a new allocation needs them.
#pragma once

#include <kvfuse/bridge/ids.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

namespace replay {

/// Block pool with prefix caching. Block ids are the same on every rank (TP shares the
/// table). Scheduler thread only.
class BlockCache {
 public:
  explicit BlockCache(std::uint32_t n) : entries_(n) {
    for (std::uint32_t i = n; i-- > 0;) free_.push_back(i);
  }
  /// Pins the leading cached blocks of `ids` (at most `limit`); appends them to `out`.
  std::size_t match(const std::vector<std::uint64_t>& ids, std::size_t limit, std::vector<kvfuse::BlockId>& out) {
    std::size_t n = 0;
    for (; n < limit && n < ids.size(); ++n) {
      const auto it = by_identity_.find(ids[n]);
      if (it == by_identity_.end()) break;
      Entry& e = entries_[it->second];
      if (e.refs++ == 0) lru_.erase(e.lru);
      out.push_back(kvfuse::BlockId{it->second});
    }
    return n;
  }
  /// Appends `n` fresh blocks to `out`, evicting cached ones as needed; false (nothing taken) if it cannot.
  bool allocate(std::size_t n, std::vector<kvfuse::BlockId>& out) {
    if (free_.size() + lru_.size() < n) return false;
    for (std::size_t i = 0; i < n; ++i) {
      if (free_.empty()) {
        const std::uint32_t victim = lru_.front();
        lru_.pop_front();
        by_identity_.erase(entries_[victim].identity);
        entries_[victim].cached = false;
        free_.push_back(victim);
      }
      const std::uint32_t b = free_.back();
      free_.pop_back();
      entries_[b].refs = 1;
      out.push_back(kvfuse::BlockId{b});
    }
    return true;
  }
  /// `b` (pinned) now holds the tokens `identity` names, whole: later requests may share it.
  void publish(kvfuse::BlockId b, std::uint64_t identity) {
    Entry& e = entries_[b.value];
    if (e.cached || by_identity_.contains(identity)) return;
    e.cached = true;
    e.identity = identity;
    by_identity_.emplace(identity, b.value);
  }
  /// Unpins `b`; a published block stays cached (LRU) once nobody pins it.
  void release(kvfuse::BlockId b) {
    Entry& e = entries_[b.value];
    if (--e.refs > 0) return;
    if (e.cached) e.lru = lru_.insert(lru_.end(), b.value);
    else free_.push_back(b.value);
  }
  /// Forgets every published block (their bytes are gone): an unpinned one is free again,
  /// a pinned one becomes free when its last pin goes.
  void forget_cached() {
    for (const std::uint32_t b : lru_) free_.push_back(b);
    lru_.clear();
    for (Entry& e : entries_) e.cached = false;
    by_identity_.clear();
  }
  /// Blocks some admission pins (0 once every admission was freed).
  std::size_t pinned() const {
    return static_cast<std::size_t>(std::count_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.refs > 0; }));
  }

 private:
  struct Entry {
    std::uint32_t refs = 0;
    bool cached = false;
    std::uint64_t identity = 0;
    std::list<std::uint32_t>::iterator lru;
  };
  std::vector<Entry> entries_;
  std::vector<std::uint32_t> free_;
  std::list<std::uint32_t> lru_;  // cached and unpinned, least recently used first
  std::unordered_map<std::uint64_t, std::uint32_t> by_identity_;
};

}  // namespace replay
