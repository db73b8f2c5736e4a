// kvfuse/engine/detail/coordinator_composition.hpp — the Coordinator's admission through a
// composition (R16): the tier planned first, its plan offered as the offload sub's, the
// first sub that loads KV winning, a P/D sub's transfer parked on and drained. Member
// definitions of Coordinator (engine/coordinator.hpp), kept apart from the class so the
// class reads as the engine's loop; included at the end of coordinator.hpp.
//
// Scheduler thread only, like the rest of the Coordinator.
#pragma once

#include <kvfuse/engine/coordinator.hpp>

namespace kvfuse {

template <CompletionGroup G, CoordinatorTransport T, KvLookup L, class Clock>
template <KvArbiter A>
AdmitDecision Coordinator<G, T, L, Clock>::admit(const AdmitRequest& req, A& arbiter) {
  AdmitDecision d;
  if (already_parked(req.id, d)) return d;
  const AdmissionPlan p = start(req, d);
  const bool secured = state_boundary(d.plan).has_value() && req.slot.has_value();
  const AdmissionQuery query{req.id, req.hbm, req.prompt_tokens, detail::offer_of(d.plan, req.hbm)};
  const Arbitration a = arbiter.arbitrate(query, secured);
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
    parking_.park_on_transfer(req.id, d.claimed_tokens, d.admission);
    ++counters_.parked;
    return d;
  }
  if (a.state == StateDisposition::state_only && std::holds_alternative<StateOnlyLoad>(d.plan))
    return dispatch_plan(req, d);
  // A plan with a state leg but no slot to restore it into: the same answer as admit().
  if (state_boundary(d.plan) && !req.slot) return compute_from_zero(req, d, ComputeReason::no_slot);
  if (const auto* no = std::get_if<NoLoad>(&d.plan)) d.no_load = no->reason;
  return compute_from_zero(req, d, ComputeReason::planned_no_load);
}

template <CompletionGroup G, CoordinatorTransport T, KvLookup L, class Clock>
template <KvArbiter A>
typename Coordinator<G, T, L, Clock>::StepResult Coordinator<G, T, L, Clock>::step(A& arbiter, typename Pump::TimePoint now) {
  StepResult r = step(now);
  (void)arbiter.drain_finished([this](RequestId id, bool ok) { on_transfer(id, ok); });
  hand_out_frees();  // freed by a transfer's end: out in this step
  r.unparked = unparked_;
  r.freed = freed_;
  r.snapshots = snapshots_;
  return r;
}

template <CompletionGroup G, CoordinatorTransport T, KvLookup L, class Clock>
void Coordinator<G, T, L, Clock>::on_transfer(RequestId id, bool ok) {
  if (const std::optional<AdmissionId> held = parking_.transfer_ended(id)) {
    ledger_.hold_writer(*held, false);
    ledger_.free_if_idle(*held);
    return;
  }
  if (!parking_.on_transfer(id)) {
    ++counters_.invariant_violations;  // a transfer nobody waits on
    return;
  }
  const TokenCount claims = parking_.leave(id)->claims;
  const TokenCount tokens = ok ? claims : 0;
  ++counters_.unparked;
  if (tokens > 0) ++counters_.unparked_with_tokens;
  unparked_.push_back(Unpark{id, tokens, ok ? Resolution::completed : Resolution::failed, false});
}

}  // namespace kvfuse
