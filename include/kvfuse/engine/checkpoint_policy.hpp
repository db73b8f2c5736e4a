// kvfuse/engine/checkpoint_policy.hpp — the checkpoint policy (docs/reference.md#checkpoint-policy):
// where a stateful model (DSV4, K3) captures state checkpoints, so that later prompts can
// resume from them.
//
// A stateful model resumes only from a state checkpoint at a boundary B (the state at B
// needs a forward over [0, B)); KV alone is not enough. A later prompt shares a prefix of an
// earlier prompt and leaves it somewhere; it can use a checkpoint at or below that point
// only, and the highest such checkpoint spares the most prefill. One checkpoint at the end
// of each request misses every prompt that branches off inside an earlier one, so the
// policy places several during prefill, where later prompts are likely to branch.
//
// plan_checkpoints() is a pure function of one CheckpointInput: no state, no allocation,
// no I/O, noexcept, constexpr, and therefore thread-safe. The engine calls it when it
// admits a request, splits the prefill at the boundaries it returns, and captures the
// state at each. generation_end_checkpoint() is the one checkpoint taken at finish.
//
// The grids are the planner's (PlanGrids): the block grid is the checkpoint grid (a state
// checkpoint exists only at a multiple of block_tokens), the tier moves whole chunks.
//
// The rules, in order:
//   1. Invalid grids (PlanGrids::valid() is false) or an empty prompt: no checkpoints.
//   2. Every prefill checkpoint B lies on the block grid and in (resume, P - 1]. At or
//      below `resume` the request restores a state rather than computing one; P itself is
//      never a prefill checkpoint (the planner never resumes a request at its own P, and a
//      later prompt extending this one is served by the generation-end checkpoint).
//   3. The candidates:
//      - the branch point (at_branch): `branch` floored to the block grid, taken only when
//        branch <= P - 1. A branch at or beyond P means the whole prompt is already shared
//        with earlier prompts: it does not leave them inside this prompt.
//      - the prompt end (at_prompt_end): P - 1 floored to the CHUNK grid. Not the block
//        grid: a later prompt that extends this one can restore B only with the KV chunk
//        covering B whole in the tier (the planner's joint load needs ceil_chunk(B) within
//        its lookup), and above the last chunk boundary that chunk reaches past P - 1: it
//        is whole only once the output fills it, and then the generation-end one serves.
//      - every N chunks (every_chunks = N > 0): each multiple of N x chunk_tokens.
//   4. Deduplicated, then capped at min(max_prefill, out.size()), keeping in this order:
//      the branch point, the prompt end, then the every-N boundaries from the highest down.
//      The branch point is where this prompt was seen to leave earlier ones, the highest
//      point another prompt sharing that prefix can use; the prompt end is the highest
//      point a continuation of this prompt (the next turn of a chat) can use. The every-N
//      boundaries hedge for branch points nobody has seen yet; the higher ones lie in the
//      tokens this prompt adds, which no earlier request checkpointed, while the lower ones
//      lie in the prefix it shares, where earlier requests already may have.
//   5. Written ascending.
//
// The generation-end checkpoint is at (prompt + generated) - 1 floored to the chunk grid:
// the state after the last generated token does not exist at finish (that token was
// sampled, never fed forward), a later prompt containing all of prompt + output restores at
// B <= its own P - 1, and the chunk ending at B is whole in the tier. It is taken only when
// the policy asks and it is nonzero; it may equal a prefill checkpoint (an output that does
// not reach the next chunk boundary), whose hash the index then already serves.
//
// Arithmetic: no step forms a value above its inputs (only floors, and subtractions from a
// boundary known to be above the subtrahend), so every input up to 2^64 - 1 is computed
// exactly, never wrapped.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/planner.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// Where a request's state checkpoints go (the rules are in the header comment). Plain
/// data; a default-constructed policy is the default one ("default"). The presets are
/// constexpr and noexcept; any thread.
struct CheckpointPolicy {
  /// max_prefill value meaning "no cap": only the size of the caller's span limits the count.
  static constexpr std::uint32_t uncapped = std::numeric_limits<std::uint32_t>::max();

  bool at_branch = true;          ///< at the branch point: where the prompt leaves what HBM and the tier hold
  bool at_prompt_end = true;      ///< at the prompt's last chunk boundary at or below P - 1
  std::uint32_t every_chunks = 8;  ///< at every multiple of every_chunks x chunk_tokens; 0: none
  /// At finish, at the last chunk boundary of prompt + output (not a prefill checkpoint).
  bool at_generation_end = true;
  std::uint32_t max_prefill = 4;  ///< the most prefill checkpoints per request; `uncapped`: no cap

  /// One checkpoint per request, as an engine that checkpoints only at finish takes it: none
  /// during prefill, one at the generation end.
  static constexpr CheckpointPolicy last() noexcept { return {false, false, 0, true, 0}; }
  /// The upper reference: every chunk boundary of the prompt, the branch point and the
  /// generation end, uncapped. A superset of every other preset's choices (up to their caps),
  /// so nothing they reuse is missed here.
  static constexpr CheckpointPolicy all() noexcept { return {true, true, 1, true, uncapped}; }
  /// A fixed interval alone: every n chunks plus the generation end, uncapped; no branch point
  /// and no prompt end, so that it measures what spacing buys without knowing where prompts
  /// branch. every(0) takes no prefill checkpoints (as last()).
  static constexpr CheckpointPolicy every(std::uint32_t n) noexcept { return {false, false, n, true, uncapped}; }

  friend constexpr bool operator==(const CheckpointPolicy&, const CheckpointPolicy&) noexcept = default;
};

/// Everything plan_checkpoints decides from. Plain data.
struct CheckpointInput {
  TokenCount prompt_tokens = 0;  ///< P: the prompt length
  /// The boundary the request resumes from: the tokens its load claims (claimed_tokens of its
  /// plan); 0 when it computes from the start.
  TokenCount resume = 0;
  /// How far the prompt's prefix is known to be shared with earlier prompts, as the admission
  /// learned it: max(tier lookup tokens, hbm). Any value: it is floored to the block grid and
  /// ignored at or beyond P, or at or below `resume`.
  TokenCount branch = 0;
  PlanGrids grids;  ///< block grid = checkpoint grid; chunk_tokens a multiple of it
  CheckpointPolicy policy;
};

namespace detail {
/// The branch-point candidate, or 0 when there is none (0 is never a checkpoint).
constexpr TokenCount branch_checkpoint(const CheckpointInput& in, TokenCount last) noexcept {
  if (!in.policy.at_branch || in.branch > last) return 0;
  const TokenCount b = in.grids.block_grid().floor(in.branch);
  return b > in.resume ? b : 0;
}
/// The prompt-end candidate unless it is the branch candidate, or 0 when there is none.
constexpr TokenCount prompt_end_checkpoint(const CheckpointInput& in, TokenCount last, TokenCount branch) noexcept {
  if (!in.policy.at_prompt_end) return 0;
  const TokenCount e = in.grids.chunk_grid().floor(last);
  return e > in.resume && e != branch ? e : 0;
}
}  // namespace detail

/// Writes into `out` the boundaries at which the engine should capture a state checkpoint
/// during this request's prefill, and returns how many. Promises: ascending; each on the
/// block grid and in (resume, P - 1]; no duplicates; at most min(policy.max_prefill,
/// out.size()), chosen by the priority of the header comment. 0 for invalid grids or P == 0.
/// Never wraps, for any input. Pure: O(count), no allocation; constexpr, noexcept, any thread.
constexpr std::size_t plan_checkpoints(const CheckpointInput& in, std::span<TokenCount> out) noexcept {
  if (!in.grids.valid() || in.prompt_tokens == 0) return 0;
  const TokenCount last = in.prompt_tokens - 1;
  const std::size_t cap = std::min<std::size_t>(in.policy.max_prefill, out.size());
  if (cap == 0 || last <= in.resume) return 0;
  const TokenCount branch = detail::branch_checkpoint(in, last);
  const TokenCount end = detail::prompt_end_checkpoint(in, last, branch);
  std::size_t n = 0;
  if (branch != 0) out[n++] = branch;
  if (end != 0 && n < cap) out[n++] = end;
  if (in.policy.every_chunks > 0) {
    // Both factors are below 2^32, so the stride fits. Walking down from the highest multiple
    // at or below P - 1 never wraps: a multiple above resume >= 0 is at least one stride.
    const TokenCount stride = TokenCount{in.policy.every_chunks} * in.grids.chunk_tokens;
    for (TokenCount b = last - last % stride; b > in.resume && n < cap; b -= stride)
      if (b != branch && b != end) out[n++] = b;
  }
  std::sort(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(n));
  return n;
}

/// How many boundaries plan_checkpoints writes when `out` is at least this large: the size
/// the engine should give `out` (min(policy.max_prefill, the number of candidates)).
/// Exact and never wrapping for any input. Pure: O(1); constexpr, noexcept, any thread.
constexpr std::size_t count_checkpoints(const CheckpointInput& in) noexcept {
  if (!in.grids.valid() || in.prompt_tokens == 0) return 0;
  const TokenCount last = in.prompt_tokens - 1;
  if (in.policy.max_prefill == 0 || last <= in.resume) return 0;
  const TokenCount branch = detail::branch_checkpoint(in, last);
  const TokenCount end = detail::prompt_end_checkpoint(in, last, branch);
  std::uint64_t count = 0;
  if (in.policy.every_chunks == 0) {
    count = (branch != 0 ? 1 : 0) + (end != 0 ? 1 : 0);
  } else {
    // Multiples of the stride in (resume, last], plus the two others where not among them.
    // With a stride of 1 the others are always among them, so the sum stays below 2^64.
    const TokenCount stride = TokenCount{in.policy.every_chunks} * in.grids.chunk_tokens;
    count = last / stride - in.resume / stride;
    count += (branch != 0 && branch % stride != 0 ? 1 : 0) + (end != 0 && end % stride != 0 ? 1 : 0);
  }
  return static_cast<std::size_t>(std::min<std::uint64_t>(count, in.policy.max_prefill));
}

/// The boundary at which the engine checkpoints when the request finishes with
/// `total_tokens` = prompt + generated tokens: total_tokens - 1 floored to the chunk grid
/// (the header comment says why). Empty when the policy does not take it, the grids are
/// invalid, or the boundary is 0. Pure: O(1); constexpr, noexcept, any thread.
constexpr std::optional<TokenCount> generation_end_checkpoint(TokenCount total_tokens, const PlanGrids& grids,
                                                              const CheckpointPolicy& policy) noexcept {
  if (!policy.at_generation_end || !grids.valid() || total_tokens == 0) return std::nullopt;
  const TokenCount b = grids.chunk_grid().floor(total_tokens - 1);
  if (b == 0) return std::nullopt;
  return b;
}

/// The policy a tool names: "default" (CheckpointPolicy{}), "last", "all", or "every:N"
/// (CheckpointPolicy::every(N), N a decimal whole number of chunks from 1 to 2^32 - 1).
/// Exact spellings only; anything else is empty. Pure; constexpr, noexcept, any thread.
constexpr std::optional<CheckpointPolicy> find_checkpoint_policy(std::string_view name) noexcept {
  if (name == "default") return CheckpointPolicy{};
  if (name == "last") return CheckpointPolicy::last();
  if (name == "all") return CheckpointPolicy::all();
  constexpr std::string_view every_prefix = "every:";
  if (!name.starts_with(every_prefix)) return std::nullopt;
  const std::string_view digits = name.substr(every_prefix.size());
  if (digits.empty()) return std::nullopt;
  std::uint64_t n = 0;
  for (const char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    n = n * 10 + static_cast<std::uint64_t>(c - '0');
    if (n > std::numeric_limits<std::uint32_t>::max()) return std::nullopt;  // checked per digit: never wraps
  }
  if (n == 0) return std::nullopt;
  return CheckpointPolicy::every(static_cast<std::uint32_t>(n));
}

/// find_checkpoint_policy, for configuration: an unknown name throws Error(invalid_argument)
/// naming it and the accepted names. Any thread; allocates only to throw.
inline CheckpointPolicy checkpoint_policy_named(std::string_view name) {
  if (const std::optional<CheckpointPolicy> policy = find_checkpoint_policy(name)) return *policy;
  throw Error(ErrorCode::invalid_argument,
              "checkpoint policy '" + std::string(name) +
                  "' is not one of default, last, all, every:N (N a whole number of chunks, 1 to 4294967295)");
}

}  // namespace kvfuse
