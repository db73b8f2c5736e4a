// kvfuse/tier/memory_tier_pool.hpp — the shape of a MemoryTier's pool (memory_tier.hpp):
// its size classes, their counters, and the check a pool passes before any slab is
// allocated. Plain data and a pure function; any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <kvfuse/error.hpp>

namespace kvfuse {

/// One size class of a MemoryTierPool: `count` blocks of `class_bytes` bytes each.
struct MemoryTierPoolClass {
  std::size_t class_bytes = 0;  ///< the size of each block; > 0
  std::size_t count = 0;        ///< how many blocks; > 0
};

/// The size classes of a MemoryTier's pool, in strictly increasing `class_bytes` order, e.g.
/// `MemoryTierPool{{4096, 256}, {1 << 20, 16}}`. Empty: no pool (allocation per put).
/// Every block of a class lies in one slab from a single allocate_pinned of
/// class_bytes x count bytes, at slab + i x class_bytes: choose class sizes that are
/// multiples of the alignment your copy engine wants (the Source aligns only the slab).
using MemoryTierPool = std::vector<MemoryTierPoolClass>;

/// A consistent snapshot of a MemoryTier's pool. All zero for a tier without a pool.
/// Always `free_blocks + held_blocks + retired_blocks + filling_blocks == blocks`.
struct MemoryTierPoolStats {
  std::size_t blocks = 0;          ///< blocks in the pool, all classes
  std::size_t free_blocks = 0;     ///< blocks on the free lists
  std::size_t held_blocks = 0;     ///< blocks of entries in the catalogue
  std::size_t retired_blocks = 0;  ///< blocks unlinked from the catalogue, still pinned by views
  std::size_t filling_blocks = 0;  ///< blocks taken by a put that is copying into them now
  std::size_t bytes = 0;           ///< the pool's bytes: the sum of class_bytes x count
  std::uint64_t exhausted = 0;     ///< puts with no free fitting block even after eviction
  std::uint64_t oversize = 0;      ///< puts larger than the largest class
};

/// Checks `pool` against a tier of `capacity_bytes` and returns its bytes (the sum of
/// class_bytes x count). Throws Error(invalid_argument) naming the class and the value: a
/// class of 0 bytes or 0 blocks, a class larger than the capacity, classes not strictly
/// increasing (duplicates included), a byte total that overflows or exceeds the capacity.
inline std::size_t check_pool(const MemoryTierPool& pool, std::size_t capacity_bytes) {
  std::size_t total = 0;
  for (std::size_t i = 0; i < pool.size(); ++i) {
    const MemoryTierPoolClass& c = pool[i];
    const std::string at = "MemoryTier pool class " + std::to_string(i) + " ";
    if (c.class_bytes == 0) throw Error(ErrorCode::invalid_argument, at + "class_bytes must be > 0, got 0");
    if (c.count == 0)
      throw Error(ErrorCode::invalid_argument,
                  at + "(class_bytes " + std::to_string(c.class_bytes) + ") count must be > 0, got 0");
    if (c.class_bytes > capacity_bytes)
      throw Error(ErrorCode::invalid_argument, at + "class_bytes " + std::to_string(c.class_bytes) +
                                                   " is larger than capacity_bytes " + std::to_string(capacity_bytes));
    if (i > 0 && c.class_bytes <= pool[i - 1].class_bytes)
      throw Error(ErrorCode::invalid_argument,
                  at + "class_bytes " + std::to_string(c.class_bytes) + " must be larger than the previous class's " +
                      std::to_string(pool[i - 1].class_bytes) + " (classes strictly increasing, no duplicates)");
    if (c.count > (std::numeric_limits<std::size_t>::max() - total) / c.class_bytes)
      throw Error(ErrorCode::invalid_argument, at + "class_bytes " + std::to_string(c.class_bytes) + " x count " +
                                                   std::to_string(c.count) + " overflows the pool's byte total");
    total += c.class_bytes * c.count;
  }
  if (total > capacity_bytes)
    throw Error(ErrorCode::invalid_argument, "MemoryTier pool bytes (sum of class_bytes x count) " +
                                                 std::to_string(total) + " exceed capacity_bytes " +
                                                 std::to_string(capacity_bytes));
  return total;
}

}  // namespace kvfuse
