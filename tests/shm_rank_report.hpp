// What tests/shm_rank_process.cpp reports when it ends, shared with the tests that read it.
#pragma once

#include <kvfuse/bridge/ids.hpp>

#include <cstdint>
#include <span>

namespace kvfuse::testing {

/// Folds the block ids a rank's loads named, in order, into one number: the engine side
/// compares it with the blocks it sent, so a frame that lands in the wrong blocks shows.
inline std::uint64_t load_blocks_hash(std::uint64_t h, std::span<const BlockId> blocks) {
  for (BlockId b : blocks) h = h * 1000003 + b.value + 1;
  return h;
}

}  // namespace kvfuse::testing
