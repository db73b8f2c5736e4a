// kvfuse-replay: what the simulated model does to one rank's device memory. The engine
// describes the work as plain data (BlockSpan lists, a slot and a digest); RankMemory does
// it on the memory it is given. Ranks as threads run it in the engine's process, ranks as
// processes in each rank's own (rank_server.cpp), so both modes compute the same bytes.
#pragma once

#include "content.hpp"

#include <kvfuse/bridge/ids.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <type_traits>

namespace replay {

/// Tokens [lo, hi) of one block of a request: the device block they live in, the block's
/// position in the request (`index`) and the identity of its tokens (block_id).
struct BlockSpan {
  std::uint64_t id = 0;
  std::uint32_t block = 0;
  std::uint32_t index = 0;
  std::uint32_t lo = 0, hi = 0;
};
static_assert(std::is_trivially_copyable_v<BlockSpan>);

/// Bytes a check compared, and how many of them differed.
struct Checked {
  std::uint64_t verified = 0, corrupted = 0;
  Checked& operator+=(const Checked& o) noexcept {
    verified += o.verified;
    corrupted += o.corrupted;
    return *this;
  }
};

/// One rank's device memory: its block pool and its slot pool. Whoever owns the rank calls
/// it (the scheduler thread, or a rank process's control thread).
struct RankMemory {
  std::byte* blocks = nullptr;
  std::byte* slots = nullptr;
  std::uint32_t rank = 0;
  std::size_t slot_bytes = default_slot_bytes;  ///< the geometry's: a multiple of 8

  std::byte* block(std::uint32_t b) const noexcept { return blocks + std::size_t{b} * block_bytes; }
  std::byte* slot(kvfuse::SlotId s) const noexcept { return slots + std::size_t{s.value} * slot_bytes; }

  /// Writes the model's KV of every span.
  void write_kv(std::span<const BlockSpan> spans) const noexcept {
    for (const BlockSpan& s : spans)
      for (std::uint32_t t = s.lo; t < s.hi; ++t)
        store_word(block(s.block) + t * kv_bytes_per_token, kv_word(s.id, std::uint64_t{s.index} * block_tokens + t, rank, 0));
  }
  /// Writes a slot holding `digest`.
  void write_state(kvfuse::SlotId s, std::uint64_t digest) const noexcept {
    for (std::size_t j = 0; j < slot_bytes / 8; ++j) store_word(slot(s) + j * 8, state_word(digest, rank, j));
  }
  /// The digest a slot holds.
  std::uint64_t read_state(kvfuse::SlotId s) const noexcept { return load_word(slot(s)); }
  /// Every KV word of the spans as it sits in memory, folded in order from 0.
  std::uint64_t fold_kv(std::span<const BlockSpan> spans) const noexcept {
    std::uint64_t kv = 0;
    for (const BlockSpan& s : spans)
      for (std::uint32_t t = s.lo; t < s.hi; ++t) kv = mix64(kv ^ load_word(block(s.block) + t * kv_bytes_per_token));
    return kv;
  }
  /// Every byte of the spans, and of `slot` when given (against a slot holding `digest`),
  /// compared with what the model writes.
  Checked check(std::span<const BlockSpan> spans, std::optional<kvfuse::SlotId> s, std::uint64_t digest) const noexcept {
    Checked c;
    for (const BlockSpan& b : spans)
      for (std::uint32_t t = b.lo; t < b.hi; ++t) {
        const std::uint64_t got = load_word(block(b.block) + t * kv_bytes_per_token);
        c.corrupted += differing_bytes(got, kv_word(b.id, std::uint64_t{b.index} * block_tokens + t, rank, 0));
        c.verified += kv_bytes_per_token;
      }
    if (s) {
      for (std::size_t j = 0; j < slot_bytes / 8; ++j)
        c.corrupted += differing_bytes(load_word(slot(*s) + j * 8), state_word(digest, rank, j));
      c.verified += slot_bytes;
    }
    return c;
  }
};

}  // namespace replay
