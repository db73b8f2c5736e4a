// kvfuse/engine/reseed.hpp — rebuilding the index's state hashes after a restart (R18).
//
// The index lives in the engine process and starts empty; a DiskTier rebuilds its own
// catalogue from its directory. A state hash may be indexed only if EVERY rank can serve
// it (the same rule settle_save applies to a fresh save), so re-seeding intersects the
// ranks' catalogues rather than trusting any one of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/tier/tier.hpp>

namespace kvfuse {

/// Calls index.note_stored(hash) for every state hash of `model` at `world_size` that all
/// ranks 0 .. world_size-1 hold, given each rank's state keys (e.g. DiskTier::keys(
/// EntryKind::state) per rank, in any order, possibly one list holding several ranks).
/// Returns how many hashes were indexed. Keys of other models, world sizes, kinds or
/// out-of-range ranks are ignored. Scheduler thread, at start-up; allocates.
template <class Index, class KeyLists>
std::size_t reseed_state_hashes(Index& index, const KeyLists& per_rank_keys, std::uint64_t model,
                                std::uint32_t world_size) {
  if (world_size == 0 || world_size > 64) return 0;
  const std::uint64_t all = world_size == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << world_size) - 1;
  std::unordered_map<PrefixHash, std::uint64_t> ranks_holding;
  for (const auto& keys : per_rank_keys)
    for (const TierKey& k : keys)
      if (k.kind == EntryKind::state && k.model == model && k.world_size == world_size && k.rank < world_size)
        ranks_holding[k.hash] |= std::uint64_t{1} << k.rank;
  std::size_t indexed = 0;
  for (const auto& [hash, mask] : ranks_holding) {
    if (mask != all) continue;
    index.note_stored(hash);
    ++indexed;
  }
  return indexed;
}

}  // namespace kvfuse
