// kvfuse/device/save_fence.hpp — SaveFence<R>: the producer fence of R13.
//
// A save gathers bytes that the step's forward wrote. Without a fence the copy stream may
// read them before the forward finished: a torn save that no checksum catches, because
// the bytes are checksummed after they were copied wrong. The fence is one event per step:
//   step thread:   forward enqueued on the compute stream; fence.begin_step(compute)
//                  records the event after it.
//   save lane(s): fence.fence(copy) makes the copy stream wait on that event on the
//                  device, then the gather's copies are enqueued. No host thread waits.
// If the event cannot be created or recorded, begin_step falls back to
// rt.device_synchronize(): the forward has finished before begin_step returns, which is
// stronger ordering, never dropped work (the seed's unguarded event dropped every save
// of the step). Each fallback is counted.
//
// One event is re-recorded every step. A fence() that runs after the next step's
// begin_step waits for that later forward instead: later, never earlier, so still safe.
#pragma once

#include <atomic>
#include <cstdint>

#include <kvfuse/device/runtime.hpp>

namespace kvfuse {

/// How a step was fenced.
enum class FenceMode : std::uint8_t {
  event = 0,                ///< the event was recorded; copies wait on it on the device
  device_synchronized = 1,  ///< event creation or record failed; the device was synchronized
};

/// Counters of a SaveFence. Plain data, a snapshot.
struct SaveFenceStats {
  std::uint64_t steps = 0;             ///< begin_step calls
  std::uint64_t event_steps = 0;       ///< steps fenced by the event
  std::uint64_t fallback_steps = 0;    ///< steps that fell back to device_synchronize
  std::uint64_t create_failures = 0;   ///< event creations that failed
  std::uint64_t record_failures = 0;   ///< event records that failed
  std::uint64_t fences = 0;            ///< fence() calls
  std::uint64_t wait_fallbacks = 0;    ///< fence() calls whose device-side wait failed (host waited instead)
  std::uint64_t failed_fences = 0;     ///< fence() calls that could not order the copy at all
  std::uint64_t sync_failures = 0;     ///< fallback device_synchronize calls that failed
};

/// The R13 producer fence over a Runtime `R`. Holds one event, created on the first step
/// (creation is retried on later steps while it fails). Not copyable or movable: store
/// lanes hold references to it. The runtime must outlive it.
/// Threads: begin_step from one thread at a time (the step thread); fence() from any
/// number of threads (save lanes), concurrently with begin_step. Counters are atomics.
template <Runtime R>
class SaveFence {
 public:
  using Stream = typename R::Stream;
  using Event = typename R::Event;

  /// Takes the runtime by reference; allocates nothing (the event is made on step one).
  explicit SaveFence(R& runtime) noexcept : rt_(runtime) {}
  SaveFence(const SaveFence&) = delete;
  SaveFence& operator=(const SaveFence&) = delete;

  /// Call once per step, after the step's forward was enqueued on `compute` and before
  /// its saves are handed to save lanes. Records the step's event on `compute`; if the
  /// event cannot be created or recorded, blocks until the device is idle instead.
  /// Step thread only; noexcept; allocates only while creating the event.
  FenceMode begin_step(Stream& compute) noexcept {
    steps_.fetch_add(1, std::memory_order_relaxed);
    if (!created_) {
      if (rt_.create_event(event_)) {
        created_ = true;
      } else {
        create_failures_.fetch_add(1, std::memory_order_relaxed);
        return fall_back();
      }
    }
    if (!rt_.record(event_, compute)) {
      record_failures_.fetch_add(1, std::memory_order_relaxed);
      return fall_back();
    }
    // Publishes the handle written by create_event to fence() callers on other threads.
    state_.store(State::armed, std::memory_order_release);
    event_steps_.fetch_add(1, std::memory_order_relaxed);
    return FenceMode::event;
  }

  /// Orders everything enqueued on `copy` after this call behind the latest begin_step's
  /// forward. With an event: a device-side wait, the caller does not block. After a
  /// fallback step: nothing to do, the forward already finished. If the device-side
  /// wait fails, the caller blocks on the event instead (then on the device). Returns
  /// false only if no ordering could be established (the save must then fail, not copy).
  /// Any thread; noexcept; never allocates.
  bool fence(Stream& copy) noexcept {
    fences_.fetch_add(1, std::memory_order_relaxed);
    switch (state_.load(std::memory_order_acquire)) {
      case State::idle: return true;  // no step yet, or the device was synchronized
      case State::unordered: failed_fences_.fetch_add(1, std::memory_order_relaxed); return false;
      case State::armed: break;
    }
    if (rt_.wait(copy, event_)) return true;
    wait_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    if (rt_.synchronize(event_) || rt_.device_synchronize()) return true;
    failed_fences_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }

  /// A snapshot of the counters. Any thread; lock-free.
  [[nodiscard]] SaveFenceStats stats() const noexcept {
    SaveFenceStats s;
    s.steps = steps_.load(std::memory_order_relaxed);
    s.event_steps = event_steps_.load(std::memory_order_relaxed);
    s.fallback_steps = fallback_steps_.load(std::memory_order_relaxed);
    s.create_failures = create_failures_.load(std::memory_order_relaxed);
    s.record_failures = record_failures_.load(std::memory_order_relaxed);
    s.fences = fences_.load(std::memory_order_relaxed);
    s.wait_fallbacks = wait_fallbacks_.load(std::memory_order_relaxed);
    s.failed_fences = failed_fences_.load(std::memory_order_relaxed);
    s.sync_failures = sync_failures_.load(std::memory_order_relaxed);
    return s;
  }

 private:
  FenceMode fall_back() noexcept {
    // Synchronize first, disarm second: a fence() that still sees `armed` is for an
    // earlier step and waits on that step's event; one that sees `idle` finds the device
    // idle. If even the device cannot be synchronized, nothing orders this step's
    // copies: fence() then refuses (the saves fail) rather than risk a torn gather.
    const bool synced = rt_.device_synchronize();
    if (!synced) sync_failures_.fetch_add(1, std::memory_order_relaxed);
    state_.store(synced ? State::idle : State::unordered, std::memory_order_release);
    fallback_steps_.fetch_add(1, std::memory_order_relaxed);
    return FenceMode::device_synchronized;
  }

  enum class State : std::uint8_t { idle, armed, unordered };

  R& rt_;
  Event event_{};
  bool created_ = false;  // step thread only
  std::atomic<State> state_{State::idle};
  std::atomic<std::uint64_t> steps_{0};
  std::atomic<std::uint64_t> event_steps_{0};
  std::atomic<std::uint64_t> fallback_steps_{0};
  std::atomic<std::uint64_t> create_failures_{0};
  std::atomic<std::uint64_t> record_failures_{0};
  std::atomic<std::uint64_t> fences_{0};
  std::atomic<std::uint64_t> wait_fallbacks_{0};
  std::atomic<std::uint64_t> failed_fences_{0};
  std::atomic<std::uint64_t> sync_failures_{0};
};

}  // namespace kvfuse
