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
// is used. Releasing a view takes no lock at all.
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
#include <utility>

#include <boost/intrusive/list.hpp>

#include <kvfuse/error.hpp>
#include <kvfuse/tier/pinned_source.hpp>
#include <kvfuse/tier/tier.hpp>

namespace kvfuse {

/// A consistent snapshot of a MemoryTier's catalogue and counters.
struct MemoryTierStats {
  std::size_t entries = 0;        ///< entries in the catalogue
  std::size_t bytes = 0;          ///< payload bytes in the catalogue; always <= capacity
  std::size_t capacity = 0;       ///< the byte capacity given at construction
  std::size_t retired_bytes = 0;  ///< bytes already unlinked but still pinned by live views
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

  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  /// Frees every entry. Precondition: no view of this tier is alive.
  ~MemoryTier() {
    clear();
    assert(retired_bytes_.load() == 0 && "a TierView outlived its MemoryTier");
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
      lru_.splice(lru_.begin(), lru_, lru_.iterator_to(*entry));
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
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept {
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

  /// The byte capacity given at construction. Any thread.
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

 private:
  using Hook = boost::intrusive::list_member_hook<boost::intrusive::link_mode<boost::intrusive::normal_link>>;

  // Metadata lives on the ordinary heap, not in the pinned block: pinned memory may be
  // write-combined or device-mapped, which is no place for atomics and list links.
  struct Entry {
    TierKey key;
    std::byte* data = nullptr;
    std::size_t size = 0;
    // One reference for the catalogue while linked, plus one per live view. Whoever drops
    // it to zero frees the entry: a view's release, or an unlink when no view is alive.
    std::atomic<std::uint32_t> refs{1};
    Entry* next_dead = nullptr;  // chains entries to free after the lock is released
    Hook hook;
  };
  using Lru = boost::intrusive::list<Entry, boost::intrusive::member_hook<Entry, Hook, &Entry::hook>,
                                     boost::intrusive::constant_time_size<false>>;

  static std::size_t checked(std::size_t capacity_bytes) {
    if (capacity_bytes == 0)
      throw Error(ErrorCode::invalid_argument, "MemoryTier capacity_bytes must be > 0, got 0");
    return capacity_bytes;
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
  // subtract them first.
  void drop_from_catalogue(Entry& entry, Entry*& dead) noexcept {
    lru_.erase(lru_.iterator_to(entry));
    bytes_ -= entry.size;
    retired_bytes_.fetch_add(entry.size, std::memory_order_relaxed);
    if (entry.refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      retired_bytes_.fetch_sub(entry.size, std::memory_order_relaxed);
      entry.next_dead = dead;
      dead = &entry;
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
      self->retired_bytes_.fetch_sub(entry->size, std::memory_order_relaxed);
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
};

static_assert(Tier<MemoryTier<>>);

}  // namespace kvfuse
