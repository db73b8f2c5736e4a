// kvfuse/tier/redis_cluster_tier_stats.hpp — RedisClusterTierStats, the counters of a
// RedisClusterTier (the whole tier's and each node's), apart from the tier itself so that
// code which only reports them (compose/prometheus.hpp) does not need hiredis.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <kvfuse/tier/redis_tier_stats.hpp>

namespace kvfuse {

/// What the cluster tier did with one primary it has talked to. Plain data: a snapshot.
struct RedisClusterNodeStats {
  std::string address;              ///< `HOST:PORT` (the `node` label of its metrics)
  std::uint64_t requests = 0;       ///< commands sent to it (one per key; an ASKING is not counted)
  std::uint64_t round_trips = 0;    ///< exchanges with it: at most one per batch and retry round
  std::uint64_t redirections = 0;   ///< MOVED and ASK replies it gave
  std::uint64_t timeouts = 0;       ///< exchanges or connection attempts it did not answer in time
  std::uint64_t failures = 0;       ///< exchanges or connection attempts it refused or lost, and error replies
};

/// The cluster-only counters of a RedisClusterTier. Plain data: a snapshot.
struct RedisClusterCounters {
  std::uint64_t moved = 0;        ///< MOVED replies: the slot map was patched and the key retried at the named node
  std::uint64_t asks = 0;         ///< ASK replies: the key was retried with ASKING at the named node
  std::uint64_t tryagain = 0;     ///< TRYAGAIN replies (a slot mid-migration): a failed get or put
  std::uint64_t clusterdown = 0;  ///< CLUSTERDOWN replies, and keys whose slot no primary served: failed
  std::uint64_t redirect_failures = 0;  ///< keys redirected again on their one retry: failed
  std::uint64_t map_refreshes = 0;      ///< slot maps learnt (CLUSTER SLOTS answered), the constructor's included
  std::uint64_t map_refresh_failures = 0;  ///< refreshes no node could answer
};

/// Counters of a RedisClusterTier since construction (RedisClusterTier::stats()). Plain
/// data: a snapshot. `totals` sums the nodes in RedisTier's terms (round_trips counts every
/// node's exchange: a batch over three primaries is three); `nodes` lists every primary the
/// tier has known, in the order it met them.
struct RedisClusterTierStats {
  RedisTierStats totals;
  RedisClusterCounters cluster;
  std::vector<RedisClusterNodeStats> nodes;
};

}  // namespace kvfuse
