// kvfuse-replay: one rank's tier, as an engine would deploy it on one machine — a bounded
// MemoryTier in front of a DiskTier in a directory of its own (TieredTier) — plus the knobs
// the faults need: a slow rank's latency, and closing and reopening the disk tier mid-run
// (a restart: the reopened DiskTier rebuilds its catalogue from the files, so what was stored
// before is served after). The lanes keep calling get/put while a reopen waits for them.
// With --tier redis the rank's tier is a RedisTier instead: one connection pool per rank
// to a redis-server every rank (and every engine) shares.
#pragma once

#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/tier/redis_tier_stats.hpp>
#include <kvfuse/tier/tiered_tier.hpp>
#if KVFUSE_REPLAY_WITH_REDIS
#include <kvfuse/tier/redis_tier.hpp>
#endif

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <thread>

namespace replay {

using MemoryFront = kvfuse::MemoryTier<>;
using Stack = kvfuse::TieredTier<MemoryFront, kvfuse::DiskTier>;

/// What one rank's tier is made of.
struct TierSpec {
  std::size_t memory_bytes = std::size_t{1} << 20;  ///< the memory tier's capacity
  std::optional<std::filesystem::path> disk;        ///< a DiskTier behind it, in this directory
#if KVFUSE_REPLAY_WITH_REDIS
  std::optional<kvfuse::RedisTierOptions> redis;    ///< instead of both: a RedisTier
#endif
};

/// The tier of one rank. Thread-safe (the Tier concept's promise): any lane may call
/// get/put/contains/erase while the scheduler thread reopens the disk.
class RankTier {
 public:
  /// Throws kvfuse::Error naming what could not be opened (a directory, a server).
  explicit RankTier(const TierSpec& spec) : front_(spec.memory_bytes), dir_(spec.disk) {
#if KVFUSE_REPLAY_WITH_REDIS
    if (spec.redis) {
      redis_ = std::make_unique<kvfuse::RedisTier>(*spec.redis);
      return;
    }
#endif
    open();
  }
  RankTier(const RankTier&) = delete;
  RankTier& operator=(const RankTier&) = delete;

  kvfuse::TierView get(const kvfuse::TierKey& key, std::span<std::byte> staging) noexcept {
    if (const auto us = delay_us_.load(std::memory_order_relaxed); us != 0)
      std::this_thread::sleep_for(std::chrono::microseconds(us));
#if KVFUSE_REPLAY_WITH_REDIS
    if (redis_) return redis_->get(key, staging);
#endif
    std::shared_lock lock(mu_);
    return stack_ ? stack_->get(key, staging) : front_.get(key, staging);
  }
  bool put(const kvfuse::TierKey& key, std::span<const std::byte> bytes) noexcept {
#if KVFUSE_REPLAY_WITH_REDIS
    if (redis_) return redis_->put(key, bytes);
#endif
    std::shared_lock lock(mu_);
    return stack_ ? stack_->put(key, bytes) : front_.put(key, bytes);
  }
  bool contains(const kvfuse::TierKey& key) const noexcept {
#if KVFUSE_REPLAY_WITH_REDIS
    if (redis_) return redis_->contains(key);
#endif
    std::shared_lock lock(mu_);
    return stack_ ? stack_->contains(key) : front_.contains(key);
  }
  bool erase(const kvfuse::TierKey& key) noexcept {
#if KVFUSE_REPLAY_WITH_REDIS
    if (redis_) return redis_->erase(key);
#endif
    std::shared_lock lock(mu_);
    return stack_ ? stack_->erase(key) : front_.erase(key);
  }

  /// Fault: every get sleeps this long first (a slow rank).
  void set_delay(std::chrono::microseconds d) noexcept { delay_us_.store(static_cast<std::uint32_t>(d.count())); }

  /// Fault: the disk tier closes and opens again over the same directory. Returns the
  /// catalogue size before, and after plus the files the opening scan quarantined (equal:
  /// nothing stored was lost; a corrupted file is dropped, never served). Scheduler thread.
  std::pair<std::size_t, std::size_t> reopen_disk() {
    std::unique_lock lock(mu_);
    if (!disk_) return {0, 0};
    const std::size_t before = disk_->stats().entries;
    stack_.reset();
    open();
    const auto after = disk_->stats();
    return {before, after.entries + after.quarantined};
  }

  /// Drops `key` from the memory front only (so the next get reads the disk file).
  bool erase_from_memory(const kvfuse::TierKey& key) noexcept { return front_.erase(key); }
  /// Where the disk file of `key` lives (empty for a memory-only tier).
  std::filesystem::path disk_path(const kvfuse::TierKey& key) const {
    std::shared_lock lock(mu_);
    return disk_ ? disk_->path_of(key) : std::filesystem::path{};
  }

  kvfuse::MemoryTierStats memory_stats() const noexcept { return front_.stats(); }
  std::optional<kvfuse::RedisTierStats> redis_stats() const noexcept {
#if KVFUSE_REPLAY_WITH_REDIS
    if (redis_) return redis_->stats();
#endif
    return std::nullopt;
  }
  std::optional<kvfuse::DiskTierStats> disk_stats() const noexcept {
    std::shared_lock lock(mu_);
    if (!disk_) return std::nullopt;
    return disk_->stats();
  }
  std::optional<kvfuse::TieredTierStats> stack_stats() const noexcept {
    std::shared_lock lock(mu_);
    if (!stack_) return std::nullopt;
    return stack_->stats();
  }
  /// Disk counters of the DiskTier objects this tier closed (a reopen starts them at zero).
  const kvfuse::DiskTierStats& closed_disk_stats() const noexcept { return closed_; }

 private:
  void open() {
    if (!dir_) return;
    if (disk_) {
      const auto s = disk_->stats();
      closed_.quarantined += s.quarantined;
      closed_.get_failures += s.get_failures;
      closed_.puts += s.puts;
      closed_.io_errors += s.io_errors;
    }
    disk_.reset();
    disk_ = std::make_unique<kvfuse::DiskTier>(*dir_);
    stack_ = std::make_unique<Stack>(front_, *disk_);
  }

  mutable std::shared_mutex mu_;  // shared: every tier call; exclusive: reopen
  MemoryFront front_;
  std::optional<std::filesystem::path> dir_;
  std::unique_ptr<kvfuse::DiskTier> disk_;
  std::unique_ptr<Stack> stack_;
#if KVFUSE_REPLAY_WITH_REDIS
  std::unique_ptr<kvfuse::RedisTier> redis_;
#endif
  kvfuse::DiskTierStats closed_{};
  std::atomic<std::uint32_t> delay_us_{0};
};

}  // namespace replay
