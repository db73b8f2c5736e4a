// kvfuse/ipc/shm_emitter.hpp — ShmEmitter: a rank lane's record emitter when the rank is a
// process: it writes each record, in the records' 32-byte wire format, into the lane's ring
// in the engine's shared memory segment (ipc/shm_segment.hpp).
//
// A full ring is back-pressure, never a lost record (R20): the lane sleeps on the ring's
// futex until the engine drains it, and counts the wait. It gives up only when its rank is
// told the engine is gone (ShmRank sees the engine's pidfd): then records are dropped and
// counted, as RankQueue does after close(), because nobody will read them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include <kvfuse/bridge/records.hpp>
#include <kvfuse/ipc/shm_ring.hpp>

namespace kvfuse {

/// Counters of one ShmEmitter, shared with its ShmRank (relaxed atomics: a snapshot).
struct ShmEmitterCounters {
  std::atomic<std::uint64_t> emitted{0};        ///< records written into the ring
  std::atomic<std::uint64_t> full_waits{0};     ///< emits that found the ring full and waited
  std::atomic<std::uint64_t> dropped{0};        ///< records dropped because the engine is gone
};

/// A lane's emitter into its record ring. Movable; used by exactly one thread at a time
/// (the lane that owns it), as every RecordEmitter. The ring and the flags it points at
/// belong to the ShmRank that made it, which must outlive it.
class ShmEmitter {
 public:
  ShmEmitter() noexcept = default;
  /// Made by ShmRank::emitter.
  ShmEmitter(detail::RecordRing ring, const std::atomic<bool>* engine_gone, ShmEmitterCounters* counters) noexcept
      : ring_(ring), engine_gone_(engine_gone), counters_(counters) {}

  /// Writes the record; waits while the ring is full (futex, rechecking every 50 ms whether
  /// the engine is gone). The lane's thread only; noexcept; never loses a record while the
  /// engine lives.
  void emit(const CompletionRecord& r) noexcept { push(to_bytes(r)); }
  /// The same for a save record.
  void emit(const SaveRecord& r) noexcept { push(to_bytes(r)); }

 private:
  void push(const RecordBytes& bytes) noexcept {
    bool waited = false;
    while (!ring_.try_push(bytes)) {
      if (engine_gone_->load(std::memory_order_acquire)) {
        counters_->dropped.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      const auto key = ring_.control().space.prepare_wait();
      if (ring_.try_push(bytes)) break;
      waited = true;
      (void)ring_.control().space.wait_for(key, std::chrono::milliseconds(50));
    }
    if (waited) counters_->full_waits.fetch_add(1, std::memory_order_relaxed);
    counters_->emitted.fetch_add(1, std::memory_order_relaxed);
  }

  detail::RecordRing ring_;
  const std::atomic<bool>* engine_gone_ = nullptr;
  ShmEmitterCounters* counters_ = nullptr;
};

}  // namespace kvfuse
