// kvfuse/engine/coordinator.hpp — the one object an engine calls per scheduler step: it
// ties the Planner, the checkpoint policy, the OffloadIndex, the SettlementPump and the
// saves together (docs/reference.md#coordinator). An engine admits (plan, ticket, dispatch,
// park, or "compute now"), steps (who unparks, which admissions and snapshot slots are
// free), checkpoints mid-prefill, finishes or tears down, and ticks (reclaim, overdue) — on
// its own or through a composition (Multi, R16).
//
// A request keeps its id across preemption and re-admission, but each admit() starts an
// admission (AdmissionId) with its own block table and slot, ended by finish() or
// teardown() and freed exactly once, by a Freed event naming it, when nothing touches its
// resources any more. Three ledgers keep the books: AdmissionLedger (which admission is
// live, what still touches each ended one), SaveLedger (the saves in flight, the state
// hashes being saved, the snapshot slots) and ParkingLedger (who waits on which load or P/D
// transfer). It owns no fact the index owns; stats() audits its books in O(1).
//
// Threading: not thread-safe. Every member is called from the engine's scheduler thread.
// The transport is called on that thread; it hands the plain data to the ranks however
// the engine does (ranks as threads in tests, RPC in production).
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/resolution.hpp>
#include <kvfuse/bridge/save_request.hpp>
#include <kvfuse/completion/settlement_pump.hpp>
#include <kvfuse/engine/arbitration.hpp>
#include <kvfuse/engine/checkpoint_policy.hpp>
#include <kvfuse/engine/coordinator_types.hpp>
#include <kvfuse/engine/load_cost.hpp>
#include <kvfuse/engine/detail/admission_ledger.hpp>
#include <kvfuse/engine/detail/coordinator_steps.hpp>
#include <kvfuse/engine/detail/parking_ledger.hpp>
#include <kvfuse/engine/detail/save_ledger.hpp>
#include <kvfuse/engine/offload_index.hpp>
#include <kvfuse/engine/planner.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// The engine loop over an OffloadIndex and a SettlementPump of any CompletionGroup.
/// Holds references: the index, the pump, the transport and the lookup must outlive it.
/// Not thread-safe: scheduler thread only. Non-copyable.
template <CompletionGroup G, CoordinatorTransport T, KvLookup L, class Clock = std::chrono::steady_clock>
class Coordinator {
 public:
  using Index = OffloadIndex<Clock>;
  using Pump = SettlementPump<G, Index>;

  /// The most prefill checkpoints one admission is handed, whatever the policy says (the
  /// policy `all` on a very long prompt): the highest-priority ones are kept.
  static constexpr std::size_t max_checkpoints_per_admission = 4096;

  using StepResult = CoordinatorStep;  ///< what step() produced
  using TickResult = CoordinatorTick;  ///< what tick() produced

  /// Throws Error(invalid_argument) naming the value when the grids are invalid or the
  /// layout is unknown, and when `index` was built with a slot-free callback: the
  /// Coordinator's Freed events are the one signal that a slot is free (an orphan's
  /// included), so a second signal for the same slot cannot exist.
  Coordinator(CoordinatorOptions options, Index& index, Pump& pump, T& transport, L& lookup)
      : options_(detail::validated(options)),
        index_(index),
        pump_(pump),
        transport_(transport),
        lookup_(lookup),
        ledger_(options_.expected_requests),
        saves_(options_.expected_requests),
        parking_(options_.expected_requests),
        cost_(options_.break_even) {
    if (index_.has_slot_free())
      throw Error(ErrorCode::invalid_argument,
                  "the Coordinator's OffloadIndex has a slot-free callback: build it without one "
                  "(OffloadIndex(options)); a Coordinator's Freed events return every slot, orphans' included");
  }
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  /// The plan admit() would make for `req` now (load, claimed tokens, prefill checkpoints),
  /// with no side effect of its own: no ticket, admission, watermark or LRU touch. Pure if
  /// the engine's lookup is (vLLM's get_num_new_matched_tokens). Scheduler thread.
  AdmissionPlan plan(const AdmitRequest& req) {
    AdmissionPlan p;
    p.lookup_tokens = detail::lookup_tokens(req, options_.grids, lookup_);
    p.load = detail::plan_for(req, p.lookup_tokens, options_, cost_, [this](PrefixHash h) { return index_.could_serve(h); },
                              servable_);
    p.claimed_tokens = claimed_tokens(p.load);
    p.checkpoints = checkpoints_for(req, p.lookup_tokens, p.claimed_tokens);
    return p;
  }

  /// Plans the load, takes a ticket, dispatches it and parks the request — or says
  /// "compute now" with the reason. Either way a new admission starts (ended by finish()
  /// or teardown(), freed once by a Freed), with its prefill checkpoints for the resume
  /// point the load claims. A live admission that is not parked is ended first, as by
  /// teardown(). A parked request always has exactly one live load that will settle (a
  /// dropped one fails at once). A request already parked starts nothing:
  /// `already_parked`, naming the parked admission. Scheduler thread.
  AdmitDecision admit(const AdmitRequest& req) {
    AdmitDecision d;
    if (already_parked(req.id, d)) return d;
    (void)start(req, d);
    if (const auto* no = std::get_if<NoLoad>(&d.plan)) {
      d.no_load = no->reason;
      return compute(d, ComputeReason::planned_no_load);
    }
    return dispatch_plan(req, d);
  }

  /// admit() through a composition (R16): the tier's plan is the offload sub's offer
  /// (AdmissionQuery::tier_offer); the first sub that loads KV wins, losers cancel. The
  /// offload sub wins: admit()'s load. A P/D sub wins: its transfer starts and the request
  /// parks on it; a servable state leg is waived (never ticketed, counted in
  /// state_legs_waived) and a stateful model recomputes from 0. No sub loads KV: a
  /// state-only load if one is servable, else compute. A parked request unparks once, on
  /// its owner's settlement (step(arbiter) drains the transfers). Scheduler thread.
  template <KvArbiter A>
  AdmitDecision admit(const AdmitRequest& req, A& arbiter);

  /// Pumps every rank's records into the index and returns the Unparks (each parked
  /// request once), the Freeds (each ended admission once, when nothing touches it) and the
  /// snapshot slots every rank released. Scheduler thread.
  StepResult step(typename Pump::TimePoint now = Pump::TimePoint::clock::now()) {
    unparked_.clear();
    freed_.clear();
    snapshots_.clear();
    const auto pumped = pump_.step(now);
    for (const LoadResolution& r : pumped.resolutions) on_resolution(r);
    for (const SaveSettlement& s : pumped.saves) on_save(s);
    hand_out_frees();
    counters_.unparked += unparked_.size();
    return StepResult{unparked_, freed_, pumped.records, snapshots_};
  }

  /// step() that also drains `arbiter`'s ended P/D transfers: they unpark their requests
  /// (or free torn-down admissions) in the same step. Scheduler thread.
  template <KvArbiter A>
  StepResult step(A& arbiter, typename Pump::TimePoint now = Pump::TimePoint::clock::now());

  /// Mid-prefill: the state at `c.boundary` is in `snapshot`, a slot of the engine's. Saved:
  /// a StateSave goes to every rank, and the slot comes back in a step's `snapshots` once
  /// every rank released it, whatever becomes of the request (so no request is named).
  /// Otherwise nothing was sent and the engine keeps its slot (a hash the index serves or
  /// is saving: already_indexed, counted). Scheduler thread.
  CheckpointResult checkpoint(const Checkpoint& c, SlotId snapshot) {
    return save_state(c, Source{std::nullopt, snapshot});
  }

  /// Saves what a running request computed so far (KV chunks up to the chunk-floored
  /// frontier; a checkpoint from `snapshot`, as checkpoint() does); the admission goes on,
  /// and is freed only once every rank released what the save reads. Nothing for a request
  /// not running. Returns the saves sent (0, 1 or 2). Scheduler thread.
  std::size_t save_progress(const ProgressSave& p) {
    const std::optional<AdmissionId> live = ledger_.live(p.id);
    if (!live || parking_.find(p.id) != nullptr) return 0;
    std::size_t sent = save_kv(*live, p.id, p.computed_tokens, p.chunk_keys, p.blocks) ? 1 : 0;
    if (p.checkpoint && p.snapshot) sent += checkpoint(*p.checkpoint, *p.snapshot) == CheckpointResult::saved ? 1 : 0;
    if (sent > 0) ++counters_.progress_saves;
    return sent;
  }

  /// Abort or preemption: the live admission ends. A parked request's load is orphaned and
  /// never unparks; its Freed comes only once the ranks settled the load or reclaim aged it
  /// out (R8), never while a rank may write its blocks or slot. A running one is freed at
  /// the next step unless a save still reads it. No live admission: nothing happens (a
  /// second teardown frees nothing twice). Scheduler thread.
  void teardown(RequestId id) {
    const std::optional<AdmissionId> live = ledger_.end_live(id);
    if (!live) return;
    if (const std::optional<detail::ParkingLedger::Parked> parked = parking_.leave(id)) {
      ++counters_.torn_down;
      if (parked->transfer) {
        // A P/D transfer may still write its blocks: they come back when it ends.
        parking_.hold_for_transfer(id, *live);
        ledger_.hold_writer(*live, true);
        return;
      }
      if (index_.orphan(parked->key)) {
        ledger_.hold_for_load(parked->key, *live);
        return;
      }
      // Not in flight any more (it resolved inside this step's pump): its resolution is
      // still queued for the next step, which must not unpark it.
      ledger_.note_torn_down(parked->key);
    }
    ledger_.free_if_idle(*live);
  }

  /// Saves what the request computed (KV chunks above the watermark up to the chunk-floored
  /// frontier; the checkpoint from its own slot unless the index serves it) and ends its
  /// admission, freed once every rank released the saves' source. A parked request is torn
  /// down instead. No live admission (torn down with its load in flight, finished with a
  /// save still reading, never admitted: indistinguishable here): left alone, nothing
  /// saved or freed, counted in finish_without_admission. Returns the saves sent (0, 1 or
  /// 2). Scheduler thread.
  std::size_t finish(const FinishRequest& f) {
    if (parking_.find(f.id) != nullptr) {
      ++counters_.saves_skipped;
      teardown(f.id);
      return 0;
    }
    const std::optional<AdmissionId> live = ledger_.end_live(f.id);
    if (!live) {
      ++counters_.finish_without_admission;
      return 0;
    }
    std::size_t sent = 0;
    if (ledger_.sources_held(*live) == 0) {
      sent += save_kv(*live, f.id, f.computed_tokens, f.chunk_keys, f.blocks) ? 1 : 0;
      if (f.checkpoint && f.slot)
        sent += save_state(*f.checkpoint, Source{*live, *f.slot}) == CheckpointResult::saved ? 1 : 0;
    }
    if (sent == 0) ++counters_.saves_skipped;
    ledger_.free_if_idle(*live);  // now, or once every rank released the saves' source
    return sent;
  }

  /// The tokens below which finish() sends no KV for `request`: its save watermark (what
  /// its admission's lookup found in the tier, raised by each save, lowered to 0 by a failed
  /// load; 0 for a request with no live admission). A cache ledger is offered the chunks
  /// from here up (CacheKeeper::keep_chunks). O(1), noexcept; scheduler thread.
  [[nodiscard]] TokenCount save_watermark(RequestId request) const noexcept { return ledger_.watermark(request); }

  /// Reclaims orphans older than `reclaim_after` (freed by the next step) and lists the
  /// loads in flight at least `overdue_after` (nothing is freed on a timer). Scheduler
  /// thread; may throw std::bad_alloc, before it changes anything.
  TickResult tick(typename Clock::time_point now, typename Clock::duration reclaim_after,
                  typename Clock::duration overdue_after) {
    overdue_list_.clear();
    overdue_list_.reserve(index_.stats().in_flight);  // the most report_overdue can list
    TickResult t;
    t.reclaimed = index_.reclaim(now, reclaim_after);
    counters_.overdue = index_.report_overdue(now, overdue_after,
                                              [this](const OverdueLoad& o) noexcept { overdue_list_.push_back(o); });
    t.overdue = overdue_list_;
    return t;
  }

  /// Counters, plus an O(1) audit on every read (failures count in invariant_violations):
  /// parked requests and live loads in flight match one to one, and every ledger's term
  /// holds. Scheduler thread.
  [[nodiscard]] CoordinatorStats stats() const noexcept {
    const IndexStats is = index_.stats();
    // Parked on a load that reached the ranks = live in flight, give or take the
    // resolutions queued for the next step (the ledger's term says how).
    const std::uint64_t live_in_flight = is.in_flight - is.orphaned;
    if (!parking_.consistent(live_in_flight, index_.pending_resolutions()) || is.outstanding != is.in_flight ||
        !saves_.consistent())
      ++counters_.invariant_violations;
    CoordinatorStats s = counters_;
    s.waiting_now = parking_.size();
    s.holding_now = ledger_.loads_holding() + parking_.held_for_transfers();
    s.snapshots_held = saves_.snapshots_held();
    s.sources_pinned = saves_.sources_pinned();
    return s;
  }

  /// What the load-cost meter learnt of the tier's speed (zeros unless measure_load_cost).
  /// Scheduler thread; O(1), noexcept.
  [[nodiscard]] LoadCostEstimate load_cost() const noexcept { return meter_.estimate(); }
  /// The break-even the planner weighs loads with now: the configured one, its tier times
  /// replaced by the measured ones once min_timed_loads loads were timed. Scheduler thread; O(1).
  [[nodiscard]] const BreakEven& break_even() const noexcept { return cost_; }

  /// Whether `id` is parked on a load. Scheduler thread; O(1).
  [[nodiscard]] bool is_parked(RequestId id) const noexcept { return parking_.find(id) != nullptr; }

  /// The options it was built with. Scheduler thread; O(1).
  [[nodiscard]] const CoordinatorOptions& options() const noexcept { return options_; }

 private:
  using Source = detail::SaveLedger::Source;

  // Counts the admit() call; a request already parked starts nothing.
  bool already_parked(RequestId id, AdmitDecision& d) noexcept {
    ++counters_.admitted;
    const detail::ParkingLedger::Parked* parked = parking_.find(id);
    if (parked == nullptr) return false;
    d.admission = parked->admission;
    (void)compute(d, ComputeReason::already_parked);
    return true;
  }

  AdmitDecision& compute(AdmitDecision& d, ComputeReason why) noexcept {
    ++counters_.computed;
    d.parked = false;
    d.reason = why;
    return d;
  }

  // "Compute now" for an admission whose plan claimed tokens: it computes from 0 after all,
  // so its checkpoints are planned again for that resume point.
  AdmitDecision& compute_from_zero(const AdmitRequest& req, AdmitDecision& d, ComputeReason why) {
    if (claimed_tokens(d.plan) > 0 && options_.layout != StateLayout::none) reset_checkpoints(req, d, last_lookup_);
    return compute(d, why);
  }

  void reset_checkpoints(const AdmitRequest& req, AdmitDecision& d, TokenCount lookup_tokens) {
    counters_.checkpoints_planned -= d.checkpoints.size();
    d.checkpoints = checkpoints_for(req, lookup_tokens, 0);
    counters_.checkpoints_planned += d.checkpoints.size();
  }

  // Starts the admission and fills the decision's plan and checkpoints (for the resume
  // point a successful load would give); admit() adds the side effects plan() lacks.
  AdmissionPlan start(const AdmitRequest& req, AdmitDecision& d) {
    teardown(req.id);  // a live admission that was not ended: replaced
    d.admission = ledger_.start(req.id);
    AdmissionPlan p = plan(req);
    last_lookup_ = p.lookup_tokens;
    ledger_.raise_watermark(req.id, p.lookup_tokens);
    d.plan = p.load;
    d.checkpoints = p.checkpoints;
    counters_.checkpoints_planned += d.checkpoints.size();
    if (const auto* no = std::get_if<NoLoad>(&d.plan); no && no->reason == NoLoadReason::slower_than_recompute)
      ++counters_.slower_than_recompute;
    return p;
  }

  std::vector<TokenCount> checkpoints_for(const AdmitRequest& req, TokenCount lookup_tokens, TokenCount resume) const {
    return detail::prefill_checkpoints(req, options_, lookup_tokens, resume, max_checkpoints_per_admission);
  }

  AdmitDecision dispatch_plan(const AdmitRequest& req, AdmitDecision& d) {
    bool covered = true;
    std::optional<KvSpec> kv = detail::kv_spec_for(d.plan, req, options_.grids, covered);
    if (!covered) return compute_from_zero(req, d, ComputeReason::bad_request);
    std::optional<StateSpec> state;
    if (const auto boundary = state_boundary(d.plan)) {
      if (!req.slot) return compute_from_zero(req, d, ComputeReason::no_slot);
      state = StateSpec{*boundary, detail::hash_at(req, *boundary), *req.slot, options_.grids.block_tokens,
                        options_.grids.chunk_tokens};
    }
    LoadGrant grant = index_.request_load(req.id, std::move(kv), state);
    if (!grant) {
      d.refusal = grant.refusal();
      return compute_from_zero(req, d, ComputeReason::index_refused);
    }
    d.parked = true;
    d.claimed_tokens = claimed_tokens(d.plan);
    ++counters_.parked;
    detail::ParkingLedger::Parked parked;
    parked.claims = d.claimed_tokens;
    parked.admission = d.admission;
    parked.hbm = req.hbm;
    if (const auto tokens = kv_tokens(d.plan)) {
      parked.kv_from = options_.grids.chunk_grid().floor(tokens->first);
      parked.kv_end = tokens->last;
    }
    parked.slot = req.slot;
    parked.hbm_state_held = req.hbm_state_held;
    parked.bytes = leg_bytes(parked.kv_end - parked.kv_from, state_boundary(d.plan).has_value());
    // What a second load could restore if this one fails part way: servable checkpoints
    // below the planned boundary (the one planned may be the one that misses).
    if (const auto boundary = state_boundary(d.plan))
      for (const Checkpoint& c : req.checkpoints)
        if (c.boundary > 0 && c.boundary <= *boundary && index_.could_serve(c.hash)) parked.fallbacks.push_back(c);
    std::sort(parked.fallbacks.begin(), parked.fallbacks.end(),
              [](const Checkpoint& a, const Checkpoint& b) { return a.boundary < b.boundary; });
    d.key = send_load(req.id, std::move(grant), std::move(parked));
    return d;
  }

  // Dispatches the granted load and parks the request on it. A load the transport dropped
  // (or threw on) reached no rank and nothing will report: it is failed now, drained by the
  // next step like any other (never parked without a load that settles).
  LoadKey send_load(RequestId id, LoadGrant grant, detail::ParkingLedger::Parked parked) {
    const LoadRequest request = grant.ticket().dispatch();
    parked.dispatched_ns = now_ns();
    const bool sent = detail::transport_took(transport_, request);
    parked.key = request.key;
    parked.dropped = !sent;
    parking_.park_on_load(id, std::move(parked));
    if (!sent) {
      ++counters_.transport_drops;
      (void)index_.fail(request.key, false);
    }
    return request.key;
  }

  // A load ended: unpark its request (a failed one from what it salvaged), or free the
  // torn-down admission an orphaned one held (detail/coordinator_salvage.hpp).
  void on_resolution(const LoadResolution& r);

  // The bytes one rank's longer leg reads: `kv_tokens` of whole chunks, and a state entry.
  std::uint64_t leg_bytes(TokenCount kv_tokens, bool state) const noexcept {
    const std::uint64_t chunks = options_.grids.chunk_grid().cells_covering(kv_tokens);
    return std::max(chunks * options_.break_even.kv_chunk_bytes, state ? options_.break_even.state_bytes : 0);
  }

  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  }

  // A load completed: one sample for the meter, and the break-even in force again.
  void time_load(const detail::ParkingLedger::Parked& p) noexcept {
    if (!options_.measure_load_cost || p.dropped) return;
    meter_.add(p.bytes, static_cast<double>(now_ns() - p.dispatched_ns));
    ++counters_.loads_timed;
    cost_ = meter_.applied_to(options_.break_even, options_.min_timed_loads);
  }

  void unpark(const Unpark& u) {
    if (u.tokens > 0) ++counters_.unparked_with_tokens;
    unparked_.push_back(u);
  }

  // Counts a failed load that resumed at `tokens` anyway.
  void note_salvage(TokenCount tokens, TokenCount hbm) noexcept;

  // A stateful load failed part way: a state-only load for checkpoint `c`, which every
  // rank's blocks reach, and the request stays parked on it; false (nothing sent, the
  // request unparks as it would) when the index refuses it or there is no slot.
  bool second_load(RequestId id, const Checkpoint& c, detail::ParkingLedger::Parked parked);

  // A P/D transfer ended: free a torn-down admission of the request now that nothing
  // writes its blocks, or unpark the request (tokens only for a dense model).
  void on_transfer(RequestId id, bool ok);

  // A save's phase, booked by the save ledger; its meaning for an admission's blocks or
  // slot applied here. The source goes back on the released phase (early release), never
  // later than stored; a source some rank could not confirm free stays pinned for good,
  // visibly, rather than be reused under a copy that may still run.
  void on_save(const SaveSettlement& s) {
    const detail::SaveLedger::Settled settled = saves_.settle(s);
    if (!settled.known || !settled.source.admission) return;
    const AdmissionId id = *settled.source.admission;
    // The tier may lack these chunks: the request saves them again next time.
    if (settled.store_failed && ledger_.holds(id)) ledger_.reset_watermark(ledger_.request_of(id));
    if (!settled.source_free_now) return;
    ledger_.release_source(id, settled.confirmed);
    ledger_.free_if_idle(id);
  }

  // The KV save of an admission: the whole chunks from the request's watermark up to the
  // chunk-floored frontier, if the keys and blocks cover them.
  bool save_kv(AdmissionId id, RequestId request, TokenCount computed, std::span<const PrefixHash> keys,
               std::span<const BlockId> blocks) {
    std::optional<KvSave> save = detail::kv_save_for(options_.grids, ledger_.watermark(request), computed, keys, blocks);
    if (!save || submit(Source{id, SlotId{}}, std::nullopt, std::move(*save)) != CheckpointResult::saved) return false;
    ledger_.raise_watermark(request, options_.grids.chunk_grid().floor(computed));
    return true;
  }

  // A state save from `source` (a snapshot, or the request's own slot), unless the model
  // has no state or the index already serves (or is saving) the hash.
  CheckpointResult save_state(const Checkpoint& c, Source source) {
    if (options_.layout == StateLayout::none) return CheckpointResult::not_stateful;
    if (index_.could_serve(c.hash) || saves_.saving_state(c.hash)) {
      ++counters_.checkpoints_deduplicated;
      return CheckpointResult::already_indexed;
    }
    const CheckpointResult r = submit(source, c.hash, StateSave{SaveKey{c.hash, {}}, source.slot, c.boundary});
    if (r == CheckpointResult::saved) ++counters_.checkpoints_saved;
    return r;
  }

  template <class Save>
  CheckpointResult submit(Source source, std::optional<PrefixHash> state, Save save) {
    const CheckpointResult r = saves_.submit(index_, transport_, source, state, std::move(save));
    counters_.transport_drops += r == CheckpointResult::dropped ? 1 : 0;
    if (r != CheckpointResult::saved) return r;
    ++counters_.saves_submitted;
    if (source.admission) ledger_.hold_source(*source.admission);
    return r;
  }

  // Moves everything freed since the last hand-out into this step's output.
  void hand_out_frees() {
    const std::size_t before = freed_.size();
    ledger_.take_freed(freed_);
    counters_.freed += freed_.size() - before;
    counters_.snapshots_returned += saves_.take_ready(snapshots_);
  }

  CoordinatorOptions options_;
  Index& index_;
  Pump& pump_;
  T& transport_;
  L& lookup_;
  detail::AdmissionLedger ledger_;
  detail::SaveLedger saves_;
  detail::ParkingLedger parking_;
  std::vector<TokenCount> servable_;
  std::vector<Unpark> unparked_;
  std::vector<Freed> freed_;
  std::vector<SlotId> snapshots_;  // this step's output
  std::vector<OverdueLoad> overdue_list_;
  TokenCount last_lookup_ = 0;           // the lookup of the admission being made
  LoadCostMeter meter_;                  // measure_load_cost: the tier's speed, learnt from completed loads
  BreakEven cost_;                       // the break-even in force: options_.break_even, or the meter's
  mutable CoordinatorStats counters_{};  // the counters; stats() adds the gauges (mutable: its audit counts)
};

}  // namespace kvfuse

// Two paths' member definitions, kept apart from the class: admitting through a
// composition, and ending a parked load (salvage).
#include <kvfuse/engine/detail/coordinator_composition.hpp>
#include <kvfuse/engine/detail/coordinator_salvage.hpp>
