// slot_cache_options.hpp — what a SlotCache (slot_cache.hpp) is built from and what it
// reports: its options and their checks, the rank geometry they give, a begin()'s Restore and
// the cache's counters. Plain data and pure functions; any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <kvfuse/kvfuse.hpp>
#include <kvfuse/llama/blob_codec.hpp>
#include <kvfuse/llama/serving.hpp>

namespace kvfuse::llama_server {

using llama::LoadKind;

/// How a SlotCache is built. Plain data; the constructor checks it.
struct SlotCacheOptions {
  std::uint64_t model_id = 0;          ///< in every tier key: names what decides a saved byte
  std::uint32_t chunk_tokens = 256;    ///< tokens per tier chunk, and per block (the boundary grid)
  std::uint32_t slots = 1;             ///< llama-server's slots (--parallel)
  TokenCount max_prompt_tokens = 4096; ///< the longest prompt a slot holds (its context)
  std::uint32_t snapshot_slots = 4;    ///< slots for mid-prefill checkpoints while the ranks save them
  CheckpointPolicy checkpoints{};      ///< where stateful prompts take state checkpoints
  /// A stateful prompt may resume only at boundaries b with b % state_period == state_phase
  /// (0 and 0: every block boundary). See kvfuse_backend.cpp for deepseek4's.
  TokenCount state_period = 0, state_phase = 0;

  /// Whether a state may be resumed at boundary `b` (the rule above).
  [[nodiscard]] constexpr bool state_allowed(TokenCount b) const noexcept {
    return state_period == 0 || b % state_period == state_phase;
  }
  /// The last boundary at or below `b` that state_allowed, on a grid of `grid` tokens when
  /// every boundary is allowed (0: none).
  [[nodiscard]] constexpr TokenCount state_floor(TokenCount b, TokenCount grid) const noexcept {
    if (state_period == 0) return b / grid * grid;
    return b < state_phase ? 0 : state_phase + (b - state_phase) / state_period * state_period;
  }
  std::chrono::milliseconds rank_timeout{10000};  ///< how long a load or a save may take before it is given up
  /// A cache ledger owns `cache_budget` bytes of the tier and decides what it keeps by this
  /// policy (--kvfuse-cache-policy); empty: the tier's own capacity decides.
  std::optional<CachePolicy> cache_policy;
  std::uint64_t cache_budget = 0;  ///< bytes; > 0 with a policy
};

/// What begin() found for a slot's prompt.
struct Restore {
  TokenCount boundary = 0;            ///< tokens the load brought back (0: none)
  LoadKind load = LoadKind::none;     ///< the load the admission parked on
  std::optional<Resolution> outcome;  ///< how it ended
  bool stranded = false;              ///< the rank did not answer in time
  std::vector<std::uint8_t> blob;     ///< the FULL one-stream blob at `boundary` (empty when 0)
};

/// Counters of a SlotCache, for /metrics. Plain data.
struct SlotCacheCounters {
  std::uint64_t tasks = 0;               ///< begin() calls
  std::uint64_t restores = 0;            ///< begin()s that brought tokens back
  std::uint64_t restored_tokens = 0;     ///< tokens those loads brought back
  std::uint64_t stranded = 0;            ///< loads or saves given up after rank_timeout
  std::uint64_t kv_rows_saved = 0;       ///< tokens whose KV finish() wrote to blocks for the saves
  std::uint64_t codec_refusals = 0;      ///< blobs the codec refused (cells out of order, a torn blob): nothing saved
};

/// `o`, checked against `codec`'s grid. Throws Error(invalid_argument) naming the bad value
/// (a chunk size off the grid, no slots, no context).
inline SlotCacheOptions checked_options(const llama::SequenceCodec& codec, SlotCacheOptions o) {
  if (o.chunk_tokens == 0 || o.chunk_tokens % codec.layout().granule_tokens != 0)
    throw Error(ErrorCode::invalid_argument, "--kvfuse-chunk-tokens " + std::to_string(o.chunk_tokens) +
                                                 ": must be a multiple of the model's granule of " +
                                                 std::to_string(codec.layout().granule_tokens) + " tokens");
  if (o.slots == 0) throw Error(ErrorCode::invalid_argument, "a SlotCache needs at least one slot, got 0");
  if (o.max_prompt_tokens == 0) throw Error(ErrorCode::invalid_argument, "max_prompt_tokens must be > 0, got 0");
  return o;
}

/// The one rank's geometry of a SlotCache: a block pool for every slot's whole context, a
/// state slot per llama-server slot plus the snapshot slots when `stateful`.
inline RankGeometry geometry_for(const llama::SequenceCodec& codec, const SlotCacheOptions& o, bool stateful) {
  RankGeometry g;
  g.model = o.model_id;
  g.rank = 0;
  g.world_size = 1;
  g.block_tokens = codec.block_tokens();
  g.chunk_tokens = o.chunk_tokens;
  g.kv_bytes_per_token = codec.kv_bytes_per_token();
  const auto per_slot = static_cast<std::uint32_t>(TokenGrid{g.block_tokens}.cells_covering(o.max_prompt_tokens) + 1);
  g.num_blocks = per_slot * o.slots;
  g.num_slots = stateful ? o.slots + o.snapshot_slots : 0;
  g.slot_bytes = stateful ? codec.slot_bytes() : 0;
  g.max_chunks_per_load = static_cast<std::uint32_t>(TokenGrid{o.chunk_tokens}.cells_covering(o.max_prompt_tokens) + 1);
  return g;
}

}  // namespace kvfuse::llama_server
