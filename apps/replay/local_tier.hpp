// kvfuse-replay: a rank's tier on its own machine, as an engine would deploy it — a bounded
// MemoryTier, alone or in front of a DiskTier in a directory of its own (TieredTier) — plus
// what the faults need: closing and reopening the disk tier mid-run (a restart: the reopened
// DiskTier rebuilds its catalogue from the files, so what was stored before is served
// after), and reaching the disk file behind a key. The lanes keep calling get/put while a
// reopen waits for them.
#pragma once

#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/tier/tiered_tier.hpp>

#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <utility>

namespace replay {

/// A MemoryTier, with a DiskTier behind it when given a directory. Not a BatchedTier (neither
/// of its parts is). Thread-safe (the Tier concept's promise): any lane may call
/// get/put/contains/erase while the scheduler thread reopens the disk.
class LocalTier {
 public:
  using MemoryFront = kvfuse::MemoryTier<>;
  using Stack = kvfuse::TieredTier<MemoryFront, kvfuse::DiskTier>;

  /// A memory tier of `memory_bytes`, in front of a disk tier in `disk` when given. Throws
  /// kvfuse::Error naming a directory that cannot be opened.
  LocalTier(std::size_t memory_bytes, std::optional<std::filesystem::path> disk) : front_(memory_bytes), dir_(std::move(disk)) {
    open();
  }
  LocalTier(const LocalTier&) = delete;
  LocalTier& operator=(const LocalTier&) = delete;

  kvfuse::TierView get(const kvfuse::TierKey& key, std::span<std::byte> staging) noexcept {
    std::shared_lock lock(mu_);
    return stack_ ? stack_->get(key, staging) : front_.get(key, staging);
  }
  bool put(const kvfuse::TierKey& key, std::span<const std::byte> bytes) noexcept {
    std::shared_lock lock(mu_);
    return stack_ ? stack_->put(key, bytes) : front_.put(key, bytes);
  }
  bool contains(const kvfuse::TierKey& key) const noexcept {
    std::shared_lock lock(mu_);
    return stack_ ? stack_->contains(key) : front_.contains(key);
  }
  bool erase(const kvfuse::TierKey& key) noexcept {
    std::shared_lock lock(mu_);
    return stack_ ? stack_->erase(key) : front_.erase(key);
  }

  /// The disk tier closes and opens again over the same directory. Returns the catalogue
  /// size before, and after plus the files the opening scan quarantined (equal: nothing
  /// stored was lost; a corrupted file is dropped, never served). {0, 0} without a disk.
  /// Scheduler thread; blocks until no lane is inside the tier.
  std::pair<std::size_t, std::size_t> reopen_disk() {
    std::unique_lock lock(mu_);
    if (!disk_) return {0, 0};
    const std::size_t before = disk_->stats().entries;
    stack_.reset();
    open();
    const auto after = disk_->stats();
    return {before, after.entries + after.quarantined};
  }

  /// Drops `key` from the memory front only (so the next get reads the disk file). Any thread.
  bool erase_from_memory(const kvfuse::TierKey& key) noexcept { return front_.erase(key); }
  /// Where the disk file of `key` lives (empty without a disk). Any thread.
  std::filesystem::path disk_path(const kvfuse::TierKey& key) const {
    std::shared_lock lock(mu_);
    return disk_ ? disk_->path_of(key) : std::filesystem::path{};
  }

  kvfuse::MemoryTierStats memory_stats() const noexcept { return front_.stats(); }
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
  kvfuse::DiskTierStats closed_disk_stats() const noexcept {
    std::shared_lock lock(mu_);
    return closed_;
  }

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
  kvfuse::DiskTierStats closed_{};
};

static_assert(kvfuse::UnbatchedTier<LocalTier>);

}  // namespace replay
