// tier_stack.hpp — the tiers kvfuse-llama-server's flags ask for, chosen at run time: a
// memory tier (--kvfuse-memory), then a disk tier (--kvfuse-disk), then a Redis server or a
// Redis Cluster (--kvfuse-redis ADDR, or cluster:SEED[,SEED...]), each behind the one before
// it (TieredTier: a get falls through and the hit is copied to the front; a put goes to the
// back and the front).
//
// The SlotCache is a template over its tier; one TierStack type serves every combination
// through a small virtual interface, so the three models are compiled once each rather than
// once per combination. --kvfuse-disk-size is the disk tier's own capacity: beyond it the
// least recently used files are deleted (DiskTierOptions::capacity_bytes), and a restart
// keeps that order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/tier/tier.hpp>
#include <kvfuse/tier/tiered_tier.hpp>
#if KVFUSE_LLAMA_SERVER_REDIS
#include <kvfuse/tier/redis_cluster_tier.hpp>
#include <kvfuse/tier/redis_tier.hpp>
#endif

namespace kvfuse::llama_server {

/// What a TierStack is built from. Plain data.
struct TierStackOptions {
  std::size_t memory_bytes = std::size_t{256} << 20;  ///< the memory tier's capacity
  std::optional<std::filesystem::path> disk;          ///< a disk tier in this directory
  std::optional<std::size_t> disk_bytes;              ///< the disk tier's capacity (none: unbounded)
  std::optional<std::string> redis;                   ///< a Redis server at this address, or `cluster:` and seeds, last
  std::string redis_prefix = "kvfuse-llama-server:";  ///< every Redis key starts with it
};

/// Counters of a TierStack, for /metrics. Plain data.
struct TierStackStats {
  MemoryTierStats memory;
  std::uint64_t disk_entries = 0, disk_bytes = 0, disk_evictions = 0;
  bool has_disk = false, has_redis = false, redis_cluster = false;
  std::uint64_t redis_hits = 0, redis_misses = 0, redis_failures = 0, redis_timeouts = 0, redis_put_failures = 0;
};

/// The tiers, front to back. Satisfies kvfuse's Tier concept; every call is thread-safe and
/// noexcept as the concept asks. Construction throws Error naming the flag and the value: a
/// disk directory that cannot be used (io_failure), a Redis that does not answer
/// (io_failure), a Redis asked of a build without hiredis (invalid_argument).
class TierStack {
 public:
  explicit TierStack(const TierStackOptions& o) : memory_(o.memory_bytes) {
    if (o.disk) {
      try {
        DiskTierOptions d;
        d.capacity_bytes = o.disk_bytes;
        disk_ = std::make_unique<DiskTier>(*o.disk, d);
      } catch (const Error& e) {
        throw Error(ErrorCode::io_failure, "--kvfuse-disk " + o.disk->string() + ": " + e.what());
      }
    }
    if (o.redis) {
#if KVFUSE_LLAMA_SERVER_REDIS
      try {
        constexpr std::string_view cluster = "cluster:";
        if (std::string_view(*o.redis).substr(0, cluster.size()) == cluster) {
          RedisClusterTierOptions r;
          r.add_seeds(std::string_view(*o.redis).substr(cluster.size()));
          r.key_prefix = o.redis_prefix;
          redis_ = std::make_unique<RemoteOf<RedisClusterTier>>(std::move(r));
        } else {
          RedisTierOptions r;
          r.set_address(*o.redis);
          r.key_prefix = o.redis_prefix;
          redis_ = std::make_unique<RemoteOf<RedisTier>>(std::move(r));
        }
        (void)redis_->keys(EntryKind::state);  // answers, or throws: checked before the model loads
      } catch (const Error& e) {
        throw Error(ErrorCode::io_failure, "--kvfuse-redis " + *o.redis + ": " + e.what());
      }
#else
      throw Error(ErrorCode::invalid_argument,
                  "--kvfuse-redis " + *o.redis + ": this kvfuse-llama-server was built without hiredis (apt-get install libhiredis-dev)");
#endif
    }
    if (disk_ && redis_) {
      disk_redis_ = std::make_unique<TieredTier<DiskTier, Redis>>(*disk_, redis_link_);
      chain_ = std::make_unique<Chain<TieredTier<MemoryTier<>, TieredTier<DiskTier, Redis>>>>(memory_, *disk_redis_);
    } else if (disk_) {
      chain_ = std::make_unique<Chain<TieredTier<MemoryTier<>, DiskTier>>>(memory_, *disk_);
    } else if (redis_) {
      chain_ = std::make_unique<Chain<TieredTier<MemoryTier<>, Redis>>>(memory_, redis_link_);
    } else {
      chain_ = std::make_unique<Alone>(memory_);
    }
  }
  TierStack(const TierStack&) = delete;
  TierStack& operator=(const TierStack&) = delete;

  /// The Tier concept (tier.hpp): any thread, noexcept.
  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept { return chain_->get(key, staging); }
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept { return chain_->put(key, bytes); }
  bool contains(const TierKey& key) const noexcept { return chain_->contains(key); }
  bool erase(const TierKey& key) noexcept { return chain_->erase(key); }
  /// Every key of `kind` the tiers hold (a restart re-seeds its index from them). Throws
  /// what a tier's keys() throws. Any thread; start-up only.
  std::vector<TierKey> keys(EntryKind kind) const { return chain_->keys(kind); }

  /// The tiers' counters, read now. Any thread.
  [[nodiscard]] TierStackStats stats() const {
    TierStackStats s;
    s.memory = memory_.stats();
    if (disk_) {
      const DiskTierStats d = disk_->stats();
      s.has_disk = true;
      s.disk_entries = d.entries;
      s.disk_bytes = d.bytes;
      s.disk_evictions = d.evictions;
    }
#if KVFUSE_LLAMA_SERVER_REDIS
    if (redis_) {
      const RedisTierStats r = redis_->stats();
      s.has_redis = true;
      s.redis_cluster = redis_->cluster();
      s.redis_hits = r.hits;
      s.redis_misses = r.misses;
      s.redis_failures = r.get_failures;
      s.redis_timeouts = r.timeouts;
      s.redis_put_failures = r.put_failures;
    }
#endif
    return s;
  }

  /// The disk tier, if any (tests tamper with its files through the key names).
  [[nodiscard]] DiskTier* disk() noexcept { return disk_.get(); }

 private:
  // The Redis at the back: one redis-server or a cluster, known only at run time, so it
  // sits behind a small virtual interface like the chain does.
  struct RedisImpl {
    virtual ~RedisImpl() = default;
    virtual TierView get(const TierKey&, std::span<std::byte>) noexcept = 0;
    virtual bool put(const TierKey&, std::span<const std::byte>) noexcept = 0;
    virtual bool contains(const TierKey&) const noexcept = 0;
    virtual bool erase(const TierKey&) noexcept = 0;
    virtual std::vector<TierKey> keys(EntryKind) const = 0;
#if KVFUSE_LLAMA_SERVER_REDIS
    virtual RedisTierStats stats() const = 0;  // a cluster's: its totals over every node
    virtual bool cluster() const noexcept = 0;
#endif
  };
#if KVFUSE_LLAMA_SERVER_REDIS
  template <class T>
  struct RemoteOf final : RedisImpl {
    T tier;
    template <class Options>
    explicit RemoteOf(Options o) : tier(std::move(o)) {}
    TierView get(const TierKey& k, std::span<std::byte> staging) noexcept override { return tier.get(k, staging); }
    bool put(const TierKey& k, std::span<const std::byte> b) noexcept override { return tier.put(k, b); }
    bool contains(const TierKey& k) const noexcept override { return tier.contains(k); }
    bool erase(const TierKey& k) noexcept override { return tier.erase(k); }
    std::vector<TierKey> keys(EntryKind kind) const override { return tier.keys(kind); }
    RedisTierStats stats() const override {
      if constexpr (std::is_same_v<T, RedisClusterTier>) return tier.stats().totals;
      else return tier.stats();
    }
    bool cluster() const noexcept override { return std::is_same_v<T, RedisClusterTier>; }
  };
#endif

  // The Redis tier behind another, asked one entry at a time: TieredTier refuses a batched
  // back (it would silently lose the batching), so the loss is spelled out here. Behind the
  // memory tier most hits never reach it.
  struct Redis {
    TierStack* s;
    TierView get(const TierKey& k, std::span<std::byte> staging) noexcept { return s->redis_->get(k, staging); }
    bool put(const TierKey& k, std::span<const std::byte> bytes) noexcept { return s->redis_->put(k, bytes); }
    bool contains(const TierKey& k) const noexcept { return s->redis_->contains(k); }
    bool erase(const TierKey& k) noexcept { return s->redis_->erase(k); }
    std::vector<TierKey> keys(EntryKind kind) const { return s->redis_->keys(kind); }
  };

  struct Link {
    virtual ~Link() = default;
    virtual TierView get(const TierKey&, std::span<std::byte>) noexcept = 0;
    virtual bool put(const TierKey&, std::span<const std::byte>) noexcept = 0;
    virtual bool contains(const TierKey&) const noexcept = 0;
    virtual bool erase(const TierKey&) noexcept = 0;
    virtual std::vector<TierKey> keys(EntryKind) const = 0;
  };
  template <class C>
  struct Chain final : Link {
    C tiers;
    template <class F, class B>
    Chain(F& front, B& back) : tiers(front, back) {}
    TierView get(const TierKey& k, std::span<std::byte> staging) noexcept override { return tiers.get(k, staging); }
    bool put(const TierKey& k, std::span<const std::byte> b) noexcept override { return tiers.put(k, b); }
    bool contains(const TierKey& k) const noexcept override { return tiers.contains(k); }
    bool erase(const TierKey& k) noexcept override { return tiers.erase(k); }
    std::vector<TierKey> keys(EntryKind kind) const override { return tiers.keys(kind); }
  };
  struct Alone final : Link {
    MemoryTier<>& m;
    explicit Alone(MemoryTier<>& memory) : m(memory) {}
    TierView get(const TierKey& k, std::span<std::byte> staging) noexcept override { return m.get(k, staging); }
    bool put(const TierKey& k, std::span<const std::byte> b) noexcept override { return m.put(k, b); }
    bool contains(const TierKey& k) const noexcept override { return m.contains(k); }
    bool erase(const TierKey& k) noexcept override { return m.erase(k); }
    std::vector<TierKey> keys(EntryKind) const override { return {}; }  // nothing outlives the process
  };

  MemoryTier<> memory_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<RedisImpl> redis_;
  Redis redis_link_{this};
  std::unique_ptr<TieredTier<DiskTier, Redis>> disk_redis_;
  std::unique_ptr<Link> chain_;
};

}  // namespace kvfuse::llama_server
