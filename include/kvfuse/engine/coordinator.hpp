// kvfuse/engine/coordinator.hpp — the one object an engine calls per scheduler step: it
// ties the Planner, the checkpoint policy, the OffloadIndex, the SettlementPump and the
// saves together (docs/reference.md#coordinator).
//
//   plan(request)     what admit() would plan now, without its side effects
//   admit(request)    plan, take a ticket, dispatch through the engine's transport, park —
//                     or say "compute now", with the reason; and, for a stateful model, the
//                     boundaries where the prefill should capture state checkpoints
//   checkpoint(...)   mid-prefill: save the state the engine copied into a snapshot slot
//   step()            pump records; return who unparks (with the tokens the load claimed,
//                     0 = recompute), which admissions' blocks and slot may be freed, and
//                     which snapshot slots are free again
//   teardown(id)      abort or preemption: orphan the in-flight load; the resources go back
//                     only when its ranks settle it or reclaim ages it out (R8)
//   save_progress(..) save what a running request computed so far; nothing is freed
//   finish(request)   submit the KV save (whole chunks up to the chunk-floored frontier) and
//                     the state checkpoint; blocks are freed on every rank's `released`
//   tick(now)         reclaim aged orphans; report loads in flight past a threshold
//   admit/step(arbiter)  the same through a composition (Multi): R16 arbitration, P/D transfers
//
// Admissions. A request keeps its id across preemption and re-admission, but each admit()
// starts an admission (AdmissionId) with its own block table and slot, and finish() or
// teardown() ends the request's current one. Each admission is freed exactly once, by a
// Freed event naming it, when it ended and nothing touches its resources any more: no load
// of it in flight (an orphan settled or was reclaimed), no P/D transfer writing its blocks,
// no save still reading them (detail::AdmissionLedger keeps those books). The Freed event
// is the one "free it" signal for the slot too: the index the Coordinator drives has no
// slot-free callback of its own.
//
// Checkpoints. Every state save is the same machinery: a ticketed StateSave whose source
// comes back when every rank released it. finish() saves from the request's own slot (it
// comes back with the admission's Freed); checkpoint() and save_progress() save from a
// snapshot slot (it comes back in a step's `snapshots`, whatever became of the request).
// A checkpoint whose hash the index already serves, or is already saving, is not sent.
//
// It owns no fact the index owns. Its own bookkeeping is the parked table (request ->
// its one live load key), the admission ledger, the saves in flight and the snapshot slots
// it holds; stats() audits, in O(1), that every parked request has exactly one live load in
// flight and every live load exactly one parked request, and that every snapshot slot it
// holds is read by a save in flight or waits to be handed back.
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
#include <kvfuse/engine/detail/admission_ledger.hpp>
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

  /// What one step produced. The spans stay valid until the next step() or tick().
  struct StepResult {
    std::span<const Unpark> unparked;   ///< resume these (once each)
    std::span<const Freed> freed;       ///< free these admissions' blocks and slot: no rank reads or writes them
    std::size_t records = 0;            ///< records the pump drained
    std::span<const SlotId> snapshots;  ///< snapshot slots every rank released: the engine may reuse them
  };

  /// What one tick produced.
  struct TickResult {
    std::size_t reclaimed = 0;             ///< orphans reclaimed (their release comes out of the next step)
    std::span<const OverdueLoad> overdue;  ///< loads in flight at least `overdue_after`; nothing freed
  };

  /// Throws Error(invalid_argument) naming the value when the grids are invalid or the
  /// layout is unknown, and when `index` was built with a slot-free callback: the
  /// Coordinator's Freed events are the one signal that a slot is free (an orphan's
  /// included), so a second signal for the same slot cannot exist.
  Coordinator(CoordinatorOptions options, Index& index, Pump& pump, T& transport, L& lookup)
      : options_(validated(options)),
        index_(index),
        pump_(pump),
        transport_(transport),
        lookup_(lookup),
        ledger_(options_.expected_requests) {
    if (index_.has_slot_free())
      throw Error(ErrorCode::invalid_argument,
                  "the Coordinator's OffloadIndex has a slot-free callback: build it without one "
                  "(OffloadIndex(options)); a Coordinator's Freed events return every slot, orphans' included");
    parked_.reserve(options_.expected_requests);
    holding_.reserve(options_.expected_requests);
    saves_.reserve(options_.expected_requests);
  }
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  /// The plan admit() would make for `req` now: the planner's answer over the lookup and
  /// the servable checkpoints, the tokens it claims, and the prefill checkpoints. No side
  /// effect of its own: no ticket, no admission, no save watermark, no LRU touch in the
  /// index (could_serve only reads). It does call the engine's lookup, which must be free of
  /// side effects too for the answer to be a pure one (what vLLM's
  /// get_num_new_matched_tokens needs). Scheduler thread; allocates the answer's vector.
  AdmissionPlan plan(const AdmitRequest& req) {
    AdmissionPlan p;
    p.lookup_tokens = lookup_tokens_for(req);
    p.load = plan_load_for(req, p.lookup_tokens);
    p.claimed_tokens = claimed_tokens(p.load);
    p.checkpoints = checkpoints_for(req, p.lookup_tokens, p.claimed_tokens);
    return p;
  }

  /// Plans the request's load, takes a ticket, dispatches it through the transport and
  /// parks the request — or says "compute now" with the reason. Either way it starts a new
  /// admission (AdmitDecision::admission), which ends with finish() or teardown() and is
  /// freed once (a Freed naming it) when nothing touches its resources, and a stateful
  /// model gets its prefill checkpoints (AdmitDecision::checkpoints), computed for the
  /// resume point the load claims. A request whose previous admission is still live and
  /// not parked (the engine re-admits it without a teardown) has that admission ended as by
  /// teardown() first. A request parked here always has exactly one live load that will
  /// settle: a load the transport dropped is failed at once and unparks (recompute) on the
  /// next step. A request already parked starts nothing: `already_parked`, naming the
  /// parked admission. Scheduler thread.
  AdmitDecision admit(const AdmitRequest& req) {
    ++counters_.admitted;
    AdmitDecision d;
    if (const auto it = parked_.find(req.id); it != parked_.end()) {
      d.admission = it->second.admission;
      return compute(d, ComputeReason::already_parked);
    }
    (void)start(req, d);
    if (const auto* no = std::get_if<NoLoad>(&d.plan)) {
      d.no_load = no->reason;
      return compute(d, ComputeReason::planned_no_load);
    }
    return dispatch_plan(req, d);
  }

  /// admit() through a composition (R16): the tier's plan becomes the offload sub's offer,
  /// the composition picks the first sub that loads KV, and its losers cancel.
  ///   - the offload sub wins: the planned load, state leg included, as admit() does;
  ///   - a P/D sub wins: its transfer starts and the request parks on it; a state leg the
  ///     tier could have served is waived (no ticket is ever taken for it, the boundary is
  ///     disowned) and the request recomputes from 0 when the transfer ends — a stateful
  ///     model cannot resume from KV alone; counted in state_legs_waived;
  ///   - no sub loads KV but a state leg is servable: a state-only load through the tier;
  ///   - otherwise: compute.
  /// A parked request unparks on its owning load's single settlement — the index's, or the
  /// P/D transfer's (step(arbiter) drains those). Scheduler thread.
  template <KvArbiter A>
  AdmitDecision admit(const AdmitRequest& req, A& arbiter, OffloadSub& tier) {
    ++counters_.admitted;
    AdmitDecision d;
    if (const auto it = parked_.find(req.id); it != parked_.end()) {
      d.admission = it->second.admission;
      return compute(d, ComputeReason::already_parked);
    }
    const AdmissionPlan p = start(req, d);
    const bool secured = state_boundary(d.plan).has_value() && req.slot.has_value();
    tier.offer = offer_of(d.plan, req.hbm);
    const Arbitration a = arbiter.arbitrate(AdmissionQuery{req.id, req.hbm, req.prompt_tokens}, secured);
    d.sub = a.winner;
    if (a.winner && a.winner == A::tier_sub) return dispatch_plan(req, d);
    if (a.winner) {
      if (!static_cast<bool>(arbiter.start(*a.winner, PdTransfer{req.id, req.hbm, a.tokens, req.blocks})))
        return compute_from_zero(req, d, ComputeReason::transfer_refused);
      d.state_waived = secured;
      counters_.state_legs_waived += secured ? 1 : 0;
      d.parked = true;
      d.claimed_tokens = options_.layout == StateLayout::none ? req.hbm + a.tokens : 0;
      if (options_.layout != StateLayout::none) reset_checkpoints(req, d, p.lookup_tokens);  // it recomputes from 0
      parked_.emplace(req.id, Parked{LoadKey{}, d.claimed_tokens, d.admission, false, true});
      ++counters_.parked;
      ++pd_parked_;
      return d;
    }
    if (a.state == StateDisposition::state_only && std::holds_alternative<StateOnlyLoad>(d.plan))
      return dispatch_plan(req, d);
    // A plan with a state leg but no slot to restore it into: the same answer as admit().
    if (state_boundary(d.plan) && !req.slot) return compute_from_zero(req, d, ComputeReason::no_slot);
    if (const auto* no = std::get_if<NoLoad>(&d.plan)) d.no_load = no->reason;
    return compute_from_zero(req, d, ComputeReason::planned_no_load);
  }

  /// One scheduler step: pumps every rank's records into the index, then turns the index's
  /// resolutions into Unpark events (each parked request exactly once), Freed events (each
  /// ended admission exactly once: a torn-down one whose load ended, a finished one whose
  /// saves' source every rank released) and the snapshot slots every rank released.
  /// Scheduler thread.
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

  /// step() for a coordinator that admits through `arbiter`: the P/D transfers that ended
  /// unpark their requests (or free torn-down admissions) in the same step. Scheduler thread.
  template <KvArbiter A>
  StepResult step(A& arbiter, typename Pump::TimePoint now = Pump::TimePoint::clock::now()) {
    StepResult r = step(now);
    (void)arbiter.drain_finished([this](RequestId id, bool ok) { on_transfer(id, ok); });
    hand_out_frees();  // freed by a transfer's end: out in this step
    r.unparked = unparked_;
    r.freed = freed_;
    r.snapshots = snapshots_;
    return r;
  }

  /// Mid-prefill: the engine stopped the request's prefill at `c.boundary` (one of its
  /// AdmitDecision::checkpoints, or any boundary on the checkpoint grid) and copied the
  /// state there into `snapshot`, a slot of its own. Saved: a StateSave of `snapshot` goes
  /// to every rank, and the slot comes back in a step's `snapshots` once every rank
  /// released it (early, as for KV), whatever becomes of the request meanwhile; the hash is
  /// indexed when every live rank stored it. Any other result sent nothing and the engine
  /// keeps its slot: a hash the index already serves or is already saving is not saved
  /// again (already_indexed, counted). Scheduler thread.
  CheckpointResult checkpoint(RequestId request, const Checkpoint& c, SlotId snapshot) {
    (void)request;  // the snapshot's life does not depend on the request's
    return save_state(c, Source{std::nullopt, snapshot});
  }

  /// Saves what a running request computed so far: the KV chunks above what the tier holds
  /// up to the chunk-floored frontier, and a state checkpoint from `snapshot` (as
  /// checkpoint() does). The admission goes on: its blocks are only read, and if it ends
  /// while the save still reads them they are freed only once every rank released them.
  /// A request with no live admission, or still parked, saves nothing. Returns how many
  /// saves were sent (0, 1 or 2). Scheduler thread.
  std::size_t save_progress(const ProgressSave& p) {
    const std::optional<AdmissionId> live = ledger_.live(p.id);
    if (!live || parked_.contains(p.id)) return 0;
    std::size_t sent = save_kv(*live, p.id, p.computed_tokens, p.chunk_keys, p.blocks) ? 1 : 0;
    if (p.checkpoint && p.snapshot)
      sent += checkpoint(p.id, *p.checkpoint, *p.snapshot) == CheckpointResult::saved ? 1 : 0;
    if (sent > 0) ++counters_.progress_saves;
    return sent;
  }

  /// The request was aborted or preempted: its current admission ends. A parked request's
  /// load is orphaned: the index keeps its slot, and the admission's blocks and slot come
  /// back as a Freed only once its ranks settled the load or reclaim aged it out (R8) —
  /// never while a rank may still write them. It never unparks. An admission that is not
  /// parked is freed at the next step, unless a save still reads its blocks. A request
  /// with no live admission (torn down or finished already, or never admitted) is left
  /// alone: a second teardown (an abort after a preemption) frees nothing twice.
  /// Scheduler thread.
  void teardown(RequestId id) {
    const std::optional<AdmissionId> live = ledger_.end_live(id);
    if (!live) return;
    if (const auto it = parked_.find(id); it != parked_.end()) {
      ++counters_.torn_down;
      if (it->second.transfer) {
        // A P/D transfer may still write its blocks: they come back when it ends.
        parked_.erase(it);
        --pd_parked_;
        pd_holding_[id].push_back(*live);
        ++pd_held_;
        ledger_.hold_writer(*live, true);
        return;
      }
      const LoadKey key = it->second.key;
      if (!it->second.dropped) --parked_in_flight_;
      parked_.erase(it);
      if (index_.orphan(key)) {
        holding_.emplace(key, *live);
        ledger_.hold_writer(*live, true);
        return;
      }
      // Not in flight any more (it resolved inside this step's pump): its resolution is
      // still queued for the next step, which must not unpark it.
      torn_down_keys_.push_back(key);
    }
    ledger_.free_if_idle(*live);
  }

  /// Saves what the request computed and ends its current admission: the KV chunks above
  /// what the tier already holds up to the chunk-floored frontier, and the state checkpoint
  /// from the request's own slot (stateful models; not sent when the index already serves
  /// its hash). Skipped while a save of this admission still reads its source. The
  /// admission's blocks (and slot) come back as a Freed once every rank released the saves'
  /// source — usually long before the saves land. An engine that checkpoints only at the
  /// end needs nothing else. A request still parked is torn down instead (its load
  /// orphaned, nothing saved). A request with no live admission is left alone, as by
  /// teardown(), and counted in finish_without_admission: "no live admission" is a request
  /// torn down while its load may still write its blocks and slot, one finished whose save
  /// still reads them, or one never admitted, and the Coordinator cannot tell these apart,
  /// so it frees nothing and saves nothing from resources a rank may still use. Returns
  /// how many saves were sent (0, 1 or 2). Scheduler thread.
  std::size_t finish(const FinishRequest& f) {
    if (parked_.contains(f.id)) {
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

  /// Reclaims orphans older than `reclaim_after` (their release comes out of the next step)
  /// and lists the loads in flight at least `overdue_after` (none is freed on a timer:
  /// a lost LoadRequest becomes visible here). Scheduler thread.
  TickResult tick(typename Clock::time_point now, typename Clock::duration reclaim_after,
                  typename Clock::duration overdue_after) {
    TickResult t;
    t.reclaimed = index_.reclaim(now, reclaim_after);
    overdue_list_.clear();
    counters_.overdue = index_.report_overdue(now, overdue_after, [this](const OverdueLoad& o) {
      try {
        overdue_list_.push_back(o);
      } catch (...) {
      }
    });
    t.overdue = overdue_list_;
    return t;
  }

  /// Counters, plus the audit on every read (O(1)): every parked request has exactly one
  /// live load in flight and every live load in flight exactly one parked request; every
  /// snapshot slot the coordinator holds is read by a save in flight or waits to be handed
  /// back (or stays pinned). A failed audit counts in invariant_violations. Scheduler
  /// thread.
  [[nodiscard]] CoordinatorStats stats() const noexcept {
    const IndexStats is = index_.stats();
    // One to one, counted: each parked request whose load reached the ranks is a live load
    // in flight, and each live load in flight is one of them. Loads the index resolved since
    // the last step (records ingested between steps, a dropped load) wait in its resolution
    // queue for the next step: while any wait, the parked count may exceed the live loads by
    // at most that many.
    const std::uint64_t live_in_flight = is.in_flight - is.orphaned;
    const std::uint64_t waiting = index_.pending_resolutions();
    if (parked_in_flight_ < live_in_flight || parked_in_flight_ > live_in_flight + waiting ||
        parked_in_flight_ + pd_parked_ > parked_.size() || is.outstanding != is.in_flight ||
        snapshots_held_ != snapshot_saves_unreleased_ + snapshots_ready_.size() + snapshots_pinned_)
      ++counters_.invariant_violations;
    CoordinatorStats s = counters_;
    s.waiting_now = parked_.size();
    s.holding_now = holding_.size() + pd_held_;
    s.snapshots_held = snapshots_held_;
    return s;
  }

  /// Whether `id` is parked on a load. Scheduler thread; O(1).
  [[nodiscard]] bool is_parked(RequestId id) const noexcept { return parked_.contains(id); }

  /// The options it was built with. Scheduler thread; O(1).
  [[nodiscard]] const CoordinatorOptions& options() const noexcept { return options_; }

 private:
  struct Parked {
    LoadKey key;
    TokenCount claims = 0;
    AdmissionId admission;
    bool dropped = false;   // the transport dropped it; the index already failed it
    bool transfer = false;  // parked on a P/D sub's transfer, not on an index load
  };
  // What a save reads: the blocks or slot of an admission, or a snapshot slot.
  struct Source {
    std::optional<AdmissionId> admission;  // empty for a snapshot
    SlotId slot;                           // a state save's source slot (the snapshot, or the request's)
  };
  struct SaveOwner {
    Source source;
    std::optional<PrefixHash> state;  // a state save: the hash it stores (deduplication)
    bool released = false;            // its `released` phase settled
  };

  static CoordinatorOptions validated(const CoordinatorOptions& o) {
    if (!o.grids.valid())
      throw Error(ErrorCode::invalid_argument,
                  "Coordinator grids must be nonzero with chunk_tokens a multiple of block_tokens, got block_tokens " +
                      std::to_string(o.grids.block_tokens) + ", chunk_tokens " + std::to_string(o.grids.chunk_tokens));
    if (!is_known(o.layout))
      throw Error(ErrorCode::invalid_argument,
                  "Coordinator layout is unknown: " + std::to_string(static_cast<int>(o.layout)));
    return o;
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
    return p;
  }

  TokenCount lookup_tokens_for(const AdmitRequest& req) {
    const std::size_t prompt_chunks = options_.grids.chunk_grid().cells_covering(req.prompt_tokens);
    const std::size_t n = std::min(req.chunk_keys.size(), prompt_chunks);
    const std::size_t held = std::min<std::size_t>(static_cast<std::size_t>(lookup_(req.chunk_keys.first(n))), n);
    // The tier holds whole chunks; a partial last chunk of the prompt is never in it.
    const TokenCount tokens = std::min<TokenCount>(held * options_.grids.chunk_tokens,
                                                   options_.grids.chunk_grid().floor(req.prompt_tokens));
    return tokens;
  }

  LoadPlan plan_load_for(const AdmitRequest& req, TokenCount lookup_tokens) {
    servable_.clear();
    if (options_.layout != StateLayout::none)
      for (const Checkpoint& c : req.checkpoints)
        if (index_.could_serve(c.hash)) servable_.push_back(c.boundary);
    const PlanInput in{req.prompt_tokens, req.hbm, lookup_tokens, servable_, options_.layout, options_.grids,
                       options_.min_load_tokens};
    return plan_load(in);
  }

  // The prefill checkpoints of a stateful request that resumes at `resume`: its branch
  // point is as far as its prefix is known to be shared, in the tier or in HBM.
  std::vector<TokenCount> checkpoints_for(const AdmitRequest& req, TokenCount lookup_tokens, TokenCount resume) const {
    if (options_.layout == StateLayout::none) return {};
    const CheckpointInput in{req.prompt_tokens, resume, std::max(lookup_tokens, req.hbm), options_.grids,
                             options_.checkpoints};
    std::vector<TokenCount> out(std::min(count_checkpoints(in), max_checkpoints_per_admission));
    out.resize(plan_checkpoints(in, out));
    return out;
  }

  static PrefixHash hash_at(const AdmitRequest& req, TokenCount boundary) noexcept {
    for (const Checkpoint& c : req.checkpoints)
      if (c.boundary == boundary) return c.hash;
    return PrefixHash{};
  }

  // The KV tokens beyond hbm the tier's plan restores: what the offload sub offers.
  static TokenCount offer_of(const LoadPlan& p, TokenCount hbm) noexcept {
    if (std::holds_alternative<KvOnlyLoad>(p) || std::holds_alternative<JointLoad>(p)) return claimed_tokens(p) - hbm;
    return 0;
  }

  AdmitDecision dispatch_plan(const AdmitRequest& req, AdmitDecision& d) {
    std::optional<KvSpec> kv;
    if (const auto tokens = kv_tokens(d.plan)) {
      const IndexRange chunks = chunk_range(d.plan, options_.grids);
      const IndexRange blocks = block_range(d.plan, options_.grids);
      if (chunks.last > req.chunk_keys.size() || blocks.last > req.blocks.size())
        return compute_from_zero(req, d, ComputeReason::bad_request);
      kv = KvSpec{tokens->first, tokens->last,
                  {req.chunk_keys.begin() + static_cast<std::ptrdiff_t>(chunks.first),
                   req.chunk_keys.begin() + static_cast<std::ptrdiff_t>(chunks.last)},
                  {req.blocks.begin() + static_cast<std::ptrdiff_t>(blocks.first),
                   req.blocks.begin() + static_cast<std::ptrdiff_t>(blocks.last)}};
    }
    std::optional<StateSpec> state;
    if (const auto boundary = state_boundary(d.plan)) {
      if (!req.slot) return compute_from_zero(req, d, ComputeReason::no_slot);
      state = StateSpec{*boundary, hash_at(req, *boundary), *req.slot, options_.grids.block_tokens,
                        options_.grids.chunk_tokens};
    }
    LoadAdmission admission = index_.request_load(req.id, std::move(kv), state);
    if (!admission) {
      d.refusal = admission.refusal();
      return compute_from_zero(req, d, ComputeReason::index_refused);
    }
    const LoadRequest request = admission.ticket().dispatch();
    d.parked = true;
    d.key = request.key;
    d.claimed_tokens = claimed_tokens(d.plan);
    ++counters_.parked;
    const bool sent = static_cast<bool>(transport_.send(request));
    parked_.emplace(req.id, Parked{request.key, d.claimed_tokens, d.admission, !sent});
    if (sent) {
      ++parked_in_flight_;
    } else {
      // Dropped before any rank saw it: nothing will report. A failed settlement now,
      // drained by the next step like any other (never parked without a load that settles).
      ++counters_.transport_drops;
      (void)index_.fail(request.key, false);
    }
    return d;
  }

  void on_resolution(const LoadResolution& r) {
    if (r.orphaned) {
      // A torn-down admission's load ended: now no rank writes its blocks or slot.
      if (const auto it = holding_.find(r.key); it != holding_.end()) {
        const AdmissionId id = it->second;
        holding_.erase(it);
        ledger_.hold_writer(id, false);
        ledger_.free_if_idle(id);
      }
      return;
    }
    const auto it = parked_.find(r.key.request);
    if (it == parked_.end() || it->second.key != r.key) {
      if (!erase_torn_down(r.key)) ++counters_.invariant_violations;  // a load nobody waits on, or a second unpark
      return;
    }
    const TokenCount tokens = r.kind == Resolution::completed ? it->second.claims : 0;
    if (!it->second.dropped) --parked_in_flight_;
    parked_.erase(it);
    // The tier did not deliver: do not trust what it was thought to hold.
    if (r.kind != Resolution::completed) ledger_.reset_watermark(r.key.request);
    if (tokens > 0) ++counters_.unparked_with_tokens;
    unparked_.push_back(Unpark{r.key.request, tokens, r.kind, r.state_missed});
  }

  bool erase_torn_down(const LoadKey& key) {
    for (std::size_t i = 0; i < torn_down_keys_.size(); ++i)
      if (torn_down_keys_[i] == key) {
        torn_down_keys_[i] = torn_down_keys_.back();
        torn_down_keys_.pop_back();
        return true;
      }
    return false;
  }

  // A P/D transfer ended: free a torn-down admission of the request now that nothing
  // writes its blocks (the oldest first: a sub ends one request's transfers in the order
  // they started), or unpark the request (tokens only for a dense model).
  void on_transfer(RequestId id, bool ok) {
    if (const auto held = pd_holding_.find(id); held != pd_holding_.end()) {
      const AdmissionId admission = held->second.front();
      held->second.erase(held->second.begin());
      if (held->second.empty()) pd_holding_.erase(held);
      --pd_held_;
      ledger_.hold_writer(admission, false);
      ledger_.free_if_idle(admission);
      return;
    }
    const auto it = parked_.find(id);
    if (it == parked_.end() || !it->second.transfer) {
      ++counters_.invariant_violations;  // a transfer nobody waits on
      return;
    }
    const TokenCount tokens = ok ? it->second.claims : 0;
    parked_.erase(it);
    --pd_parked_;
    ++counters_.unparked;
    if (tokens > 0) ++counters_.unparked_with_tokens;
    unparked_.push_back(Unpark{id, tokens, ok ? Resolution::completed : Resolution::failed, false});
  }

  void on_save(const SaveSettlement& s) {
    const auto it = saves_.find(s.key);
    if (it == saves_.end()) return;
    SaveOwner& owner = it->second;
    const Source source = owner.source;
    const bool source_free_now = s.phase == SavePhase::released || !owner.released;
    const bool confirmed = s.phase != SavePhase::released || s.ok;
    if (s.phase == SavePhase::released) {
      owner.released = true;
    } else {
      if (owner.state) end_state_save(*owner.state);
      saves_.erase(it);
    }
    if (s.phase == SavePhase::stored && !s.ok && source.admission) {
      // The tier may lack these chunks: the request saves them again next time.
      if (ledger_.holds(*source.admission)) ledger_.reset_watermark(ledger_.request_of(*source.admission));
    }
    if (!confirmed) {
      // Some rank could not confirm that nothing reads the source (its device failed to
      // synchronize): the blocks or slot stay pinned for good, visibly, rather than be
      // reused under a copy that may still run.
      ++counters_.sources_pinned;
    }
    // The source goes back on the released phase (early release), never later than stored.
    if (!source_free_now) return;
    if (source.admission) {
      ledger_.release_source(*source.admission, confirmed);
      ledger_.free_if_idle(*source.admission);
    } else {
      --snapshot_saves_unreleased_;
      if (confirmed) snapshots_ready_.push_back(source.slot);
      else ++snapshots_pinned_;
    }
  }

  // The KV save of an admission: the whole chunks from the request's watermark up to the
  // chunk-floored frontier, if the keys and blocks cover them.
  bool save_kv(AdmissionId id, RequestId request, TokenCount computed, std::span<const PrefixHash> keys,
               std::span<const BlockId> blocks) {
    const TokenGrid chunks = options_.grids.chunk_grid();
    const TokenCount frontier = chunks.floor(computed);
    const std::uint64_t from = chunks.cell_of(ledger_.watermark(request));
    const std::uint64_t to = chunks.cell_of(frontier);
    const std::uint64_t blocks_per_chunk = options_.grids.chunk_tokens / options_.grids.block_tokens;
    if (to <= from || to > keys.size() || to * blocks_per_chunk > blocks.size()) return false;
    KvSave save{SaveKey{keys[to - 1], {}},
                {keys.begin() + static_cast<std::ptrdiff_t>(from), keys.begin() + static_cast<std::ptrdiff_t>(to)},
                {blocks.begin() + static_cast<std::ptrdiff_t>(from * blocks_per_chunk),
                 blocks.begin() + static_cast<std::ptrdiff_t>(to * blocks_per_chunk)}};
    if (submit(Source{id, SlotId{}}, std::nullopt, std::move(save)) != CheckpointResult::saved) return false;
    ledger_.raise_watermark(request, frontier);
    return true;
  }

  // A state save from `source` (a snapshot, or the request's own slot), unless the model
  // has no state or the index already serves (or is saving) the hash.
  CheckpointResult save_state(const Checkpoint& c, Source source) {
    if (options_.layout == StateLayout::none) return CheckpointResult::not_stateful;
    if (index_.could_serve(c.hash) || state_saves_.contains(c.hash)) {
      ++counters_.checkpoints_deduplicated;
      return CheckpointResult::already_indexed;
    }
    const CheckpointResult r =
        submit(source, c.hash, StateSave{SaveKey{c.hash, {}}, source.slot, c.boundary});
    if (r == CheckpointResult::saved) {
      ++counters_.checkpoints_saved;
      ++state_saves_[c.hash];
      if (!source.admission) {
        ++snapshots_held_;
        ++snapshot_saves_unreleased_;
      }
    }
    return r;
  }

  void end_state_save(PrefixHash hash) {
    const auto it = state_saves_.find(hash);
    if (it != state_saves_.end() && --it->second == 0) state_saves_.erase(it);
  }

  template <class Save>
  CheckpointResult submit(Source source, std::optional<PrefixHash> state, Save save) {
    auto admission = index_.request_save(std::move(save));
    if (!admission) return CheckpointResult::refused;
    Save dispatched = admission.ticket().dispatch();
    if (!static_cast<bool>(transport_.send(dispatched))) {
      ++counters_.transport_drops;
      // No rank saw it: its source was never read, and nothing is stored.
      (void)index_.settle_save(SaveSettlement{dispatched.key, SavePhase::released, true});
      (void)index_.settle_save(SaveSettlement{dispatched.key, SavePhase::stored, false});
      return CheckpointResult::dropped;
    }
    ++counters_.saves_submitted;
    if (source.admission) ledger_.hold_source(*source.admission);
    saves_.emplace(dispatched.key, SaveOwner{source, state, false});
    return CheckpointResult::saved;
  }

  // Moves everything freed since the last hand-out into this step's output.
  void hand_out_frees() {
    const std::size_t before = freed_.size();
    ledger_.take_freed(freed_);
    counters_.freed += freed_.size() - before;
    snapshots_.insert(snapshots_.end(), snapshots_ready_.begin(), snapshots_ready_.end());
    counters_.snapshots_returned += snapshots_ready_.size();
    snapshots_held_ -= snapshots_ready_.size();
    snapshots_ready_.clear();
  }

  CoordinatorOptions options_;
  Index& index_;
  Pump& pump_;
  T& transport_;
  L& lookup_;
  detail::AdmissionLedger ledger_;
  std::unordered_map<RequestId, Parked> parked_;
  std::unordered_map<LoadKey, AdmissionId> holding_;  // orphaned load -> torn-down admission
  std::unordered_map<SaveKey, SaveOwner> saves_;
  std::unordered_map<PrefixHash, std::uint32_t> state_saves_;  // state saves in flight, by hash
  std::vector<TokenCount> servable_;
  std::vector<Unpark> unparked_;
  std::vector<Freed> freed_;
  std::vector<SlotId> snapshots_;        // this step's output
  std::vector<SlotId> snapshots_ready_;  // released since the last hand-out
  std::vector<LoadKey> torn_down_keys_;
  std::vector<OverdueLoad> overdue_list_;
  std::uint64_t parked_in_flight_ = 0, pd_parked_ = 0, pd_held_ = 0;
  TokenCount last_lookup_ = 0;                   // the lookup of the admission being made
  std::uint64_t snapshots_held_ = 0;             // taken by checkpoint(), not yet handed back
  std::uint64_t snapshot_saves_unreleased_ = 0;  // snapshot saves whose released phase has not settled
  std::uint64_t snapshots_pinned_ = 0;           // snapshots a rank could not confirm free: never handed back
  // Torn down while a P/D transfer may still write its blocks, oldest first per request.
  std::unordered_map<RequestId, std::vector<AdmissionId>> pd_holding_;
  mutable CoordinatorStats counters_{};  // the counters; stats() adds the gauges (mutable: its audit counts)
};

}  // namespace kvfuse
