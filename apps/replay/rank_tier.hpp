// kvfuse-replay: the tier every rank's legs talk to. RankTier<Inner> wraps whatever the
// --tier choice builds (tiers.hpp) with what the replay needs of every tier: a delay on gets
// (the slow fault) and a count of the calls by kind (the report's "tier reads per KV load").
// A wrapper must not lose a capability of what it wraps: over a BatchedTier it is one too, so
// a remote tier still answers a whole KV load in one round trip.
//
// TierControl is the same tier seen from the engine (the lookup, the faults, the report),
// which does not know the connector or the tier type of its ranks.
#pragma once

#include "local_tier.hpp"

#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/tier/redis_cluster_tier_stats.hpp>
#include <kvfuse/tier/redis_tier_stats.hpp>
#include <kvfuse/tier/tier.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <thread>
#include <type_traits>
#include <utility>

namespace replay {

/// Calls a rank's legs and the engine made into its tier, by kind. For a remote tier each is
/// one exchange (one round trip).
struct TierCalls {
  std::uint64_t kv_reads = 0;        ///< get or get_batch calls for KV chunks
  std::uint64_t kv_chunks_read = 0;  ///< KV chunks those calls asked for
  std::uint64_t state_reads = 0;     ///< gets of state checkpoints
  std::uint64_t puts = 0;
  std::uint64_t contains = 0;
  std::uint64_t erases = 0;
  std::uint64_t state_puts = 0;        ///< ... of the puts: state checkpoints the tier stored
  std::uint64_t state_bytes_put = 0;   ///< their bytes
  std::uint64_t total() const noexcept { return kv_reads + state_reads + puts + contains + erases; }
  TierCalls& operator+=(const TierCalls& o) noexcept {
    kv_reads += o.kv_reads;
    kv_chunks_read += o.kv_chunks_read;
    state_reads += o.state_reads;
    puts += o.puts;
    contains += o.contains;
    erases += o.erases;
    state_puts += o.state_puts;
    state_bytes_put += o.state_bytes_put;
    return *this;
  }
};

/// Every counter of one rank's tier after a run; a part the tier does not have is empty.
struct TierSnapshot {
  TierCalls calls;
  std::optional<kvfuse::MemoryTierStats> memory;
  std::optional<kvfuse::DiskTierStats> disk;        ///< the open DiskTier's
  std::optional<kvfuse::TieredTierStats> stack;
  std::optional<kvfuse::RedisTierStats> redis;         ///< a RedisTier's, or a RedisClusterTier's totals
  std::optional<kvfuse::RedisClusterCounters> cluster;  ///< a RedisClusterTier's own counters (its nodes stay in the rank)
  std::uint64_t quarantined = 0;                    ///< files quarantined, closed DiskTiers included
};

/// One rank's tier as the engine uses it, whatever it is made of. Thread-safe as the tier.
class TierControl {
 public:
  virtual ~TierControl() = default;
  /// The Tier concept's contains and erase (the lookup; the faults).
  virtual bool contains(const kvfuse::TierKey& key) const noexcept = 0;
  virtual bool erase(const kvfuse::TierKey& key) noexcept = 0;
  /// How many leading `keys` the tier holds (contains, key by key, up to the first miss):
  /// the lookup's question in one call, so a remote rank answers it in one exchange.
  virtual std::size_t leading(std::span<const kvfuse::TierKey> keys) const noexcept {
    std::size_t held = 0;
    while (held < keys.size() && contains(keys[held])) ++held;
    return held;
  }
  /// Every later get sleeps this long first (a slow rank).
  virtual void set_delay(std::chrono::microseconds d) noexcept = 0;
  /// Closes and reopens the disk tier: {entries before, entries + quarantined after}; {0, 0}
  /// for a tier without a disk. Scheduler thread.
  virtual std::pair<std::size_t, std::size_t> reopen_disk() = 0;
  /// Drops `key` from a memory front only; false when there is none.
  virtual bool erase_from_memory(const kvfuse::TierKey& key) noexcept = 0;
  /// The disk file of `key`; empty for a tier without a disk.
  virtual std::filesystem::path disk_path(const kvfuse::TierKey& key) const = 0;
  virtual TierSnapshot snapshot() const = 0;
};

/// Wraps `Inner`, built in place (a tier need not be movable). get sleeps for the delay
/// first; get_batch, present exactly when Inner is a BatchedTier, sleeps once per batch, as
/// one round trip does. Thread-safe exactly as far as Inner is.
template <kvfuse::Tier Inner>
class RankTier final : public TierControl {
 public:
  /// Builds Inner from what `make()` returns. Throws what Inner's construction throws.
  template <class Make>
  explicit RankTier(Make&& make) : inner_(std::forward<Make>(make)()) {}
  RankTier(const RankTier&) = delete;
  RankTier& operator=(const RankTier&) = delete;

  kvfuse::TierView get(const kvfuse::TierKey& key, std::span<std::byte> staging) noexcept {
    delay();
    if (key.kind == kvfuse::EntryKind::kv_chunk) {
      count(kv_reads_);
      count(kv_chunks_read_);
    } else {
      count(state_reads_);
    }
    return inner_.get(key, staging);
  }
  void get_batch(const kvfuse::TierKey& first, std::span<const kvfuse::PrefixHash> hashes, std::span<kvfuse::TierView> out,
                 kvfuse::BatchSink sink = {}) noexcept
    requires kvfuse::BatchedTier<Inner>
  {
    delay();
    if (first.kind == kvfuse::EntryKind::kv_chunk) {
      count(kv_reads_);
      count(kv_chunks_read_, hashes.size());
    } else {
      count(state_reads_);
    }
    inner_.get_batch(first, hashes, out, sink);
  }
  bool put(const kvfuse::TierKey& key, std::span<const std::byte> bytes) noexcept {
    count(puts_);
    const bool stored = inner_.put(key, bytes);
    if (stored && key.kind == kvfuse::EntryKind::state) {
      count(state_puts_);
      count(state_bytes_put_, bytes.size());
    }
    return stored;
  }
  bool contains(const kvfuse::TierKey& key) const noexcept override {
    count(contains_);
    return inner_.contains(key);
  }
  bool erase(const kvfuse::TierKey& key) noexcept override {
    count(erases_);
    return inner_.erase(key);
  }

  void set_delay(std::chrono::microseconds d) noexcept override {
    delay_us_.store(static_cast<std::uint32_t>(d.count()), std::memory_order_relaxed);
  }
  std::pair<std::size_t, std::size_t> reopen_disk() override {
    if constexpr (std::is_same_v<Inner, LocalTier>) return inner_.reopen_disk();
    else return {0, 0};
  }
  bool erase_from_memory(const kvfuse::TierKey& key) noexcept override {
    if constexpr (std::is_same_v<Inner, LocalTier>) return inner_.erase_from_memory(key);
    else return false;
  }
  std::filesystem::path disk_path(const kvfuse::TierKey& key) const override {
    if constexpr (std::is_same_v<Inner, LocalTier>) return inner_.disk_path(key);
    else return {};
  }
  TierSnapshot snapshot() const override {
    TierSnapshot s;
    s.calls = TierCalls{load(kv_reads_), load(kv_chunks_read_), load(state_reads_), load(puts_), load(contains_), load(erases_),
                       load(state_puts_), load(state_bytes_put_)};
    if constexpr (std::is_same_v<Inner, LocalTier>) {
      s.memory = inner_.memory_stats();
      s.disk = inner_.disk_stats();
      s.stack = inner_.stack_stats();
      s.quarantined = inner_.closed_disk_stats().quarantined + (s.disk ? s.disk->quarantined : 0);
    } else if constexpr (requires { { inner_.stats() } -> std::same_as<kvfuse::RedisTierStats>; }) {
      s.redis = inner_.stats();
    } else if constexpr (requires { { inner_.stats() } -> std::same_as<kvfuse::RedisClusterTierStats>; }) {
      const kvfuse::RedisClusterTierStats cluster = inner_.stats();
      s.redis = cluster.totals;
      s.cluster = cluster.cluster;
    }
    return s;
  }

  /// The wrapped tier.
  Inner& inner() noexcept { return inner_; }

 private:
  using Counter = std::atomic<std::uint64_t>;
  static void count(Counter& c, std::uint64_t n = 1) noexcept { c.fetch_add(n, std::memory_order_relaxed); }
  static std::uint64_t load(const Counter& c) noexcept { return c.load(std::memory_order_relaxed); }
  void delay() const noexcept {
    if (const auto us = delay_us_.load(std::memory_order_relaxed); us != 0)
      std::this_thread::sleep_for(std::chrono::microseconds(us));
  }

  Inner inner_;
  std::atomic<std::uint32_t> delay_us_{0};
  mutable Counter kv_reads_{0}, kv_chunks_read_{0}, state_reads_{0}, puts_{0}, contains_{0}, erases_{0}, state_puts_{0}, state_bytes_put_{0};
};

static_assert(!kvfuse::BatchedTier<RankTier<LocalTier>>);

}  // namespace replay
