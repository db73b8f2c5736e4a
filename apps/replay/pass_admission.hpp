// kvfuse-replay: the admission and compute side of a pass (the class is in pass_loop.hpp):
// taking blocks and a slot and admitting through the Coordinator (or a composition), putting
// the admission on the book, tearing it down, and running its compute stop by stop to its
// finish. Scheduler thread.
#pragma once

#include "pass_loop.hpp"

namespace replay::pass_detail {

template <class Group>
void Pass<Group>::admit_queued() {
  // A tensor-parallel model computes on every rank or not at all: nothing is admitted
  // while a rank process is down.
  if (processes_ != nullptr && !processes_->all_up()) return;
  while (!queue_.empty()) {
    if (!admit(*queue_.front())) return;  // FIFO: wait for blocks or a slot
    queue_.pop_front();
  }
}

template <class Group>
bool Pass<Group>::admit(const Request& q) {
  Attempt a;
  a.req = &q;
  const RequestId request{q.index + 1};
  const TokenCount total = q.prompt_tokens + q.output_tokens;
  const std::size_t nblocks = (total + block_tokens - 1) / block_tokens;
  std::vector<std::uint64_t> ids(nblocks);
  for (std::size_t b = 0; b < nblocks; ++b) ids[b] = block_id(q, b);
  std::vector<BlockId> blocks;
  a.shared = blocks_.match(ids, (q.prompt_tokens - 1) / block_tokens, blocks);
  if (!blocks_.allocate(nblocks - a.shared, blocks) || (model_.stateful && slots_.empty())) {
    for (const BlockId b : blocks) blocks_.release(b);
    return false;
  }
  const std::optional<SlotId> slot = model_.stateful ? slots_.take() : std::nullopt;
  a.hbm = static_cast<TokenCount>(a.shared) * block_tokens;
  const bool first = attempted_.insert(q.index).second;
  if (!o_.offload) {
    const TokenCount resume = model_.stateful ? 0 : a.hbm;
    start_compute(book_.open_local(request, AdmissionId{++offline_admissions_}, std::move(blocks), slot, std::move(a)), resume);
    return true;
  }
  std::vector<Checkpoint> checkpoints;  // every chunk boundary below P, one chain walk
  StateChain chain = StateChain::start(model_.id);
  for (TokenCount b = chunk_tokens; model_.stateful && b <= q.prompt_tokens - 1; b += chunk_tokens) {
    chain = chain.next(q.chunk_keys[b / chunk_tokens - 1]);
    checkpoints.push_back(Checkpoint{b, chain.at(b)});
  }
  const AdmitRequest ar{request, q.prompt_tokens, a.hbm, q.chunk_keys, blocks, checkpoints, slot};
  AdmitDecision d;
  if (composition_) {
    if (request_coin(o_.seed, q.index, 11, 250)) composition_->publish(request, q);
    d = coord_.admit(ar, composition_->arbiter());
  } else {
    d = coord_.admit(ar);
  }
  if (!d.parked && d.reason == ComputeReason::already_parked) {
    // Admitted while its earlier admission waits on a load: the engine lost track (the
    // book counts it when asked to open it). Nothing was handed to anyone.
    (void)book_.open(request, d, {}, std::nullopt);
    for (const BlockId b : blocks) blocks_.release(b);
    if (slot) (void)slots_.give(*slot);
    ++ended_;
    return true;
  }
  // A preempted request comes back while its torn-down admission may still hold its
  // blocks (its orphaned load in flight): two admissions of one RequestId, freed apart.
  if (book_.admissions_of(request) > 0) ++result_.readmitted_while_held;
  a.checkpoints = std::move(d.checkpoints);
  a.plan = d.plan;
  a.pd = d.sub && *d.sub == 0;
  a.parked_at = WallClock::now();
  Entry& e = *book_.open(request, d, std::move(blocks), slot, std::move(a));
  if (!d.parked) {
    ++result_.admitted_compute;
    start_compute(e, model_.stateful ? 0 : e.payload.hbm);
    return true;
  }
  if (e.payload.pd) ++result_.loads_pd;
  else if (std::holds_alternative<KvOnlyLoad>(d.plan)) ++result_.loads_kv_only;
  else if (std::holds_alternative<JointLoad>(d.plan)) ++result_.loads_joint;
  else if (std::holds_alternative<StateOnlyLoad>(d.plan)) ++result_.loads_state_only;
  switch (faults_.parked(q, first)) {  // the request may go away while its load is in flight
    case TearDown::abort: tear_down(e, false); break;
    case TearDown::preempt: tear_down(e, true); break;
    case TearDown::none: break;
  }
  return true;
}

template <class Group>
void Pass<Group>::tear_down(Entry& e, bool preempt) {
  coord_.teardown(e.request);
  (void)book_.end(e.request);
  if (preempt) {
    ++result_.preempted;
    queue_.push_back(e.payload.req);  // admitted again later, under the same RequestId
  } else {
    ++result_.aborted;
    ++ended_;
  }
}

template <class Group>
void Pass<Group>::start_compute(Entry& e, TokenCount resume) {
  Attempt& a = e.payload;
  const Request& q = *a.req;
  a.resume = resume;
  const TokenCount hbm_used = std::min(resume, a.hbm);
  result_.reused_hbm += hbm_used;
  result_.reused_tier += resume - hbm_used;
  // A dense model has no state to restore: its digest always runs from the start.
  const TokenCount state_from = model_.stateful ? resume : 0;
  a.forward = Forward(std::max(resume, static_cast<TokenCount>(a.shared) * block_tokens), state_from,
                      state_from > 0 ? read_state(*ranks_, *e.slot) : initial_state);
  Schedule plan = schedule(q, resume, now_ms_, o_.offload && model_.stateful, a.checkpoints, grids, o_.checkpoints);
  a.stops = std::move(plan.stops);
  a.generation_end = plan.generation_end;
  a.captured.reset();
}

template <class Group>
void Pass<Group>::run_due_stops() {
  due_.clear();
  book_.for_each([&](const Entry& e) {
    if (e.state == AdmissionState::running && e.payload.stops.front().due_ms <= now_ms_) due_.push_back(e.admission);
  });
  std::sort(due_.begin(), due_.end());
  for (const AdmissionId id : due_) {
    Entry& e = *book_.find(id);
    Attempt& a = e.payload;
    while (a.stops.size() > 1 && a.stops.front().due_ms <= now_ms_) {
      const Stop stop = a.stops.front();
      a.stops.erase(a.stops.begin());
      const std::uint64_t state = a.forward.run_to(*ranks_, *a.req, e.blocks, stop.at);
      const Handed handed = std::binary_search(a.checkpoints.begin(), a.checkpoints.end(), stop.at)
                                ? checkpoint(a, stop.at, state)
                                : Handed::no;
      // A generation-end checkpoint that is also a prefill one went to the Coordinator (or
      // was refused) already.
      if (stop.at == a.generation_end && handed == Handed::no) a.captured = Captured{stop.at, state};
    }
    if (a.stops.size() == 1 && a.stops.front().due_ms <= now_ms_) finish(e);
  }
}

template <class Group>
auto Pass<Group>::checkpoint(const Attempt& a, TokenCount boundary, std::uint64_t state) -> Handed {
  const std::optional<SlotId> taken = snapshots_.take();
  if (!taken) {
    ++result_.checkpoints_skipped;
    return Handed::no;
  }
  const SlotId snapshot = *taken;
  const Checkpoint c{boundary, StateChain::of(model_.id, *a.req, boundary)};
  const auto offer = cache_.offer_checkpoint(a.req->chunk_keys, boundary, c.hash, a.req->prompt_tokens, [&] {
    write_state(*ranks_, snapshot, state);
    const CheckpointResult r = coord_.checkpoint(c, snapshot);
    if (r == CheckpointResult::saved) faults_.checkpoint_saved(*a.req, c.hash);
    else (void)snapshots_.give(snapshot);  // nothing was sent: nothing reads it
    return r == CheckpointResult::saved || r == CheckpointResult::already_indexed;
  });
  if (offer == CacheOwner::Offer::refused) {
    ++result_.checkpoints_refused;
    (void)snapshots_.give(snapshot);
    return Handed::refused;
  }
  return offer == CacheOwner::Offer::sent ? Handed::yes : Handed::no;
}

template <class Group>
void Pass<Group>::finish(Entry& e) {
  Attempt& a = e.payload;
  const Request& q = *a.req;
  const TokenCount total = q.prompt_tokens + q.output_tokens;
  const std::uint64_t state = a.forward.run_to_end(*ranks_, q, e.blocks);
  result_.outputs[q.index] = output_of(*ranks_, q, e.blocks, state);
  for (std::size_t b = 0; (b + 1) * block_tokens <= total; ++b) blocks_.publish(e.blocks[b], block_id(q, b));
  ++result_.completed;
  ++ended_;
  if (!o_.offload) {
    (void)book_.close(e.admission, blocks_, slots_);  // no Coordinator: its blocks and slot go back now
    return;
  }
  // The ledger sees the KV first, so the checkpoint stands on kept chunks: the chunks from
  // the Coordinator's save watermark up, cut at the first one the ledger does not keep
  // (CacheKeeper::keep_chunks); the Coordinator then sends only the kept prefix.
  const std::size_t chunks = total / chunk_tokens;
  const std::size_t kept_end =
      cache_.keep_chunks(q.chunk_keys, static_cast<std::size_t>(coord_.save_watermark(e.request) / chunk_tokens), chunks);
  const TokenCount computed = kept_end == chunks ? total : static_cast<TokenCount>(kept_end) * chunk_tokens;
  std::optional<Checkpoint> checkpoint;
  if (a.captured) {
    const Checkpoint c{a.captured->boundary, StateChain::of(model_.id, q, a.captured->boundary)};
    if (cache_.keep_checkpoint(q.chunk_keys, c.boundary, c.hash, q.prompt_tokens, kept_end)) {
      write_state(*ranks_, *e.slot, a.captured->state);
      checkpoint = c;
      faults_.checkpoint_saved(q, checkpoint->hash);
    } else {
      ++result_.checkpoints_refused;
    }
  }
  (void)coord_.finish(FinishRequest{e.request, computed, q.chunk_keys, e.blocks, checkpoint, e.slot});
  (void)book_.end(e.request);  // its blocks and slot go back with its Freed
  for (std::size_t c = 0; c < kept_end; ++c) saved_.push_back(q.chunk_keys[c]);
  if (saved_.size() > 4096) saved_.erase(saved_.begin(), saved_.begin() + 2048);
}

}  // namespace replay::pass_detail
