// kvfuse/engine/detail/lru_hash_set.hpp — the indexed state hashes: a hash set and its LRU
// order as ONE intrusive structure (R5).
//
// Each node is at once a member of a hash-bucket chain and of the LRU list, so there is no
// second container whose contents could drift from the first: inserting, touching, evicting
// and erasing all act on the one node. Internal: not part of the public API. Not
// thread-safe; OffloadIndex calls it from the engine's scheduler thread only.
//
// Why this is not MemoryTier's LRU (tier/memory_tier.hpp), on purpose: the two share the
// word and little else. This one is a set of 8-byte hashes with no value, capped by count,
// owned by the scheduler thread with no lock; it never throws (short of memory it recycles
// its coldest node) and reports the hash it evicted so the index can count it. The memory
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
#include <kvfuse/detail/npos.hpp>

namespace kvfuse::detail {

/// A capped set of PrefixHash with least-recently-used eviction.
///
/// Storage is a node pool (indices, not pointers) plus a power-of-two bucket array.
/// Both grow geometrically up to the cap, or are allocated whole at construction with
/// `preallocate`. Growth never throws out of `insert_or_touch`: if the pool cannot grow,
/// the least recently used node is recycled; if the bucket array cannot grow, chains get
/// longer. Only an empty set that cannot allocate its first node drops the hash.
///
/// Two counts are kept by different code: `size()` by the bucket chains, `lru_length()`
/// by the list links. OffloadIndex compares them (and its own counter) on every stats()
/// read, an O(1) cross-check that the two views of the one structure still agree.
///
/// Every member: the scheduler thread only (the thread that owns the OffloadIndex).
class LruHashSet {
 public:
  /// What insert_or_touch did.
  enum class Outcome : std::uint8_t {
    inserted,  ///< the hash is new and now most recently used
    touched,   ///< the hash was present; it is now most recently used
    dropped,   ///< no memory for even one node: the hash is not indexed
  };
  /// What insert_or_touch did, and which hash it evicted to do it.
  struct InsertResult {
    Outcome outcome = Outcome::inserted;
    bool evicted = false;         ///< the least recently used hash was evicted to make room
    PrefixHash evicted_hash{};    ///< which one, when `evicted`
  };

  /// A set holding at most `capacity` hashes (1 <= capacity <= 2^31; the caller checks).
  /// With `preallocate`, every node and bucket is allocated here and no later call allocates.
  LruHashSet(std::size_t capacity, bool preallocate) : capacity_(capacity) {
    const std::size_t max_buckets = std::bit_ceil(capacity_);
    if (preallocate) {
      nodes_.reserve(capacity_);
      buckets_.assign(max_buckets, npos32);
    } else {
      buckets_.assign(std::min<std::size_t>(16, max_buckets), npos32);
    }
  }

  /// The most hashes the set holds. O(1).
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// Hashes reachable through the bucket chains. O(1).
  [[nodiscard]] std::size_t size() const noexcept { return chained_; }
  /// Nodes on the LRU list. O(1).
  [[nodiscard]] std::size_t lru_length() const noexcept { return listed_; }

  /// Whether `h` is in the set. Does not change the LRU order. O(1) expected.
  [[nodiscard]] bool contains(PrefixHash h) const noexcept { return find_node(h) != npos32; }

  /// Makes `h` most recently used if present; returns whether it was. O(1) expected.
  bool touch(PrefixHash h) noexcept {
    const std::uint32_t n = find_node(h);
    if (n == npos32) return false;
    list_unlink(n);
    list_push_front(n);
    return true;
  }

  /// Inserts `h` as most recently used, or touches it if present. At the cap, evicts the
  /// least recently used hash first. Never throws. O(1) amortised.
  InsertResult insert_or_touch(PrefixHash h) noexcept {
    InsertResult r;
    if (touch(h)) {
      r.outcome = Outcome::touched;
      return r;
    }
    if (chained_ >= capacity_) evict_lru(r);
    std::uint32_t n = allocate_node();
    if (n == npos32) {
      if (chained_ == 0) {
        r.outcome = Outcome::dropped;
        return r;
      }
      evict_lru(r);  // recycle the LRU node rather than fail the insert
      n = allocate_node();
    }
    maybe_grow_buckets();
    nodes_[n].hash = h;
    chain_push(n);
    list_push_front(n);
    return r;
  }

  /// Removes `h`; returns whether it was present. O(1) expected.
  bool erase(PrefixHash h) noexcept {
    const std::uint32_t n = find_node(h);
    if (n == npos32) return false;
    remove_node(n);
    return true;
  }

  /// Calls f(hash) from most to least recently used; each node visited counts one walk step.
  template <class F>
  void for_each_mru(F&& f) const {
    for (std::uint32_t n = head_; n != npos32; n = nodes_[n].next) {
      ++walks_;
      f(nodes_[n].hash);
    }
  }

  /// Full structural check for tests: the list is well linked in both directions, every
  /// listed node is found by its own hash, every chained node is listed, no hash appears
  /// twice, and the counts agree. Returns "" when consistent, else the first problem.
  /// O(size + buckets); every node and bucket visited counts one walk step.
  [[nodiscard]] std::string check() const {
    std::size_t listed = 0;
    std::uint32_t prev = npos32;
    for (std::uint32_t n = head_; n != npos32; n = nodes_[n].next) {
      ++walks_;
      if (n >= nodes_.size()) return "LRU link points outside the node pool";
      if (nodes_[n].prev != prev) return "LRU prev link disagrees with next link";
      if (nodes_[n].prev == kFreeMark) return "a free node is on the LRU list";
      if (find_node(nodes_[n].hash) != n) return "an LRU node is not reachable by its hash (or a duplicate hides it)";
      if (++listed > nodes_.size()) return "LRU list has a cycle";
      prev = n;
    }
    if (prev != tail_) return "LRU tail is not the last node";
    std::size_t chained = 0;
    for (std::uint32_t b = 0; b < buckets_.size(); ++b) {
      ++walks_;
      for (std::uint32_t n = buckets_[b]; n != npos32; n = nodes_[n].chain) {
        ++walks_;
        if (n >= nodes_.size()) return "bucket chain points outside the node pool";
        if (bucket_of(nodes_[n].hash) != b) return "a node is chained in the wrong bucket";
        if (nodes_[n].prev == kFreeMark) return "a free node is chained in a bucket";
        if (++chained > nodes_.size()) return "bucket chain has a cycle";
      }
    }
    std::size_t free_nodes = 0;
    for (std::uint32_t n = free_; n != npos32; n = nodes_[n].chain) {
      ++walks_;
      if (nodes_[n].prev != kFreeMark) return "a node on the free list is not marked free";
      if (++free_nodes > nodes_.size()) return "free list has a cycle";
    }
    if (listed != listed_) return "LRU length counter disagrees with the list";
    if (chained != chained_) return "chained counter disagrees with the buckets";
    if (listed != chained) return "the LRU list and the hash buckets hold different node counts";
    if (listed + free_nodes != nodes_.size()) return "nodes leaked: neither listed nor free";
    if (chained_ > capacity_) return "more hashes than the cap";
    return {};
  }

  /// Nodes and buckets visited by walks (check, for_each_mru, rehash) since construction.
  [[nodiscard]] std::uint64_t walks() const noexcept { return walks_; }

 private:
  // prev == kFreeMark tags a node on the free list, so check() can tell it from a live one.
  static constexpr std::uint32_t kFreeMark = 0xFFFF'FFFEu;

  struct Node {
    PrefixHash hash;
    std::uint32_t prev = npos32;   // LRU list: towards most recently used
    std::uint32_t next = npos32;   // LRU list: towards least recently used
    std::uint32_t chain = npos32;  // bucket chain, or the free list
  };

  [[nodiscard]] std::size_t bucket_of(PrefixHash h) const noexcept {
    return std::hash<PrefixHash>{}(h) & (buckets_.size() - 1);
  }

  [[nodiscard]] std::uint32_t find_node(PrefixHash h) const noexcept {
    for (std::uint32_t n = buckets_[bucket_of(h)]; n != npos32; n = nodes_[n].chain)
      if (nodes_[n].hash == h) return n;
    return npos32;
  }

  void evict_lru(InsertResult& r) noexcept {
    const std::uint32_t victim = tail_;
    r.evicted = true;
    r.evicted_hash = nodes_[victim].hash;
    remove_node(victim);
  }

  void remove_node(std::uint32_t n) noexcept {
    chain_remove(n);
    list_unlink(n);
    nodes_[n].prev = kFreeMark;
    nodes_[n].chain = free_;
    free_ = n;
  }

  std::uint32_t allocate_node() noexcept {
    if (free_ != npos32) {
      const std::uint32_t n = free_;
      free_ = nodes_[n].chain;
      nodes_[n] = Node{};
      return n;
    }
    if (nodes_.size() >= capacity_) return npos32;
    try {
      if (nodes_.size() == nodes_.capacity())
        nodes_.reserve(std::min(capacity_, std::max<std::size_t>(64, nodes_.size() * 2)));
      nodes_.emplace_back();
    } catch (...) {
      return npos32;
    }
    return static_cast<std::uint32_t>(nodes_.size() - 1);
  }

  void maybe_grow_buckets() noexcept {
    if (chained_ + 1 <= buckets_.size() || buckets_.size() >= std::bit_ceil(capacity_)) return;
    std::vector<std::uint32_t> fresh;
    try {
      fresh.assign(buckets_.size() * 2, npos32);
    } catch (...) {
      return;  // longer chains, still correct
    }
    const std::size_t mask = fresh.size() - 1;
    for (std::uint32_t n = head_; n != npos32; n = nodes_[n].next) {
      ++walks_;
      const std::size_t b = std::hash<PrefixHash>{}(nodes_[n].hash) & mask;
      nodes_[n].chain = fresh[b];
      fresh[b] = n;
    }
    buckets_.swap(fresh);
  }

  void chain_push(std::uint32_t n) noexcept {
    std::uint32_t& head = buckets_[bucket_of(nodes_[n].hash)];
    nodes_[n].chain = head;
    head = n;
    ++chained_;
  }

  void chain_remove(std::uint32_t n) noexcept {
    std::uint32_t* link = &buckets_[bucket_of(nodes_[n].hash)];
    while (*link != n) link = &nodes_[*link].chain;
    *link = nodes_[n].chain;
    nodes_[n].chain = npos32;
    --chained_;
  }

  void list_push_front(std::uint32_t n) noexcept {
    nodes_[n].prev = npos32;
    nodes_[n].next = head_;
    if (head_ != npos32) nodes_[head_].prev = n;
    head_ = n;
    if (tail_ == npos32) tail_ = n;
    ++listed_;
  }

  void list_unlink(std::uint32_t n) noexcept {
    Node& node = nodes_[n];
    if (node.prev != npos32) nodes_[node.prev].next = node.next; else head_ = node.next;
    if (node.next != npos32) nodes_[node.next].prev = node.prev; else tail_ = node.prev;
    node.prev = node.next = npos32;
    --listed_;
  }

  std::size_t capacity_;
  std::vector<Node> nodes_;
  std::vector<std::uint32_t> buckets_;
  std::uint32_t head_ = npos32;  // most recently used
  std::uint32_t tail_ = npos32;  // least recently used
  std::uint32_t free_ = npos32;
  std::size_t chained_ = 0;
  std::size_t listed_ = 0;
  mutable std::uint64_t walks_ = 0;
};

}  // namespace kvfuse::detail
