// kvfuse/completion/rank_queue.hpp — one rank's lock-free verdict path to the engine (R20).
//
// A RankQueue holds one bounded single-producer/single-consumer queue per producing lane of
// one rank (KV load lane, state lane, save lane...). Each lane pushes through its own
// LaneEmitter; one consumer (the engine's settle thread) drains every lane in turn.
//
//   lane thread ──emit──► [spsc lane 0] ─┐
//   lane thread ──emit──► [spsc lane 1] ─┼──► drain(visitor)  (scheduler thread)
//   lane thread ──emit──► [spsc lane 2] ─┘
//
// Both record types travel in one 32-byte envelope, so a lane needs one queue and per-lane
// FIFO order holds across loads and saves. A full queue never drops a record: the producer
// backs off (spin, then yield, then sleep with a capped doubling) and the wait is counted.
// The drain is wait-free and never blocks a producer.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/lockfree/spsc_queue.hpp>

#include <kvfuse/bridge/records.hpp>
#include <kvfuse/detail/spin.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// Which record an envelope carries.
enum class RecordKind : std::uint8_t { load = 0, save = 1 };

/// A CompletionRecord or a SaveRecord, tagged: the element type of every lane queue.
/// Trivially copyable and default constructible, as Boost.Lockfree 1.74 requires; 40 bytes
/// (the load record's 32 and the tag, aligned).
struct RecordEnvelope {
  alignas(8) std::array<std::byte, sizeof(CompletionRecord)> payload{};  ///< the record's in-memory bytes
  RecordKind kind = RecordKind::load;

  /// Wraps a record. Thread-safe, constexpr, noexcept.
  static constexpr RecordEnvelope wrap(const CompletionRecord& r) noexcept {
    return RecordEnvelope{std::bit_cast<std::array<std::byte, sizeof(CompletionRecord)>>(r), RecordKind::load};
  }
  static constexpr RecordEnvelope wrap(const SaveRecord& r) noexcept {
    RecordEnvelope e;
    const auto bytes = std::bit_cast<std::array<std::byte, sizeof(SaveRecord)>>(r);
    std::copy(bytes.begin(), bytes.end(), e.payload.begin());
    e.kind = RecordKind::save;
    return e;
  }
  /// Calls visitor(record) with the record this envelope carries. noexcept if the visitor is.
  template <class Visitor>
  constexpr void visit(Visitor& visitor) const {
    if (kind == RecordKind::load) {
      visitor(std::bit_cast<CompletionRecord>(payload));
    } else {
      std::array<std::byte, sizeof(SaveRecord)> bytes{};
      std::copy_n(payload.begin(), sizeof(SaveRecord), bytes.begin());
      visitor(std::bit_cast<SaveRecord>(bytes));
    }
  }
};
static_assert(sizeof(SaveRecord) <= sizeof(CompletionRecord));
static_assert(std::is_trivially_copyable_v<RecordEnvelope> && std::is_default_constructible_v<RecordEnvelope>);
static_assert(sizeof(RecordEnvelope) == 40);

/// How a producer waits on a full lane queue: `spins` busy polls, then `yields` calls to
/// std::this_thread::yield, then sleeps starting at 1 µs and doubling up to `max_sleep`.
/// Every wait is counted (RankQueueStats); none ends in a drop.
struct Backoff {
  std::uint32_t spins = 256;
  std::uint32_t yields = 64;
  std::chrono::microseconds max_sleep{200};
};

/// Shape of one rank's queues. `capacity` is per lane, in records.
struct RankQueueOptions {
  std::size_t lanes = 3;
  std::size_t capacity = 4096;
  Backoff backoff{};
};

/// Counters of one RankQueue, summed over its lanes. Readable from any thread (relaxed
/// snapshots, each field individually exact).
struct RankQueueStats {
  std::uint64_t drained = 0;              ///< records handed to the consumer
  std::uint64_t full_waits = 0;           ///< emits that found their queue full and had to wait
  std::uint64_t sleeps = 0;               ///< sleeps taken inside those waits
  std::uint64_t wait_ns = 0;              ///< total time producers spent waiting on full queues
  std::uint64_t dropped_after_close = 0;  ///< records refused by a full queue after close() (shutdown only)
};

namespace detail {

/// Adds to a counter that only one thread writes: a relaxed load and store, no RMW.
inline void bump(std::atomic<std::uint64_t>& c, std::uint64_t by = 1) noexcept {
  c.store(c.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
}

/// One lane: its queue and the producer-written counters, on their own cache lines.
struct alignas(64) LaneQueue {
  explicit LaneQueue(std::size_t capacity) : queue(capacity) {}
  boost::lockfree::spsc_queue<RecordEnvelope> queue;
  alignas(64) std::atomic<std::uint64_t> full_waits{0};
  std::atomic<std::uint64_t> sleeps{0};
  std::atomic<std::uint64_t> wait_ns{0};
  std::atomic<std::uint64_t> dropped_after_close{0};
  std::atomic<bool> claimed{false};
  std::atomic<bool> closed{false};
};

}  // namespace detail

class RankQueue;

/// The producer handle of one lane: the RecordEmitter a lane's load and save tasks emit
/// through. Move-only; exactly one thread (the lane's) may emit through it at a time.
/// Destroying it returns the lane, so it can be claimed again. The RankQueue must outlive it.
class LaneEmitter {
 public:
  LaneEmitter(const LaneEmitter&) = delete;
  LaneEmitter& operator=(const LaneEmitter&) = delete;
  LaneEmitter(LaneEmitter&& other) noexcept
      : lane_(std::exchange(other.lane_, nullptr)), backoff_(other.backoff_), rank_(other.rank_), index_(other.index_) {}
  LaneEmitter& operator=(LaneEmitter&& other) noexcept {
    if (this != &other) {
      release();
      lane_ = std::exchange(other.lane_, nullptr);
      backoff_ = other.backoff_;
      rank_ = other.rank_;
      index_ = other.index_;
    }
    return *this;
  }
  ~LaneEmitter() { release(); }

  /// Pushes one record. Lock-free and wait-free while the queue has room; on a full queue
  /// it backs off until the consumer makes room (never drops, counts the wait). Lane thread
  /// only; noexcept. Precondition: this handle was not moved from.
  void emit(const CompletionRecord& r) noexcept { push(RecordEnvelope::wrap(r)); }
  void emit(const SaveRecord& r) noexcept { push(RecordEnvelope::wrap(r)); }

  /// The rank and lane this handle pushes into.
  [[nodiscard]] std::uint32_t rank() const noexcept { return rank_; }
  [[nodiscard]] std::size_t lane() const noexcept { return index_; }

 private:
  friend class RankQueue;
  LaneEmitter(detail::LaneQueue* lane, Backoff backoff, std::uint32_t rank, std::size_t index) noexcept
      : lane_(lane), backoff_(backoff), rank_(rank), index_(index) {}

  void release() noexcept {
    if (lane_ != nullptr) lane_->claimed.store(false, std::memory_order_release);
    lane_ = nullptr;
  }

  void push(const RecordEnvelope& e) noexcept {
    if (lane_->queue.push(e)) [[likely]]
      return;
    push_when_full(e);
  }

  [[gnu::noinline, gnu::cold]] void push_when_full(const RecordEnvelope& e) noexcept {
    detail::LaneQueue& lane = *lane_;
    detail::bump(lane.full_waits);
    const auto started = std::chrono::steady_clock::now();
    std::uint32_t spins = 0;
    std::uint32_t yields = 0;
    auto nap = std::chrono::microseconds{1};
    for (;;) {
      if (lane.queue.push(e)) break;
      if (lane.closed.load(std::memory_order_acquire)) {
        detail::bump(lane.dropped_after_close);
        break;
      }
      if (spins < backoff_.spins) {
        ++spins;
        detail::cpu_relax();
      } else if (yields < backoff_.yields) {
        ++yields;
        std::this_thread::yield();
      } else {
        detail::bump(lane.sleeps);
        std::this_thread::sleep_for(nap);
        if (nap < backoff_.max_sleep) nap = std::min(nap * 2, backoff_.max_sleep);
      }
    }
    const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - started);
    detail::bump(lane.wait_ns, static_cast<std::uint64_t>(waited.count()));
  }

  detail::LaneQueue* lane_;
  Backoff backoff_;
  std::uint32_t rank_;
  std::size_t index_;
};

/// One rank's lane queues. Construction allocates every queue (bounded, runtime-sized);
/// nothing allocates afterwards. Producers: one LaneEmitter per lane. Consumer: one thread
/// calls drain(). Non-copyable, non-movable (emitters point into it).
class RankQueue {
 public:
  /// Throws Error(invalid_argument) naming the value if `lanes` or `capacity` is zero.
  RankQueue(std::uint32_t rank, RankQueueOptions config) : rank_(rank), backoff_(config.backoff) {
    if (config.lanes == 0)
      throw Error(ErrorCode::invalid_argument, "RankQueue lanes must be > 0, got 0 (rank " + std::to_string(rank) + ")");
    if (config.capacity == 0)
      throw Error(ErrorCode::invalid_argument,
                  "RankQueue capacity must be > 0 records per lane, got 0 (rank " + std::to_string(rank) + ")");
    lanes_.reserve(config.lanes);
    for (std::size_t i = 0; i < config.lanes; ++i) lanes_.push_back(std::make_unique<detail::LaneQueue>(config.capacity));
    capacity_ = config.capacity;
  }
  RankQueue(const RankQueue&) = delete;
  RankQueue& operator=(const RankQueue&) = delete;

  /// Claims lane `lane`'s producer handle. Throws Error(invalid_argument) naming the lane
  /// if it is out of range or already claimed (two producers would break the SPSC contract).
  /// Thread-safe.
  [[nodiscard]] LaneEmitter emitter(std::size_t lane) {
    if (lane >= lanes_.size())
      throw Error(ErrorCode::invalid_argument, "lane " + std::to_string(lane) + " out of range: rank " +
                                                   std::to_string(rank_) + " has " + std::to_string(lanes_.size()) +
                                                   " lanes");
    if (lanes_[lane]->claimed.exchange(true, std::memory_order_acq_rel))
      throw Error(ErrorCode::invalid_argument,
                  "lane " + std::to_string(lane) + " of rank " + std::to_string(rank_) + " already has a producer");
    return LaneEmitter(lanes_[lane].get(), backoff_, rank_, lane);
  }

  /// Hands every record queued now to `visitor` — visitor(const CompletionRecord&) and
  /// visitor(const SaveRecord&) — lane by lane, FIFO within a lane. Takes a snapshot per
  /// lane, so it returns even while producers keep pushing. Consumer thread only; wait-free
  /// apart from the visitor, never blocks a producer; noexcept (the visitor must not throw).
  /// Returns the number of records visited.
  template <class Visitor>
  std::size_t drain(Visitor& visitor) noexcept {
    std::size_t n = 0;
    for (auto& lane : lanes_) {
      n += lane->queue.consume_all([&visitor](const RecordEnvelope& e) noexcept { e.visit(visitor); });
    }
    detail::bump(drained_, n);
    return n;
  }

  /// Shutdown only: from now on a producer that finds its queue full drops the record and
  /// counts it (dropped_after_close) instead of waiting for a consumer that has stopped, so
  /// lane threads can be joined. Records already queued stay drainable. Thread-safe.
  void close() noexcept {
    for (auto& lane : lanes_) lane->closed.store(true, std::memory_order_release);
  }

  /// Counters summed over lanes. Any thread; O(lanes).
  [[nodiscard]] RankQueueStats stats() const noexcept {
    RankQueueStats s;
    s.drained = drained_.load(std::memory_order_relaxed);
    for (const auto& lane : lanes_) {
      s.full_waits += lane->full_waits.load(std::memory_order_relaxed);
      s.sleeps += lane->sleeps.load(std::memory_order_relaxed);
      s.wait_ns += lane->wait_ns.load(std::memory_order_relaxed);
      s.dropped_after_close += lane->dropped_after_close.load(std::memory_order_relaxed);
    }
    return s;
  }

  [[nodiscard]] std::uint32_t rank() const noexcept { return rank_; }
  [[nodiscard]] std::size_t lanes() const noexcept { return lanes_.size(); }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

 private:
  std::uint32_t rank_;
  Backoff backoff_;
  std::size_t capacity_ = 0;
  std::vector<std::unique_ptr<detail::LaneQueue>> lanes_;
  std::atomic<std::uint64_t> drained_{0};
};

}  // namespace kvfuse
