// kvfuse-replay: the engine's KV lookup, the Coordinator's question "how many leading chunks
// does the tier hold?". LMCache asks its first worker only; while saves are still landing on
// the other ranks that answer races them, and the quorum turns each race into a failed load
// and a recompute. Ranks as threads can afford to ask them all: the answer is the leading
// chunks every live rank holds.
#pragma once

#include "faults.hpp"
#include "ranks.hpp"
#include "transport.hpp"

#include <kvfuse/bridge/ids.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace replay {

/// Models KvLookup. After counting, the armed faults' lookup hooks run (the evict fault
/// strikes there, between the lookup and the load). Scheduler thread only.
class Lookup {
 public:
  Lookup(Ranks& ranks, const Transport& transport, TierKeys keys, const ArmedFaults& faults)
      : ranks_(ranks), transport_(transport), keys_(keys), faults_(faults) {}

  std::size_t operator()(std::span<const kvfuse::PrefixHash> keys) {
    std::size_t n = keys.size();
    for (std::uint32_t r = 0; r < ranks_.world() && n > 0; ++r) {
      if (!transport_.alive(r)) continue;
      tier_keys_.clear();
      for (std::size_t i = 0; i < n; ++i) tier_keys_.push_back(keys_.kv(keys[i], r));
      n = ranks_.tier(r).leading(tier_keys_);
    }
    if (n > 0) faults_.lookup(keys, n);
    return n;
  }

 private:
  Ranks& ranks_;
  const Transport& transport_;
  TierKeys keys_;
  const ArmedFaults& faults_;
  std::vector<kvfuse::TierKey> tier_keys_;  // one rank's question, asked in one call
};

}  // namespace replay
