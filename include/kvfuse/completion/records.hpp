// kvfuse/completion/records.hpp — what a rank reports back: one record per load, one per save.
//
// Records are fixed-size and trivially copyable so any transport (SPSC queue, shared
// memory, RPC) can carry them. The byte layout is documented beside each struct.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
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

/// The highest Reason value this build knows. from_bytes refuses anything above it, so a
/// record from a newer peer is reported as corrupt rather than misread. Keep it last.
inline constexpr Reason last_reason = Reason::shutdown;

/// One rank's report on one load. Layout (24 bytes, little-endian on the wire):
///   [0,8) request id  [8,16) generation  [16,20) rank  [20] kv  [21] state  [22,24) reason
/// (to_bytes / completion_from_bytes below; the in-memory struct has the same offsets).
struct CompletionRecord {
  LoadKey key;
  std::uint32_t rank = 0;
  KvOutcome kv = KvOutcome::none;
  StateOutcome state = StateOutcome::none;
  Reason reason = Reason::none;
  friend bool operator==(const CompletionRecord&, const CompletionRecord&) = default;
};

/// One rank's report on one save (state store or KV save; DESIGN section 5). Layout
/// (24 bytes): [0,8) hash  [8,16) generation  [16,20) rank  [20] stored (0|1)
///   [21] source_released (0|1)  [22,24) reason  (to_bytes / store_from_bytes below).
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

/// Whether one rank's record says the load succeeded on that rank: every leg it had
/// succeeded (KV ok or absent, state restored or absent) and it had at least one leg.
/// The quorum's failure-dominant merge is "ok iff record_ok on every rank" (R4).
/// Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr bool record_ok(const CompletionRecord& r) noexcept {
  const bool kv_fine = r.kv == KvOutcome::ok || r.kv == KvOutcome::none;
  const bool state_fine = r.state == StateOutcome::restored || r.state == StateOutcome::none;
  const bool has_a_leg = r.kv != KvOutcome::none || r.state != StateOutcome::none;
  return kv_fine && state_fine && has_a_leg;
}

/// Whether one rank's record retracts the state hash: only a genuine tier miss does
/// (R2/R4). A KV failure, a transfer failure, a refusal or `none` never retracts.
/// Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr bool record_missed_state(const CompletionRecord& r) noexcept {
  return r.state == StateOutcome::missed;
}

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

// ---------------------------------------------------------------------------------------
// Wire format. Both records are 24 bytes, little-endian, no padding, no version byte: the
// layout is the one documented on each struct. Encoding is explicit byte by byte, so the
// bytes are the same on any host; on a little-endian host the compiler reduces it to moves.

/// Bytes of one encoded CompletionRecord or StoreRecord.
inline constexpr std::size_t record_wire_bytes = 24;

/// The encoded form of one record.
using RecordBytes = std::array<std::byte, record_wire_bytes>;

/// Why from_bytes refused a buffer. Every refusal is reported; no input is undefined behaviour.
enum class DecodeError : std::uint8_t {
  none = 0,
  wrong_size = 1,     ///< the buffer is not exactly record_wire_bytes long (truncated or padded)
  bad_kv = 2,         ///< byte 20 is not a KvOutcome
  bad_state = 3,      ///< byte 21 is not a StateOutcome
  bad_reason = 4,     ///< bytes [22,24) are above last_reason
  bad_bool = 5,       ///< a StoreRecord flag byte is neither 0 nor 1
};

/// The result of decoding: `record` is meaningful only when `error == DecodeError::none`.
template <class Record>
struct Decoded {
  Record record{};
  DecodeError error = DecodeError::none;
  [[nodiscard]] constexpr bool ok() const noexcept { return error == DecodeError::none; }
  constexpr explicit operator bool() const noexcept { return ok(); }
};

namespace detail {
constexpr void put_u64(std::byte* out, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xffU);
}
constexpr void put_u32(std::byte* out, std::uint32_t v) noexcept {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xffU);
}
constexpr void put_u16(std::byte* out, std::uint16_t v) noexcept {
  out[0] = static_cast<std::byte>(v & 0xffU);
  out[1] = static_cast<std::byte>((v >> 8) & 0xffU);
}
constexpr std::uint64_t get_u64(const std::byte* in) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(in[i]) << (8 * i);
  return v;
}
constexpr std::uint32_t get_u32(const std::byte* in) noexcept {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(in[i]) << (8 * i);
  return v;
}
constexpr std::uint16_t get_u16(const std::byte* in) noexcept {
  return static_cast<std::uint16_t>(static_cast<std::uint16_t>(in[0]) | (static_cast<std::uint16_t>(in[1]) << 8));
}
}  // namespace detail

/// Encodes `r` with the layout documented on CompletionRecord. Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr RecordBytes to_bytes(const CompletionRecord& r) noexcept {
  RecordBytes out{};
  detail::put_u64(out.data() + 0, r.key.request.value);
  detail::put_u64(out.data() + 8, r.key.generation.value);
  detail::put_u32(out.data() + 16, r.rank);
  out[20] = static_cast<std::byte>(r.kv);
  out[21] = static_cast<std::byte>(r.state);
  detail::put_u16(out.data() + 22, static_cast<std::uint16_t>(r.reason));
  return out;
}

/// Encodes `r` with the layout documented on StoreRecord. Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr RecordBytes to_bytes(const StoreRecord& r) noexcept {
  RecordBytes out{};
  detail::put_u64(out.data() + 0, r.key.hash.value);
  detail::put_u64(out.data() + 8, r.key.generation.value);
  detail::put_u32(out.data() + 16, r.rank);
  out[20] = static_cast<std::byte>(r.stored ? 1 : 0);
  out[21] = static_cast<std::byte>(r.source_released ? 1 : 0);
  detail::put_u16(out.data() + 22, static_cast<std::uint16_t>(r.reason));
  return out;
}

/// Decodes a CompletionRecord. Refuses (never misreads) a buffer of the wrong size or with
/// an outcome or reason value this build does not know. Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr Decoded<CompletionRecord> completion_from_bytes(std::span<const std::byte> in) noexcept {
  Decoded<CompletionRecord> d;
  if (in.size() != record_wire_bytes) {
    d.error = DecodeError::wrong_size;
    return d;
  }
  const auto kv = static_cast<std::uint8_t>(in[20]);
  const auto state = static_cast<std::uint8_t>(in[21]);
  const std::uint16_t reason = detail::get_u16(in.data() + 22);
  if (kv > static_cast<std::uint8_t>(KvOutcome::failed)) {
    d.error = DecodeError::bad_kv;
    return d;
  }
  if (state > static_cast<std::uint8_t>(StateOutcome::refused)) {
    d.error = DecodeError::bad_state;
    return d;
  }
  if (reason > static_cast<std::uint16_t>(last_reason)) {
    d.error = DecodeError::bad_reason;
    return d;
  }
  d.record.key = LoadKey{RequestId{detail::get_u64(in.data())}, Generation{detail::get_u64(in.data() + 8)}};
  d.record.rank = detail::get_u32(in.data() + 16);
  d.record.kv = static_cast<KvOutcome>(kv);
  d.record.state = static_cast<StateOutcome>(state);
  d.record.reason = static_cast<Reason>(reason);
  return d;
}

/// Decodes a StoreRecord. Refuses a buffer of the wrong size, a flag byte other than 0 or
/// 1, or an unknown reason. Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr Decoded<StoreRecord> store_from_bytes(std::span<const std::byte> in) noexcept {
  Decoded<StoreRecord> d;
  if (in.size() != record_wire_bytes) {
    d.error = DecodeError::wrong_size;
    return d;
  }
  const auto stored = static_cast<std::uint8_t>(in[20]);
  const auto released = static_cast<std::uint8_t>(in[21]);
  const std::uint16_t reason = detail::get_u16(in.data() + 22);
  if (stored > 1 || released > 1) {
    d.error = DecodeError::bad_bool;
    return d;
  }
  if (reason > static_cast<std::uint16_t>(last_reason)) {
    d.error = DecodeError::bad_reason;
    return d;
  }
  d.record.key = StoreKey{PrefixHash{detail::get_u64(in.data())}, Generation{detail::get_u64(in.data() + 8)}};
  d.record.rank = detail::get_u32(in.data() + 16);
  d.record.stored = stored == 1;
  d.record.source_released = released == 1;
  d.record.reason = static_cast<Reason>(reason);
  return d;
}

/// `from_bytes<CompletionRecord>(bytes)` / `from_bytes<StoreRecord>(bytes)`: the same two
/// decoders, chosen by type for generic transports. Thread-safe, constexpr, noexcept.
template <class Record>
  requires std::same_as<Record, CompletionRecord> || std::same_as<Record, StoreRecord>
[[nodiscard]] constexpr Decoded<Record> from_bytes(std::span<const std::byte> in) noexcept {
  if constexpr (std::same_as<Record, CompletionRecord>) {
    return completion_from_bytes(in);
  } else {
    return store_from_bytes(in);
  }
}

}  // namespace kvfuse
