// kvfuse-replay: the engine's cache ledger (--cache-policy) over the ranks' tiers. The pass
// hands every save to a kvfuse::CacheKeeper first (host/cache_keeper.hpp); what the ledger
// evicts is erased from every live rank's tier, and a checkpoint from the index too, so the
// index never serves what the tiers dropped and the tiers keep nothing the ledger does not
// count. Scheduler thread only.
#pragma once

#include "content.hpp"
#include "models.hpp"
#include "ranks.hpp"
#include "transport.hpp"

#include <kvfuse/host/cache_keeper.hpp>
#include <kvfuse/kvfuse.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace replay {

/// Every live rank's tier as the cache ledger sees it: what it evicts leaves each of them,
/// and a checkpoint the index; an entry is held when every live rank holds it.
struct EveryRankTier {
  Ranks* ranks;
  const Transport* transport;
  TierKeys keys;
  kvfuse::OffloadIndex<>* index;

  void erase(const kvfuse::CacheKey& k) {
    for (std::uint32_t r = 0; r < ranks->world(); ++r)
      if (transport->alive(r)) (void)ranks->tier(r).erase(key(k, r));
    if (k.kind == kvfuse::EntryKind::state) (void)index->forget(k.hash);
  }
  [[nodiscard]] bool holds(const kvfuse::CacheKey& k) const {
    for (std::uint32_t r = 0; r < ranks->world(); ++r)
      if (transport->alive(r) && !ranks->tier(r).contains(key(k, r))) return false;
    return true;
  }
  [[nodiscard]] kvfuse::TierKey key(const kvfuse::CacheKey& k, std::uint32_t r) const {
    return k.kind == kvfuse::EntryKind::state ? keys.state(k.hash, r) : keys.kv(k.hash, r);
  }
};

/// The pass's keeper: off without --cache-policy.
using CacheOwner = kvfuse::CacheKeeper<EveryRankTier>;

/// One rank's KV of a chunk: what a chunk costs the budget (every rank holds the same entries).
inline constexpr std::uint64_t kv_chunk_bytes = std::uint64_t{chunk_tokens} * kv_bytes_per_token;

/// The keeper's options for `model`: `policy` empty, off. A checkpoint counts one rank's
/// state slot at `state_scale`; a state of up to two chunks' KV comes in on first sight;
/// a dense model's KV comes in on second sight (docs/replay.md#cache-policy).
inline kvfuse::CacheKeeperOptions cache_options(std::optional<kvfuse::CachePolicy> policy, std::uint64_t budget,
                                                const Model& model, std::uint32_t state_scale) {
  kvfuse::CacheKeeperOptions o;
  if (policy) o.ledger = kvfuse::CacheLedgerOptions{*policy, budget, std::size_t{1} << 16, 2 * kv_chunk_bytes, !model.stateful};
  o.chunk_tokens = chunk_tokens;
  o.kv_chunk_bytes = kv_chunk_bytes;
  o.state_bytes = std::uint64_t{state_scale} * default_slot_bytes;
  o.stateful = model.stateful;
  return o;
}

}  // namespace replay
