// kvfuse/engine/planner.hpp — the Planner (docs/reference.md#planner): what, if anything, to load
// for a request when the engine admits it.
//
// plan_load() is a pure function of one PlanInput: no state, no allocation, no I/O,
// noexcept, constexpr, and therefore thread-safe (concurrent calls share nothing; the
// caller must only not mutate the servable-boundary span during a call). The engine calls
// it on its scheduler thread, turns the answer into an OffloadIndex ticket, and builds the
// KvSpec / StateSpec from it with chunk_range() / block_range() / state_boundary().
//
// The grids:
//   - block grid = checkpoint grid: `block_tokens` (paged KV blocks; a state checkpoint,
//     and so a boundary B, exists only at a multiple of it);
//   - chunk grid: `chunk_tokens`, a nonzero multiple of `block_tokens` (the tier stores and
//     retrieves whole chunks, keyed by a chained prefix hash).
//
// The answer is exactly one of four alternatives (a std::variant, LoadPlan):
//   NoLoad{reason}            compute the prompt (from hbm for a dense model); `reason` says why.
//   KvOnlyLoad{hbm, end}      dense models only. Fill [hbm, end) from the tier, then compute
//                             from `end`. Promises: hbm < end; end on the chunk grid;
//                             end <= lookup_tokens; end <= P - 1 floored to the chunk grid (the
//                             last prompt token is always computed, so all P are never
//                             claimed); the request claims `end` tokens.
//   JointLoad{hbm, end, boundary}
//                             stateful models only (DSV4, K3). Restore the state checkpoint at
//                             B = `boundary` and fill [hbm, end) from the tier, then compute
//                             from B. Promises: B is servable, on the block grid, and
//                             hbm < B <= P - 1; end = the chunk covering B (B ceiled to the chunk
//                             grid, which is what ranks require, R11), so the KV leg may run
//                             past B, even past P - 1, but never past lookup_tokens (<= P); the
//                             request claims B tokens and never more (the KV in [B, end) is
//                             loaded only because the tier moves whole chunks, and is
//                             overwritten by the recompute). Any block-aligned hbm, DSV4
//                             included.
//   StateOnlyLoad{boundary}   stateful models only. The KV of [0, B) is already resident
//                             (0 < B <= hbm, B <= P - 1); only the state checkpoint at B moves:
//                             the LoadRequest carries no KV spec at all (R10). The request
//                             claims B tokens.
// A stateful model never gets a KvOnlyLoad: it could not resume from KV without a state.
//
// The rules, in the order they are applied (the first that decides, wins):
//   1. Invalid input is refused, never clamped (R11): bad grids, an unknown layout, an empty
//      prompt, a prompt too long for the grids (the chunk holding its last token would end
//      past 2^64 - 1, so its grid arithmetic cannot be done in a TokenCount), an HBM floor
//      off the block grid (ranks refuse it), a lookup off the chunk grid (the tier holds
//      whole chunks only) or beyond the prompt.
//   2. Dense: end = min(lookup, floor_chunk(P - 1)); no load when lookup <= hbm
//      (lookup_within_hbm) or end <= hbm (chunk_holds_last_token).
//   3. Stateful: a boundary is a candidate if it is in the servable list, on the block grid
//      and 0 < B <= P - 1 (B = P is never chosen: the last token is always computed).
//      A joint candidate has B > hbm and its covering chunk within the lookup
//      (ceil_chunk(B) <= lookup, i.e. the KV of [0, B) is in HBM ∪ tier); a state-only
//      candidate has B <= hbm. The plan is the highest joint candidate, else the highest
//      state-only candidate, for DSV4 and K3 alike: the state at B depends only on the
//      tokens before B, wherever their KV sits, so a joint load may start at any
//      block-aligned floor (docs/reference.md#any-floor). A joint load always claims more than a
//      state-only one (B > hbm >= B'), so "prefer the load that claims more" and "prefer a
//      joint load" are the same rule. With no plan the reason is, in this order:
//      nothing_servable_above_hbm (no candidate above hbm), lookup_within_hbm
//      (lookup <= hbm), covering_chunk_beyond_lookup.
//   4. Break-even (only when the BreakEven input is enabled): a candidate pays when its load
//      costs no more time than the prefill it spares (load_ns <= spared x
//      recompute_ns_per_token; what "spared" is, is rule 5's). A leg costs the tier's
//      latency plus its bytes at the tier's rate; the KV leg moves every chunk overlapping
//      [hbm, end), the state leg one checkpoint; a joint load costs the longer of its two
//      legs, which run at once. Stateful: the plan is the highest joint candidate that
//      pays, else the highest state-only one (a state-only load moves no KV, so it can pay
//      where every joint load does not). Dense: only the longest load is weighed, because
//      each chunk adds the same time and the same saving: if one more chunk pays, the
//      longest load is the best; if it does not, even the first (partial) chunk does not,
//      and no load pays. No candidate pays: slower_than_recompute.
//   5. Minimum size: a plan that spares fewer than `min_load_tokens` tokens of prefill is
//      load_too_small. A dense load spares end - hbm (its HBM prefix is usable without a
//      load); a stateful load spares all B tokens it claims (without a state at some
//      boundary a stateful model recomputes from 0: HBM KV alone cannot resume it — which
//      is why a state-only load is worth making at all). The chosen plan is the one that
//      spares the most, so when it is too small every other one is too.
//
// An HBM floor off the chunk grid (but on the block grid) is a normal, loadable case, not a
// refusal. An earlier design listed "HBM floor off the chunk grid" as a no-load reason, but
// ranks load from any block-aligned floor: PagedKv copies only the part of the first chunk
// above hbm (check_kv_spec requires hbm on the block grid and end on the chunk grid). So
// the KV spec starts at hbm, its chunk keys start at the chunk containing hbm
// (floor(hbm / chunk_tokens)), and its blocks start at hbm / block_tokens. Refusing would
// throw away every load behind a prefix-cache hit that ends mid-chunk, the common case.
//
// The servable boundaries are a span, not a callable: the engine asks
// OffloadIndex::could_serve(hash at B) for the boundaries it cares about (it already holds
// the prompt's per-block prefix hashes) and passes those that answered yes. The planner
// stays pure and cheap: it reads each entry once (O(n)), in any order; duplicates, zero,
// entries off the block grid and entries above P - 1 are never chosen. Only boundaries in
// (0, P - 1] on the block grid are worth asking about.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <variant>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/detail/enum_sentinel.hpp>
#include <kvfuse/engine/capability.hpp>

namespace kvfuse {

/// The two grids the plan is made on; the same values travel in StateSpec and must equal
/// the ranks' RankGeometry (R11).
struct PlanGrids {
  std::uint32_t block_tokens = 16;   ///< block grid = checkpoint grid
  std::uint32_t chunk_tokens = 256;  ///< chunk grid: a nonzero multiple of block_tokens

  /// Both nonzero and chunk_tokens a multiple of block_tokens.
  [[nodiscard]] constexpr bool valid() const noexcept {
    return block_tokens > 0 && chunk_tokens > 0 && chunk_tokens % block_tokens == 0;
  }
  [[nodiscard]] constexpr TokenGrid block_grid() const noexcept { return TokenGrid{block_tokens}; }
  [[nodiscard]] constexpr TokenGrid chunk_grid() const noexcept { return TokenGrid{chunk_tokens}; }
  friend constexpr bool operator==(PlanGrids, PlanGrids) noexcept = default;
};

/// What a load costs against recomputing the tokens it spares, for the planner's
/// break-even (rule 4 of the header comment). Times are nanoseconds, bytes are what one rank
/// reads (ranks read their slices at once, so one rank's leg is the load's time). Plain data;
/// every member constexpr and noexcept, any thread.
///
/// Values are the caller's to check (CoordinatorOptions checks them: finite, not negative);
/// the planner itself never fails on them: a NaN anywhere but in recompute_ns_per_token
/// makes a load pay, a NaN there turns the check off.
struct BreakEven {
  /// The engine's prefill time per token; 0 (the default) turns the break-even off.
  double recompute_ns_per_token = 0;
  double tier_ns_per_byte = 0;      ///< the tier's time per byte read: 1e9 / its bandwidth in bytes per second
  double tier_latency_ns = 0;       ///< the fixed time of one leg (a round trip, a file open)
  std::uint64_t kv_chunk_bytes = 0; ///< bytes one rank reads per KV chunk
  std::uint64_t state_bytes = 0;    ///< bytes one rank reads per state checkpoint

  /// Costs from a bandwidth in bytes per second (0: reading is free) and a latency.
  static constexpr BreakEven from_bandwidth(double recompute_ns_per_token, double bytes_per_second, double latency_ns,
                                            std::uint64_t kv_chunk_bytes, std::uint64_t state_bytes) noexcept {
    return {recompute_ns_per_token, bytes_per_second > 0 ? 1e9 / bytes_per_second : 0.0, latency_ns, kv_chunk_bytes,
            state_bytes};
  }
  /// Whether the planner weighs loads at all: recompute_ns_per_token > 0.
  [[nodiscard]] constexpr bool enabled() const noexcept { return recompute_ns_per_token > 0; }
  /// The time of a KV leg of `chunks` chunks.
  [[nodiscard]] constexpr double kv_leg_ns(std::uint64_t chunks) const noexcept {
    return tier_latency_ns + static_cast<double>(chunks) * static_cast<double>(kv_chunk_bytes) * tier_ns_per_byte;
  }
  /// The time of a state leg (one checkpoint).
  [[nodiscard]] constexpr double state_leg_ns() const noexcept {
    return tier_latency_ns + static_cast<double>(state_bytes) * tier_ns_per_byte;
  }
  /// Whether a load taking `load_ns` pays for itself against recomputing `spared` tokens.
  /// Always true when the check is off.
  [[nodiscard]] constexpr bool pays(double load_ns, TokenCount spared) const noexcept {
    return !enabled() || !(load_ns > static_cast<double>(spared) * recompute_ns_per_token);
  }
  friend constexpr bool operator==(const BreakEven&, const BreakEven&) noexcept = default;
};

/// Everything the planner decides from. Plain data; the span is borrowed for the call.
struct PlanInput {
  TokenCount prompt_tokens = 0;  ///< P: the prompt length (> 0)
  TokenCount hbm = 0;            ///< tokens resident on the device (prefix-cache hit); on the block grid
  /// Length in tokens of the leading run of the prompt's chunks the tier holds (e.g. from
  /// rank 0's tier); on the chunk grid, at most P.
  TokenCount lookup_tokens = 0;
  /// Boundaries B for which OffloadIndex::could_serve(hash at B) said yes. Any order;
  /// ignored for a dense model. See the header comment.
  std::span<const TokenCount> servable_boundaries;
  StateLayout layout = StateLayout::none;  ///< the model's shape
  PlanGrids grids;
  /// The smallest prefill saving worth a load (rule 5 of the header comment); 0: any.
  TokenCount min_load_tokens = 0;
  /// What a load costs against recomputing (rule 4); the default is off: every load pays.
  BreakEven break_even{};
};

/// Why the planner chose not to load. Each value is decided by exactly one rule.
enum class NoLoadReason : std::uint8_t {
  bad_grids,                     ///< block or chunk grid zero, or chunk_tokens not a multiple of block_tokens
  unknown_layout,                ///< the StateLayout value is none of the known ones
  empty_prompt,                  ///< prompt_tokens == 0
  hbm_off_block_grid,            ///< the HBM floor is not on the block grid: ranks refuse it
  lookup_off_chunk_grid,         ///< the lookup is not a whole number of chunks
  lookup_beyond_prompt,          ///< the lookup claims more tokens than the prompt has
  lookup_within_hbm,             ///< the tier holds nothing above the HBM floor
  chunk_holds_last_token,        ///< dense: every tier chunk above hbm reaches the last prompt token
  nothing_servable_above_hbm,    ///< stateful: no servable boundary B with 0 < B <= P - 1 at all
                                 ///< (none above hbm and none at or below it)
  covering_chunk_beyond_lookup,  ///< stateful: the chunk covering every boundary above hbm is not all in the tier
  load_too_small,                ///< the best load spares fewer than min_load_tokens tokens of prefill
  /// The chunk holding the prompt's last token would end past 2^64 - 1 (P > the chunk
  /// grid's max_aligned()): the grids' arithmetic over the prompt cannot be represented, so
  /// the input is refused (R11) rather than wrapped. Checked right after empty_prompt.
  prompt_too_long_for_grids,
  /// Rule 4: every load the tier could serve takes longer than recomputing what it spares
  /// (BreakEven); the prompt is computed.
  slower_than_recompute,
};
/// The highest NoLoadReason value; the static_assert below to_string checks it is the last.
inline constexpr NoLoadReason last_no_load_reason = NoLoadReason::slower_than_recompute;

/// Short, stable name of a NoLoadReason, for engine logs. Constexpr, noexcept, thread-safe.
constexpr std::string_view to_string(NoLoadReason r) noexcept {
  switch (r) {
    case NoLoadReason::bad_grids: return "bad_grids";
    case NoLoadReason::unknown_layout: return "unknown_layout";
    case NoLoadReason::empty_prompt: return "empty_prompt";
    case NoLoadReason::hbm_off_block_grid: return "hbm_off_block_grid";
    case NoLoadReason::lookup_off_chunk_grid: return "lookup_off_chunk_grid";
    case NoLoadReason::lookup_beyond_prompt: return "lookup_beyond_prompt";
    case NoLoadReason::lookup_within_hbm: return "lookup_within_hbm";
    case NoLoadReason::chunk_holds_last_token: return "chunk_holds_last_token";
    case NoLoadReason::nothing_servable_above_hbm: return "nothing_servable_above_hbm";
    case NoLoadReason::covering_chunk_beyond_lookup: return "covering_chunk_beyond_lookup";
    case NoLoadReason::load_too_small: return "load_too_small";
    case NoLoadReason::prompt_too_long_for_grids: return "prompt_too_long_for_grids";
    case NoLoadReason::slower_than_recompute: return "slower_than_recompute";
  }
  return "unknown_no_load_reason";
}
static_assert(detail::is_last_named(last_no_load_reason),
              "last_no_load_reason is not the last NoLoadReason: move it to the new last value");

/// Compute; load nothing.
struct NoLoad {
  NoLoadReason reason = NoLoadReason::bad_grids;
  friend constexpr bool operator==(NoLoad, NoLoad) noexcept = default;
};
/// Dense: fill [hbm, end) from the tier; the request claims `end` tokens.
struct KvOnlyLoad {
  TokenCount hbm = 0;  ///< the HBM floor the KV spec starts at (on the block grid)
  TokenCount end = 0;  ///< on the chunk grid; <= lookup; <= floor_chunk(P - 1)
  friend constexpr bool operator==(KvOnlyLoad, KvOnlyLoad) noexcept = default;
};
/// Stateful: restore the state at `boundary` and fill [hbm, end); the request claims
/// `boundary` tokens, never `end`.
struct JointLoad {
  TokenCount hbm = 0;       ///< the HBM floor, on the block grid (any, DSV4 included)
  TokenCount end = 0;       ///< the chunk covering `boundary`; <= lookup
  TokenCount boundary = 0;  ///< B: hbm < B <= P - 1, on the block grid, servable
  friend constexpr bool operator==(JointLoad, JointLoad) noexcept = default;
};
/// Stateful: the KV of [0, boundary) is resident; restore the state only (no KV spec, R10).
struct StateOnlyLoad {
  TokenCount boundary = 0;  ///< B: 0 < B <= hbm, B <= P - 1, on the block grid, servable
  friend constexpr bool operator==(StateOnlyLoad, StateOnlyLoad) noexcept = default;
};

/// Exactly one decision. Every alternative is trivially copyable, so a LoadPlan is never
/// valueless; read it with std::get_if / index() (or std::visit).
using LoadPlan = std::variant<NoLoad, KvOnlyLoad, JointLoad, StateOnlyLoad>;

/// The planner. Pure: the answer depends on `in` alone; no allocation; constexpr; noexcept;
/// thread-safe. The rules are in the header comment.
constexpr LoadPlan plan_load(const PlanInput& in) noexcept {
  const PlanGrids grids = in.grids;
  if (!grids.valid()) return NoLoad{NoLoadReason::bad_grids};
  if (in.layout != StateLayout::none && in.layout != StateLayout::dsv4_slot && in.layout != StateLayout::k3_recurrent)
    return NoLoad{NoLoadReason::unknown_layout};
  const TokenCount prompt = in.prompt_tokens, hbm = in.hbm, lookup = in.lookup_tokens;
  if (prompt == 0) return NoLoad{NoLoadReason::empty_prompt};
  const TokenGrid blocks = grids.block_grid(), chunks = grids.chunk_grid();
  // From here on every token count is at most P <= chunks.max_aligned(), so the chunk
  // covering any of them fits in a TokenCount (and so does the block covering it: the chunk
  // is a multiple of the block), and no step below can wrap.
  if (prompt > chunks.max_aligned()) return NoLoad{NoLoadReason::prompt_too_long_for_grids};
  if (!blocks.aligned(hbm)) return NoLoad{NoLoadReason::hbm_off_block_grid};
  if (!chunks.aligned(lookup)) return NoLoad{NoLoadReason::lookup_off_chunk_grid};
  if (lookup > prompt) return NoLoad{NoLoadReason::lookup_beyond_prompt};
  const TokenCount last = prompt - 1;  // the highest token count a load may claim

  if (in.layout == StateLayout::none) {
    if (lookup <= hbm) return NoLoad{NoLoadReason::lookup_within_hbm};
    const TokenCount end = std::min(lookup, chunks.floor(last));
    if (end <= hbm) return NoLoad{NoLoadReason::chunk_holds_last_token};
    const std::uint64_t moved = end / grids.chunk_tokens - hbm / grids.chunk_tokens;  // chunks overlapping [hbm, end)
    if (!in.break_even.pays(in.break_even.kv_leg_ns(moved), end - hbm)) return NoLoad{NoLoadReason::slower_than_recompute};
    if (end - hbm < in.min_load_tokens) return NoLoad{NoLoadReason::load_too_small};
    return KvOnlyLoad{hbm, end};
  }

  // Stateful. `lookup` is on the chunk grid, so ceil_chunk(B) <= lookup exactly when
  // B <= lookup; testing it that way cannot overflow.
  // Each candidate is weighed on its own (rule 4): a state-only one by its state leg, a
  // joint one by the longer of its legs. The KV leg's chunks start at the one holding hbm.
  const BreakEven& cost = in.break_even;
  const std::uint64_t first_chunk = hbm / grids.chunk_tokens;
  TokenCount joint_b = 0, state_b = 0;
  bool any_above = false, any_candidate = false;
  for (const TokenCount b : in.servable_boundaries) {
    if (b == 0 || b > last || !blocks.aligned(b)) continue;
    if (b <= hbm) {
      any_candidate = true;
      if (cost.pays(cost.state_leg_ns(), b)) state_b = std::max(state_b, b);
    } else {
      any_above = true;
      if (b > lookup) continue;
      any_candidate = true;
      const std::uint64_t moved = chunks.cells_covering(b) - first_chunk;
      if (cost.pays(std::max(cost.kv_leg_ns(moved), cost.state_leg_ns()), b)) joint_b = std::max(joint_b, b);
    }
  }
  if (joint_b > 0) {
    if (joint_b < in.min_load_tokens) return NoLoad{NoLoadReason::load_too_small};
    return JointLoad{hbm, chunks.ceil(joint_b), joint_b};
  }
  if (state_b > 0) {
    if (state_b < in.min_load_tokens) return NoLoad{NoLoadReason::load_too_small};
    return StateOnlyLoad{state_b};
  }
  if (any_candidate) return NoLoad{NoLoadReason::slower_than_recompute};
  if (!any_above) return NoLoad{NoLoadReason::nothing_servable_above_hbm};
  if (lookup <= hbm) return NoLoad{NoLoadReason::lookup_within_hbm};
  return NoLoad{NoLoadReason::covering_chunk_beyond_lookup};
}

/// Tokens the request may treat as computed once the load succeeds: `end` for a KV-only
/// load, B for a joint or state-only load (never the joint load's `end`), 0 for NoLoad.
/// Constexpr, noexcept, thread-safe.
constexpr TokenCount claimed_tokens(const LoadPlan& plan) noexcept {
  if (const auto* kv = std::get_if<KvOnlyLoad>(&plan)) return kv->end;
  if (const auto* joint = std::get_if<JointLoad>(&plan)) return joint->boundary;
  if (const auto* state = std::get_if<StateOnlyLoad>(&plan)) return state->boundary;
  return 0;
}

/// B, for a plan with a state leg (joint or state-only); empty otherwise. The StateSpec's
/// boundary_tokens, and the position of its boundary_hash. Constexpr, noexcept, thread-safe.
constexpr std::optional<TokenCount> state_boundary(const LoadPlan& plan) noexcept {
  if (const auto* joint = std::get_if<JointLoad>(&plan)) return joint->boundary;
  if (const auto* state = std::get_if<StateOnlyLoad>(&plan)) return state->boundary;
  return std::nullopt;
}

/// A half-open range [first, last) of chunk or block indices within the prompt.
struct IndexRange {
  std::uint64_t first = 0;
  std::uint64_t last = 0;
  [[nodiscard]] constexpr std::uint64_t size() const noexcept { return last - first; }
  [[nodiscard]] constexpr bool empty() const noexcept { return last == first; }
  friend constexpr bool operator==(IndexRange, IndexRange) noexcept = default;
};

/// The token range [hbm, end) of the plan's KV leg (KvSpec::hbm and ::end), if it has one;
/// empty for a state-only load (R10: no KV spec at all) or no load. Constexpr, noexcept.
constexpr std::optional<IndexRange> kv_tokens(const LoadPlan& plan) noexcept {
  if (const auto* kv = std::get_if<KvOnlyLoad>(&plan)) return IndexRange{kv->hbm, kv->end};
  if (const auto* joint = std::get_if<JointLoad>(&plan)) return IndexRange{joint->hbm, joint->end};
  return std::nullopt;
}

/// The prompt's chunk indices the KV spec needs: [floor(hbm / chunk), end / chunk), i.e. the
/// chunks overlapping [hbm, end), first the one containing hbm. KvSpec::chunk_keys is the
/// engine's per-chunk key vector sliced to this range. Empty for a plan without a KV leg,
/// or for invalid `grids` (pass the grids the plan was made with). Never wraps, whatever
/// the plan holds (TokenGrid::cells_covering is exact up to 2^64 - 1). Constexpr, noexcept.
constexpr IndexRange chunk_range(const LoadPlan& plan, PlanGrids grids) noexcept {
  const std::optional<IndexRange> tokens = kv_tokens(plan);
  if (!tokens || !grids.valid()) return {};
  const TokenGrid chunks = grids.chunk_grid();
  return {chunks.cell_of(tokens->first), chunks.cells_covering(tokens->last)};
}

/// The request's block indices the KV spec fills: [hbm / block, end / block), the blocks
/// covering [hbm, end). KvSpec::blocks is the request's block table sliced to this range.
/// Empty for a plan without a KV leg, or for invalid `grids`. Never wraps, like chunk_range.
/// Constexpr, noexcept.
constexpr IndexRange block_range(const LoadPlan& plan, PlanGrids grids) noexcept {
  const std::optional<IndexRange> tokens = kv_tokens(plan);
  if (!tokens || !grids.valid()) return {};
  const TokenGrid blocks = grids.block_grid();
  return {blocks.cell_of(tokens->first), blocks.cells_covering(tokens->last)};
}

}  // namespace kvfuse
