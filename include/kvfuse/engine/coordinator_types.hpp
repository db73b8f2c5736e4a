// kvfuse/engine/coordinator_types.hpp — what the engine and the Coordinator say to each
// other (docs/reference.md#coordinator): the transport and lookup it is given, the
// requests it admits and finishes, and what it answers. Plain data and concepts; the
// Coordinator itself is engine/coordinator.hpp.
//
// Threading: plain data; the transport and the lookup are called on the scheduler thread.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/resolution.hpp>
#include <kvfuse/bridge/save_request.hpp>
#include <kvfuse/engine/checkpoint_policy.hpp>
#include <kvfuse/engine/index_options.hpp>
#include <kvfuse/engine/planner.hpp>
#include <kvfuse/engine/tickets.hpp>

namespace kvfuse {

/// How the coordinator reaches the ranks: `send(x) -> bool` for a LoadRequest, a KvSave
/// and a StateSave. True: the data is on its way to every rank (each will report, R1).
/// False: it was dropped before any rank could see it (the transport is down, or the
/// connector found at build time that the tier lost the prefix); the coordinator then
/// resolves it itself in the same step, so nothing waits for records that never come.
/// Called on the scheduler thread; must not call back into the coordinator.
template <class T>
concept CoordinatorTransport = requires(T& t, const LoadRequest& load, const KvSave& kv, const StateSave& state) {
  { t.send(load) } -> std::convertible_to<bool>;
  { t.send(kv) } -> std::convertible_to<bool>;
  { t.send(state) } -> std::convertible_to<bool>;
};

/// The tier's KV lookup the engine provides: how many leading chunks of `keys` the tier
/// holds (for example, asked of rank 0's tier, as LMCache asks its first worker; ranks
/// whose tiers diverge are the quorum's business). Scheduler thread.
template <class L>
concept KvLookup = requires(L& lookup, std::span<const PrefixHash> keys) {
  { lookup(keys) } -> std::convertible_to<std::size_t>;
};

/// A state checkpoint the engine can name: its boundary B (on the block grid) and the
/// prefix hash of the tokens before it.
struct Checkpoint {
  TokenCount boundary = 0;
  PrefixHash hash;
  friend constexpr bool operator==(const Checkpoint&, const Checkpoint&) = default;
};

/// What the engine tells the coordinator about a request it admits. The spans are read
/// during the call only.
struct AdmitRequest {
  RequestId id;
  TokenCount prompt_tokens = 0;             ///< P
  TokenCount hbm = 0;                       ///< tokens already resident (prefix-cache hit), on the block grid
  std::span<const PrefixHash> chunk_keys;   ///< the prompt's chunk keys, chunk i covering [i*chunk, (i+1)*chunk)
  std::span<const BlockId> blocks;          ///< the request's block table, block i holding [i*block, (i+1)*block)
  std::span<const Checkpoint> checkpoints;  ///< candidate state boundaries (stateful models)
  std::optional<SlotId> slot;               ///< the request's state slot (stateful models)
  /// Stateful models: the engine itself holds the state at `hbm` (its slot has it, the way a
  /// serving engine's own cells do), so a partly failed load can still resume at `hbm`.
  bool hbm_state_held = false;
};

/// What the engine tells the coordinator when a request finished: finish() saves what it
/// computed and ends its admission, so its blocks and slot come back as a Freed once no
/// rank reads them. Spans are read during the call only.
struct FinishRequest {
  RequestId id;
  TokenCount computed_tokens = 0;           ///< the frontier: KV exists for [0, computed_tokens)
  std::span<const PrefixHash> chunk_keys;   ///< as in AdmitRequest, covering at least the frontier
  std::span<const BlockId> blocks;          ///< as in AdmitRequest
  std::optional<Checkpoint> checkpoint;     ///< the state to save (stateful), with its slot below
  std::optional<SlotId> slot;
};

/// Why admit() did not park the request: compute it now.
enum class ComputeReason : std::uint8_t {
  planned_no_load,   ///< the planner chose no load (see `no_load`)
  index_refused,     ///< the index refused the ticket (see `refusal`)
  no_slot,           ///< a stateful plan but the request has no slot
  bad_request,       ///< the chunk keys or blocks do not cover the plan's range
  already_parked,    ///< the request already waits on a load
  transfer_refused,  ///< a P/D sub won the KV load but could not start its transfer
};

/// Short, stable name of a ComputeReason. Thread-safe, noexcept.
constexpr std::string_view to_string(ComputeReason r) noexcept {
  switch (r) {
    case ComputeReason::planned_no_load: return "planned_no_load";
    case ComputeReason::index_refused: return "index_refused";
    case ComputeReason::no_slot: return "no_slot";
    case ComputeReason::bad_request: return "bad_request";
    case ComputeReason::already_parked: return "already_parked";
    case ComputeReason::transfer_refused: return "transfer_refused";
  }
  return "unknown_reason";
}

/// One admission of a request: admit() starts one, finish() or teardown() ends it. A request
/// keeps its RequestId across preemption and re-admission; each admission holds its own
/// block table and slot, so each is freed on its own, exactly once, under its own id.
/// Ids are issued by the Coordinator, from 1, never reused while it lives.
struct AdmissionId {
  std::uint64_t value = 0;
  friend constexpr auto operator<=>(AdmissionId, AdmissionId) noexcept = default;
};

/// A Freed event: no rank reads or writes the blocks and slot this admission of this
/// request held any more (its load ended, its saves' sources were released): the engine
/// frees them. The only signal an engine under a Coordinator listens to for that.
struct Freed {
  RequestId request;
  AdmissionId admission;
  friend constexpr bool operator==(const Freed&, const Freed&) = default;
};

/// The answer of admit(): parked on a load, or compute now.
struct AdmitDecision {
  bool parked = false;
  AdmissionId admission{};                ///< the admission this call started (or the parked one: already_parked)
  LoadPlan plan = NoLoad{};
  /// Stateful models: the boundaries at which the engine should stop this request's
  /// prefill and hand the state to checkpoint() (the coordinator's CheckpointPolicy over
  /// this admission: ascending, in (resume, P - 1]); empty for a dense model.
  std::vector<TokenCount> checkpoints;
  LoadKey key{};                          ///< the load it waits on (parked only)
  TokenCount claimed_tokens = 0;          ///< what the load gives back if it completes (parked only)
  ComputeReason reason = ComputeReason::planned_no_load;  ///< why not (compute only)
  NoLoadReason no_load = NoLoadReason::lookup_within_hbm; ///< planned_no_load only
  LoadRefusal refusal = LoadRefusal::none;                ///< index_refused only
  std::optional<std::size_t> sub;  ///< admitted through a composition: the sub that owns the KV load
  bool state_waived = false;     ///< a P/D sub won: the servable state leg was waived (R16)
};

/// What Coordinator::plan() answers: the plan admit() would make for the same request
/// now, without its side effects (no ticket, no admission, no watermark, no LRU touch).
struct AdmissionPlan {
  LoadPlan load = NoLoad{};
  TokenCount lookup_tokens = 0;          ///< the tier's answer, in whole chunks within P
  TokenCount claimed_tokens = 0;         ///< what the load gives back if it completes (0 for NoLoad)
  std::vector<TokenCount> checkpoints;   ///< where the prefill stops to capture state (stateful models)
};

/// What checkpoint() did with a state the engine captured into a snapshot slot.
enum class CheckpointResult : std::uint8_t {
  saved,            ///< a StateSave went to every rank: the snapshot slot comes back in a step's `snapshots`
  already_indexed,  ///< the index already serves this hash, or a save of it is in flight: nothing sent (counted)
  not_stateful,     ///< the model has no state: nothing sent
  refused,          ///< the index could not record the save (out of memory): nothing sent
  dropped,          ///< the transport dropped it before any rank saw it: nothing read the slot
};

/// Short, stable name of a CheckpointResult. Thread-safe, noexcept.
constexpr std::string_view to_string(CheckpointResult r) noexcept {
  switch (r) {
    case CheckpointResult::saved: return "saved";
    case CheckpointResult::already_indexed: return "already_indexed";
    case CheckpointResult::not_stateful: return "not_stateful";
    case CheckpointResult::refused: return "refused";
    case CheckpointResult::dropped: return "dropped";
  }
  return "unknown_checkpoint_result";
}

/// A progress save of a running request: the KV chunks computed so far and, optionally, a
/// state checkpoint the engine copied into a snapshot slot. The admission goes on; its
/// blocks are only read. Spans are read during the call only.
struct ProgressSave {
  RequestId id;
  TokenCount computed_tokens = 0;          ///< the frontier: KV exists for [0, computed_tokens)
  std::span<const PrefixHash> chunk_keys;  ///< as in AdmitRequest, covering at least the frontier
  std::span<const BlockId> blocks;         ///< as in AdmitRequest
  std::optional<Checkpoint> checkpoint;    ///< the state to save, held in `snapshot`
  std::optional<SlotId> snapshot;
};

/// One request the scheduler resumes. `tokens` = where it continues: what the load
/// restored, its KV below `tokens` in the request's blocks and, for a stateful model, the
/// state at `tokens` in its slot; 0 = recompute from the start (nothing could be salvaged,
/// the load was abandoned, or the state leg was waived). A load that failed part way can
/// still resume above 0 (salvage, docs/reference.md#salvage): then `salvaged` is set, only
/// the blocks below `tokens` were filled, and the blocks above must not be trusted.
struct Unpark {
  RequestId request;
  TokenCount tokens = 0;
  Resolution kind = Resolution::completed;
  bool state_missed = false;
  bool salvaged = false;  ///< resumed below what the load claimed (a dense load's restored prefix, a second load, the engine's own state at hbm)
  friend constexpr bool operator==(const Unpark&, const Unpark&) = default;
};

/// Construction options of a Coordinator. Checked at construction: a bad value is a
/// kvfuse::Error naming it.
struct CoordinatorOptions {
  StateLayout layout = StateLayout::none;  ///< the model's shape
  PlanGrids grids;                          ///< must match every rank's geometry
  TokenCount min_load_tokens = 0;           ///< passed to the planner
  std::size_t expected_requests = 1024;     ///< sizes the tables so steady state never rehashes
  /// Where stateful requests capture state checkpoints (AdmitDecision::checkpoints); the
  /// default places them at branch points, the prompt's end and every 8 chunks, at most 4.
  CheckpointPolicy checkpoints{};
  /// Passed to the planner: a load slower than recomputing what it spares is not made
  /// (NoLoadReason::slower_than_recompute, counted). Off by default. Its three times must be
  /// finite and >= 0 (checked at construction, naming the field).
  BreakEven break_even{};
  /// Times the loads (LoadCostMeter, engine/load_cost.hpp): each completed load's time from
  /// dispatch to the step that settles it (the Coordinator's Clock), against the bytes its
  /// longer leg read on one rank (break_even's kv_chunk_bytes and state_bytes, which must
  /// then be > 0). Once `min_timed_loads` loads were timed, the fit replaces break_even's
  /// tier_ns_per_byte and tier_latency_ns: the tier's speed is measured, not configured.
  bool measure_load_cost = false;
  std::uint32_t min_timed_loads = 8;  ///< loads timed before the fit is used (> 0 when measuring)
};

/// What one Coordinator::step() produced. The spans stay valid until the next step() or
/// tick().
struct CoordinatorStep {
  std::span<const Unpark> unparked;   ///< resume these (once each)
  std::span<const Freed> freed;       ///< free these admissions' blocks and slot: no rank reads or writes them
  std::size_t records = 0;            ///< records the pump drained
  std::span<const SlotId> snapshots;  ///< snapshot slots every rank released: the engine may reuse them
};

/// What one Coordinator::tick() produced. The span stays valid until the next tick().
struct CoordinatorTick {
  std::size_t reclaimed = 0;             ///< orphans reclaimed (their release comes out of the next step)
  std::span<const OverdueLoad> overdue;  ///< loads in flight at least `overdue_after`; nothing freed
};

/// Counters and gauges of a Coordinator, read in O(1).
struct CoordinatorStats {
  std::uint64_t admitted = 0;          ///< admit() calls
  std::uint64_t parked = 0;            ///< admissions that parked on a load
  std::uint64_t computed = 0;          ///< admissions told to compute now
  std::uint64_t unparked = 0;          ///< Unpark events handed out
  std::uint64_t unparked_with_tokens = 0;  ///< ... of which resumed from a load
  std::uint64_t transport_drops = 0;   ///< loads and saves the transport dropped or threw on (resolved here as dropped)
  std::uint64_t torn_down = 0;         ///< teardown() of a parked request
  std::uint64_t freed = 0;             ///< Freed events handed out (one per admission: blocks and slot free)
  std::uint64_t saves_submitted = 0;   ///< KV and state saves sent
  std::uint64_t saves_skipped = 0;     ///< finish() that saved nothing: a load or a save in flight, or nothing new
  std::uint64_t finish_without_admission = 0;  ///< finish() of a request with no live admission: left alone, nothing saved or freed
  std::uint64_t waiting_now = 0;       ///< parked requests now
  std::uint64_t holding_now = 0;       ///< torn-down admissions whose load or transfer may still write their resources now
  std::uint64_t overdue = 0;           ///< loads the last tick() found in flight past the threshold
  std::uint64_t sources_pinned = 0;    ///< saves whose source some rank could not confirm free: kept pinned, never freed
  std::uint64_t state_legs_waived = 0;  ///< admissions where a P/D sub won and a servable state leg was waived (R16)
  std::uint64_t checkpoints_planned = 0;      ///< prefill checkpoints handed out in AdmitDecision::checkpoints
  std::uint64_t checkpoints_saved = 0;        ///< state checkpoints sent to the ranks (mid-prefill, progress and finish)
  std::uint64_t checkpoints_deduplicated = 0; ///< checkpoints not sent: the index already served the hash or a save of it was in flight
  std::uint64_t progress_saves = 0;           ///< save_progress calls that sent something
  std::uint64_t snapshots_returned = 0;       ///< snapshot slots handed back in a step's `snapshots`
  std::uint64_t snapshots_held = 0;           ///< snapshot slots some rank may still read now (gauge)
  std::uint64_t salvaged_loads = 0;        ///< failed loads that resumed above 0 anyway (their restored prefix, a second load, the engine's state at hbm)
  std::uint64_t salvaged_tokens = 0;       ///< tokens above the HBM floor those resumes kept
  std::uint64_t second_loads = 0;          ///< state-only loads sent after a stateful load failed part way (at most one per admission)
  std::uint64_t slower_than_recompute = 0; ///< admissions that computed because every servable load cost more than its prefill (BreakEven)
  std::uint64_t loads_timed = 0;           ///< completed loads the load-cost meter learnt from (measure_load_cost)
  std::uint64_t invariant_violations = 0;  ///< stats() audits that failed, plus double unparks
};

}  // namespace kvfuse

template <>
struct std::hash<kvfuse::AdmissionId> {
  std::size_t operator()(kvfuse::AdmissionId v) const noexcept { return kvfuse::mix64(v.value); }
};
