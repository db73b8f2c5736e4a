// kvfuse-replay: the simulated model on the ranks' device memory. Its forward writes each
// token's KV into the request's blocks and folds the state digest; a request's output is the
// final state mixed with every KV word of its prompt as it sits in device memory; a load's
// bytes are checked word by word against what the forward would have written (content.hpp).
#pragma once

#include "content.hpp"
#include "ranks.hpp"

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/planner.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>

namespace replay {

/// Writes the KV of `q`'s block `b`, tokens [lo, hi) of the block, at `at` (one rank's block).
inline void write_block(std::byte* at, const Request& q, std::size_t b, std::uint32_t rank, TokenCount lo, TokenCount hi) {
  const std::uint64_t id = block_id(q, b);
  for (TokenCount t = lo; t < hi; ++t) store_word(at + t * kv_bytes_per_token, kv_word(id, b * block_tokens + t, rank, 0));
}

/// Writes the KV of `q`'s tokens [from, to) into `blocks` on every rank.
inline void write_kv(const Ranks& ranks, const Request& q, std::span<const kvfuse::BlockId> blocks, TokenCount from, TokenCount to) {
  for (std::uint32_t r = 0; r < ranks.world(); ++r)
    for (TokenCount b = from / block_tokens; b * block_tokens < to; ++b) {
      const TokenCount lo = std::max(from, b * block_tokens) - b * block_tokens;
      const TokenCount hi = std::min(to, (b + 1) * block_tokens) - b * block_tokens;
      write_block(ranks.block(r, blocks[b]), q, b, r, lo, hi);
    }
}

/// Writes a slot holding `digest` on every rank.
inline void write_state(const Ranks& ranks, kvfuse::SlotId slot, std::uint64_t digest) {
  for (std::uint32_t r = 0; r < ranks.world(); ++r)
    for (std::size_t j = 0; j < slot_bytes / 8; ++j) store_word(ranks.slot(r, slot) + j * 8, state_word(digest, r, j));
}

/// The digest a slot holds (what the model continues from).
inline std::uint64_t read_state(const Ranks& ranks, kvfuse::SlotId slot) { return load_word(ranks.slot(0, slot)); }

/// The output of `q` from its final state and its prompt's KV as read back from every rank;
/// never 0 (0 means "no output").
inline std::uint64_t output_of(const Ranks& ranks, const Request& q, std::span<const kvfuse::BlockId> blocks, std::uint64_t state) {
  std::uint64_t kv = 0;
  for (std::uint32_t r = 0; r < ranks.world(); ++r)
    for (TokenCount t = 0; t < q.prompt_tokens; ++t)
      kv = mix64(kv ^ load_word(ranks.block(r, blocks[t / block_tokens]) + (t % block_tokens) * kv_bytes_per_token));
  return mix64(state ^ kv) | 1;
}

/// Bytes a check compared, and how many of them differed.
struct Checked {
  std::uint64_t verified = 0, corrupted = 0;
};

/// Every byte `plan`'s load restored into `blocks` and `slot`, on every rank, against the model.
inline Checked check_load(const Ranks& ranks, const Request& q, std::span<const kvfuse::BlockId> blocks,
                          std::optional<kvfuse::SlotId> slot, const kvfuse::LoadPlan& plan) {
  Checked c;
  const std::optional<kvfuse::IndexRange> range = kvfuse::kv_tokens(plan);
  const std::optional<TokenCount> boundary = kvfuse::state_boundary(plan);
  for (std::uint32_t r = 0; r < ranks.world(); ++r) {
    if (range)
      for (TokenCount t = range->first; t < range->last; ++t) {
        const std::size_t b = t / block_tokens;
        const std::uint64_t got = load_word(ranks.block(r, blocks[b]) + (t % block_tokens) * kv_bytes_per_token);
        c.corrupted += differing_bytes(got, kv_word(block_id(q, b), t, r, 0));
        c.verified += kv_bytes_per_token;
      }
    if (boundary) {
      const std::uint64_t expect = state_at(q, *boundary);
      for (std::size_t j = 0; j < slot_bytes / 8; ++j)
        c.corrupted += differing_bytes(load_word(ranks.slot(r, *slot) + j * 8), state_word(expect, r, j));
      c.verified += slot_bytes;
    }
  }
  return c;
}

/// One admission's forward, run in steps: run_to(B) computes up to boundary B (the engine
/// stops there to act, say to capture the state), run_to_end() finishes the request. KV
/// below `kv_from` is already in the blocks (restored or cached); the digest folds whole
/// blocks from `state_from`. Scheduler thread.
class Forward {
 public:
  Forward() = default;
  Forward(TokenCount kv_from, TokenCount state_from, std::uint64_t state) noexcept
      : kv_(kv_from), state_from_(state_from), state_(state) {}

  /// Computes [frontier, to) for `to` on the block grid, at or past the state's frontier;
  /// returns the state digest at `to`.
  std::uint64_t run_to(const Ranks& ranks, const Request& q, std::span<const kvfuse::BlockId> blocks, TokenCount to) {
    if (to > kv_) {
      write_kv(ranks, q, blocks, kv_, to);
      kv_ = to;
    }
    state_ = state_at(q, to, state_, state_from_);
    state_from_ = to;
    return state_;
  }

  /// Computes the rest of `q` (prompt and output, the partial last block included); returns
  /// the final state.
  std::uint64_t run_to_end(const Ranks& ranks, const Request& q, std::span<const kvfuse::BlockId> blocks) {
    const TokenCount total = q.prompt_tokens + q.output_tokens;
    (void)run_to(ranks, q, blocks, total - total % block_tokens);
    if (total > kv_) {
      write_kv(ranks, q, blocks, kv_, total);
      kv_ = total;
    }
    if (total % block_tokens != 0) state_ = advance_state(state_, block_id(q, total / block_tokens) ^ (total % block_tokens));
    return state_;
  }

 private:
  TokenCount kv_ = 0, state_from_ = 0;
  std::uint64_t state_ = initial_state;
};

}  // namespace replay
