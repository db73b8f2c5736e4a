// kvfuse/completion/records.hpp — what a rank reports back: one record per load, one per save.
//
// Records are fixed-size and trivially copyable so any transport (SPSC queue, shared
// memory, RPC) can carry them. The byte layout is documented beside each struct.
#pragma once

#include <cstdint>
#include <type_traits>

#include <kvfuse/engine/ids.hpp>

namespace kvfuse {

/// Outcome of the KV leg on one rank.
enum class KvOutcome : std::uint8_t {
  none = 0,    ///< the load had no KV leg (state-only)
  ok = 1,      ///< every chunk in [hbm, end) arrived
  failed = 2,  ///< some chunk missed or a transfer failed; the engine recomputes
};

/// Outcome of the state leg on one rank (R2: it rides the completion).
enum class StateOutcome : std::uint8_t {
  none = 0,      ///< the load had no state leg
  restored = 1,  ///< the entry was found and copied into the slot
  missed = 2,    ///< the tier genuinely did not have the entry: the only outcome that retracts the hash
  failed = 3,    ///< a transfer failed, or the leg never ran; never retracts
  refused = 4,   ///< the rank refused the spec at the boundary (R11); never retracts
};

/// Why a leg did not succeed. One code per record: the first problem found.
enum class Reason : std::uint16_t {
  none = 0,
  kv_chunk_missing = 1,       ///< a chunk in [hbm, end) was not in the tier
  kv_transfer_failed = 2,     ///< a tier read or device copy failed on the KV leg
  state_transfer_failed = 3,  ///< a tier read or device copy failed on the state leg
  slot_out_of_range = 4,      ///< the destination slot is outside the slot pool
  grid_mismatch = 5,          ///< boundary off the checkpoint grid, or the rank's grids differ from the engine's
  kv_end_mismatch = 6,        ///< the KV end is not the chunk covering the boundary
  entry_size_mismatch = 7,    ///< the stored entry's size does not match the slot
  nonzero_hbm_floor = 8,      ///< a stateful DSV4 load with hbm > 0
  sidecar_mismatch = 9,       ///< the stored entry's boundary hash or length disagrees with the spec
  leg_not_run = 10,           ///< the leg never ran (an earlier failure, shutdown)
  exception = 11,             ///< a leg threw; the guard caught it and reported
  no_tier = 12,               ///< this rank has no tier (capability said no)
  invalid_spec = 13,          ///< the KV spec is malformed (keys or blocks do not cover [hbm, end))
  shutdown = 14,              ///< the connector was shutting down
};

/// One rank's report on one load. Layout (24 bytes, little-endian on the wire):
///   [0,8) request id  [8,16) generation  [16,20) rank  [20] kv  [21] state  [22,24) reason
struct CompletionRecord {
  LoadKey key;
  std::uint32_t rank = 0;
  KvOutcome kv = KvOutcome::none;
  StateOutcome state = StateOutcome::none;
  Reason reason = Reason::none;
  friend bool operator==(const CompletionRecord&, const CompletionRecord&) = default;
};

/// One rank's report on one save (state store or KV save; DESIGN section 5). Layout
/// (24 bytes): [0,8) hash  [8,16) generation  [16,20) rank  [20] stored
///   [21] source_released  [22,24) reason
struct StoreRecord {
  StoreKey key;
  std::uint32_t rank = 0;
  bool stored = false;           ///< the bytes are in this rank's tier
  bool source_released = false;  ///< the gather finished: the device source may be reused
  Reason reason = Reason::none;
  friend bool operator==(const StoreRecord&, const StoreRecord&) = default;
};

static_assert(std::is_trivially_copyable_v<CompletionRecord> && sizeof(CompletionRecord) == 24);
static_assert(std::is_trivially_copyable_v<StoreRecord> && sizeof(StoreRecord) == 24);

/// The engine-side verdict on one load, after the group merged every rank's record.
struct Settlement {
  LoadKey key;
  bool ok = false;            ///< every rank's record was ok
  bool state_missed = false;  ///< some rank's tier genuinely lacked the state entry: retract the hash
  friend bool operator==(const Settlement&, const Settlement&) = default;
};

/// The engine-side verdict on one save, after the group merged every rank's record.
struct StoreSettlement {
  StoreKey key;
  bool stored = false;           ///< every rank stored: index the hash
  bool source_released = false;  ///< every rank released: the engine may free the source units
  friend bool operator==(const StoreSettlement&, const StoreSettlement&) = default;
};

}  // namespace kvfuse
