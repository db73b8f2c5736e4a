// kvfuse/bridge/load_request.hpp — the plain data that crosses from engine to rank.
//
// A LoadRequest is produced once, by LoadTicket::dispatch, and shipped to every rank by
// whatever transport the engine uses. It carries only what the ranks need: never the
// whole prompt, never a zero-length KV sentinel (R10).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <kvfuse/bridge/ids.hpp>

namespace kvfuse {

/// The KV leg of a load: fill tokens [hbm, end) of the request's paged KV from the tier.
///
/// Chunk i of `chunk_keys` is chunk number floor(hbm / chunk_tokens) + i of the prompt;
/// the keys cover every chunk that overlaps [hbm, end). Block i of `blocks` holds tokens
/// [(floor(hbm / block_tokens) + i) * block_tokens, ... + block_tokens) and the blocks
/// cover [hbm, end). The engine computes both once; ranks only read them.
struct KvSpec {
  TokenCount hbm = 0;                  ///< tokens already resident on the device (the HBM floor)
  TokenCount end = 0;                  ///< one past the last token to load; on the chunk grid
  std::vector<PrefixHash> chunk_keys;  ///< tier keys of the chunks covering [hbm, end)
  std::vector<BlockId> blocks;         ///< destination blocks covering [hbm, end)
  friend bool operator==(const KvSpec&, const KvSpec&) = default;
};

/// The state leg of a load: copy the state checkpoint at `boundary_tokens` into `slot`.
///
/// The grids the engine used travel with the spec so a rank that disagrees refuses the
/// leg instead of silently restoring the wrong checkpoint (R11).
struct StateSpec {
  TokenCount boundary_tokens = 0;    ///< B: where the checkpoint was taken; on the checkpoint grid
  PrefixHash boundary_hash;          ///< tier key of the checkpoint
  SlotId slot;                       ///< destination slot in the rank's slot pool
  std::uint32_t block_tokens = 16;   ///< the engine's checkpoint grid
  std::uint32_t chunk_tokens = 256;  ///< the engine's chunk grid
  friend bool operator==(const StateSpec&, const StateSpec&) = default;
};

/// One load, as dispatched to every rank. At least one of `kv`, `state` is present:
/// KV-only, joint, or state-only (kv empty: no token ids, no block table; R10).
struct LoadRequest {
  LoadKey key;
  std::optional<KvSpec> kv;
  std::optional<StateSpec> state;
  friend bool operator==(const LoadRequest&, const LoadRequest&) = default;
};

}  // namespace kvfuse
