// kvfuse/ipc/shm_engine.hpp — the engine side of ranks as processes: ShmEngine owns the
// shared memory segment, is the Coordinator's transport (every LoadRequest, KvSave and
// StateSave goes as one frame into each live rank's frame ring), and watches the rank
// processes; ShmQuorum is the completion group whose lanes are the ranks' record rings and
// whose merge is TpQuorum's failure-dominant quorum.
//
//   ShmEngine engine(ShmOptions{...});           // creates the segment (0600, random name)
//   spawn rank processes with engine.name()      // each builds a ShmRank and serves
//   engine.wait_attached(timeout);               // every rank attached
//   ShmQuorum group(engine);  SettlementPump pump(group, index);
//   Coordinator coord(options, index, pump, engine /* transport */, lookup);
//   per step:  engine.watch(pump);  coord.step();
//
// A rank that dies. The engine holds a pidfd per attached rank process; watch() polls them
// (no timer: the kernel says when the process is gone), so a death is seen by the next
// watch() — within the engine's step period, bounded by what the caller states (the tests
// require 100 ms). It then marks the rank dead (its loads and saves in flight settle without
// it, R4), discards and counts whatever records the dead incarnation left in its rings
// (never reports), empties its rings and frees its place, so a restarted process can attach
// with a new incarnation; watch() marks that one alive for the keys issued after it.
// A rank whose ring holds a malformed record, or whose counters are impossible, is faulty:
// the engine kills the process and handles it as a death; the others go on.
//
// Back-pressure: send() puts a frame into every live rank's ring or into none. When a ring
// lacks room it waits (on the ring's futex) up to ShmOptions::send_timeout for the rank to
// drain; if room never comes it sends nothing and returns false, which the Coordinator
// resolves as a dropped load or save (counted in backpressure_refusals): never a lost frame,
// never a frame some ranks have and others not.
//
// Threading: every member is called from the engine's scheduler thread.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <kvfuse/bridge/frames.hpp>
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/completion/group.hpp>
#include <kvfuse/completion/group_wrapper.hpp>
#include <kvfuse/completion/tp_quorum.hpp>
#include <kvfuse/detail/unique_fd.hpp>
#include <kvfuse/error.hpp>
#include <kvfuse/ipc/shm_emitter.hpp>
#include <kvfuse/ipc/shm_segment.hpp>

namespace kvfuse {

/// How the engine's segment is built. Checked at construction: a bad value is an Error
/// naming it.
struct ShmOptions {
  std::string name_prefix = "kvfuse";          ///< segment names are /<prefix>-<16 hex digits>
  RankGeometry geometry;                        ///< every rank's (its rank field is ignored); world_size ranks
  std::uint32_t lanes_per_rank = 3;             ///< record rings per rank: the connector's lane_count, 1..8
  std::size_t frame_ring_bytes = std::size_t{1} << 22;  ///< per rank; a multiple of 8, >= 4 KiB
  std::size_t record_ring_records = 4096;       ///< per lane; >= 16
  std::chrono::milliseconds send_timeout{1000}; ///< how long send waits for room before it refuses
};

/// The engine side's counters. Read on the scheduler thread.
struct ShmEngineStats {
  std::uint64_t frames_sent = 0;            ///< frames put into rank rings (one per live rank per send)
  std::uint64_t backpressure_waits = 0;     ///< sends that had to wait for room
  std::uint64_t backpressure_refusals = 0;  ///< sends refused after send_timeout: nothing went out
  std::uint64_t too_large = 0;              ///< sends refused: the frame does not fit a ring, or cannot be encoded
  std::uint64_t attaches = 0;               ///< rank incarnations seen attaching
  std::uint64_t deaths = 0;                 ///< rank processes seen gone (faulty ones included)
  std::uint64_t faulty = 0;                 ///< ranks killed for a malformed record or impossible ring counters
  std::uint64_t records_received = 0;       ///< records read from the rings and handed to the merge
  std::uint64_t dead_records_dropped = 0;   ///< records a dead incarnation left behind: dropped, never reports
  std::uint64_t stale_segments_removed = 0; ///< crashed engines' segments removed at construction
};

/// The segment owner and the Coordinator's transport. Not copyable or movable (the group
/// holds a reference). Scheduler thread only, after construction.
class ShmEngine {
 public:
  /// Removes stale segments of the prefix (crashed engines'), creates a fresh one owner-only
  /// and initialises it. Throws Error naming a bad option, or io_failure when the segment
  /// cannot be created.
  explicit ShmEngine(ShmOptions options) : options_(validated(std::move(options))) {
    namespace bip = boost::interprocess;
    stats_.stale_segments_removed = detail::remove_stale_segments(options_.name_prefix);
    const std::uint32_t world = options_.geometry.world_size;
    const detail::SegmentLayout layout =
        detail::segment_layout(world, options_.lanes_per_rank, options_.frame_ring_bytes, options_.record_ring_records);
    name_ = detail::fresh_segment_name(options_.name_prefix);
    try {
      bip::permissions owner_only;
      owner_only.set_permissions(0600);
      bip::shared_memory_object object(bip::create_only, name_.c_str(), bip::read_write, owner_only);
      object.truncate(static_cast<bip::offset_t>(layout.total));
      segment_ = detail::MappedSegment(std::move(object), bip::read_write);
    } catch (const bip::interprocess_exception& e) {
      throw Error(ErrorCode::io_failure, "cannot create the shared memory segment /" + name_ + ": " + e.what());
    }
    // Shared memory from shm_open is zero-filled; the header and the control blocks are
    // still constructed in place, so their atomics start life as objects.
    detail::SegmentHeader* h = new (segment_.base()) detail::SegmentHeader{};
    h->lanes = options_.lanes_per_rank;
    h->frame_ring_bytes = options_.frame_ring_bytes;
    h->record_ring_records = options_.record_ring_records;
    h->geometry = ShmGeometry::of(options_.geometry);
    h->engine_pid = ::getpid();
    h->engine_start = detail::process_start(h->engine_pid);
    for (std::uint32_t r = 0; r < world; ++r) {
      std::byte* area = segment_.rank_area(r);
      new (area + layout.control) detail::RankControl{};
      new (area + layout.frame_control) detail::RingControl{};
      for (std::uint32_t l = 0; l < options_.lanes_per_rank; ++l)
        new (area + layout.record_control + l * layout.record_stride) detail::RingControl{};
    }
    ranks_.resize(world);
    scratch_.resize(max_frame_bytes);
  }

  ShmEngine(const ShmEngine&) = delete;
  ShmEngine& operator=(const ShmEngine&) = delete;

  /// Marks the segment closed and wakes every rank (they stop serving and exit), then
  /// removes it (rank processes still mapping it keep their mapping); the pidfds close with the peers.
  ~ShmEngine() {
    // Tell the ranks first (they may be asleep on their frame rings): a clean shutdown ends
    // them as surely as the engine process dying would.
    segment_.header().closed.store(1, std::memory_order_release);
    for (std::uint32_t r = 0; r < world_size(); ++r) segment_.frame_ring(r).control().data.notify_all();
    boost::interprocess::shared_memory_object::remove(name_.c_str());
  }

  /// The segment's name, for the rank processes. Any thread.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The options it was built with.
  [[nodiscard]] const ShmOptions& options() const noexcept { return options_; }
  /// The world size.
  [[nodiscard]] std::uint32_t world_size() const noexcept { return options_.geometry.world_size; }

  /// Blocks until every rank attached, or `timeout` passed; returns whether all did.
  /// Call it before the first load: a rank that never attached receives nothing, so a key
  /// would wait on it until it is marked dead. Notes each attach (see watch). Scheduler thread.
  bool wait_attached(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto key = segment_.header().membership.prepare_wait();
      std::uint32_t attached = 0;
      for (std::uint32_t r = 0; r < world_size(); ++r) attached += note_attach(r) ? 1 : 0;
      if (attached == world_size()) return true;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return false;
      (void)segment_.header().membership.wait_for(key, deadline - now);
    }
  }

  /// Whether rank `r` is attached and alive as far as the engine knows. Scheduler thread.
  [[nodiscard]] bool attached(std::uint32_t r) const noexcept { return r < ranks_.size() && ranks_[r].pidfd.valid(); }
  /// The pid of rank `r`'s attached process, or 0.
  [[nodiscard]] int pid_of(std::uint32_t r) const noexcept { return attached(r) ? ranks_[r].pid : 0; }

  /// Liveness, once per scheduler step, before the step drains records: a rank process
  /// that is gone (its pidfd readable) or was found faulty is marked dead in `pump`
  /// (pump.mark_rank_dead), the records its dead incarnation left are dropped and counted,
  /// its rings emptied and its place freed; a newly attached incarnation of a rank that was
  /// dead is marked alive (pump.mark_rank_alive: it counts for keys issued from now on).
  /// Returns how many ranks changed. O(world), one poll(2) per attached rank. Scheduler thread.
  template <class Pump>
  std::size_t watch(Pump& pump) {
    std::size_t changed = 0;
    for (std::uint32_t r = 0; r < world_size(); ++r) {
      Peer& p = ranks_[r];
      if (p.pidfd.valid() && (p.faulty || gone(p.pidfd.get()))) {
        retire(r);
        pump.mark_rank_dead(r);
        ++changed;
      }
      if (!p.pidfd.valid() && note_attach(r)) {
        if (p.was_dead) pump.mark_rank_alive(r);
        ++changed;
      }
    }
    return changed;
  }

  /// CoordinatorTransport: the load as one frame into every live rank's ring, or into none
  /// (false: back-pressure past send_timeout, or a frame too large for a ring).
  bool send(const LoadRequest& r) { return broadcast(r); }
  bool send(const KvSave& s) { return broadcast(s); }
  bool send(const StateSave& s) { return broadcast(s); }

  /// Counters. Scheduler thread; O(1).
  [[nodiscard]] ShmEngineStats stats() const noexcept { return stats_; }

 private:
  friend class ShmQuorum;

  struct Peer {
    detail::UniqueFd pidfd;
    int pid = 0;
    std::uint64_t incarnation = 0;
    bool faulty = false;    // a malformed record or impossible counters: killed, retired at the next watch
    bool was_dead = false;  // retired before: a new incarnation is a return
  };

  static ShmOptions validated(ShmOptions o) {
    o.geometry.rank = 0;
    o.geometry.validate();
    auto bad = [](const std::string& what) { throw Error(ErrorCode::invalid_argument, "ShmOptions::" + what); };
    if (o.geometry.world_size > 64) bad("geometry.world_size must be at most 64, got " + std::to_string(o.geometry.world_size));
    if (o.lanes_per_rank == 0 || o.lanes_per_rank > 8)
      bad("lanes_per_rank must be in 1..8, got " + std::to_string(o.lanes_per_rank));
    if (o.frame_ring_bytes < 4096 || o.frame_ring_bytes % 8 != 0 || o.frame_ring_bytes > (std::size_t{1} << 32))
      bad("frame_ring_bytes must be a multiple of 8 in [4096, 2^32], got " + std::to_string(o.frame_ring_bytes));
    if (o.record_ring_records < 16 || o.record_ring_records > (std::size_t{1} << 24))
      bad("record_ring_records must be in [16, 2^24], got " + std::to_string(o.record_ring_records));
    if (o.name_prefix.empty() || o.name_prefix.find('/') != std::string::npos || o.name_prefix.size() > 200)
      bad("name_prefix must be a non-empty name without '/', got \"" + o.name_prefix + "\"");
    if (o.send_timeout.count() < 0) bad("send_timeout must be >= 0 ms, got " + std::to_string(o.send_timeout.count()));
    return o;
  }

  static bool gone(int pidfd) noexcept {
    pollfd fd{pidfd, POLLIN, 0};
    return ::poll(&fd, 1, 0) > 0;
  }

  // A rank that attached since the engine last looked: take a pidfd on its process.
  bool note_attach(std::uint32_t r) {
    Peer& p = ranks_[r];
    if (p.pidfd.valid()) return true;
    detail::RankControl& c = segment_.rank_control(r);
    if (c.state.load(std::memory_order_acquire) != static_cast<std::uint32_t>(detail::RankState::alive)) return false;
    const std::uint64_t incarnation = c.incarnation.load(std::memory_order_acquire);
    if (incarnation == p.incarnation) return false;  // the retired incarnation's state, not yet freed
    const int pid = c.pid.load(std::memory_order_acquire);
    detail::UniqueFd fd(detail::open_pidfd(pid));
    p.incarnation = incarnation;
    if (!fd.valid()) {  // it attached and died before we looked
      p.was_dead = true;
      reset_rank(r);
      return false;
    }
    p.pidfd = std::move(fd);
    p.pid = pid;
    p.faulty = false;
    ++stats_.attaches;
    return true;
  }

  // The rank's process is gone: drop what its incarnation left, empty its rings, free its place.
  void retire(std::uint32_t r) {
    Peer& p = ranks_[r];
    p.pidfd.reset();
    p.pid = 0;
    p.was_dead = true;
    p.faulty = false;
    ++stats_.deaths;
    for (std::uint32_t l = 0; l < options_.lanes_per_rank; ++l) {
      detail::RecordRing ring = segment_.record_ring(r, l);
      RecordBytes record;
      for (std::size_t n = 0; n < ring.capacity() && ring.pop(record) == detail::RingRead::item; ++n)
        ++stats_.dead_records_dropped;
    }
    reset_rank(r);
  }

  void reset_rank(std::uint32_t r) {
    segment_.frame_ring(r).control().reset();
    for (std::uint32_t l = 0; l < options_.lanes_per_rank; ++l) segment_.record_ring(r, l).control().reset();
    segment_.rank_control(r).state.store(static_cast<std::uint32_t>(detail::RankState::free), std::memory_order_release);
    segment_.header().membership.notify_all();  // a waiting restart may attach now
  }

  // A rank that broke the protocol: killed now, handled as a death at the next watch.
  void mark_faulty(std::uint32_t r) {
    Peer& p = ranks_[r];
    if (!p.pidfd.valid() || p.faulty) return;
    p.faulty = true;
    ++stats_.faulty;
    (void)detail::signal_pidfd(p.pidfd.get(), SIGKILL);
  }

  template <class Frame>
  bool broadcast(const Frame& frame) {
    const Encoded e = to_bytes(frame, std::span<std::byte>(scratch_));
    if (e.error != EncodeError::none || detail::FrameRing::footprint(e.length) > options_.frame_ring_bytes) {
      ++stats_.too_large;
      return false;
    }
    const std::span<const std::byte> bytes(scratch_.data(), e.length);
    const std::size_t need = detail::FrameRing::footprint(e.length);
    // Room in every live ring first (room only grows while we wait: the ranks consume),
    // so the frame goes to all of them or to none.
    const auto deadline = std::chrono::steady_clock::now() + options_.send_timeout;
    bool waited = false;
    for (std::uint32_t r = 0; r < world_size(); ++r) {
      if (!attached(r) || ranks_[r].faulty) continue;
      detail::FrameRing ring = segment_.frame_ring(r);
      while (ring.free_bytes() < need) {
        const auto key = ring.control().space.prepare_wait();
        if (ring.free_bytes() >= need) break;
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline || gone(ranks_[r].pidfd.get())) {
          ++stats_.backpressure_refusals;
          return false;
        }
        waited = true;
        (void)ring.control().space.wait_for(key, deadline - now);
      }
    }
    stats_.backpressure_waits += waited ? 1 : 0;
    for (std::uint32_t r = 0; r < world_size(); ++r) {
      if (!attached(r) || ranks_[r].faulty) continue;
      if (segment_.frame_ring(r).try_push(bytes)) ++stats_.frames_sent;
    }
    return true;
  }

  ShmOptions options_;
  std::string name_;
  detail::MappedSegment segment_;
  std::vector<Peer> ranks_;
  std::vector<std::byte> scratch_;  // one encoded frame, max_frame_bytes
  ShmEngineStats stats_{};
};

/// The completion group of ranks as processes: the rank side's emitters are ShmEmitter
/// (ipc/shm_rank.hpp: a record ring per lane, in the rank process); the engine side drains
/// every attached rank's rings and merges through an inner TpQuorum (R3, R4). Engine side:
/// scheduler thread only, like TpQuorum. emitter() is not for the engine: a rank process's
/// emitters come from its ShmRank.
class ShmQuorum : public GroupWrapper<TpQuorum> {
 public:
  using Emitter = ShmEmitter;

  /// Drains `engine`'s rings, which must outlive the group. `tombstones` and
  /// `expected_pending` size the inner quorum (TpQuorumOptions).
  explicit ShmQuorum(ShmEngine& engine, std::size_t tombstones = 4096, std::size_t expected_pending = 4096)
      : GroupWrapper(TpQuorumOptions{engine.world_size(), 0, 4096, tombstones, expected_pending, Backoff{}}), engine_(engine) {}
  ShmQuorum(const ShmQuorum&) = delete;
  ShmQuorum& operator=(const ShmQuorum&) = delete;

  /// Always throws Error(invalid_argument): in a rank process the emitters come from ShmRank.
  [[nodiscard]] Emitter emitter(std::uint32_t rank, std::size_t lane) {
    throw Error(ErrorCode::invalid_argument, "rank " + std::to_string(rank) + " lane " + std::to_string(lane) +
                                                 ": a process rank's emitters come from its ShmRank, not the engine's group");
  }

  /// Visits every record the attached ranks' rings hold now, rank by rank, lane by lane
  /// (a snapshot of each ring). A malformed record or a ring with impossible counters makes
  /// its rank faulty (the engine kills it; watch() retires it): nothing more is read from
  /// that rank. Scheduler thread; noexcept.
  template <class Visitor>
  std::size_t drain(Visitor& visitor) noexcept {
    std::size_t n = 0;
    for (std::uint32_t r = 0; r < engine_.world_size(); ++r) {
      if (!engine_.attached(r) || engine_.ranks_[r].faulty) continue;
      for (std::uint32_t l = 0; l < engine_.options().lanes_per_rank && !engine_.ranks_[r].faulty; ++l)
        n += drain_ring(r, engine_.segment_.record_ring(r, l), visitor);
    }
    engine_.stats_.records_received += n;
    return n;
  }

 private:
  template <class Visitor>
  std::size_t drain_ring(std::uint32_t r, detail::RecordRing ring, Visitor& visitor) noexcept {
    std::size_t visited = 0, taken = 0;
    bool malformed = false;
    const detail::RingRead got = ring.take_published(
        [&](const RecordBytes& bytes) noexcept {
          if (const auto load = completion_from_bytes(bytes); load.ok()) {
            visitor(r, load.record);
          } else if (const auto save = save_from_bytes(bytes); save.ok()) {
            visitor(r, save.record);
          } else {
            malformed = true;  // not a record of this format: the rank is broken or hostile
            return false;
          }
          ++visited;
          return true;
        },
        taken);
    if (got == detail::RingRead::corrupt || malformed) engine_.mark_faulty(r);
    return visited;
  }

  ShmEngine& engine_;
};

static_assert(CompletionGroup<ShmQuorum>);

}  // namespace kvfuse
