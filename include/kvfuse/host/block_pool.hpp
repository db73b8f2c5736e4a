// kvfuse/host/block_pool.hpp — the engine's paged KV block pool with prefix caching, the
// way vLLM's BlockPool does it: a block that holds whole tokens of a known prefix is
// published under a hash of those tokens (its identity) and stays cached after its request,
// least recently used first out, until an allocation needs it; a later request whose prompt
// starts with the same tokens pins it instead of computing it again.
//
// The pool is what an engine without a pool of its own uses. An engine that has one (vLLM's
// BlockPool, llama.cpp's cells) keeps it: the AdmissionBook (host/admission_book.hpp) only
// needs something that models BlockAllocator to hand freed blocks back to.
//
// Why the LRU is an index-linked list in a vector and not std::list: every block is in the
// pool from construction, so the links live beside the block's other fields and moving a
// block between "free", "cached" and "pinned" allocates nothing.
//
// Threading: not thread-safe. Every member is called from the engine's scheduler thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/detail/npos.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// Something the engine's freed blocks go back to: `pool.release(block)`, called on the
/// scheduler thread once per block of an admission the Coordinator freed.
template <class P>
concept BlockAllocator = requires(P& pool, BlockId block) { pool.release(block); };

/// Counters of a PrefixBlockPool. Plain data.
struct BlockPoolStats {
  std::uint64_t blocks = 0;           ///< blocks in the pool
  std::uint64_t pinned = 0;           ///< blocks some admission pins now (gauge)
  std::uint64_t cached = 0;           ///< published blocks nobody pins now (gauge)
  std::uint64_t matched = 0;          ///< blocks match() pinned from the cache
  std::uint64_t allocated = 0;        ///< fresh blocks allocate() handed out
  std::uint64_t evicted = 0;          ///< cached blocks allocate() took back
  std::uint64_t allocation_refusals = 0;  ///< allocate() calls that found too few unpinned blocks
  std::uint64_t bad_releases = 0;     ///< release() of a block nobody pinned: the engine lost track of it
};

/// A fixed pool of KV blocks (ids 0 .. blocks - 1, the same on every rank) with prefix
/// caching. Scheduler thread only. Movable, not copyable.
class PrefixBlockPool {
 public:
  /// A pool of `blocks` free blocks. Throws Error(invalid_argument) naming the value when
  /// `blocks` is 0 or does not fit the block id.
  explicit PrefixBlockPool(std::uint32_t blocks) : blocks_(checked(blocks)) {
    free_.reserve(blocks);
    for (std::uint32_t b = blocks; b-- > 0;) free_.push_back(b);
    by_identity_.reserve(blocks);
    stats_.blocks = blocks;
  }

  /// Pins the leading cached blocks named by `identities`, at most `limit` of them, appends
  /// them to `table` and returns how many: the run stops at the first identity the cache
  /// does not hold. O(matched); allocates only when `table` grows.
  std::size_t match(std::span<const std::uint64_t> identities, std::size_t limit, std::vector<BlockId>& table) {
    std::size_t n = 0;
    for (; n < limit && n < identities.size(); ++n) {
      const auto it = by_identity_.find(identities[n]);
      if (it == by_identity_.end()) break;
      Block& b = blocks_[it->second];
      if (b.pins++ == 0) {
        unlink(it->second);
        ++stats_.pinned;
        --stats_.cached;
      }
      table.push_back(BlockId{it->second});
    }
    stats_.matched += n;
    return n;
  }

  /// Appends `n` fresh pinned blocks to `table`, taking cached ones back (least recently
  /// used first) when no free one is left; returns false and takes nothing when fewer than
  /// `n` blocks are unpinned. O(n).
  bool allocate(std::size_t n, std::vector<BlockId>& table) {
    if (free_.size() + stats_.cached < n) {
      ++stats_.allocation_refusals;
      return false;
    }
    table.reserve(table.size() + n);
    for (std::size_t i = 0; i < n; ++i) {
      if (free_.empty()) {
        const std::uint32_t victim = lru_head_;
        unlink(victim);
        uncache(victim);
        --stats_.cached;
        ++stats_.evicted;
        free_.push_back(victim);
      }
      const std::uint32_t b = free_.back();
      free_.pop_back();
      blocks_[b].pins = 1;
      ++stats_.pinned;
      table.push_back(BlockId{b});
    }
    stats_.allocated += n;
    return true;
  }

  /// Block `b` (pinned) now holds the whole tokens `identity` names: later requests may
  /// share it. A block already published, or an identity another block holds, is left as
  /// it is (the first holder stays the cached one). O(1).
  void publish(BlockId b, std::uint64_t identity) {
    Block& e = blocks_.at(b.value);
    if (e.cached || by_identity_.contains(identity)) return;
    e.cached = true;
    e.identity = identity;
    by_identity_.emplace(identity, b.value);
  }

  /// Unpins `b`. The last pin's release makes a published block cached (most recently
  /// used) and any other block free. A block nobody pins is left alone and counted in
  /// bad_releases. O(1). Models BlockAllocator.
  void release(BlockId b) noexcept {
    if (b.value >= blocks_.size() || blocks_[b.value].pins == 0) {
      ++stats_.bad_releases;
      return;
    }
    Block& e = blocks_[b.value];
    if (--e.pins > 0) return;
    --stats_.pinned;
    if (e.cached) {
      link_newest(b.value);
      ++stats_.cached;
    } else {
      free_.push_back(b.value);  // reserved for every block: never reallocates
    }
  }

  /// Forgets every published block, pinned ones included: their bytes cannot be trusted
  /// any more (a rank lost its part of them, or the engine wants an empty cache). A cached
  /// block is free at once; a pinned one stays with its admission and becomes free, not
  /// cached, at its last release. O(blocks).
  void forget_cached() {
    for (std::uint32_t b = lru_head_; b != detail::npos32;) {
      const std::uint32_t next = blocks_[b].next;
      free_.push_back(b);
      blocks_[b].prev = blocks_[b].next = detail::npos32;
      b = next;
    }
    lru_head_ = lru_tail_ = detail::npos32;
    for (Block& e : blocks_) e.cached = false;
    by_identity_.clear();
    stats_.cached = 0;
  }

  /// Blocks some admission pins now. O(1).
  [[nodiscard]] std::size_t pinned() const noexcept { return static_cast<std::size_t>(stats_.pinned); }
  /// Blocks in the pool. O(1).
  [[nodiscard]] std::size_t size() const noexcept { return blocks_.size(); }
  /// Counters and gauges. O(1).
  [[nodiscard]] BlockPoolStats stats() const noexcept { return stats_; }

 private:
  struct Block {
    std::uint32_t pins = 0;
    bool cached = false;  // published under `identity`
    std::uint64_t identity = 0;
    std::uint32_t prev = detail::npos32, next = detail::npos32;  // LRU links while cached and unpinned
  };

  static std::vector<Block> checked(std::uint32_t blocks) {
    if (blocks == 0 || blocks == detail::npos32)
      throw Error(ErrorCode::invalid_argument,
                  "PrefixBlockPool needs 1 to " + std::to_string(detail::npos32 - 1) + " blocks, got " + std::to_string(blocks));
    return std::vector<Block>(blocks);
  }

  void uncache(std::uint32_t b) {
    by_identity_.erase(blocks_[b].identity);
    blocks_[b].cached = false;
  }
  void unlink(std::uint32_t b) noexcept {
    Block& e = blocks_[b];
    (e.prev == detail::npos32 ? lru_head_ : blocks_[e.prev].next) = e.next;
    (e.next == detail::npos32 ? lru_tail_ : blocks_[e.next].prev) = e.prev;
    e.prev = e.next = detail::npos32;
  }
  void link_newest(std::uint32_t b) noexcept {
    Block& e = blocks_[b];
    e.prev = lru_tail_;
    e.next = detail::npos32;
    (lru_tail_ == detail::npos32 ? lru_head_ : blocks_[lru_tail_].next) = b;
    lru_tail_ = b;
  }

  std::vector<Block> blocks_;
  std::vector<std::uint32_t> free_;                           // neither pinned nor cached
  std::uint32_t lru_head_ = detail::npos32;                   // least recently used cached block
  std::uint32_t lru_tail_ = detail::npos32;                   // most recently used
  std::unordered_map<std::uint64_t, std::uint32_t> by_identity_;  // published blocks, pinned or not
  BlockPoolStats stats_{};
};

}  // namespace kvfuse
