// kvfuse/engine/detail/coordinator_salvage.hpp — how the Coordinator ends a parked load: a
// completed one resumes at its claim; a failed one at what every rank restored
// (docs/reference.md#salvage): the KV frontier for a dense model, the highest checkpoint a
// second, state-only load can restore for a stateful one (sent here, at most once per
// admission), the engine's own state at the HBM floor, or 0. Member definitions of
// Coordinator (engine/coordinator.hpp); included at the end of coordinator.hpp.
//
// Scheduler thread only, like the rest of the Coordinator.
#pragma once

#include <kvfuse/engine/coordinator.hpp>

namespace kvfuse {

template <CompletionGroup G, CoordinatorTransport T, KvLookup L, class Clock>
void Coordinator<G, T, L, Clock>::on_resolution(const LoadResolution& r) {
  if (r.orphaned) {
    (void)ledger_.load_ended(r.key);  // a torn-down admission's load ended: no rank writes it now
    return;
  }
  if (!parking_.parked_on(r.key.request, r.key)) {
    if (!ledger_.forget_torn_down(r.key)) ++counters_.invariant_violations;  // a load nobody waits on, or a second unpark
    return;
  }
  detail::ParkingLedger::Parked parked = *parking_.leave(r.key.request);
  if (r.kind == Resolution::completed) {
    time_load(parked);
    if (parked.second) note_salvage(parked.claims, parked.hbm);
    unpark(Unpark{r.key.request, parked.claims, r.kind, r.state_missed, parked.second});
    return;
  }
  // The tier did not deliver: do not trust what it was thought to hold.
  ledger_.reset_watermark(r.key.request);
  const detail::SalvagePoint at =
      r.kind == Resolution::failed
          ? detail::salvage_point(options_.layout, parked.hbm, parked.kv_from, parked.kv_end, r.kv_restored,
                                  options_.grids.chunk_tokens, parked.hbm_state_held, parked.second, parked.fallbacks,
                                  [this](PrefixHash h) { return index_.could_serve(h); })
          : detail::SalvagePoint{};
  const TokenCount hbm = parked.hbm;
  if (at.second_load && second_load(r.key.request, *at.second_load, std::move(parked))) return;
  if (at.tokens > 0) note_salvage(at.tokens, hbm);
  unpark(Unpark{r.key.request, at.tokens, r.kind, r.state_missed, at.tokens > 0});
}

template <CompletionGroup G, CoordinatorTransport T, KvLookup L, class Clock>
void Coordinator<G, T, L, Clock>::note_salvage(TokenCount tokens, TokenCount hbm) noexcept {
  ++counters_.salvaged_loads;
  counters_.salvaged_tokens += tokens > hbm ? tokens - hbm : 0;
}

template <CompletionGroup G, CoordinatorTransport T, KvLookup L, class Clock>
bool Coordinator<G, T, L, Clock>::second_load(RequestId id, const Checkpoint& c, detail::ParkingLedger::Parked parked) {
  if (!parked.slot) return false;
  LoadGrant grant = index_.request_load(
      id, std::nullopt, StateSpec{c.boundary, c.hash, *parked.slot, options_.grids.block_tokens, options_.grids.chunk_tokens});
  if (!grant) return false;
  ++counters_.second_loads;
  parked.claims = c.boundary;
  parked.kv_from = parked.kv_end = 0;
  parked.bytes = leg_bytes(0, true);
  parked.second = true;
  parked.fallbacks.clear();
  (void)send_load(id, std::move(grant), std::move(parked));
  return true;
}

}  // namespace kvfuse
