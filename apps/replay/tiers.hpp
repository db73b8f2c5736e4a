// kvfuse-replay: the tier table. Each --tier choice is one entry: its name, what it is,
// whether it keeps files on disk (what the reopen and corrupt faults act on), and how rank r
// builds it. The entry's type is the tier the ranks' legs are compiled against: entries of
// one type share their connector instantiations (models.cpp builds one per model and type).
#pragma once

#include "local_tier.hpp"
#include "rank_tier.hpp"

#if KVFUSE_REPLAY_WITH_REDIS
#include <kvfuse/tier/redis_cluster_tier.hpp>
#include <kvfuse/tier/redis_tier.hpp>
#endif

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace replay {

/// What one rank's tier is built from: the command line's choices, then each fault's tier
/// set-up for that rank.
struct TierOptions {
  std::size_t memory_bytes = std::size_t{1} << 20;  ///< a memory tier's capacity
  std::filesystem::path dir;                        ///< the pass's directory: rank r's files live in dir/rank<r>
  std::string pass;                                 ///< names the pass: a shared server keeps each pass's keys apart
#if KVFUSE_REPLAY_WITH_REDIS
  std::optional<kvfuse::RedisTierOptions> redis;    ///< --redis
  std::optional<kvfuse::RedisClusterTierOptions> redis_cluster;  ///< --tier redis-cluster:SEED[,SEED...]
#endif
};

/// A --tier choice, whatever its type.
struct TierKind {
  std::string_view name;  ///< --tier
  std::string_view what;  ///< --help and the report's first line
  bool disk = false;      ///< keeps files on disk: the reopen and corrupt faults act on them
};

/// A --tier choice whose ranks hold a RankTier<Inner>, rank r's Inner made by make(options, r).
template <class Inner>
struct TierEntry : TierKind {
  Inner (*make)(const TierOptions& options, std::uint32_t rank);
};

/// The tier table.
inline const auto tier_table = std::tuple{
    TierEntry<LocalTier>{{"memory+disk", "a MemoryTier in front of a DiskTier", true},
                         [](const TierOptions& o, std::uint32_t rank) {
                           return LocalTier(o.memory_bytes, o.dir / ("rank" + std::to_string(rank)));
                         }},
    TierEntry<LocalTier>{{"memory", "a MemoryTier", false},
                         [](const TierOptions& o, std::uint32_t) { return LocalTier(o.memory_bytes, std::nullopt); }},
#if KVFUSE_REPLAY_WITH_REDIS
    TierEntry<kvfuse::RedisTier>{{"redis", "a RedisTier on the server --redis names", false},
                                 [](const TierOptions& o, std::uint32_t) {
                                   kvfuse::RedisTierOptions r = o.redis.value();
                                   r.key_prefix += o.pass + ":";
                                   return kvfuse::RedisTier(r);
                                 }},
    TierEntry<kvfuse::RedisClusterTier>{{"redis-cluster", "a RedisClusterTier on the cluster of redis-cluster:SEED[,SEED...]", false},
                                        [](const TierOptions& o, std::uint32_t) {
                                          kvfuse::RedisClusterTierOptions r = o.redis_cluster.value();
                                          r.key_prefix += o.pass + ":";
                                          return kvfuse::RedisClusterTier(r);
                                        }},
#endif
};

#if KVFUSE_REPLAY_WITH_REDIS
// A remote tier answers a KV load in one round trip only if the ranks' wrapper keeps get_batch.
static_assert(kvfuse::BatchedTier<kvfuse::RedisTier> && kvfuse::BatchedTier<RankTier<kvfuse::RedisTier>>);
static_assert(kvfuse::BatchedTier<RankTier<kvfuse::RedisClusterTier>>);
#endif

inline constexpr std::size_t tier_count = std::tuple_size_v<std::remove_cvref_t<decltype(tier_table)>>;

/// Calls f(entry) on entry `index` of the tier table; returns what it returns.
template <class F>
decltype(auto) with_tier(std::size_t index, F&& f) {
  using Result = decltype(f(std::get<0>(tier_table)));
  return [&]<std::size_t... I>(std::index_sequence<I...>) -> Result {
    std::optional<Result> out;
    ((I == index ? (void)out.emplace(f(std::get<I>(tier_table))) : void()), ...);
    return std::move(out).value();
  }(std::make_index_sequence<tier_count>{});
}

/// Every entry's kind, in table order.
inline std::vector<TierKind> tier_kinds() {
  std::vector<TierKind> kinds;
  std::apply([&](const auto&... entry) { (kinds.push_back(entry), ...); }, tier_table);
  return kinds;
}

}  // namespace replay
