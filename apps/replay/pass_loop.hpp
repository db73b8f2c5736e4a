// kvfuse-replay: one pass, the engine loop and the clock (its admission and compute side is
// pass_admission.hpp). One scheduler thread runs what an engine writes around kvfuse — a FIFO
// admission queue, the host kit's prefix-caching block pool, slot pools and admission book,
// the Coordinator over an OffloadIndex, a TpQuorum and its pump — and its ranks run their
// lanes, as threads of this process or as processes of their own (then the group is a
// ShmQuorum over the segment, and each step first watches the rank processes: a death tears
// down every running admission). A request keeps its RequestId across preemption and
// re-admission; each admission (AdmissionId) holds its own blocks and slot until the
// Coordinator frees it.
//
// Time is simulated: requests arrive at their times, prefill and decode take simulated time,
// and the clock jumps from event to event (or follows the wall clock at --speed). Loads and
// saves run for real on the ranks' lanes; while any load is in flight or any save has not
// landed the clock stands still, so the replay measures the tier, not the model.
//
// An admission's compute is a list of stops: the forward runs up to each stop's token when
// the clock reaches it, the engine acts there, and the last stop finishes the request. A
// stateful request stops at each prefill checkpoint its admit decision planned (the state
// there is copied into a snapshot slot and handed to the Coordinator at once) and at its
// generation-end checkpoint (captured there, saved by finish from the request's own slot).
#pragma once

#include "pass.hpp"

#include "cache_owner.hpp"
#include "composition.hpp"
#include "compute.hpp"
#include "content.hpp"
#include "forward.hpp"
#include "lookup.hpp"
#include "pass_setup.hpp"
#include "rank_process.hpp"
#include "transport.hpp"

#include <kvfuse/host/admission_book.hpp>
#include <kvfuse/host/audit.hpp>
#include <kvfuse/kvfuse.hpp>

#include <algorithm>
#include <chrono>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace replay::pass_detail {

using namespace kvfuse;
using WallClock = std::chrono::steady_clock;

/// One pass. Group is the completion group: TpQuorum for ranks as threads, ShmQuorum (over
/// the engine's segment) for ranks as processes.
template <class Group>
class Pass final : private FaultSite {
  static constexpr bool processes = std::is_same_v<Group, ShmQuorum>;

 public:
  Pass(const Model& model, const Workload& w, const RunOptions& o)
      : model_(model),
        o_(o),
        w_(w),
        keys_{model.id, o.world},
        disk_(with_tier(o.tier, [](const TierKind& kind) { return kind.disk; })),
        result_(empty_result(model, o)),
        rng_(o.seed),
        shm_(make_shm()),
        group_(make_group()),
        // No slot-free callback: an orphan's slot comes back through the Coordinator's Freed
        // event for its torn-down admission, the one signal.
        index_(OffloadIndexOptions{.hash_capacity = o.state_capacity,
                                   .slot_count = model.stateful ? o.num_slots : 0,
                                   .hash_eviction = o.hash_eviction}),
        pump_(group_, index_),
        faults_(o.offload ? o.faults : FaultSet(fault_table().size(), false), *this, result_.fault_counts),
        ranks_(make_ranks()),
        transport_(*ranks_),
        lookup_(*ranks_, transport_, keys_, faults_),
        coord_(CoordinatorOptions{.layout = model.layout, .grids = grids, .expected_requests = 4096, .checkpoints = o.checkpoints},
               index_, pump_, transport_, lookup_),
        blocks_(o.num_blocks),
        slots_(model.stateful ? o.num_slots : 0),
        snapshots_(model.stateful && o.offload ? o.snapshot_slots : 0, o.num_slots),
        book_(4096),
        cache_(cache_options(o.offload ? o.cache_policy : std::nullopt, o.cache_budget, model, o.state_scale),
               EveryRankTier{ranks_.get(), &transport_, keys_, &index_}) {
    if (model.composition == Composition::loopback_pd) composition_ = std::make_unique<LoopbackComposition>(*ranks_, rt_, o.num_blocks);
    faults_.ranks_built();
  }
  ~Pass() { ranks_->drain(); }
  Pass(const Pass&) = delete;
  Pass& operator=(const Pass&) = delete;

  RunResult run() {
    const auto started = WallClock::now();
    const auto& reqs = w_.requests;
    result_.outputs.assign(reqs.size(), 0);
    std::size_t next = 0;
    auto last_tick = WallClock::now(), last_progress = WallClock::now();
    while (ended_ < reqs.size()) {
      const bool blocked_by_saves = sync_blocked();
      while (next < reqs.size() && reqs[next].arrival_ms <= now_ms_ && !blocked_by_saves) {
        queue_.push_back(&reqs[next++]);
        faults_.arrival(next, reqs.size());
        if (o_.sync_saves) break;
      }
      admit_queued();
      step();
      run_due_stops();
      faults_.step();
      if (WallClock::now() - last_tick > std::chrono::milliseconds(50)) {
        last_tick = WallClock::now();
        if (o_.offload) result_.orphans_reclaimed += coord_.tick(last_tick, std::chrono::seconds(30), std::chrono::seconds(5)).reclaimed;
      }
      if (o_.progress && WallClock::now() - last_progress > std::chrono::milliseconds(100)) {
        last_progress = WallClock::now();
        o_.progress(ended_, reqs.size(), book_.stats().parked_now);
      }
      advance_clock(next < reqs.size() ? std::optional<double>(reqs[next].arrival_ms) : std::nullopt);
    }
    drain();
    result_.wall_seconds = std::chrono::duration<double>(WallClock::now() - started).count();
    collect();
    if (processes_ != nullptr) processes_->quit_all();  // a rank process that ended badly fails the run
    return result_;
  }

 private:
  static constexpr PlanGrids grids{block_tokens, chunk_tokens};

  /// The state the compute captured at the generation-end stop, for finish() to save.
  struct Captured {
    TokenCount boundary = 0;
    std::uint64_t state = 0;
  };
  /// What the pass knows of one admission beside its blocks and slot (the book's entry).
  struct Attempt {
    const Request* req = nullptr;
    std::size_t shared = 0;  // leading blocks pinned from the prefix cache
    TokenCount hbm = 0, resume = 0;
    LoadPlan plan = NoLoad{};
    bool pd = false;
    WallClock::time_point parked_at{};
    Forward forward;
    std::vector<Stop> stops;  // ascending; the last one finishes the request
    std::vector<TokenCount> checkpoints;  // the prefill checkpoints its admit decision planned, ascending
    TokenCount generation_end = 0;        // the stop whose state finish() saves (0: none)
    std::optional<Captured> captured;
  };
  using Book = AdmissionBook<Attempt>;
  using Entry = typename Book::Entry;

  /// Ranks as processes: the segment they attach to (null for ranks as threads).
  std::unique_ptr<ShmEngine> make_shm() const {
    if constexpr (!processes) return nullptr;
    else return rank_segment(model_, o_, w_);
  }

  Group make_group() {
    if constexpr (processes) return Group(*shm_, 8192, 4096);
    else return Group(TpQuorumOptions{o_.world, model_.lanes, 8192, 8192, 4096});
  }

  std::unique_ptr<Ranks> make_ranks() {
    RankSetup s = rank_setup(model_, o_, w_);
    for (std::uint32_t r = 0; r < o_.world; ++r) {
      s.tier_options.push_back(o_.tier_options);
      faults_.set_up_tier(r, s.tier_options.back());
    }
    s.runtime = &rt_;
    if constexpr (processes) {
      auto made = std::make_unique<RankProcesses>(s, model_.name, *shm_);
      processes_ = made.get();
      return made;
    } else {
      s.group = &group_;
      return model_.make_ranks(s);
    }
  }

  // ---- admission and the compute side (pass_admission.hpp) ------------------------------
  void admit_queued();

  bool admit(const Request& q);

  void tear_down(Entry& e, bool preempt);

  /// The request computes from `resume`: its stops are its planned prefill checkpoints and its
  /// generation-end checkpoint above `resume` (a load that restored less than it claimed, or
  /// nothing, leaves them all above), then its end.
  void start_compute(Entry& e, TokenCount resume);

  /// Runs every computing admission up to the stops the clock reached, in admission order.
  void run_due_stops();

  /// A planned prefill checkpoint, mid-prefill: the state at `boundary` is copied into a
  /// snapshot slot and handed to the Coordinator, which sends it (the slot comes back in a
  /// step's `snapshots` once every rank read it) or already has it (the slot is free at once).
  /// No free snapshot slot: skipped and counted, the prefill goes on. Says whether the
  /// Coordinator has the checkpoint now (saved, or already indexed or being saved), or the
  /// cache ledger refused it (then finish() does not offer the same boundary again: a
  /// second offer from the same request would pass for a second sighting).
  enum class Handed { yes, no, refused };
  Handed checkpoint(const Attempt& a, TokenCount boundary, std::uint64_t state);

  /// The rest of the forward, the output checksum, and finish(): the KV and the
  /// generation-end checkpoint go to the Coordinator.
  void finish(Entry& e);

  // ---- the coordinator's events ------------------------------------------------------------
  void step() {
    if constexpr (processes) {
      for (const std::uint32_t r : processes_->watch(pump_)) lose_rank(r);
    }
    if (!o_.offload) return;
    const CoordinatorStep s = composition_ ? coord_.step(composition_->arbiter()) : coord_.step();
    // Unparks resume their admissions, Freeds hand blocks and slots back, snapshots return;
    // anything the book cannot match is a protocol error it counts.
    (void)book_.apply(s, blocks_, slots_, snapshots_, [this](Entry& e, const Unpark& u) { on_unpark(e, u); });
    // No save in flight: none can land after its entry's eviction any more.
    if (cache_.stats().unswept > 0 && index_.stats().saves_outstanding == 0) (void)cache_.sweep();
    if (s.records == 0 && s.unparked.empty() && s.freed.empty() && s.snapshots.empty() &&
        (book_.stats().parked_now > 0 || book_.stats().ended_now > 0))
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

  /// The blocks a load plan's KV range lands in.
  static std::vector<BlockId> plan_blocks(const Entry& e) {
    std::vector<BlockId> out;
    if (const std::optional<IndexRange> range = kv_tokens(e.payload.plan))
      for (TokenCount b = range->first / block_tokens; b * block_tokens < range->last; ++b) out.push_back(e.blocks[b]);
    return out;
  }

  /// The engine saw rank r's process die (ShmEngine's pidfd; the pump marked it dead, its
  /// loads settle without it). Its device KV died with it, so every admission that holds
  /// blocks and has not finished is torn down and admitted again later, and no cached block
  /// is reused: they lack that rank's part. Nothing is admitted until it is back.
  void lose_rank(std::uint32_t r) {
    if (!processes_->killed(r))
      throw Error(ErrorCode::io_failure, "rank " + std::to_string(r) + "'s process died and no fault killed it: " +
                                            processes_->how_it_ended(r));
    ++result_.rank_processes_lost;
    due_.clear();
    book_.for_each([&](const Entry& e) {
      if (e.state != AdmissionState::ended) due_.push_back(e.admission);
    });
    std::sort(due_.begin(), due_.end());
    for (const AdmissionId id : due_) {
      tear_down(*book_.find(id), true);
      ++result_.rank_loss_preemptions;
    }
    blocks_.forget_cached();
  }

  /// The book resumed `e` on `u` (the book checked that it waited on a load).
  void on_unpark(Entry& e, const Unpark& u) {
    Attempt& a = e.payload;
    const double us = std::chrono::duration<double, std::micro>(WallClock::now() - a.parked_at).count();
    switch (u.kind) {
      case Resolution::completed: ++result_.outcome_completed; break;
      case Resolution::failed: ++result_.outcome_failed; break;
      default: ++result_.outcome_abandoned; break;
    }
    result_.outcome_state_missed += u.state_missed;
    if (u.tokens > 0) {
      ++result_.resumed_from_load;
      cache_.note_uses(a.req->chunk_keys, a.hbm, u.tokens,
                       model_.stateful ? std::optional<PrefixHash>(StateChain::of(model_.id, *a.req, u.tokens)) : std::nullopt);
      if (a.pd) ranks_->pd_landed(plan_blocks(e));
      const Checked c = check_load(*ranks_, *a.req, e.blocks, e.slot, a.plan,
                                   u.salvaged ? std::optional<TokenCount>(u.tokens) : std::nullopt);
      result_.verified_bytes += c.verified;
      result_.corrupted_bytes += c.corrupted;
      if (std::holds_alternative<JointLoad>(a.plan)) joint_us_.push_back(us);
      else if (std::holds_alternative<KvOnlyLoad>(a.plan)) kv_only_us_.push_back(us);
      else if (std::holds_alternative<StateOnlyLoad>(a.plan)) state_only_us_.push_back(us);
    }
    const TokenCount resume = model_.stateful ? u.tokens : std::max(u.tokens, a.hbm);
    if (u.kind != Resolution::completed || u.salvaged) {
      // What a policy that fails a load whole would recompute, against what salvage does.
      const TokenCount floor = model_.stateful ? 0 : a.hbm;
      result_.recomputed_after_failed_loads += a.req->prompt_tokens - std::min(resume, a.req->prompt_tokens);
      result_.fail_whole_would_recompute += a.req->prompt_tokens - std::min(floor, a.req->prompt_tokens);
    }
    start_compute(e, resume);
  }

  // ---- the clock -------------------------------------------------------------------------------
  /// --sync-saves: the next request arrives only once the last one's saves landed.
  bool sync_blocked() {
    return o_.sync_saves && o_.offload && (book_.size() > 0 || !queue_.empty() || index_.stats().saves_outstanding > 0);
  }

  void advance_clock(std::optional<double> next_arrival) {
    if (book_.stats().parked_now > 0 || index_.stats().saves_outstanding > 0) return;  // loads and saves take no simulated time
    constexpr double never = std::numeric_limits<double>::infinity();
    double next = next_arrival && !sync_blocked() ? *next_arrival : never;
    book_.for_each([&](const Entry& e) {
      if (e.state == AdmissionState::running) next = std::min(next, e.payload.stops.front().due_ms);
    });
    if (next == never || next <= now_ms_) return;
    if (o_.speed > 0) {
      const auto due = wall_start_ + std::chrono::duration_cast<WallClock::duration>(std::chrono::duration<double, std::milli>(next / o_.speed));
      if (WallClock::now() < due) {
        std::this_thread::sleep_until(std::min(due, WallClock::now() + std::chrono::milliseconds(2)));
        return;
      }
    }
    now_ms_ = next;
  }

  /// Every load and save settles, every admission's resources come back.
  void drain() {
    if (!o_.offload) return;
    const auto deadline = WallClock::now() + std::chrono::seconds(60);
    while (WallClock::now() < deadline &&
           (book_.size() > 0 || index_.stats().outstanding > 0 || index_.stats().saves_outstanding > 0)) {
      step();
      if (WallClock::now() > deadline - std::chrono::seconds(30)) {
        // A load lost on its way is reclaimed after its timeout, as an engine's tick would.
        result_.orphans_reclaimed += coord_.tick(WallClock::now() + std::chrono::hours(1), std::chrono::seconds(30), std::chrono::seconds(5)).reclaimed;
      }
    }
    ranks_->drain();
    step();
  }

  void collect() {
    RunResult& r = result_;
    r.requests = w_.requests.size();
    r.reuse_bound = w_.reuse_bound;
    r.prompt_tokens = w_.prompt_tokens;
    r.joint = Latency::of(joint_us_);
    r.kv_only = Latency::of(kv_only_us_);
    r.state_only = Latency::of(state_only_us_);
    const IndexStats is = index_.stats();
    const PumpStats ps = pump_.stats();
    const CoordinatorStats cs = coord_.stats();
    r.hashes_retracted = is.hashes_retracted;
    r.late_reports = ps.late_reports;
    r.saves_stored = is.saves_stored;
    r.saves_failed = is.saves_failed;
    // The host kit's audit (index, coordinator, book, pools), plus what the faults found.
    const HostAudit audit = audit_host(index_, cs, book_, blocks_, slots_, snapshots_);
    r.invariant_violations = audit.invariant_violations + fault_violations_;
    r.stranded_parked = audit.stranded_parked;
    r.leaked_slots = audit.leaked_slots + audit.leaked_blocks + audit.held_admissions;
    r.checkpoints_saved = cs.checkpoints_saved;
    r.salvaged_loads = cs.salvaged_loads;
    r.salvaged_tokens = cs.salvaged_tokens;
    r.second_loads = cs.second_loads;
    r.checkpoints_deduplicated = cs.checkpoints_deduplicated;
    if (const auto& l = cache_.ledger()) {
      r.cache_policy = l->policy();
      r.cache_ledger = l->stats();
    }
    r.kv_loads_sent = transport_.kv_loads_sent();
    r.ranks_as = processes ? "processes" : "threads";
    r.rank_processes = ranks_->rank_counts();
    if (shm_) r.segment = shm_->stats();
    faults_.collect();
    RunResult::Snapshot& snap = r.snapshot;
    snap.index = is;
    snap.pump = ps;
    snap.coordinator = cs;
    for (std::uint32_t i = 0; i < ranks_->world(); ++i) {
      snap.connectors.push_back(ranks_->connector_stats(i));
      snap.tiers.push_back(ranks_->tier(i).snapshot());
      r.staging_bytes += snap.connectors.back().standing_staging_bytes;
      r.tier_calls += snap.tiers.back().calls;
      r.state_bytes_stored += snap.tiers.back().calls.state_bytes_put;
    }
    if (composition_) snap.pd = composition_->stats();
  }

  // ---- FaultSite ---------------------------------------------------------------------------
  std::uint32_t world() const override { return o_.world; }
  bool disk() const override { return disk_; }
  TierControl& tier(std::uint32_t rank) override { return ranks_->tier(rank); }
  TierKey kv_key(PrefixHash h, std::uint32_t rank) const override { return keys_.kv(h, rank); }
  TierKey state_key(PrefixHash h, std::uint32_t rank) const override { return keys_.state(h, rank); }
  bool alive(std::uint32_t rank) const override { return transport_.alive(rank); }
  void set_alive(std::uint32_t rank, bool alive) override {
    transport_.set_alive(rank, alive);
    if (alive) pump_.mark_rank_alive(rank);
    else pump_.mark_rank_dead(rank);
  }
  bool coin(const Request& q, std::uint64_t salt, std::uint32_t per_mille) const override {
    return request_coin(o_.seed, q.index, salt, per_mille);
  }
  std::uint64_t random() override { return rng_(); }
  std::span<const PrefixHash> saved_chunks() const override { return saved_; }
  void violation() override { ++fault_violations_; }
  bool processes_mode() const override { return processes; }
  std::size_t loads_in_flight() const override { return book_.stats().parked_now; }
  bool kill_rank(std::uint32_t rank) override { return processes_ != nullptr && processes_->kill(rank); }
  bool rank_lost(std::uint32_t rank) const override { return processes_ != nullptr && processes_->lost(rank); }
  bool restart_rank(std::uint32_t rank) override { return processes_ != nullptr && processes_->restart(rank); }

  using Pump = SettlementPump<Group, OffloadIndex<>>;
  using Coord = Coordinator<Group, Transport, Lookup>;

  const Model& model_;
  const RunOptions o_;
  const Workload& w_;
  const TierKeys keys_;
  const bool disk_;
  RunResult result_;
  std::mt19937_64 rng_;
  HostRuntime rt_;
  std::unique_ptr<ShmEngine> shm_;     // ranks as processes: their segment
  RankProcesses* processes_ = nullptr;  // ranks as processes: ranks_ (set while ranks_ is built)
  Group group_;
  OffloadIndex<> index_;
  Pump pump_;
  ArmedFaults faults_;
  std::unique_ptr<Ranks> ranks_;
  Transport transport_;
  Lookup lookup_;
  Coord coord_;
  std::unique_ptr<LoopbackComposition> composition_;
  PrefixBlockPool blocks_;
  SlotPool slots_;
  SlotPool snapshots_;  // after the request slots
  Book book_;           // every admission's blocks and slot, and what the pass knows of it
  CacheOwner cache_;    // --cache-policy: the one owner of what the tiers keep

  std::unordered_set<std::uint64_t> attempted_;
  std::deque<const Request*> queue_;
  std::vector<AdmissionId> due_;
  std::vector<PrefixHash> saved_;  // chunk keys of recent KV saves
  std::vector<double> joint_us_, kv_only_us_, state_only_us_;
  std::uint64_t offline_admissions_ = 0, fault_violations_ = 0;
  std::size_t ended_ = 0;
  double now_ms_ = 0;
  WallClock::time_point wall_start_ = WallClock::now();
};

}  // namespace replay::pass_detail
