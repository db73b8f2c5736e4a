// kvfuse/engine/detail/coordinator_steps.hpp — the pure steps the Coordinator strings
// together: what the tier holds of the prompt, the planner's answer over it, the prefill
// checkpoints for a resume point, the KV leg of a load and the chunks of a KV save, cut from
// the request's keys and blocks. Each is a function of its arguments; the Coordinator adds
// the side effects (the ticket, the admission, the watermark).
//
// Internal: the Coordinator's; scheduler thread only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/save_request.hpp>
#include <kvfuse/engine/checkpoint_policy.hpp>
#include <kvfuse/engine/coordinator_types.hpp>
#include <kvfuse/engine/planner.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse::detail {

/// `o`, or Error(invalid_argument) naming the bad value: grids that are zero or disagree,
/// an unknown layout.
inline CoordinatorOptions validated(const CoordinatorOptions& o) {
  if (!o.grids.valid())
    throw Error(ErrorCode::invalid_argument,
                "Coordinator grids must be nonzero with chunk_tokens a multiple of block_tokens, got block_tokens " +
                    std::to_string(o.grids.block_tokens) + ", chunk_tokens " + std::to_string(o.grids.chunk_tokens));
  if (!is_known(o.layout))
    throw Error(ErrorCode::invalid_argument, "Coordinator layout is unknown: " + std::to_string(static_cast<int>(o.layout)));
  const auto check_cost = [](const char* name, double v) {
    if (!std::isfinite(v) || v < 0)
      throw Error(ErrorCode::invalid_argument,
                  std::string("CoordinatorOptions::break_even.") + name + " must be finite and >= 0, got " + std::to_string(v));
  };
  check_cost("recompute_ns_per_token", o.break_even.recompute_ns_per_token);
  check_cost("tier_ns_per_byte", o.break_even.tier_ns_per_byte);
  check_cost("tier_latency_ns", o.break_even.tier_latency_ns);
  if (o.measure_load_cost) {
    if (o.break_even.kv_chunk_bytes == 0)
      throw Error(ErrorCode::invalid_argument,
                  "CoordinatorOptions::measure_load_cost needs break_even.kv_chunk_bytes > 0 (the bytes a load reads), got 0");
    if (o.layout != StateLayout::none && o.break_even.state_bytes == 0)
      throw Error(ErrorCode::invalid_argument,
                  "CoordinatorOptions::measure_load_cost needs break_even.state_bytes > 0 for a stateful layout, got 0");
    if (o.min_timed_loads == 0)
      throw Error(ErrorCode::invalid_argument, "CoordinatorOptions::min_timed_loads must be > 0 when measuring, got 0");
  }
  return o;
}

/// The prompt tokens the tier holds: the engine's lookup over the prompt's chunk keys, in
/// whole chunks (a partial last chunk of the prompt is never in the tier).
template <class Lookup>
TokenCount lookup_tokens(const AdmitRequest& req, const PlanGrids& grids, Lookup& lookup) {
  const std::size_t prompt_chunks = grids.chunk_grid().cells_covering(req.prompt_tokens);
  const std::size_t n = std::min(req.chunk_keys.size(), prompt_chunks);
  const std::size_t held = std::min<std::size_t>(static_cast<std::size_t>(lookup(req.chunk_keys.first(n))), n);
  return std::min<TokenCount>(held * grids.chunk_tokens, grids.chunk_grid().floor(req.prompt_tokens));
}

/// The planner's answer for `req` over `lookup` tokens in the tier and the checkpoints
/// `could_serve(hash)` says the index serves (stateful layouts only). `servable` is scratch.
/// `cost`: the break-even in force (the configured one, or the measured one).
template <class CouldServe>
LoadPlan plan_for(const AdmitRequest& req, TokenCount lookup, const CoordinatorOptions& o, const BreakEven& cost,
                  CouldServe&& could_serve, std::vector<TokenCount>& servable) {
  servable.clear();
  if (o.layout != StateLayout::none)
    for (const Checkpoint& c : req.checkpoints)
      if (could_serve(c.hash)) servable.push_back(c.boundary);
  return plan_load(PlanInput{req.prompt_tokens, req.hbm, lookup, servable, o.layout, o.grids, o.min_load_tokens, cost});
}

/// The prefill checkpoints of a stateful request that resumes at `resume`, at most `most`
/// (the highest-priority ones): its branch point is as far as its prefix is known to be
/// shared, in the tier or in HBM. Empty for a dense model.
inline std::vector<TokenCount> prefill_checkpoints(const AdmitRequest& req, const CoordinatorOptions& o, TokenCount lookup,
                                                   TokenCount resume, std::size_t most) {
  if (o.layout == StateLayout::none) return {};
  const CheckpointInput in{req.prompt_tokens, resume, std::max(lookup, req.hbm), o.grids, o.checkpoints};
  std::vector<TokenCount> out(std::min(count_checkpoints(in), most));
  out.resize(plan_checkpoints(in, out));
  return out;
}

/// The hash the request gives for the checkpoint at `boundary` (empty if it gives none).
inline PrefixHash hash_at(const AdmitRequest& req, TokenCount boundary) noexcept {
  for (const Checkpoint& c : req.checkpoints)
    if (c.boundary == boundary) return c.hash;
  return PrefixHash{};
}

/// The KV tokens beyond hbm the tier's plan restores: what the offload sub offers a
/// composition (0 for a state-only plan or none).
inline TokenCount offer_of(const LoadPlan& p, TokenCount hbm) noexcept {
  if (std::holds_alternative<KvOnlyLoad>(p) || std::holds_alternative<JointLoad>(p)) return claimed_tokens(p) - hbm;
  return 0;
}

/// The KV leg of `plan`, cut from the request's chunk keys and block table; nothing for a
/// plan without one. `covered` turns false when the keys or blocks end before the plan's
/// range (the engine handed in too few: the request computes).
inline std::optional<KvSpec> kv_spec_for(const LoadPlan& plan, const AdmitRequest& req, const PlanGrids& grids, bool& covered) {
  covered = true;
  const auto tokens = kv_tokens(plan);
  if (!tokens) return std::nullopt;
  const IndexRange chunks = chunk_range(plan, grids);
  const IndexRange blocks = block_range(plan, grids);
  if (chunks.last > req.chunk_keys.size() || blocks.last > req.blocks.size()) {
    covered = false;
    return std::nullopt;
  }
  return KvSpec{tokens->first, tokens->last,
                {req.chunk_keys.begin() + static_cast<std::ptrdiff_t>(chunks.first),
                 req.chunk_keys.begin() + static_cast<std::ptrdiff_t>(chunks.last)},
                {req.blocks.begin() + static_cast<std::ptrdiff_t>(blocks.first),
                 req.blocks.begin() + static_cast<std::ptrdiff_t>(blocks.last)}};
}

/// The KV save of a request whose tier holds its KV below `watermark` and which computed
/// `computed` tokens: the whole chunks from the watermark up to the chunk-floored frontier,
/// keyed by the last of them; nothing when there is no whole new chunk or the keys and
/// blocks do not cover them.
inline std::optional<KvSave> kv_save_for(const PlanGrids& grids, TokenCount watermark, TokenCount computed,
                                         std::span<const PrefixHash> keys, std::span<const BlockId> blocks) {
  const TokenGrid chunks = grids.chunk_grid();
  const std::uint64_t from = chunks.cell_of(watermark);
  const std::uint64_t to = chunks.cell_of(chunks.floor(computed));
  const std::uint64_t blocks_per_chunk = grids.chunk_tokens / grids.block_tokens;
  if (to <= from || to > keys.size() || to * blocks_per_chunk > blocks.size()) return std::nullopt;
  return KvSave{SaveKey{keys[to - 1], {}},
                {keys.begin() + static_cast<std::ptrdiff_t>(from), keys.begin() + static_cast<std::ptrdiff_t>(to)},
                {blocks.begin() + static_cast<std::ptrdiff_t>(from * blocks_per_chunk),
                 blocks.begin() + static_cast<std::ptrdiff_t>(to * blocks_per_chunk)}};
}

/// Where a load that failed part way resumes (salvage, docs/reference.md#salvage).
struct SalvagePoint {
  TokenCount tokens = 0;                 ///< resume here now (0: recompute; a second load supersedes it)
  std::optional<Checkpoint> second_load; ///< a state-only load that resumes higher: send it, resume on its settlement
};

/// The salvage of a failed load from what it planned and what every live rank restored.
/// The KV in the request's blocks runs to the frontier: the HBM floor, or the leading
/// `kv_restored` chunks of its KV leg from `kv_from`. A dense model resumes there. A stateful
/// model needs the state at its resume point too: the highest servable checkpoint
/// (`fallbacks`, ascending; `could_serve` asks the index now, after the retraction) at or
/// below the frontier, through a second, state-only load, unless this is one already;
/// else the HBM floor's own state if the engine holds it; else nothing. Pure.
template <class CouldServe>
SalvagePoint salvage_point(StateLayout layout, TokenCount hbm, TokenCount kv_from, TokenCount kv_end,
                           std::uint32_t kv_restored, TokenCount chunk_tokens, bool hbm_state_held, bool second,
                           const std::vector<Checkpoint>& fallbacks, CouldServe&& could_serve) {
  const TokenCount restored_to =
      kv_end > kv_from ? std::min<TokenCount>(kv_end, kv_from + TokenCount{kv_restored} * chunk_tokens) : hbm;
  const TokenCount frontier = std::max(hbm, restored_to);
  SalvagePoint p;
  if (layout == StateLayout::none) {
    p.tokens = frontier > hbm ? frontier : 0;
    return p;
  }
  const TokenCount own = hbm_state_held ? hbm : 0;
  if (!second)
    for (auto it = fallbacks.rbegin(); it != fallbacks.rend(); ++it)
      if (it->boundary <= frontier && it->boundary > own && could_serve(it->hash)) {
        p.second_load = *it;
        return p;
      }
  p.tokens = own;
  return p;
}

}  // namespace kvfuse::detail
