// kvfuse/host/audit.hpp — the end-of-run audit of an engine built on the host kit: every
// check kvfuse can make of an engine's books after its last request, summed into the
// numbers that must be zero.
//
// Run it when the engine has drained (every load settled, every save stored, every Freed
// routed): then an admission still on the book, a block still pinned or a slot still taken
// is a leak, and a request still parked was stranded. It walks the whole index
// (check_consistency), so it is O(everything): an audit for the end of a run or a test,
// never a metrics path (R17).
//
// Threading: the scheduler thread, like everything it reads.
#pragma once

#include <cstdint>
#include <string>

#include <kvfuse/engine/coordinator_types.hpp>
#include <kvfuse/engine/index_consistency.hpp>
#include <kvfuse/engine/offload_index.hpp>
#include <kvfuse/host/admission_book.hpp>
#include <kvfuse/host/block_pool.hpp>
#include <kvfuse/host/slot_pool.hpp>

namespace kvfuse {

/// What audit_host() found. Every field is zero for an engine that kept its books.
struct HostAudit {
  /// The index's and the coordinator's O(1) audits, the full index walk (1 when it found a
  /// problem), and the book's protocol errors (an unpark or a Freed nobody waited for).
  std::uint64_t invariant_violations = 0;
  std::uint64_t stranded_parked = 0;   ///< requests the coordinator or the book still hold waiting on a load
  std::uint64_t leaked_blocks = 0;     ///< blocks still pinned
  std::uint64_t leaked_slots = 0;      ///< request and snapshot slots still taken
  std::uint64_t held_admissions = 0;   ///< admissions still on the book, or torn down and held for their ranks
  std::string problem;                 ///< the index walk's first inconsistency; empty when it found none

  /// Whether every number is zero.
  [[nodiscard]] bool clean() const noexcept {
    return invariant_violations == 0 && stranded_parked == 0 && leaked_blocks == 0 && leaked_slots == 0 &&
           held_admissions == 0;
  }
};

/// Audits an engine after it drained: `index` and `coordinator` (its stats() now) as kvfuse
/// left them, `book` with every admission's resources, and the pools they came from.
/// Scheduler thread; O(everything): walks the index.
template <class Clock, class Payload>
HostAudit audit_host(const OffloadIndex<Clock>& index, const CoordinatorStats& coordinator,
                     const AdmissionBook<Payload>& book, const PrefixBlockPool& blocks, const SlotPool& request_slots,
                     const SlotPool& snapshot_slots) {
  HostAudit a;
  const ConsistencyReport walk = check_consistency(index);
  const AdmissionBookStats bs = book.stats();
  a.invariant_violations = index.stats().invariant_violations + coordinator.invariant_violations + bs.protocol_errors() +
                           (walk.ok ? 0 : 1);
  a.problem = walk.problem;
  a.stranded_parked = coordinator.waiting_now + bs.parked_now;
  a.leaked_blocks = blocks.pinned();
  a.leaked_slots = request_slots.taken() + snapshot_slots.taken();
  a.held_admissions = book.size() + coordinator.holding_now;
  return a;
}

}  // namespace kvfuse
