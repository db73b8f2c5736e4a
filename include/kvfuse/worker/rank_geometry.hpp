// kvfuse/worker/rank_geometry.hpp — what one rank knows about its slice of the model.
//
// Every rank-side check in R11 compares a spec the engine computed against this struct,
// so it is validated once, at construction, and never clamped afterwards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// One rank's view of the model and its device pools. Plain data; validate() before use.
struct RankGeometry {
  std::uint64_t model = 0;            ///< model id: goes into every tier key
  std::uint32_t rank = 0;             ///< this rank, in [0, world_size)
  std::uint32_t world_size = 1;       ///< tensor-parallel world size
  std::uint32_t block_tokens = 16;    ///< tokens per paged KV block: also the checkpoint grid
  std::uint32_t chunk_tokens = 256;   ///< tokens per tier chunk: a multiple of block_tokens
  std::size_t kv_bytes_per_token = 0; ///< this rank's KV bytes per token, all layers together
  std::uint32_t num_blocks = 0;       ///< blocks in the device KV pool
  std::uint32_t num_slots = 0;        ///< slots in the device state pool (0: the model has no state)
  std::size_t slot_bytes = 0;         ///< bytes of one state slot on this rank
  std::uint32_t max_chunks_per_load = 1024;  ///< a longer KV spec is refused (bounds the chunk mask)

  /// Bytes of one paged block on this rank.
  [[nodiscard]] constexpr std::size_t block_bytes() const noexcept { return block_tokens * kv_bytes_per_token; }
  /// Bytes of one tier chunk on this rank.
  [[nodiscard]] constexpr std::size_t chunk_bytes() const noexcept { return chunk_tokens * kv_bytes_per_token; }
  /// The chunk grid.
  [[nodiscard]] constexpr TokenGrid chunk_grid() const noexcept { return TokenGrid{chunk_tokens}; }
  /// The checkpoint (block) grid.
  [[nodiscard]] constexpr TokenGrid block_grid() const noexcept { return TokenGrid{block_tokens}; }

  /// Throws Error(invalid_argument) naming the first bad field. Construction time only.
  void validate() const {
    auto bad = [](const std::string& what) { throw Error(ErrorCode::invalid_argument, what); };
    if (world_size == 0) bad("world_size must be > 0, got 0");
    if (rank >= world_size)
      bad("rank must be < world_size (" + std::to_string(world_size) + "), got " + std::to_string(rank));
    if (block_tokens == 0) bad("block_tokens must be > 0, got 0");
    if (chunk_tokens == 0 || chunk_tokens % block_tokens != 0)
      bad("chunk_tokens must be a nonzero multiple of block_tokens (" + std::to_string(block_tokens) + "), got " +
          std::to_string(chunk_tokens));
    if (kv_bytes_per_token == 0) bad("kv_bytes_per_token must be > 0, got 0");
    if (num_blocks == 0) bad("num_blocks must be > 0, got 0");
    if (num_slots > 0 && slot_bytes == 0) bad("slot_bytes must be > 0 when num_slots > 0, got 0");
    if (max_chunks_per_load == 0) bad("max_chunks_per_load must be > 0, got 0");
  }
};

}  // namespace kvfuse
