// kvfuse/tier/redis_tier_stats.hpp — RedisTierStats, the counters of a RedisTier, apart
// from the tier itself so that code which only reports them (compose/prometheus.hpp) does
// not need hiredis.
#pragma once

#include <cstdint>

namespace kvfuse {

/// Counters of a RedisTier since construction (RedisTier::stats()). Plain data: a snapshot.
struct RedisTierStats {
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;        ///< absent keys (GET answered nil)
  std::uint64_t rejected = 0;      ///< values that failed the entry check: served as misses, never as hits
  std::uint64_t get_failures = 0;  ///< gets answered failed (I/O error, server error, a connection refused)
  std::uint64_t timeouts = 0;      ///< gets answered timed_out (no reply in time, or a connect or its PING timed out)
  std::uint64_t puts = 0;          ///< successful puts
  std::uint64_t put_failures = 0;  ///< puts the server refused (OOM, ...) or that could not be sent or confirmed
  std::uint64_t round_trips = 0;   ///< exchanges sent: one per get, get_batch, put, contains, erase, SCAN page
  std::uint64_t connects = 0;      ///< connections opened (the constructor's included)
  std::uint64_t connect_failures = 0;   ///< connection attempts refused or failed (no socket, error reply, ...)
  std::uint64_t connect_timeouts = 0;   ///< connection attempts whose connect or set-up got no answer in time
  std::uint64_t dropped_connections = 0;  ///< connections closed after a failure or a timeout, or retired as stale
};

}  // namespace kvfuse
