// kvfuse/worker/connector.hpp — Connector<KvLeg, StateLeg, Group, Runtime>: one rank's
// side of the offload tier.
//
// The connector owns its lanes (single-thread executors), one copy stream and one staging
// buffer per lane (the save lane's holds ConnectorOptions::save_staging_chunks chunks, so a
// multi-chunk save that fits releases its blocks before its first put), and one record
// emitter per lane. Every load it accepts produces exactly
// one CompletionRecord (R1) through a guard the load task holds from its first line; every
// save produces exactly two SaveRecords (`released`, then `stored`). Nothing on the load or store path allocates (R12)
// or throws (R19).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvfuse/worker/completion_guard.hpp>
#include <kvfuse/completion/group.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/device/save_fence.hpp>
#include <kvfuse/worker/lane.hpp>
#include <kvfuse/worker/leg.hpp>
#include <kvfuse/worker/staging.hpp>

namespace kvfuse {

/// Construction-time knobs of a Connector.
struct ConnectorOptions {
  std::size_t lane_capacity = 256;  ///< queued tasks per lane before submit backs off
  std::size_t staging_bytes = 0;    ///< per-lane staging; 0 = the larger of a KV chunk and a state entry
                                    ///< (StateLeg::entry_bytes), for the rank's geometry
  /// How many KV chunks the save lane's staging holds: its buffer is the larger of this
  /// many chunks and the other lanes' buffer (`staging_bytes`). Must be >= 1.
  ///
  /// Why: a KV save releases its source blocks once its last gather is synchronized,
  /// before any of its puts (docs/reference.md#save-path), only if the whole save fits the
  /// save lane's staging. A save of more chunks than that falls back to batches: it
  /// gathers and puts all but the last `save_staging_chunks` chunks first, so its blocks
  /// stay pinned through those puts (a round trip each, for a remote tier).
  /// Each such save counts in ConnectorStats::staging_fallbacks: raise this field when
  /// that counter grows. 1 is the least pinned memory and releases a multi-chunk save only
  /// before its last put.
  ///
  /// The default, 8 chunks (2048 tokens at the default 256-token chunk), lets a save of
  /// up to 8 chunks free its blocks right after its gather, for 7 chunks more pinned host
  /// memory than a one-chunk buffer (224 MiB at 128 KiB of KV per token per rank): host
  /// memory, which is plentiful, spent to hand device blocks, which are not, back early.
  std::size_t save_staging_chunks = 8;
  /// How long the lanes that run loads (the load lane, and the state lane of a composition
  /// that has one) poll for the next load after finishing one, before they sleep on a
  /// futex (BasicLane's `spin`). 0, the default, never spins. Must be >= 0.
  ///
  /// What it buys: a load submitted while its lane still spins skips the lane's futex
  /// wake-up, which on a small VM whose other vCPU sits halted is most of a one-chunk
  /// load's fixed cost from load() to its record (bench/README.md#fixed-cost). A load
  /// that comes after the spin ran out finds the lane asleep and pays the wake-up as before.
  /// What it costs: after every load (every burst of loads) each of those lanes keeps one
  /// CPU busy for up to `lane_spin`, whether or not another load comes; on a two-core
  /// machine that is a core the engine's own threads cannot use, and two with a concurrent
  /// state lane. The save lane never spins. Use it when loads arrive closer together than
  /// the spin (an engine issuing many small loads per step) and a core can be spared;
  /// leave it 0 on a small or shared machine, and when loads are rare.
  std::chrono::nanoseconds lane_spin{0};
  /// The CPUs every lane of the connector (load, state, save) may run on; empty, the
  /// default, leaves placement to the OS. Each value must be a CPU this machine has.
  ///
  /// Why: under OS placement a lane woken by the engine's scheduler thread lands on
  /// whichever CPU the kernel picks, and on a small VM that choice (the scheduler's CPU or
  /// a halted vCPU) changes a one-chunk load's cost severalfold and sticks for the run
  /// (bench/README.md#placement). Lanes on CPUs of their own, apart from the scheduler
  /// thread, pay the same hand-off on every load, and their copies never compete with the
  /// scheduler for a core. Give the lanes CPUs the engine's own threads do not use.
  std::vector<unsigned> lane_cpus{};
};

/// Counters of one connector. Read from any thread (relaxed atomics): a snapshot, not a fence.
struct ConnectorStats {
  std::size_t lanes = 0;                 ///< lanes this composition runs (2 without state, 3 with a concurrent one)
  /// Exactly what the staging pool allocated (R12): the load lane's and (with a concurrent
  /// state leg) the state lane's buffer of `staging_bytes` each, plus the save lane's buffer
  /// of max(`staging_bytes`, `save_staging_chunks` chunks).
  std::size_t standing_staging_bytes = 0;
  std::uint64_t loads = 0;               ///< loads accepted
  std::uint64_t saves = 0;               ///< saves accepted (KV and state)
  std::uint64_t fence_fallbacks = 0;     ///< steps that degraded to a device synchronize (R13)
  /// KV saves with more chunks than the save lane's staging holds: gathered and put in
  /// batches, so their blocks stayed pinned until all but the last batch were put
  /// (ConnectorOptions::save_staging_chunks).
  std::uint64_t staging_fallbacks = 0;
};

namespace detail {
/// Stands in for a member a composition does not have (no state lane under NoState).
/// Constructible from anything, so the member's initializer is written once.
struct Absent {
  constexpr Absent() noexcept = default;
  template <class... Args>
  constexpr explicit Absent(Args&&...) noexcept {}
};
template <bool Present, class T>
using maybe_t = std::conditional_t<Present, T, Absent>;
}  // namespace detail

/// One rank's connector. Thread rules: `load`, `save_kv`, `save_state` and `begin_step`
/// are called by ONE thread per rank (the rank's rank thread); they never block on a
/// leg (they enqueue onto a lane; only a full lane makes them back off). `stats` is
/// thread-safe. Destruction finishes every queued task, so every accepted load still
/// reports (R1), then joins the lanes.
template <class KvLeg, class StateLeg, CompletionGroup Group, Runtime R = HostRuntime>
  requires KvLegFor<KvLeg, R> && StateLegFor<StateLeg, R>
class Connector {
 public:
  using Emitter = typename Group::Emitter;
  using kv_leg_type = KvLeg;
  using state_leg_type = StateLeg;
  using group_type = Group;
  using runtime_type = R;
  static constexpr StateOrdering ordering = StateLeg::ordering;
  /// The model's state layout, as the state leg names it: what the engine plans by
  /// (CoordinatorOptions::layout, PlanInput::layout).
  static constexpr StateLayout layout = StateLeg::layout;
  static constexpr bool has_state = ordering != StateOrdering::none;
  static constexpr bool has_state_lane = ordering == StateOrdering::concurrent;
  /// Lane indices, also the index of each lane's staging buffer and emitter.
  static constexpr std::size_t load_lane = 0, save_lane = 1, state_lane = 2;
  static constexpr std::size_t lane_count = has_state_lane ? 3 : 2;

  /// The emitters of this rank, one per lane (a lane is the only producer of its emitter).
  struct Emitters {
    Emitter load;
    Emitter save;
    [[no_unique_address]] detail::maybe_t<has_state_lane, Emitter> state{};
  };

  /// Builds the lanes, streams and staging. Throws kvfuse::Error naming a bad geometry or
  /// option value, or if the runtime cannot allocate. `runtime`, the tiers behind the legs
  /// and `memory` must outlive the connector.
  Connector(const RankGeometry& geometry, R& runtime, DeviceMemory memory, KvLeg kv_leg, StateLeg state_leg,
            Emitters emitters, ConnectorOptions options = {})
      : geometry_(validated(geometry, memory, options)),
        runtime_(runtime),
        memory_(memory),
        kv_leg_(std::move(kv_leg)),
        state_leg_(std::move(state_leg)),
        emitters_(std::move(emitters)),
        staging_(runtime, staging_sizes(geometry_, options)),
        chunk_mask_(geometry_.max_chunks_per_load, 0),
        held_views_(geometry_.max_chunks_per_load),
        fence_(runtime),
        streams_(make_streams(runtime)),
        load_lane_("kvfuse-load", options.lane_capacity, options.lane_spin, options.lane_cpus),
        save_lane_("kvfuse-save", options.lane_capacity, std::chrono::nanoseconds{0}, options.lane_cpus),
        state_lane_("kvfuse-state", options.lane_capacity, options.lane_spin, options.lane_cpus) {}

  /// Same, claiming this rank's lane emitters from `group` (lanes 0 .. lane_count-1 of
  /// rank geometry.rank). Throws kvfuse::Error(invalid_argument) naming both values if
  /// geometry.world_size is not group.world_size() (a rank cut for another world), and
  /// kvfuse::Error if the group has too few lanes or they are already claimed. The
  /// geometry, memory and world size are checked before any emitter is claimed.
  Connector(const RankGeometry& geometry, R& runtime, DeviceMemory memory, KvLeg kv_leg, StateLeg state_leg,
            Group& group, ConnectorOptions options = {})
      : Connector(geometry, runtime, memory, std::move(kv_leg), std::move(state_leg),
                  claim_checked(group, geometry, memory, options), options) {}

  /// Claims the lane emitters of `rank` from `group`, in lane order (load, save, state).
  static Emitters claim_emitters(Group& group, std::uint32_t rank) {
    if constexpr (has_state_lane) {
      return Emitters{group.emitter(rank, load_lane), group.emitter(rank, save_lane), group.emitter(rank, state_lane)};
    } else {
      return Emitters{group.emitter(rank, load_lane), group.emitter(rank, save_lane)};
    }
  }

  Connector(const Connector&) = delete;
  Connector& operator=(const Connector&) = delete;

  ~Connector() { drain(); }

  /// Accepts one load: KV-only and joint loads run on the load lane; a state-only load
  /// (a state spec, no KV spec) with a concurrent state leg runs entirely on the state
  /// lane (R9), so it never queues behind other requests' KV retrieves. A request with
  /// neither leg (an empty ticket's dispatch, a garbled transport) runs on the load lane
  /// and reports Reason::invalid_spec, on every composition. Exactly one record follows
  /// (R1). Rank thread only; noexcept; never allocates (the request is moved into the
  /// lane's inline task).
  void load(LoadRequest request) noexcept {
    loads_.fetch_add(1, std::memory_order_relaxed);
    if constexpr (has_state_lane) {
      if (request.state.has_value() && !request.kv.has_value()) {
        state_lane_.submit([this, req = std::move(request)]() mutable noexcept { run_state_only(req); });
        return;
      }
    }
    load_lane_.submit([this, req = std::move(request)]() mutable noexcept { run_load(req); });
  }

  /// Saves whole KV chunks on the save lane, after the step's producer fence (R13).
  /// Exactly two SaveRecords follow: `released` once nothing reads the blocks, then
  /// `stored`. Rank thread only; noexcept.
  void save_kv(KvSave save) noexcept {
    saves_.fetch_add(1, std::memory_order_relaxed);
    if (save.chunk_keys.size() > staging_.buffer_bytes(save_lane) / geometry_.chunk_bytes())
      staging_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    save_lane_.submit([this, s = std::move(save)]() mutable noexcept {
      run_save(s.key, [&](LaneContext<R>& lane) { return kv_leg_.save(s, lane); });
    });
  }

  /// Saves a state checkpoint on the save lane (docs/reference.md#save-path). Exactly two
  /// SaveRecords follow, `released` then `stored`; a rank without a state tier reports its
  /// untouched source released and the save not stored (R14). Rank thread only; noexcept.
  void save_state(StateSave save) noexcept
    requires has_state
  {
    saves_.fetch_add(1, std::memory_order_relaxed);
    save_lane_.submit([this, s = save]() noexcept {
      run_save(s.key, [&](LaneContext<R>& lane) { return state_leg_.save(s, lane); });
    });
  }

  /// Marks the end of this step's forward on `compute`: saves submitted afterwards wait
  /// for it on the device (R13). One event per step; falls back to a device synchronize if
  /// the event cannot be created or recorded. Rank thread only; noexcept.
  void begin_step(typename R::Stream& compute) noexcept { fence_.begin_step(compute); }

  /// Blocks until every lane is idle. Any thread but a lane's own.
  void drain() noexcept {
    load_lane_.wait_idle();
    if constexpr (has_state_lane) state_lane_.wait_idle();
    save_lane_.wait_idle();
  }

  /// A snapshot of the counters. Thread-safe, wait-free.
  [[nodiscard]] ConnectorStats stats() const noexcept {
    return ConnectorStats{lane_count,
                          staging_.standing_bytes(),
                          loads_.load(std::memory_order_relaxed),
                          saves_.load(std::memory_order_relaxed),
                          fence_.stats().fallback_steps,
                          staging_fallbacks_.load(std::memory_order_relaxed)};
  }

  /// This rank's geometry.
  [[nodiscard]] const RankGeometry& geometry() const noexcept { return geometry_; }

 private:
  using Streams = std::vector<typename R::Stream>;

  static const RankGeometry& validated(const RankGeometry& geometry, DeviceMemory memory,
                                       const ConnectorOptions& options) {
    geometry.validate();
    if (options.lane_spin < std::chrono::nanoseconds{0})
      throw Error(ErrorCode::invalid_argument, "ConnectorOptions::lane_spin must be >= 0 ns, got " +
                                                   std::to_string(options.lane_spin.count()) + " ns");
    detail::check_cpus(options.lane_cpus, "ConnectorOptions::lane_cpus");
    if (options.save_staging_chunks == 0)
      throw Error(ErrorCode::invalid_argument, "ConnectorOptions::save_staging_chunks must be >= 1, got 0");
    if (options.save_staging_chunks > SIZE_MAX / geometry.chunk_bytes())
      throw Error(ErrorCode::invalid_argument, "ConnectorOptions::save_staging_chunks (" +
                                                   std::to_string(options.save_staging_chunks) + ") x a chunk of " +
                                                   std::to_string(geometry.chunk_bytes()) + " bytes overflows size_t");
    if (memory.kv_blocks == nullptr) throw Error(ErrorCode::invalid_argument, "DeviceMemory::kv_blocks is null");
    if (has_state && geometry.num_slots == 0)
      throw Error(ErrorCode::invalid_argument, "num_slots must be > 0 for a stateful connector, got 0");
    if (has_state && memory.slots == nullptr)
      throw Error(ErrorCode::invalid_argument, "DeviceMemory::slots is null for a stateful connector");
    return geometry;
  }

  /// Validates like the constructor (options included), refuses a rank whose world is not the group's, then
  /// claims the rank's emitters.
  static Emitters claim_checked(Group& group, const RankGeometry& geometry, DeviceMemory memory,
                                const ConnectorOptions& options) {
    (void)validated(geometry, memory, options);
    if (geometry.world_size != group.world_size())
      throw Error(ErrorCode::invalid_argument,
                  "geometry.world_size (" + std::to_string(geometry.world_size) + ") differs from the group's world_size (" +
                      std::to_string(group.world_size()) + "): a rank cut for another world cannot join this group");
    return claim_emitters(group, geometry.rank);
  }

  static std::size_t staging_size(const RankGeometry& geometry, const ConnectorOptions& options) {
    if (options.staging_bytes != 0) return options.staging_bytes;
    if constexpr (has_state) return std::max(geometry.chunk_bytes(), StateLeg::entry_bytes(geometry));
    else return geometry.chunk_bytes();
  }

  /// One buffer per lane, indexed like the lanes: every lane gets staging_size; the save
  /// lane at least save_staging_chunks whole chunks, so a save that fits is gathered whole
  /// before its first put (validated() bounds the product).
  static std::array<std::size_t, lane_count> staging_sizes(const RankGeometry& geometry, const ConnectorOptions& options) {
    std::array<std::size_t, lane_count> sizes;
    sizes.fill(staging_size(geometry, options));
    sizes[save_lane] = std::max(sizes[save_lane], options.save_staging_chunks * geometry.chunk_bytes());
    return sizes;
  }

  static Streams make_streams(R& runtime) {
    Streams streams;
    streams.reserve(lane_count);
    for (std::size_t i = 0; i < lane_count; ++i) streams.push_back(runtime.make_stream());
    return streams;
  }

  LaneContext<R> context(std::size_t lane) noexcept {
    // Only the load lane retrieves chunks; the other lanes never touch the mask or views.
    const bool retrieves = lane == load_lane;
    return LaneContext<R>{runtime_,
                          streams_[lane],
                          staging_.buffer(lane),
                          retrieves ? std::span<std::uint8_t>(chunk_mask_) : std::span<std::uint8_t>{},
                          geometry_,
                          memory_,
                          retrieves ? std::span<TierView>(held_views_) : std::span<TierView>{}};
  }

  /// The load lane's task. The state leg of a concurrent joint load is submitted first so
  /// both legs run at once; the join happens on every path before the guard reports (R9).
  void run_load(LoadRequest& req) noexcept {
    CompletionGuard<Emitter> guard(req, geometry_.rank, emitters_.load);
    auto lane = context(load_lane);
    if constexpr (has_state_lane) {
      if (req.state.has_value()) {
        StateVerdict state_verdict;
        LegLatch join;
        state_lane_.submit([this, &req, &state_verdict, &join]() noexcept {
          state_verdict = run_state_leg(*req.state, &*req.kv, context(state_lane));
          join.arrive();
        });
        run_kv_leg(req, lane, guard);
        join.wait();
        guard.state(state_verdict.outcome, state_verdict.reason);
        return;
      }
    }
    run_kv_leg(req, lane, guard);
    if constexpr (ordering == StateOrdering::after_kv) {
      if (req.state.has_value()) {
        const StateVerdict v = run_state_leg(*req.state, req.kv ? &*req.kv : nullptr, lane);
        guard.state(v.outcome, v.reason);
      }
    }
  }

  /// The state lane's task for a state-only load: it reports from the state lane. load()
  /// routes a request here only if it has a state spec.
  void run_state_only(LoadRequest& req) noexcept
    requires has_state_lane
  {
    CompletionGuard<Emitter> guard(req, geometry_.rank, emitters_.state);
    const StateVerdict v = run_state_leg(*req.state, nullptr, context(state_lane));
    guard.state(v.outcome, v.reason);
  }

  /// The save lane's task: fence, gather, put, two SaveRecords. The leg reports the
  /// source released as soon as its last gather synchronized (before its puts, when the
  /// save fits the save lane's staging). On every other
  /// path (a failure, an exception, a leg that never says) the task synchronizes the
  /// lane's stream first (a device synchronize if that fails), so `released` is sent only
  /// once nothing can read the source; if even the device cannot synchronize, the guard
  /// says source_unconfirmed and the engine keeps the source pinned. If nothing can order
  /// the gather after the forward (R13: not even a device synchronize), the save fails
  /// without reading the source.
  template <class Save>
  void run_save(SaveKey key, Save&& save) noexcept {
    SaveGuard<Emitter> guard(key, geometry_.rank, emitters_.save);
    auto lane = context(save_lane);
    lane.release_source = SourceRelease(guard);
    if (!fence_.fence(lane.stream)) {
      guard.fail(Reason::kv_transfer_failed);
    } else {
      try {
        guard.set(save(lane));
      } catch (...) {
        guard.fail(Reason::exception);
      }
    }
    if (!guard.source_released() &&
        (runtime_.synchronize(lane.stream) || runtime_.device_synchronize()))
      guard.release_source();
  }

  void run_kv_leg(const LoadRequest& req, LaneContext<R>& lane, CompletionGuard<Emitter>& guard) noexcept {
    if (!req.kv.has_value()) return;
    try {
      const KvVerdict v = kv_leg_.load(*req.kv, lane);
      if (v.ok) guard.kv_ok();
      else guard.kv_failed(v.reason, v.restored);
    } catch (...) {
      guard.kv_failed(Reason::exception);
    }
  }

  StateVerdict run_state_leg(const StateSpec& spec, const KvSpec* kv, LaneContext<R> lane) noexcept
    requires has_state
  {
    try {
      return state_leg_.load(spec, kv, lane);
    } catch (...) {
      return {StateOutcome::failed, Reason::exception};
    }
  }

  const RankGeometry geometry_;
  R& runtime_;
  DeviceMemory memory_;
  KvLeg kv_leg_;
  [[no_unique_address]] StateLeg state_leg_;
  Emitters emitters_;
  StagingPool<R> staging_;
  std::vector<std::uint8_t> chunk_mask_;
  std::vector<TierView> held_views_;  // the load lane's views awaiting one synchronize
  SaveFence<R> fence_;
  Streams streams_;
  std::atomic<std::uint64_t> loads_{0};
  std::atomic<std::uint64_t> saves_{0};
  std::atomic<std::uint64_t> staging_fallbacks_{0};
  // Lanes last: they are destroyed first, so queued tasks finish while everything they
  // touch is still alive.
  Lane load_lane_;
  Lane save_lane_;
  [[no_unique_address]] detail::maybe_t<has_state_lane, Lane> state_lane_;
};

}  // namespace kvfuse
