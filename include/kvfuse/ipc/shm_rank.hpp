// kvfuse/ipc/shm_rank.hpp — the rank side of ranks as processes: ShmRank attaches a rank
// process to its engine's segment, hands its connector one ShmEmitter per lane, and feeds
// the connector the frames the engine sends.
//
//   ShmRank rank(segment_name, geometry);       // attach: checks world and geometry
//   Conn conn(geometry, runtime, memory, kv_leg, state_leg,
//             Conn::Emitters{rank.emitter(0), rank.emitter(1), rank.emitter(2)});
//   rank.serve(conn);                            // until the engine is gone
//
// Attach. The segment names the world and geometry it was made for; a rank process of
// another world size or geometry is refused with an Error naming both. Each attach takes
// the rank's place (free -> alive) with a new incarnation: the engine counts a returned
// rank only for keys issued after it saw this incarnation, and drops whatever the previous
// one left in the rings. A place the engine has not freed yet (it has not seen the previous
// process die) is waited for, up to a timeout.
//
// The engine dying. The rank holds a pidfd of the engine process: serve() returns when the
// engine is gone (checked whenever the frame ring is idle, at least every 50 ms), and from
// then on the lanes drop their records instead of waiting for room nobody will make. A rank
// process whose serve() returned exits: no rank outlives its engine.
//
// Threading: the constructor and serve()/serve_one() run on the rank's one serving thread
// (the connector's "rank thread"); the emitters are used by the connector's lanes.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <kvfuse/bridge/frames.hpp>
#include <kvfuse/detail/unique_fd.hpp>
#include <kvfuse/error.hpp>
#include <kvfuse/ipc/shm_emitter.hpp>
#include <kvfuse/ipc/shm_segment.hpp>

namespace kvfuse {

/// What serve_one() did.
enum class Served : std::uint8_t {
  frame,        ///< one frame went to the connector
  idle,         ///< nothing arrived within the wait
  engine_gone,  ///< the engine process is gone: stop serving
  bad_frame,    ///< a frame that does not decode (or a state save for a stateless connector): stop
};

/// A rank process's counters. Read from any thread (relaxed atomics).
struct ShmRankStats {
  std::uint64_t incarnation = 0;  ///< this attach's incarnation
  std::uint64_t loads = 0, kv_saves = 0, state_saves = 0;  ///< frames handed to the connector
  std::uint64_t bad_frames = 0;
  /// Why the last bad frame was refused: a DecodeError's name, "ring_corrupt" (the ring's
  /// counters or a length prefix were impossible), or "state_for_stateless"; empty if none.
  std::string_view last_refusal;
  std::uint64_t records_emitted = 0, full_waits = 0, records_dropped = 0;  ///< over every lane
};

/// One rank process's attachment. Not copyable or movable (the emitters point into it).
class ShmRank {
 public:
  /// Attaches to segment `name` as rank `geometry.rank`. Throws Error(invalid_argument)
  /// naming both sides when the segment was made for another world size or geometry, or
  /// naming the rank when it is out of range; Error(io_failure) when the segment cannot be
  /// opened, is not a kvfuse segment, its engine is already gone, or the place stays taken
  /// for `attach_timeout` (a live process holds it).
  ShmRank(const std::string& name, const RankGeometry& geometry,
          std::chrono::milliseconds attach_timeout = std::chrono::seconds(10))
      : rank_(geometry.rank) {
    namespace bip = boost::interprocess;
    try {
      segment_ = detail::MappedSegment(bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_write),
                                       bip::read_write);
    } catch (const bip::interprocess_exception& e) {
      throw Error(ErrorCode::io_failure, "cannot open the shared memory segment /" + name + ": " + e.what());
    }
    const detail::SegmentHeader& h = segment_.header();
    if (segment_.size() < sizeof(detail::SegmentHeader) || h.magic != detail::shm_magic || h.version != detail::shm_version)
      throw Error(ErrorCode::io_failure, "/" + name + " is not a kvfuse segment of version " +
                                             std::to_string(detail::shm_version));
    const ShmGeometry mine = ShmGeometry::of(geometry);
    if (!(mine == h.geometry))
      throw Error(ErrorCode::invalid_argument, "rank " + std::to_string(rank_) + " cannot attach to /" + name +
                                                   ": the segment is for " + h.geometry.describe() +
                                                   ", this rank is " + mine.describe());
    if (rank_ >= h.geometry.world_size)
      throw Error(ErrorCode::invalid_argument, "rank " + std::to_string(rank_) + " is out of range: /" + name +
                                                   " has world_size " + std::to_string(h.geometry.world_size));
    // Allocated before the place is taken: a throw past take_place would leave the place
    // marked alive for a rank that never serves.
    frame_.resize(max_frame_bytes);
    counters_ = std::make_unique<ShmEmitterCounters[]>(h.lanes);
    engine_pidfd_ = detail::UniqueFd(detail::open_pidfd(h.engine_pid));  // owned at once: a throw below closes it
    if (!engine_pidfd_.valid() || detail::process_start(h.engine_pid) != h.engine_start)
      throw Error(ErrorCode::io_failure, "the engine of /" + name + " (pid " + std::to_string(h.engine_pid) + ") is gone");
    take_place(name, attach_timeout);
  }

  ShmRank(const ShmRank&) = delete;
  ShmRank& operator=(const ShmRank&) = delete;

  /// The emitter of `lane` (0 .. lanes_per_rank - 1), for the connector. Throws Error
  /// naming the lane when out of range. Call before the connector runs.
  [[nodiscard]] ShmEmitter emitter(std::size_t lane) {
    if (lane >= segment_.header().lanes)
      throw Error(ErrorCode::invalid_argument, "lane " + std::to_string(lane) + " out of range: the segment has " +
                                                   std::to_string(segment_.header().lanes) + " lanes per rank");
    return ShmEmitter(segment_.record_ring(rank_, static_cast<std::uint32_t>(lane)), &engine_gone_, &counters_[lane]);
  }

  /// Waits up to `wait` for one frame and hands it to `conn` (load, save_kv, save_state).
  /// The serving thread only.
  template <class Conn>
  Served serve_one(Conn& conn, std::chrono::nanoseconds wait) {
    detail::FrameRing ring = segment_.frame_ring(rank_);
    std::size_t length = 0;
    detail::RingRead got = ring.pop(frame_, length);
    if (got == detail::RingRead::empty) {
      const auto key = ring.control().data.prepare_wait();
      got = ring.pop(frame_, length);
      if (got == detail::RingRead::empty) {
        if (engine_gone()) return Served::engine_gone;
        (void)ring.control().data.wait_for(key, std::min<std::chrono::nanoseconds>(wait, std::chrono::milliseconds(50)));
        got = ring.pop(frame_, length);
      }
    }
    if (got == detail::RingRead::empty) return engine_gone() ? Served::engine_gone : Served::idle;
    if (got == detail::RingRead::corrupt) return bad("ring_corrupt");
    return dispatch(conn, std::span<const std::byte>(frame_.data(), length));
  }

  /// Serves frames until the engine is gone (or a bad frame arrives, or `stop` is set).
  /// Returns why it stopped. The serving thread only.
  template <class Conn>
  Served serve(Conn& conn, const std::atomic<bool>* stop = nullptr) {
    for (;;) {
      if (stop != nullptr && stop->load(std::memory_order_acquire)) return Served::idle;
      const Served s = serve_one(conn, std::chrono::milliseconds(50));
      if (s == Served::engine_gone || s == Served::bad_frame) return s;
    }
  }

  /// Whether the engine is gone: its process exited, or it shut down cleanly (and, from then
  /// on, the lanes drop). Any thread.
  bool engine_gone() noexcept {
    if (engine_gone_.load(std::memory_order_acquire)) return true;
    pollfd fd{engine_pidfd_.get(), POLLIN, 0};
    if (::poll(&fd, 1, 0) > 0 || segment_.header().closed.load(std::memory_order_acquire) != 0)
      engine_gone_.store(true, std::memory_order_release);
    return engine_gone_.load(std::memory_order_relaxed);
  }

  /// This rank. Any thread.
  [[nodiscard]] std::uint32_t rank() const noexcept { return rank_; }

  /// Counters. Any thread.
  [[nodiscard]] ShmRankStats stats() const noexcept {
    ShmRankStats s = stats_;
    for (std::uint32_t l = 0; l < segment_.header().lanes; ++l) {
      s.records_emitted += counters_[l].emitted.load(std::memory_order_relaxed);
      s.full_waits += counters_[l].full_waits.load(std::memory_order_relaxed);
      s.records_dropped += counters_[l].dropped.load(std::memory_order_relaxed);
    }
    return s;
  }

 private:
  void take_place(const std::string& name, std::chrono::milliseconds timeout) {
    detail::RankControl& c = segment_.rank_control(rank_);
    detail::SegmentHeader& h = segment_.header();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    constexpr auto free_state = static_cast<std::uint32_t>(detail::RankState::free);
    constexpr std::uint32_t attaching = 2;  // between free and alive: pid and incarnation being written
    for (;;) {
      const auto key = h.membership.prepare_wait();
      std::uint32_t expected = free_state;
      if (c.state.compare_exchange_strong(expected, attaching, std::memory_order_acq_rel)) break;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline)
        throw Error(ErrorCode::io_failure, "rank " + std::to_string(rank_) + " of /" + name +
                                               " is still held by process " + std::to_string(c.pid.load()));
      (void)h.membership.wait_for(key, std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(50)));
    }
    c.pid.store(::getpid(), std::memory_order_relaxed);
    stats_.incarnation = c.incarnation.fetch_add(1, std::memory_order_relaxed) + 1;
    c.state.store(static_cast<std::uint32_t>(detail::RankState::alive), std::memory_order_release);
    h.membership.notify_all();
  }

  Served bad(std::string_view why) noexcept {
    ++stats_.bad_frames;
    stats_.last_refusal = why;
    return Served::bad_frame;
  }

  template <class Conn>
  Served dispatch(Conn& conn, std::span<const std::byte> bytes) {
    const auto header = read_frame_header(bytes);
    if (!header.ok()) return bad(to_string(header.error));
    switch (header.record.kind) {
      case WireKind::load_request: {
        auto d = load_request_from_bytes(bytes);
        if (!d.ok()) return bad(to_string(d.error));
        ++stats_.loads;
        conn.load(std::move(d.record));
        return Served::frame;
      }
      case WireKind::kv_save: {
        auto d = kv_save_from_bytes(bytes);
        if (!d.ok()) return bad(to_string(d.error));
        ++stats_.kv_saves;
        conn.save_kv(std::move(d.record));
        return Served::frame;
      }
      case WireKind::state_save: {
        if constexpr (Conn::has_state) {
          const auto d = state_save_from_bytes(bytes);
          if (!d.ok()) return bad(to_string(d.error));
          ++stats_.state_saves;
          conn.save_state(d.record);
          return Served::frame;
        } else {
          return bad("state_for_stateless");  // the engine never sends state to a stateless model
        }
      }
      default:
        return bad(to_string(DecodeError::unknown_kind));
    }
  }

  std::uint32_t rank_;
  detail::MappedSegment segment_;
  detail::UniqueFd engine_pidfd_;
  std::atomic<bool> engine_gone_{false};
  std::unique_ptr<ShmEmitterCounters[]> counters_;
  std::vector<std::byte> frame_;
  ShmRankStats stats_{};
};

}  // namespace kvfuse
