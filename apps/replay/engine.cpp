// kvfuse-replay: the engine loop and the clock. One scheduler thread runs what an engine
// would write around kvfuse — a FIFO admission queue, a paged block pool with prefix caching,
// a state slot pool, the Coordinator over an OffloadIndex, a TpQuorum and its pump — and its
// ranks run their lanes, as threads of this process or as processes of their own (then the
// group is a ShmQuorum over the segment, and each step first watches the rank processes:
// a death tears down every running admission). A request keeps its RequestId across
// preemption and re-admission; each admission (AdmissionId) holds its own blocks and slot
// until the Coordinator frees it.
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
#include "engine.hpp"

#include "block_cache.hpp"
#include "composition.hpp"
#include "content.hpp"
#include "forward.hpp"
#include "lookup.hpp"
#include "rank_process.hpp"
#include "slot_pool.hpp"
#include "transport.hpp"

#include <kvfuse/kvfuse.hpp>
#include <kvfuse/testing/index_consistency.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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

namespace replay {

namespace {

using namespace kvfuse;
using WallClock = std::chrono::steady_clock;

constexpr double prefill_tokens_per_ms = 50.0;  // simulated prefill speed
constexpr double decode_ms_per_token = 1.0;     // simulated decode speed

/// Deterministic per-request coin: the same request gets the same answer in every pass.
bool request_coin(std::uint64_t seed, std::uint64_t request, std::uint64_t salt, std::uint32_t per_mille) {
  return mix64(seed ^ mix64(request * 0x100000001b3ULL + salt)) % 1000 < per_mille;
}

/// One pass. Group is the completion group: TpQuorum for ranks as threads, ShmQuorum (over
/// the engine's segment) for ranks as processes.
template <class Group>
class Engine final : private FaultSite {
  static constexpr bool processes = std::is_same_v<Group, ShmQuorum>;

 public:
  Engine(const Model& model, const Workload& w, const RunOptions& o)
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
        coord_(CoordinatorOptions{model.layout, grids, 0, 4096, o.checkpoints}, index_, pump_, transport_, lookup_),
        blocks_(o.num_blocks),
        slots_(model.stateful ? o.num_slots : 0),
        snapshots_(model.stateful && o.offload ? o.snapshot_slots : 0, o.num_slots) {
    if (model.admission == Admission::loopback_pd) composition_ = std::make_unique<LoopbackComposition>(*ranks_, rt_, o.num_blocks);
    faults_.ranks_built();
  }
  ~Engine() { ranks_->drain(); }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

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
        o_.progress(ended_, reqs.size(), parked_);
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

  enum class Phase { parked, computing, finishing, torn_down };
  /// Where an admission's compute pauses: token `at`, reached at simulated time `due_ms`.
  struct Stop {
    TokenCount at = 0;
    double due_ms = 0;
  };
  /// The state the compute captured at the generation-end stop, for finish() to save.
  struct Captured {
    TokenCount boundary = 0;
    std::uint64_t state = 0;
  };
  /// One admission of a request.
  struct Attempt {
    const Request* req = nullptr;
    RequestId request;
    Phase phase = Phase::computing;
    std::vector<BlockId> blocks;
    std::size_t shared = 0;  // leading blocks pinned from the prefix cache
    std::optional<SlotId> slot;
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

  static RunResult empty_result(const Model& model, const RunOptions& o) {
    RunResult r;
    r.model = std::string(model.name);
    r.offload = o.offload;
    r.fault_counts.assign(fault_rows().size(), 0);
    return r;
  }

  /// The ranks' shape, before the faults set up their tiers.
  RankSetup base_setup() const {
    RankSetup s;
    s.model = model_.id;
    s.world = o_.world;
    s.num_blocks = o_.num_blocks;
    // Request slots and snapshot slots share each rank's device slot memory.
    s.num_slots = model_.stateful ? o_.num_slots + (o_.offload ? o_.snapshot_slots : 0) : 0;
    s.max_chunks_per_load = static_cast<std::uint32_t>(w_.max_request_tokens / chunk_tokens + 2);
    s.tier = o_.tier;
    return s;
  }

  /// Ranks as processes: the segment they attach to (null for ranks as threads).
  std::unique_ptr<ShmEngine> make_shm() const {
    if constexpr (!processes) return nullptr;
    ShmOptions so;
    so.name_prefix = "kvfuse-replay";
    so.geometry = base_setup().geometry(0);
    so.lanes_per_rank = static_cast<std::uint32_t>(model_.lanes);
    return std::make_unique<ShmEngine>(so);
  }

  Group make_group() {
    if constexpr (processes) return Group(*shm_, 8192, 4096);
    else return Group(TpQuorumOptions{o_.world, model_.lanes, 8192, 8192, 4096});
  }

  std::unique_ptr<Ranks> make_ranks() {
    RankSetup s = base_setup();
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

  // ---- admission ---------------------------------------------------------------------------
  void admit_queued() {
    // A tensor-parallel model computes on every rank or not at all: nothing is admitted
    // while a rank process is down.
    if (processes_ != nullptr && !processes_->all_up()) return;
    while (!queue_.empty()) {
      if (!admit(*queue_.front())) return;  // FIFO: wait for blocks or a slot
      queue_.pop_front();
    }
  }

  bool admit(const Request& q) {
    Attempt a;
    a.req = &q;
    a.request = RequestId{q.index + 1};
    const TokenCount total = q.prompt_tokens + q.output_tokens;
    const std::size_t nblocks = (total + block_tokens - 1) / block_tokens;
    std::vector<std::uint64_t> ids(nblocks);
    for (std::size_t b = 0; b < nblocks; ++b) ids[b] = block_id(q, b);
    a.shared = blocks_.match(ids, (q.prompt_tokens - 1) / block_tokens, a.blocks);
    if (!blocks_.allocate(nblocks - a.shared, a.blocks) || (model_.stateful && slots_.empty())) {
      for (const BlockId b : a.blocks) blocks_.release(b);
      return false;
    }
    if (model_.stateful) a.slot = slots_.take();
    a.hbm = static_cast<TokenCount>(a.shared) * block_tokens;
    const bool first = attempted_.insert(q.index).second;
    if (!o_.offload) {
      start_compute(a, model_.stateful ? 0 : a.hbm);
      attempts_.emplace(AdmissionId{++offline_admissions_}, std::move(a));
      return true;
    }
    std::vector<Checkpoint> checkpoints;  // every chunk boundary below P, one chain walk
    StateChain chain = StateChain::start(model_.id);
    for (TokenCount b = chunk_tokens; model_.stateful && b <= q.prompt_tokens - 1; b += chunk_tokens) {
      chain = chain.next(q.chunk_keys[b / chunk_tokens - 1]);
      checkpoints.push_back(Checkpoint{b, chain.at(b)});
    }
    const AdmitRequest ar{a.request, q.prompt_tokens, a.hbm, q.chunk_keys, a.blocks, checkpoints, a.slot};
    AdmitDecision d;
    if (composition_) {
      if (request_coin(o_.seed, q.index, 11, 250)) composition_->publish(a.request, q);
      d = coord_.admit(ar, composition_->arbiter(), composition_->offload());
    } else {
      d = coord_.admit(ar);
    }
    if (!d.parked && d.reason == ComputeReason::already_parked) {
      ++sim_violations_;  // admitted while its earlier admission waits on a load: the engine lost track
      release(a);
      ++ended_;
      return true;
    }
    live_[a.request] = d.admission;
    a.checkpoints = std::move(d.checkpoints);
    // A preempted request comes back while its torn-down admission may still hold its
    // blocks (its orphaned load in flight): two admissions of one RequestId, freed apart.
    if (std::any_of(attempts_.begin(), attempts_.end(), [&](const auto& kv) { return kv.second.request == a.request; }))
      ++result_.readmitted_while_held;
    if (!d.parked) {
      ++result_.admitted_compute;
      start_compute(a, model_.stateful ? 0 : a.hbm);
      attempts_.emplace(d.admission, std::move(a));
      return true;
    }
    a.phase = Phase::parked;
    a.plan = d.plan;
    a.pd = d.sub && *d.sub == 0;
    a.parked_at = WallClock::now();
    ++parked_;
    if (a.pd) ++result_.loads_pd;
    else if (std::holds_alternative<KvOnlyLoad>(d.plan)) ++result_.loads_kv_only;
    else if (std::holds_alternative<JointLoad>(d.plan)) ++result_.loads_joint;
    else if (std::holds_alternative<StateOnlyLoad>(d.plan)) ++result_.loads_state_only;
    attempts_.emplace(d.admission, std::move(a));
    switch (faults_.parked(q, first)) {  // the request may go away while its load is in flight
      case TearDown::abort: tear_down(d.admission, false); break;
      case TearDown::preempt: tear_down(d.admission, true); break;
      case TearDown::none: break;
    }
    return true;
  }

  void tear_down(AdmissionId id, bool preempt) {
    Attempt& a = attempts_.at(id);
    if (a.phase == Phase::parked) --parked_;
    a.phase = Phase::torn_down;
    coord_.teardown(a.request);
    live_.erase(a.request);
    if (preempt) {
      ++result_.preempted;
      queue_.push_back(a.req);  // admitted again later, under the same RequestId
    } else {
      ++result_.aborted;
      ++ended_;
    }
  }

  // ---- the compute side ------------------------------------------------------------------------
  /// The request computes from `resume`: its stops are its planned prefill checkpoints and its
  /// generation-end checkpoint above `resume` (a load that restored less than it claimed, or
  /// nothing, leaves them all above), then its end.
  void start_compute(Attempt& a, TokenCount resume) {
    const Request& q = *a.req;
    a.phase = Phase::computing;
    a.resume = resume;
    const TokenCount hbm_used = std::min(resume, a.hbm);
    result_.reused_hbm += hbm_used;
    result_.reused_tier += resume - hbm_used;
    // A dense model has no state to restore: its digest always runs from the start.
    const TokenCount state_from = model_.stateful ? resume : 0;
    a.forward = Forward(std::max(resume, static_cast<TokenCount>(a.shared) * block_tokens), state_from,
                        state_from > 0 ? read_state(*ranks_, *a.slot) : initial_state);
    const TokenCount total = q.prompt_tokens + q.output_tokens;
    a.stops.clear();
    a.generation_end = 0;
    a.captured.reset();
    if (o_.offload && model_.stateful) {
      std::vector<TokenCount> at;
      for (const TokenCount b : a.checkpoints)
        if (b > resume) at.push_back(b);
      if (const std::optional<TokenCount> end = generation_end_checkpoint(total, grids, o_.checkpoints); end && *end > resume) {
        a.generation_end = *end;
        at.push_back(*end);
      }
      std::sort(at.begin(), at.end());
      at.erase(std::unique(at.begin(), at.end()), at.end());
      for (const TokenCount b : at) a.stops.push_back(Stop{b, now_ms_ + compute_ms(q, resume, b)});
    }
    const double prefill = static_cast<double>(q.prompt_tokens - std::min(resume, q.prompt_tokens)) / prefill_tokens_per_ms;
    a.stops.push_back(Stop{total, now_ms_ + prefill + decode_ms_per_token * static_cast<double>(q.output_tokens)});
  }

  /// Simulated milliseconds to compute tokens [from, to) of `q`: prefill below P, decode above.
  static double compute_ms(const Request& q, TokenCount from, TokenCount to) {
    const TokenCount p = q.prompt_tokens;
    const double prefill = static_cast<double>(std::min(to, p) - std::min(from, p)) / prefill_tokens_per_ms;
    return prefill + decode_ms_per_token * static_cast<double>(std::max(to, p) - std::max(from, p));
  }

  /// Runs every computing admission up to the stops the clock reached, in admission order.
  void run_due_stops() {
    due_.clear();
    for (auto& [id, a] : attempts_)
      if (a.phase == Phase::computing && a.stops.front().due_ms <= now_ms_) due_.push_back(id);
    std::sort(due_.begin(), due_.end());
    for (const AdmissionId id : due_) {
      Attempt& a = attempts_.at(id);
      while (a.stops.size() > 1 && a.stops.front().due_ms <= now_ms_) {
        const Stop stop = a.stops.front();
        a.stops.erase(a.stops.begin());
        const std::uint64_t state = a.forward.run_to(*ranks_, *a.req, a.blocks, stop.at);
        const bool handed =
            std::binary_search(a.checkpoints.begin(), a.checkpoints.end(), stop.at) && checkpoint(a, stop.at, state);
        // A generation-end checkpoint that is also a prefill one went to the Coordinator already.
        if (stop.at == a.generation_end && !handed) a.captured = Captured{stop.at, state};
      }
      if (a.stops.size() == 1 && a.stops.front().due_ms <= now_ms_) finish(id, a);
    }
  }

  /// A planned prefill checkpoint, mid-prefill: the state at `boundary` is copied into a
  /// snapshot slot and handed to the Coordinator, which sends it (the slot comes back in a
  /// step's `snapshots` once every rank read it) or already has it (the slot is free at once).
  /// No free snapshot slot: skipped and counted, the prefill goes on. Returns whether the
  /// Coordinator has the checkpoint now (saved, or already indexed or being saved).
  bool checkpoint(const Attempt& a, TokenCount boundary, std::uint64_t state) {
    if (snapshots_.empty()) {
      ++result_.checkpoints_skipped;
      return false;
    }
    const SlotId snapshot = snapshots_.take();
    write_state(*ranks_, snapshot, state);
    const Checkpoint c{boundary, StateChain::of(model_.id, *a.req, boundary)};
    const CheckpointResult r = coord_.checkpoint(a.request, c, snapshot);
    if (r == CheckpointResult::saved) faults_.checkpoint_saved(*a.req, c.hash);
    else (void)snapshots_.give(snapshot);  // nothing was sent: nothing reads it
    return r == CheckpointResult::saved || r == CheckpointResult::already_indexed;
  }

  /// The rest of the forward, the output checksum, and finish(): the KV and the
  /// generation-end checkpoint go to the Coordinator.
  void finish(AdmissionId id, Attempt& a) {
    const Request& q = *a.req;
    const TokenCount total = q.prompt_tokens + q.output_tokens;
    const std::uint64_t state = a.forward.run_to_end(*ranks_, q, a.blocks);
    result_.outputs[q.index] = output_of(*ranks_, q, a.blocks, state);
    for (std::size_t b = 0; (b + 1) * block_tokens <= total; ++b) blocks_.publish(a.blocks[b], block_id(q, b));
    ++result_.completed;
    ++ended_;
    a.phase = Phase::finishing;
    if (!o_.offload) {
      release(a);
      attempts_.erase(id);
      return;
    }
    live_.erase(a.request);
    std::optional<Checkpoint> checkpoint;
    if (a.captured) {
      write_state(*ranks_, *a.slot, a.captured->state);
      checkpoint = Checkpoint{a.captured->boundary, StateChain::of(model_.id, q, a.captured->boundary)};
      faults_.checkpoint_saved(q, checkpoint->hash);
    }
    (void)coord_.finish(FinishRequest{a.request, total, q.chunk_keys, a.blocks, checkpoint, a.slot});
    for (std::size_t c = 0; c < total / chunk_tokens; ++c) saved_.push_back(q.chunk_keys[c]);
    if (saved_.size() > 4096) saved_.erase(saved_.begin(), saved_.begin() + 2048);
  }

  /// Blocks and slot back to the pools (published blocks stay cached).
  void release(Attempt& a) {
    for (const BlockId b : a.blocks) blocks_.release(b);
    if (a.slot && !slots_.give(*a.slot)) ++sim_violations_;  // a slot given back twice
  }

  // ---- the coordinator's events ------------------------------------------------------------
  void step() {
    if constexpr (processes) {
      for (const std::uint32_t r : processes_->watch(pump_)) lose_rank(r);
    }
    if (!o_.offload) return;
    const typename Coord::StepResult s = composition_ ? coord_.step(composition_->arbiter()) : coord_.step();
    for (const Unpark& u : s.unparked) on_unpark(u);
    for (const Freed& f : s.freed) {
      const auto it = attempts_.find(f.admission);
      if (it == attempts_.end() || it->second.request != f.request ||
          (it->second.phase != Phase::finishing && it->second.phase != Phase::torn_down)) {
        ++sim_violations_;  // a Freed for an admission that still computes, or a second one
        continue;
      }
      release(it->second);
      attempts_.erase(it);
    }
    for (const SlotId snapshot : s.snapshots)
      if (!snapshots_.give(snapshot)) ++sim_violations_;  // not a snapshot slot, or handed back twice
    if (s.records == 0 && s.unparked.empty() && s.freed.empty() && s.snapshots.empty() && (parked_ > 0 || waiting_for_ranks()))
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

  /// The blocks a load plan's KV range lands in.
  static std::vector<BlockId> plan_blocks(const Attempt& a) {
    std::vector<BlockId> out;
    if (const std::optional<IndexRange> range = kv_tokens(a.plan))
      for (TokenCount b = range->first / block_tokens; b * block_tokens < range->last; ++b) out.push_back(a.blocks[b]);
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
    for (const auto& [id, a] : attempts_)
      if (a.phase == Phase::parked || a.phase == Phase::computing) due_.push_back(id);
    std::sort(due_.begin(), due_.end());
    for (const AdmissionId id : due_) {
      tear_down(id, true);
      ++result_.rank_loss_preemptions;
    }
    blocks_.forget_cached();
  }

  bool waiting_for_ranks() const {
    return std::any_of(attempts_.begin(), attempts_.end(),
                       [](const auto& kv) { return kv.second.phase == Phase::finishing || kv.second.phase == Phase::torn_down; });
  }

  void on_unpark(const Unpark& u) {
    const auto live = live_.find(u.request);
    const auto it = live == live_.end() ? attempts_.end() : attempts_.find(live->second);
    if (it == attempts_.end() || it->second.phase != Phase::parked) {
      ++sim_violations_;  // an unpark nobody waits for, or a second one
      return;
    }
    Attempt& a = it->second;
    --parked_;
    const double us = std::chrono::duration<double, std::micro>(WallClock::now() - a.parked_at).count();
    switch (u.kind) {
      case Resolution::completed: ++result_.outcome_completed; break;
      case Resolution::failed: ++result_.outcome_failed; break;
      default: ++result_.outcome_abandoned; break;
    }
    result_.outcome_state_missed += u.state_missed;
    if (u.tokens > 0) {
      ++result_.resumed_from_load;
      if (a.pd) ranks_->pd_landed(plan_blocks(a));
      const Checked c = check_load(*ranks_, *a.req, a.blocks, a.slot, a.plan);
      result_.verified_bytes += c.verified;
      result_.corrupted_bytes += c.corrupted;
      if (std::holds_alternative<JointLoad>(a.plan)) joint_us_.push_back(us);
      else if (std::holds_alternative<KvOnlyLoad>(a.plan)) kv_only_us_.push_back(us);
      else if (std::holds_alternative<StateOnlyLoad>(a.plan)) state_only_us_.push_back(us);
    }
    start_compute(a, model_.stateful ? u.tokens : std::max(u.tokens, a.hbm));
  }

  // ---- the clock -------------------------------------------------------------------------------
  /// --sync-saves: the next request arrives only once the last one's saves landed.
  bool sync_blocked() {
    return o_.sync_saves && o_.offload && (!attempts_.empty() || !queue_.empty() || index_.stats().saves_outstanding > 0);
  }

  void advance_clock(std::optional<double> next_arrival) {
    if (parked_ > 0 || index_.stats().saves_outstanding > 0) return;  // loads and saves take no simulated time
    constexpr double never = std::numeric_limits<double>::infinity();
    double next = next_arrival && !sync_blocked() ? *next_arrival : never;
    for (const auto& [id, a] : attempts_)
      if (a.phase == Phase::computing) next = std::min(next, a.stops.front().due_ms);
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
           (!attempts_.empty() || index_.stats().outstanding > 0 || index_.stats().saves_outstanding > 0)) {
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
    const auto consistency = kvfuse::testing::check_consistency(index_);
    r.invariant_violations = is.invariant_violations + cs.invariant_violations + sim_violations_ + (consistency.ok ? 0 : 1);
    if (std::getenv("KVFUSE_REPLAY_DEBUG"))
      std::fprintf(stderr, "%s: index %llu coordinator %llu replay %llu consistency %s\n", r.model.c_str(),
                   (unsigned long long)is.invariant_violations, (unsigned long long)cs.invariant_violations,
                   (unsigned long long)sim_violations_, consistency.ok ? "ok" : consistency.problem.c_str());
    r.stranded_parked = static_cast<std::uint64_t>(parked_) + cs.waiting_now;
    r.leaked_slots = slots_.taken() + snapshots_.taken() + blocks_.pinned() + attempts_.size() + cs.holding_now;
    r.checkpoints_saved = cs.checkpoints_saved;
    r.checkpoints_deduplicated = cs.checkpoints_deduplicated;
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
  void violation() override { ++sim_violations_; }
  bool processes_mode() const override { return processes; }
  std::size_t loads_in_flight() const override { return parked_; }
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
  BlockCache blocks_;
  SlotPool slots_;
  SlotPool snapshots_;  // after the request slots

  std::unordered_map<AdmissionId, Attempt> attempts_;
  std::unordered_map<RequestId, AdmissionId> live_;  // each request's admission that has not ended
  std::unordered_set<std::uint64_t> attempted_;
  std::deque<const Request*> queue_;
  std::vector<AdmissionId> due_;
  std::vector<PrefixHash> saved_;  // chunk keys of recent KV saves
  std::vector<double> joint_us_, kv_only_us_, state_only_us_;
  std::uint64_t offline_admissions_ = 0, sim_violations_ = 0;
  std::size_t parked_ = 0, ended_ = 0;
  double now_ms_ = 0;
  WallClock::time_point wall_start_ = WallClock::now();
};

}  // namespace

RunResult replay_pass(const Model& model, const Workload& w, const RunOptions& options) {
  if (options.ranks_as == RanksAs::processes) return Engine<ShmQuorum>(model, w, options).run();
  return Engine<TpQuorum>(model, w, options).run();
}

}  // namespace replay
