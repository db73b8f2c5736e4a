// kvfuse/tier/memory_tier.hpp — MemoryTier: a per-rank LRU of entries in pinned host memory.
//
// A hit is one copy: get hands out a view of the tier's own pinned bytes, and the caller
// copies them straight into its device blocks. The view pins the entry (a reference count),
// so an LRU eviction, an overwrite or an erase that happens while a lane is still copying
// only unlinks the entry from the catalogue; its bytes are freed when the last view goes.
//
// Locking: one mutex guards the catalogue (hash map + LRU list) and the counters. It is
// held for O(1) catalogue work only — never across the copy of a put (the new entry is
// allocated and filled before the lock is taken, then published) and never while a view
// is used. Releasing a view takes no lock, except the last view of a retired pooled entry,
// which takes it for O(1) to return its block to the free list.
//
// Pool (opt-in, MemoryTierPool): size classes of fixed blocks, each class one slab taken
// from the Source at construction and given back at destruction. A pooled put takes a block
// under the lock, copies into it outside the lock, and publishes it under the lock: no
// allocate_pinned and no heap allocation for the payload or the entry's metadata (both are
// made at construction). Each class keeps its own LRU list, so finding a victim of a
// fitting class costs O(classes), not a scan of the whole catalogue.
//
// This LRU is not the index's LruHashSet (engine/detail/lru_hash_set.hpp), on purpose: that
// one is a set of hashes capped by count, used by the scheduler thread alone with no lock;
// this one holds byte buffers capped by bytes, shared by lanes under a lock, with entries
// pinned by views. lru_hash_set.hpp says more.
#pragma once

#include <atomic>
#include <cassert>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <unordered_map>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <boost/intrusive/list.hpp>

#include <kvfuse/error.hpp>
#include <kvfuse/tier/memory_tier_pool.hpp>
#include <kvfuse/tier/pinned_source.hpp>
#include <kvfuse/tier/tier.hpp>

namespace kvfuse {

/// A consistent snapshot of a MemoryTier's catalogue and counters.
struct MemoryTierStats {
  std::size_t entries = 0;        ///< entries in the catalogue
  std::size_t bytes = 0;          ///< payload bytes in the catalogue (with a pool: block bytes); always <= capacity
  std::size_t capacity = 0;       ///< the byte capacity given at construction
  std::size_t retired_bytes = 0;  ///< bytes already unlinked but still pinned by live views (pool: block bytes)
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t evictions = 0;    ///< entries dropped to make room (not overwrites or erases)
  std::uint64_t puts = 0;         ///< successful puts
  std::uint64_t put_failures = 0; ///< larger than the capacity, or the allocation failed
};

/// Per-rank LRU tier with a byte capacity, its memory from a PinnedMemorySource.
///
/// Capacity bounds the bytes in the catalogue. Memory actually held is that plus
/// `retired_bytes`: entries evicted or replaced while a view was reading them, freed as
/// soon as that view goes (at most one entry per lane that is mid-copy, in practice).
/// A put makes room by evicting least-recently-used entries, unpinned ones first; only if
/// that is not enough does it unlink pinned ones too (deferred free), so a put of an entry
/// that fits the capacity always succeeds unless allocation fails.
///
/// Different ranks' tiers hold different entries (each has its own LRU history): that is
/// normal, and the quorum (R4) treats a rank's miss as that rank's fact.
///
/// With a pool (MemoryTierPool) a put of n bytes never allocates outside the pool. Rule:
///   1. n larger than the largest class: the put fails (put_failures, pool oversize).
///   2. A free block of the smallest class whose class_bytes >= n; if that class has none,
///      a free block of the next larger class, and so on (never evicts while a fitting
///      block is free).
///   3. None free: evict the least recently used *unpinned* entry whose block fits (class
///      >= the smallest fitting one); its block is free at once and step 2 repeats.
///      Pinned entries are never evicted for a pooled put: unlinking one frees no block.
///   4. No fitting entry is unpinned (all pinned by live views, or none of a fitting
///      class): the put fails (put_failures, pool exhausted); the previous entry stays.
/// With a pool, `bytes` and `retired_bytes` count block bytes (what the budget pays), not
/// payload bytes, so bytes <= the pool's bytes <= capacity always.
///
/// Thread-safe: every member may be called from any thread at once. Views must be
/// destroyed before the tier. Not copyable or movable (views point at it).
template <PinnedMemorySource Source = HeapPinnedSource>
class MemoryTier {
 public:
  /// A tier that owns a default-constructed Source. Throws Error(invalid_argument) naming
  /// the value when `capacity_bytes` is 0.
  explicit MemoryTier(std::size_t capacity_bytes)
    requires std::default_initializable<Source>
      : owned_(std::make_unique<Source>()), source_(owned_.get()), capacity_(checked(capacity_bytes)) {}

  /// A tier that allocates from `source` (for example the rank's HostRuntime or
  /// HipRuntime); `source` must outlive the tier. Throws like the other constructor.
  MemoryTier(std::size_t capacity_bytes, Source& source) : source_(&source), capacity_(checked(capacity_bytes)) {}

  /// A tier that owns a default-constructed Source and serves every put from `pool`'s
  /// blocks (see the class comment for the rule). The slabs are allocated here, one
  /// allocate_pinned per class, and freed by the destructor. Throws Error(invalid_argument)
  /// naming the value for a zero capacity, a class of 0 bytes, a count of 0, a class larger
  /// than the capacity, classes not strictly increasing (duplicates included), or a pool
  /// whose bytes (sum of class_bytes x count) exceed the capacity or overflow; throws what
  /// the Source throws if a slab cannot be allocated (nothing leaks). Allocates.
  MemoryTier(std::size_t capacity_bytes, const MemoryTierPool& pool)
    requires std::default_initializable<Source>
      : owned_(std::make_unique<Source>()), source_(owned_.get()), capacity_(checked(capacity_bytes)) {
    build_pool(pool);
  }

  /// As above, allocating the slabs from `source`, which must outlive the tier.
  MemoryTier(std::size_t capacity_bytes, Source& source, const MemoryTierPool& pool)
      : source_(&source), capacity_(checked(capacity_bytes)) {
    build_pool(pool);
  }

  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  /// Frees every entry. Precondition: no view of this tier is alive.
  ~MemoryTier() {
    clear();
    assert(retired_bytes_.load() == 0 && "a TierView outlived its MemoryTier");
    release_slabs();
  }

  /// The entry for `key`, as a view of the tier's own pinned bytes that keeps the entry
  /// alive while it lives; `miss` if absent. `staging` is not used (no intermediate copy).
  /// Marks the entry most recently used. Any thread; noexcept; never allocates; O(1) under
  /// the catalogue lock (not lock-free). Destroying the view is lock-free.
  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept {
    (void)staging;
    Entry* entry = nullptr;
    {
      std::lock_guard lock(mutex_);
      const auto it = map_.find(key);
      if (it == map_.end()) {
        ++misses_;
        return TierView(GetStatus::miss);
      }
      entry = it->second;
      // The catalogue's own reference keeps the entry alive while we hold the lock, so a
      // relaxed increment is enough; the release side orders the frees.
      entry->refs.fetch_add(1, std::memory_order_relaxed);
      Lru& list = list_for(*entry);
      list.splice(list.begin(), list, list.iterator_to(*entry));
      entry->stamp = ++clock_;
      ++hits_;
    }
    return TierView(std::span<const std::byte>(entry->data, entry->size), &release_view, this, entry);
  }

  /// Stores a copy of `bytes` under `key`, replacing any previous entry, evicting LRU
  /// entries to make room. False (and counted in put_failures) if `bytes` is larger than
  /// the capacity or memory could not be allocated; the previous entry then stays.
  /// Allocation and the copy happen outside the lock; publishing and eviction are O(1) per
  /// evicted entry under it. Entries it evicts are freed after the lock is released. Any
  /// thread; noexcept; allocates (a map node and the entry).
  /// With a pool: the block is taken under the lock by the rule in the class comment,
  /// filled outside it, published under it; false (counted) when larger than the largest
  /// class or no fitting block can be freed. Never calls the Source; allocates only the
  /// map node of a new key.
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept {
    if (!classes_.empty()) return put_pooled(key, bytes);
    Entry* fresh = bytes.size() <= capacity_ ? make_entry(key, bytes) : nullptr;
    if (fresh == nullptr) {
      std::lock_guard lock(mutex_);
      ++put_failures_;
      return false;
    }
    Entry* dead = nullptr;
    bool published = false;
    {
      std::lock_guard lock(mutex_);
      try {
        const auto [it, inserted] = map_.try_emplace(key, fresh);
        if (!inserted) {
          Entry* old = std::exchange(it->second, fresh);
          drop_from_catalogue(*old, dead);
        }
        make_room(fresh->size, dead);
        lru_.push_front(*fresh);
        bytes_ += fresh->size;
        ++puts_;
        published = true;
      } catch (...) {  // only try_emplace can throw (bad_alloc); nothing was changed
        ++put_failures_;
      }
    }
    free_chain(dead);
    if (!published) destroy(fresh);
    return published;
  }

  /// Whether `key` is in the catalogue now. Any thread; noexcept; O(1) under the lock.
  bool contains(const TierKey& key) const noexcept {
    std::lock_guard lock(mutex_);
    return map_.contains(key);
  }

  /// Removes `key`; its bytes are freed now, or when its last view goes. True if it was
  /// there. Any thread; noexcept; O(1) under the lock.
  bool erase(const TierKey& key) noexcept {
    Entry* dead = nullptr;
    {
      std::lock_guard lock(mutex_);
      const auto it = map_.find(key);
      if (it == map_.end()) return false;
      Entry* entry = it->second;
      map_.erase(it);
      drop_from_catalogue(*entry, dead);
    }
    free_chain(dead);
    return true;
  }

  /// Removes every entry (pinned ones are freed when their views go). Any thread; noexcept.
  void clear() noexcept {
    Entry* dead = nullptr;
    {
      std::lock_guard lock(mutex_);
      map_.clear();
      while (!lru_.empty()) drop_from_catalogue(lru_.front(), dead);
      for (PoolClass& c : classes_)
        while (!c.lru.empty()) drop_from_catalogue(c.lru.front(), dead);
    }
    free_chain(dead);
  }

  /// A consistent snapshot of the counters. Any thread; noexcept; O(1) under the lock.
  MemoryTierStats stats() const noexcept {
    std::lock_guard lock(mutex_);
    return MemoryTierStats{map_.size(), bytes_,  capacity_, retired_bytes_.load(std::memory_order_relaxed),
                           hits_,       misses_, evictions_, puts_,
                           put_failures_};
  }

  /// A consistent snapshot of the pool's counters (all zero without a pool). Any thread;
  /// noexcept; never allocates; O(classes) under the lock.
  MemoryTierPoolStats pool_stats() const noexcept {
    std::lock_guard lock(mutex_);
    MemoryTierPoolStats s;
    for (const PoolClass& c : classes_) {
      s.blocks += c.count;
      s.free_blocks += c.free_count;
      s.bytes += c.block_bytes * c.count;
    }
    s.held_blocks = classes_.empty() ? 0 : map_.size();
    s.retired_blocks = retired_blocks_;
    s.filling_blocks = filling_blocks_;
    s.exhausted = pool_exhausted_;
    s.oversize = pool_oversize_;
    return s;
  }

  /// Free blocks of the class whose class_bytes is exactly `class_bytes`; 0 if there is no
  /// such class. Any thread; noexcept; O(classes) under the lock.
  std::size_t pool_free_blocks(std::size_t class_bytes) const noexcept {
    std::lock_guard lock(mutex_);
    for (const PoolClass& c : classes_)
      if (c.block_bytes == class_bytes) return c.free_count;
    return 0;
  }

  /// The byte capacity given at construction. Any thread.
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

 private:
  using Hook = boost::intrusive::list_member_hook<boost::intrusive::link_mode<boost::intrusive::normal_link>>;

  // Metadata lives on the ordinary heap, not in the pinned block: pinned memory may be
  // write-combined or device-mapped, which is no place for atomics and list links.
  static constexpr std::uint32_t no_class = std::numeric_limits<std::uint32_t>::max();

  struct Entry {
    TierKey key;
    std::byte* data = nullptr;
    std::size_t size = 0;
    std::size_t charge = 0;  // what bytes_ / retired_bytes_ count: size, or the block size
    std::uint32_t pool_class = no_class;  // the class of a pooled entry's block
    std::uint64_t stamp = 0;              // last use (pooled entries): picks the LRU class
    // One reference for the catalogue while linked, plus one per live view. Whoever drops
    // it to zero frees the entry: a view's release, or an unlink when no view is alive.
    std::atomic<std::uint32_t> refs{1};
    Entry* next_dead = nullptr;  // chains entries to free after the lock is released
    Entry* next_free = nullptr;  // a pooled entry's link in its class's free list
    Hook hook;
  };
  using Lru = boost::intrusive::list<Entry, boost::intrusive::member_hook<Entry, Hook, &Entry::hook>,
                                     boost::intrusive::constant_time_size<false>>;

  // One size class: its slab, its blocks' entries (made once), free list and LRU.
  struct PoolClass {
    std::size_t block_bytes = 0;
    std::size_t count = 0;
    std::byte* slab = nullptr;
    std::unique_ptr<Entry[]> entries;
    Entry* free_head = nullptr;  // guarded by mutex_
    std::size_t free_count = 0;  // guarded by mutex_
    Lru lru;                     // guarded by mutex_; front = most recently used
  };

  static std::size_t checked(std::size_t capacity_bytes) {
    if (capacity_bytes == 0)
      throw Error(ErrorCode::invalid_argument, "MemoryTier capacity_bytes must be > 0, got 0");
    return capacity_bytes;
  }

  // Validates `pool` and allocates its slabs; on a throw frees what it took (the
  // destructor does not run for a constructor that throws).
  void build_pool(const MemoryTierPool& pool) {
    check_pool(pool, capacity_);
    if (pool.size() >= no_class)
      throw Error(ErrorCode::invalid_argument, "MemoryTier pool has " + std::to_string(pool.size()) + " classes, too many");
    std::size_t blocks = 0;
    try {
      classes_ = std::vector<PoolClass>(pool.size());
      for (std::size_t i = 0; i < pool.size(); ++i) {
        PoolClass& c = classes_[i];
        c.block_bytes = pool[i].class_bytes;
        c.count = pool[i].count;
        c.entries = std::make_unique<Entry[]>(c.count);
        c.slab = static_cast<std::byte*>(source_->allocate_pinned(c.block_bytes * c.count));
        for (std::size_t b = c.count; b-- > 0;) {
          Entry& e = c.entries[b];
          e.data = c.slab + b * c.block_bytes;
          e.charge = c.block_bytes;
          e.pool_class = static_cast<std::uint32_t>(i);
          e.refs.store(0, std::memory_order_relaxed);
          e.next_free = c.free_head;
          c.free_head = &e;
        }
        c.free_count = c.count;
        blocks += c.count;
      }
      map_.reserve(blocks);
    } catch (...) {
      release_slabs();
      throw;
    }
  }

  void release_slabs() noexcept {
    for (PoolClass& c : classes_)
      if (c.slab != nullptr) source_->free_pinned(std::exchange(c.slab, nullptr));
  }

  Lru& list_for(Entry& entry) noexcept { return entry.pool_class == no_class ? lru_ : classes_[entry.pool_class].lru; }

  // Under the lock. A free block of class `first` or the smallest larger one; nullptr if none.
  Entry* take_free(std::size_t first) noexcept {
    for (std::size_t c = first; c < classes_.size(); ++c) {
      PoolClass& pc = classes_[c];
      if (pc.free_head == nullptr) continue;
      Entry* e = std::exchange(pc.free_head, pc.free_head->next_free);
      e->next_free = nullptr;
      --pc.free_count;
      return e;
    }
    return nullptr;
  }

  // Under the lock. Puts a pooled entry's block back on its class's free list (its last
  // reference is gone: nobody reads its bytes any more).
  void give_back(Entry& entry) noexcept {
    PoolClass& pc = classes_[entry.pool_class];
    entry.next_free = pc.free_head;
    pc.free_head = &entry;
    ++pc.free_count;
  }

  // Under the lock. The least recently used unpinned entry of class `first` or larger;
  // nullptr if every such entry is pinned (or there is none). Pinned entries are rarely
  // at a cold end (a get moves its entry to the hot end), so the skips are few.
  Entry* coldest_fitting(std::size_t first) noexcept {
    Entry* best = nullptr;
    for (std::size_t c = first; c < classes_.size(); ++c) {
      Lru& list = classes_[c].lru;
      for (auto it = list.rbegin(); it != list.rend(); ++it) {
        if (it->refs.load(std::memory_order_acquire) > 1) continue;  // pinned: skip
        if (best == nullptr || it->stamp < best->stamp) best = &*it;
        break;
      }
    }
    return best;
  }

  bool put_pooled(const TierKey& key, std::span<const std::byte> bytes) noexcept {
    const std::size_t n = bytes.size();
    std::size_t first = 0;
    while (first < classes_.size() && classes_[first].block_bytes < n) ++first;
    Entry* dead = nullptr;  // pooled entries never join it; kept for drop_from_catalogue
    Entry* block = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (first == classes_.size()) {
        ++put_failures_;
        ++pool_oversize_;
        return false;
      }
      block = take_free(first);
      while (block == nullptr) {
        Entry* victim = coldest_fitting(first);
        if (victim == nullptr) break;
        evict(*victim, dead);  // unpinned: its block is on the free list now
        block = take_free(first);
      }
      if (block == nullptr) {
        ++put_failures_;
        ++pool_exhausted_;
        return false;
      }
      ++filling_blocks_;
    }
    assert(dead == nullptr);
    // Ours alone until published: no view or list can reach a block off the free list.
    block->key = key;
    block->size = n;
    block->refs.store(1, std::memory_order_relaxed);
    if (n != 0) std::memcpy(block->data, bytes.data(), n);
    bool published = false;
    {
      std::lock_guard lock(mutex_);
      --filling_blocks_;
      try {
        const auto [it, inserted] = map_.try_emplace(key, block);
        if (!inserted) {
          Entry* old = std::exchange(it->second, block);
          drop_from_catalogue(*old, dead);
        }
        classes_[block->pool_class].lru.push_front(*block);
        block->stamp = ++clock_;
        bytes_ += block->charge;
        assert(bytes_ <= capacity_);
        ++puts_;
        published = true;
      } catch (...) {  // only try_emplace can throw (bad_alloc); nothing was changed
        ++put_failures_;
        block->refs.store(0, std::memory_order_relaxed);
        give_back(*block);
      }
    }
    assert(dead == nullptr);
    return published;
  }

  // Allocates and fills an unpublished entry; nullptr if either allocation fails.
  Entry* make_entry(const TierKey& key, std::span<const std::byte> bytes) noexcept {
    Entry* entry = new (std::nothrow) Entry;
    if (entry == nullptr) return nullptr;
    try {
      entry->data = static_cast<std::byte*>(source_->allocate_pinned(bytes.size()));
    } catch (...) {  // the source reports exhaustion with kvfuse::Error; a put just fails
      delete entry;
      return nullptr;
    }
    entry->key = key;
    entry->size = bytes.size();
    entry->charge = bytes.size();
    if (!bytes.empty()) std::memcpy(entry->data, bytes.data(), bytes.size());
    return entry;
  }

  void destroy(Entry* entry) noexcept {
    source_->free_pinned(entry->data);
    delete entry;
  }

  void free_chain(Entry* dead) noexcept {
    while (dead != nullptr) destroy(std::exchange(dead, dead->next_dead));
  }

  // Under the lock. Unlinks `entry` from the LRU (the caller has already removed or
  // replaced its map slot) and drops the catalogue's reference. If no view holds it, it
  // joins `dead` to be freed after the lock; otherwise it is retired and its last view
  // frees it. Retired bytes are added before the decrement so a racing release can never
  // subtract them first. A pooled entry's block goes back to the free list here, under the
  // lock, instead of joining `dead`; a retired one is counted in retired_blocks_ (under
  // the lock, before its last view can take the lock to give the block back).
  void drop_from_catalogue(Entry& entry, Entry*& dead) noexcept {
    Lru& list = list_for(entry);
    list.erase(list.iterator_to(entry));
    // Read before the decrement: once it leaves a view's reference, that view's release
    // may free an unpooled entry on another thread (without the lock) at any moment.
    const std::size_t charge = entry.charge;
    const bool pooled = entry.pool_class != no_class;
    bytes_ -= charge;
    retired_bytes_.fetch_add(charge, std::memory_order_relaxed);
    if (entry.refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      retired_bytes_.fetch_sub(charge, std::memory_order_relaxed);
      if (pooled) {
        give_back(entry);
        return;
      }
      entry.next_dead = dead;
      dead = &entry;
    } else if (pooled) {
      ++retired_blocks_;  // its last view gives the block back under the lock we hold
    }
  }

  void evict(Entry& entry, Entry*& dead) noexcept {
    map_.erase(entry.key);
    drop_from_catalogue(entry, dead);
    ++evictions_;
  }

  // Under the lock. Evicts from the cold end until `need` more bytes fit. Unpinned entries
  // go first: their memory comes back at once, while unlinking a pinned one frees nothing
  // until its view goes and throws away an entry a lane is using right now. A get moves
  // its entry to the hot end, so pinned entries are rarely near the cold end and the scan
  // skips at most a handful of them.
  void make_room(std::size_t need, Entry*& dead) noexcept {
    auto next = lru_.end();
    while (bytes_ + need > capacity_ && next != lru_.begin()) {
      const auto victim = std::prev(next);
      if (victim->refs.load(std::memory_order_acquire) > 1) {
        next = victim;  // pinned: skip
        continue;
      }
      evict(*victim, dead);  // `next` stays valid: only `victim` is unlinked
    }
    while (bytes_ + need > capacity_ && !lru_.empty()) evict(lru_.back(), dead);
  }

  static void release_view(void* owner, void* opaque) noexcept {
    auto* self = static_cast<MemoryTier*>(owner);
    auto* entry = static_cast<Entry*>(opaque);
    if (entry->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Zero only after the catalogue dropped its reference, i.e. the entry was retired.
      if (entry->pool_class != no_class) {  // a pooled block goes back under the lock
        std::lock_guard lock(self->mutex_);
        self->retired_bytes_.fetch_sub(entry->charge, std::memory_order_relaxed);
        --self->retired_blocks_;
        self->give_back(*entry);
        return;
      }
      self->retired_bytes_.fetch_sub(entry->charge, std::memory_order_relaxed);
      self->destroy(entry);
    }
  }

  std::unique_ptr<Source> owned_;
  Source* source_;
  const std::size_t capacity_;

  mutable std::mutex mutex_;
  std::unordered_map<TierKey, Entry*> map_;  // guarded by mutex_
  Lru lru_;                                  // guarded by mutex_; front = most recently used
  std::size_t bytes_ = 0;                    // guarded by mutex_
  std::uint64_t hits_ = 0, misses_ = 0, evictions_ = 0, puts_ = 0, put_failures_ = 0;  // guarded
  std::atomic<std::size_t> retired_bytes_{0};  // also changed by lock-free view releases
  std::vector<PoolClass> classes_;             // empty: no pool; its shape fixed at construction
  std::uint64_t clock_ = 0;                    // guarded; stamps pooled entries' last use
  std::size_t retired_blocks_ = 0, filling_blocks_ = 0;       // guarded by mutex_
  std::uint64_t pool_exhausted_ = 0, pool_oversize_ = 0;      // guarded by mutex_
};

static_assert(Tier<MemoryTier<>>);

}  // namespace kvfuse
