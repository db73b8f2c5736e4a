// kvfuse/bridge/save_request.hpp — the plain data of a save, engine to rank (docs/reference.md#save-path).
#pragma once

#include <vector>

#include <kvfuse/bridge/ids.hpp>

namespace kvfuse {

/// What a save holds. OffloadIndex::request_save knows it from the save's type (KvSave or
/// StateSave): a save record does not carry it, and the index is the one owner of what
/// each outstanding save was.
enum class SaveKind : std::uint8_t {
  state = 0,  ///< a state checkpoint: its hash is indexed when every rank stored it
  kv = 1,     ///< KV chunks: tracked and counted, never put in the state-hash set
};

/// Save whole chunks of a request's prefix. `chunk_keys` are the prefix hashes of the
/// chunks to save, in prompt order (the tier keys a chunk by that hash alone, so no
/// position travels); `blocks` hold those chunks' tokens in order, chunk_tokens /
/// block_tokens blocks per chunk. `key.hash` names the save (usually the last chunk's
/// key); OffloadIndex::request_save issues the generation.
struct KvSave {
  SaveKey key;
  std::vector<PrefixHash> chunk_keys;
  std::vector<BlockId> blocks;
  friend bool operator==(const KvSave&, const KvSave&) = default;
};

/// Save the state checkpoint held in `source` at `boundary_tokens` under `key.hash`.
struct StateSave {
  SaveKey key;
  SlotId source;
  TokenCount boundary_tokens = 0;
  friend bool operator==(const StateSave&, const StateSave&) = default;
};

}  // namespace kvfuse
