// in_process.hpp — what an engine loop whose one rank is a connector in its own process
// hands its Coordinator: the transport (every ticket goes straight to the connector) and the
// tier lookup (how many leading chunks the rank's tier holds). kvfuse::llama::Server and
// kvfuse-llama-server's SlotCache are two such loops; both use these.
#pragma once

#include <cstddef>
#include <functional>
#include <span>

#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/save_request.hpp>
#include <kvfuse/engine/cache_ledger.hpp>
#include <kvfuse/engine/offload_index.hpp>
#include <kvfuse/tier/tier.hpp>
#include <kvfuse/worker/rank_geometry.hpp>

namespace kvfuse::llama::detail {

/// The tier key of a KV chunk or a state entry of `g`'s model and rank. Any thread.
[[nodiscard]] inline TierKey tier_key_of(const RankGeometry& g, PrefixHash hash, EntryKind kind) noexcept {
  return TierKey{g.model, hash, g.world_size, g.rank, kind};
}

/// The Coordinator's transport to a connector in the same process: a send is the connector's
/// call, so it never fails. `on_load`, when it points at a set function, sees each
/// LoadRequest first (tests tamper with the tier there). Scheduler thread only.
template <class Conn>
struct InProcessTransport {
  Conn* connector;
  const std::function<void(const LoadRequest&)>* on_load = nullptr;
  bool send(const LoadRequest& r) {
    if (on_load != nullptr && *on_load) (*on_load)(r);
    connector->load(r);
    return true;
  }
  bool send(const KvSave& s) {
    connector->save_kv(s);
    return true;
  }
  bool send(const StateSave& s) {
    if constexpr (Conn::has_state) connector->save_state(s);
    return Conn::has_state;
  }
};

/// The Coordinator's tier lookup: how many of `keys`, from the first, the rank's tier holds
/// as KV chunks. Scheduler thread (the tier itself is thread-safe).
template <class Tier>
struct LeadingChunks {
  const Tier* tier;
  const RankGeometry* geometry;
  std::size_t operator()(std::span<const PrefixHash> keys) const {
    std::size_t n = 0;
    while (n < keys.size() && tier->contains(tier_key_of(*geometry, keys[n], EntryKind::kv_chunk))) ++n;
    return n;
  }
};

/// The rank's tier as a cache ledger sees it (CacheKeeper's CacheTiers): what the ledger
/// evicts leaves the tier (every level of a tiered one), and a checkpoint the index too.
/// Scheduler thread (the tier is thread-safe).
template <class Tier>
struct LedgerTier {
  Tier* tier;
  const RankGeometry* geometry;
  OffloadIndex<>* index;
  void erase(const CacheKey& k) {
    (void)tier->erase(tier_key_of(*geometry, k.hash, k.kind));
    if (k.kind == EntryKind::state) (void)index->forget(k.hash);
  }
  [[nodiscard]] bool holds(const CacheKey& k) const { return tier->contains(tier_key_of(*geometry, k.hash, k.kind)); }
};

}  // namespace kvfuse::llama::detail
