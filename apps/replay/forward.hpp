// kvfuse-replay: the simulated model on the ranks' device memory. Its forward writes each
// token's KV into the request's blocks and folds the state digest; a request's output is the
// final state mixed with each rank's fold of every KV word of its prompt as it sits in device
// memory; a load's bytes are checked word by word against what the forward would have
// written (content.hpp). The work goes to the ranks as BlockSpan lists (rank_memory.hpp).
#pragma once

#include "content.hpp"
#include "ranks.hpp"

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/planner.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace replay {

/// Writes the KV of `q`'s block `b`, tokens [lo, hi) of the block, at `at` (one rank's block).
inline void write_block(std::byte* at, const Request& q, std::size_t b, std::uint32_t rank, TokenCount lo, TokenCount hi) {
  const std::uint64_t id = block_id(q, b);
  for (TokenCount t = lo; t < hi; ++t) store_word(at + t * kv_bytes_per_token, kv_word(id, b * block_tokens + t, rank, 0));
}

/// `q`'s tokens [from, to) in `blocks`, one span per block they touch.
inline std::vector<BlockSpan> spans_of(const Request& q, std::span<const kvfuse::BlockId> blocks, TokenCount from, TokenCount to) {
  std::vector<BlockSpan> out;
  for (TokenCount b = from / block_tokens; b * block_tokens < to; ++b) {
    const TokenCount lo = std::max(from, b * block_tokens) - b * block_tokens;
    const TokenCount hi = std::min(to, (b + 1) * block_tokens) - b * block_tokens;
    out.push_back(BlockSpan{block_id(q, b), blocks[b].value, static_cast<std::uint32_t>(b), static_cast<std::uint32_t>(lo),
                            static_cast<std::uint32_t>(hi)});
  }
  return out;
}

/// Writes the KV of `q`'s tokens [from, to) into `blocks` on every rank.
inline void write_kv(Ranks& ranks, const Request& q, std::span<const kvfuse::BlockId> blocks, TokenCount from, TokenCount to) {
  if (from < to) ranks.write_kv(spans_of(q, blocks, from, to));
}

/// Writes a slot holding `digest` on every rank.
inline void write_state(Ranks& ranks, kvfuse::SlotId slot, std::uint64_t digest) { ranks.write_state(slot, digest); }

/// The digest a slot holds (what the model continues from).
inline std::uint64_t read_state(Ranks& ranks, kvfuse::SlotId slot) { return ranks.read_state(slot); }

/// The output of `q` from its final state and its prompt's KV as read back from every rank:
/// each rank folds its own words, the folds are combined in rank order. Never 0 (0 means
/// "no output").
inline std::uint64_t output_of(Ranks& ranks, const Request& q, std::span<const kvfuse::BlockId> blocks, std::uint64_t state) {
  std::vector<std::uint64_t> folds(ranks.world());
  ranks.fold_kv(spans_of(q, blocks, 0, q.prompt_tokens), folds);
  std::uint64_t kv = 0;
  for (const std::uint64_t f : folds) kv = mix64(kv ^ f);
  return mix64(state ^ kv) | 1;
}

/// Every byte `plan`'s load restored into `blocks` and `slot`, on every rank, against the model.
inline Checked check_load(Ranks& ranks, const Request& q, std::span<const kvfuse::BlockId> blocks,
                          std::optional<kvfuse::SlotId> slot, const kvfuse::LoadPlan& plan,
                          std::optional<TokenCount> salvaged_at = std::nullopt) {
  std::optional<kvfuse::IndexRange> range = kvfuse::kv_tokens(plan);
  std::optional<TokenCount> boundary = kvfuse::state_boundary(plan);
  if (salvaged_at) {
    // A load that failed part way filled only what lies below its resume point; a stateful
    // request resumes on the state restored there (its second load's, or its own).
    if (range) range->last = std::min(range->last, *salvaged_at);
    if (range && range->last <= range->first) range.reset();
    boundary = slot ? salvaged_at : std::nullopt;
  }
  const std::vector<BlockSpan> spans = range ? spans_of(q, blocks, range->first, range->last) : std::vector<BlockSpan>{};
  return ranks.check(spans, boundary ? slot : std::nullopt, boundary ? state_at(q, *boundary) : 0);
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
  std::uint64_t run_to(Ranks& ranks, const Request& q, std::span<const kvfuse::BlockId> blocks, TokenCount to) {
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
  std::uint64_t run_to_end(Ranks& ranks, const Request& q, std::span<const kvfuse::BlockId> blocks) {
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
