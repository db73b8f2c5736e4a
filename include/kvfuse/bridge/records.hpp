// kvfuse/bridge/records.hpp — what a rank reports back: one record per load, two per save.
//
// Records are fixed-size and trivially copyable so any transport (SPSC queue, shared
// memory, RPC) can carry them. The byte layout is documented beside each struct.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/detail/enum_sentinel.hpp>
#include <kvfuse/detail/little_endian.hpp>

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

/// Why a leg did not succeed. Each leg of a record carries its own (kv_reason,
/// state_reason), so a load whose two legs failed for two reasons reports both.
enum class Reason : std::uint8_t {
  none = 0,
  kv_chunk_missing = 1,       ///< a chunk in [hbm, end) was not in the tier
  kv_transfer_failed = 2,     ///< a tier read or device copy failed on the KV leg
  state_transfer_failed = 3,  ///< a tier read or device copy failed on the state leg
  slot_out_of_range = 4,      ///< the destination slot is outside the slot pool
  grid_mismatch = 5,          ///< boundary off the checkpoint grid, or the rank's grids differ from the engine's
  kv_end_mismatch = 6,        ///< the KV end is not the chunk covering the boundary
  entry_size_mismatch = 7,    ///< the stored entry's size does not match the slot
  nonzero_hbm_floor = 8,      ///< retired: no longer sent (DSV4 loads from any floor: docs/reference.md#any-floor);
                              ///< kept so its number is never reused and an older peer's record still decodes
  sidecar_mismatch = 9,       ///< the stored entry's boundary hash or length disagrees with the spec
  leg_not_run = 10,           ///< the leg never ran (an earlier failure, or the task forgot to report it)
  exception = 11,             ///< a leg threw; the guard caught it and reported
  no_tier = 12,               ///< this rank has no tier (capability said no)
  invalid_spec = 13,          ///< the request or save is malformed (no leg at all, or keys/blocks do not cover the range)
  source_unconfirmed = 14,    ///< a save could not confirm that nothing reads its source (the device failed to synchronize)
};

/// The highest Reason value this build knows. from_bytes refuses anything above it, so a
/// record from a newer peer is reported as corrupt rather than misread. A static_assert
/// below to_string checks that it is the last named value.
inline constexpr Reason last_reason = Reason::source_unconfirmed;

/// Short, stable name of a Reason ("kv_chunk_missing", ...), for engine logs.
/// Thread-safe, constexpr, noexcept.
constexpr std::string_view to_string(Reason r) noexcept {
  switch (r) {
    case Reason::none: return "none";
    case Reason::kv_chunk_missing: return "kv_chunk_missing";
    case Reason::kv_transfer_failed: return "kv_transfer_failed";
    case Reason::state_transfer_failed: return "state_transfer_failed";
    case Reason::slot_out_of_range: return "slot_out_of_range";
    case Reason::grid_mismatch: return "grid_mismatch";
    case Reason::kv_end_mismatch: return "kv_end_mismatch";
    case Reason::entry_size_mismatch: return "entry_size_mismatch";
    case Reason::nonzero_hbm_floor: return "nonzero_hbm_floor";
    case Reason::sidecar_mismatch: return "sidecar_mismatch";
    case Reason::leg_not_run: return "leg_not_run";
    case Reason::exception: return "exception";
    case Reason::no_tier: return "no_tier";
    case Reason::invalid_spec: return "invalid_spec";
    case Reason::source_unconfirmed: return "source_unconfirmed";
  }
  return "unknown_reason";
}
static_assert(detail::is_last_named(last_reason), "last_reason is not the last Reason: move it to the new last value");

/// Which of a save's two reports a SaveRecord is (docs/reference.md#save-path). Every save yields
/// both, in this order, from every rank.
enum class SavePhase : std::uint8_t {
  released = 1,  ///< nothing on this rank reads the save's source any more: the engine may reuse it
  stored = 2,    ///< the save ended on this rank; `ok` says whether its tier holds the bytes
};

/// One rank's report on one load. In memory the struct is 32 bytes; on the wire it is
/// the 32-byte layout documented at to_bytes below.
struct CompletionRecord {
  LoadKey key;
  std::uint32_t rank = 0;
  KvOutcome kv = KvOutcome::none;
  StateOutcome state = StateOutcome::none;
  Reason kv_reason = Reason::none;     ///< why the KV leg did not succeed; none if it did or is absent
  Reason state_reason = Reason::none;  ///< why the state leg did not succeed; none if it did or is absent
  /// How far the KV leg restored contiguously from the HBM floor, in whole chunks of the
  /// spec's chunk_keys: every chunk when `kv` is ok, the leading run that reached its blocks
  /// (confirmed by a synchronize) when it failed, 0 without a KV leg. What a partly failed
  /// load can still be resumed from (salvage): never more than arrived, so 0 is always safe.
  std::uint32_t kv_restored = 0;
  friend bool operator==(const CompletionRecord&, const CompletionRecord&) = default;
};

/// One rank's report on one phase of one save (state checkpoint or KV save;
/// docs/reference.md#save-path). A rank sends two per save: `released`, then `stored`.
///   released: ok = nothing reads the source any more (false only if that could not be
///             confirmed: the source must stay pinned);
///   stored:   ok = this rank's tier holds the bytes.
struct SaveRecord {
  SaveKey key;
  std::uint32_t rank = 0;
  SavePhase phase = SavePhase::stored;
  bool ok = false;
  Reason reason = Reason::none;  ///< why ok is false; none when ok
  friend bool operator==(const SaveRecord&, const SaveRecord&) = default;
};

static_assert(std::is_trivially_copyable_v<CompletionRecord> && sizeof(CompletionRecord) == 32);
static_assert(std::is_trivially_copyable_v<SaveRecord> && sizeof(SaveRecord) == 24);

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
  /// The fewest chunks any rank restored contiguously from the HBM floor: the KV every rank
  /// holds (salvage). A rank that never reported (dead when the load was issued, or before it
  /// reported) counts as 0: its slice of the blocks may be empty.
  std::uint32_t kv_restored = 0;
  friend bool operator==(const Settlement&, const Settlement&) = default;
};

/// The engine-side verdict on one phase of one save, after the group merged every live
/// rank's record of that phase.
///   released: ok = every rank released the source: the engine may free the source units
///             (early block release, long before the store lands);
///   stored:   ok = every rank stored: a state save's hash may be indexed.
struct SaveSettlement {
  SaveKey key;
  SavePhase phase = SavePhase::stored;
  bool ok = false;
  friend bool operator==(const SaveSettlement&, const SaveSettlement&) = default;
};

// ---------------------------------------------------------------------------------------
// Wire format, version 3. Both records encode to 32 bytes, little-endian, explicit byte by
// byte (the same bytes on any host; on a little-endian host the compiler reduces it to
// moves). Version 3 added kv_restored to the load record (bytes [28,32), reserved zero in
// version 2); a version 2 record is refused by its version byte (bad_version), so an older
// rank that cannot say how far it restored is never read as one that restored nothing.
// Version 1 was a 24-byte layout with one reason per record; a v1 buffer is refused by size.
//
//   CompletionRecord                         SaveRecord
//   [0,8)   request id                       [0,8)   prefix hash
//   [8,16)  generation                       [8,16)  generation
//   [16,20) rank                             [16,20) rank
//   [20]    format version (3)               [20]    format version (3)
//   [21]    record kind (1 = load)           [21]    record kind (2 = save)
//   [22]    KvOutcome                        [22]    SavePhase
//   [23]    StateOutcome                     [23]    ok (0 | 1)
//   [24,26) kv_reason                        [24,26) reason
//   [26,28) state_reason                     [26,32) zero
//   [28,32) kv_restored (0 without a KV leg)
// Decoders refuse (never misread) a wrong size, version or kind, an unknown enum value, a
// flag other than 0 or 1, and nonzero reserved bytes.

/// Bytes of one encoded CompletionRecord or SaveRecord.
inline constexpr std::size_t record_wire_bytes = 32;

/// The wire format version this build writes and reads.
inline constexpr std::uint8_t record_format_version = 3;

/// The encoded form of one record.
using RecordBytes = std::array<std::byte, record_wire_bytes>;

/// Why a decoder refused a buffer: a record's (here) or a frame's (bridge/frames.hpp). One
/// vocabulary for every byte layout kvfuse reads, so a transport that carries both reports
/// one type. Every refusal is reported; no input is undefined behaviour. Values are stable:
/// new ones are appended.
enum class DecodeError : std::uint8_t {
  none = 0,
  wrong_size = 1,         ///< a record buffer is not exactly record_wire_bytes long (truncated, padded, or v1)
  bad_kv = 2,             ///< byte 22 of a load record is not a KvOutcome
  bad_state = 3,          ///< byte 23 of a load record is not a StateOutcome
  bad_reason = 4,         ///< a reason is above last_reason
  bad_bool = 5,           ///< a flag byte (a save record's ok, a frame's leg presence) is neither 0 nor 1
  bad_version = 6,        ///< the format version byte is not the one this build reads
  wrong_kind = 7,         ///< the kind byte names another record or frame type than the decoder's
  bad_phase = 8,          ///< byte 22 of a save record is not a SavePhase
  bad_reserved = 9,       ///< a reserved byte is not zero (a load record's kv_restored without a KV leg included)
  truncated = 10,         ///< a frame buffer ends before its header does, or before the length it declares
  trailing_bytes = 11,    ///< bytes follow a frame's last field: in the buffer past the declared length, or inside it
  frame_too_large = 12,   ///< a frame declares a length above max_frame_bytes
  fields_overrun = 13,    ///< a frame's fields, as its leg flags and counts size them, need more bytes than it declares
  too_many_chunks = 14,   ///< a frame's chunk count is above max_frame_chunks
  too_many_blocks = 15,   ///< a frame's block count is above max_frame_blocks
  unknown_kind = 16,      ///< the kind byte is no WireKind this build knows
  out_of_memory = 17,     ///< the decoded value's vectors could not be allocated (never more than the frame's own size)
};

/// Short, stable name of a DecodeError ("truncated", ...), for logs. Thread-safe, constexpr, noexcept.
constexpr std::string_view to_string(DecodeError e) noexcept {
  switch (e) {
    case DecodeError::none: return "none";
    case DecodeError::wrong_size: return "wrong_size";
    case DecodeError::bad_kv: return "bad_kv";
    case DecodeError::bad_state: return "bad_state";
    case DecodeError::bad_reason: return "bad_reason";
    case DecodeError::bad_bool: return "bad_bool";
    case DecodeError::bad_version: return "bad_version";
    case DecodeError::wrong_kind: return "wrong_kind";
    case DecodeError::bad_phase: return "bad_phase";
    case DecodeError::bad_reserved: return "bad_reserved";
    case DecodeError::truncated: return "truncated";
    case DecodeError::trailing_bytes: return "trailing_bytes";
    case DecodeError::frame_too_large: return "frame_too_large";
    case DecodeError::fields_overrun: return "fields_overrun";
    case DecodeError::too_many_chunks: return "too_many_chunks";
    case DecodeError::too_many_blocks: return "too_many_blocks";
    case DecodeError::unknown_kind: return "unknown_kind";
    case DecodeError::out_of_memory: return "out_of_memory";
  }
  return "unknown_decode_error";
}

/// The highest DecodeError value this build knows. Keep it last.
inline constexpr DecodeError last_decode_error = DecodeError::out_of_memory;

/// The result of decoding a record, a frame (bridge/frames.hpp) or a frame header: `record`
/// holds the decoded value and is meaningful only when `error == DecodeError::none`; on a
/// refusal it is value-initialised, never partly filled.
template <class Record>
struct Decoded {
  Record record{};
  DecodeError error = DecodeError::none;
  [[nodiscard]] constexpr bool ok() const noexcept { return error == DecodeError::none; }
  constexpr explicit operator bool() const noexcept { return ok(); }
};

namespace detail {
inline constexpr std::uint8_t load_record_kind = 1;
inline constexpr std::uint8_t save_record_kind = 2;

// The checks both decoders share: size, version, kind, reserved bytes from `reserved_from`.
constexpr DecodeError check_frame(std::span<const std::byte> in, std::uint8_t kind, std::size_t reserved_from) noexcept {
  if (in.size() != record_wire_bytes) return DecodeError::wrong_size;
  if (static_cast<std::uint8_t>(in[20]) != record_format_version) return DecodeError::bad_version;
  if (static_cast<std::uint8_t>(in[21]) != kind) return DecodeError::wrong_kind;
  for (std::size_t i = reserved_from; i < record_wire_bytes; ++i)
    if (in[i] != std::byte{0}) return DecodeError::bad_reserved;
  return DecodeError::none;
}
}  // namespace detail

/// Encodes `r` in wire format version 3 (see above). Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr RecordBytes to_bytes(const CompletionRecord& r) noexcept {
  RecordBytes out{};
  detail::put_le(out.data() + 0, r.key.request.value, 8);
  detail::put_le(out.data() + 8, r.key.generation.value, 8);
  detail::put_le(out.data() + 16, r.rank, 4);
  out[20] = static_cast<std::byte>(record_format_version);
  out[21] = static_cast<std::byte>(detail::load_record_kind);
  out[22] = static_cast<std::byte>(r.kv);
  out[23] = static_cast<std::byte>(r.state);
  detail::put_le(out.data() + 24, static_cast<std::uint16_t>(r.kv_reason), 2);
  detail::put_le(out.data() + 26, static_cast<std::uint16_t>(r.state_reason), 2);
  detail::put_le(out.data() + 28, r.kv_restored, 4);
  return out;
}

/// Encodes `r` in wire format version 3 (see above). Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr RecordBytes to_bytes(const SaveRecord& r) noexcept {
  RecordBytes out{};
  detail::put_le(out.data() + 0, r.key.hash.value, 8);
  detail::put_le(out.data() + 8, r.key.generation.value, 8);
  detail::put_le(out.data() + 16, r.rank, 4);
  out[20] = static_cast<std::byte>(record_format_version);
  out[21] = static_cast<std::byte>(detail::save_record_kind);
  out[22] = static_cast<std::byte>(r.phase);
  out[23] = static_cast<std::byte>(r.ok ? 1 : 0);
  detail::put_le(out.data() + 24, static_cast<std::uint16_t>(r.reason), 2);
  return out;
}

/// Decodes a CompletionRecord. Refuses (never misreads) anything but a well-formed v3 load
/// record. Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr Decoded<CompletionRecord> completion_from_bytes(std::span<const std::byte> in) noexcept {
  Decoded<CompletionRecord> d;
  if ((d.error = detail::check_frame(in, detail::load_record_kind, record_wire_bytes)) != DecodeError::none) return d;
  const auto kv = static_cast<std::uint8_t>(in[22]);
  const auto state = static_cast<std::uint8_t>(in[23]);
  const auto kv_reason = detail::get_le(in.data() + 24, 2);
  const auto state_reason = detail::get_le(in.data() + 26, 2);
  if (kv > static_cast<std::uint8_t>(KvOutcome::failed)) d.error = DecodeError::bad_kv;
  else if (state > static_cast<std::uint8_t>(StateOutcome::refused)) d.error = DecodeError::bad_state;
  else if (kv_reason > static_cast<std::uint16_t>(last_reason) || state_reason > static_cast<std::uint16_t>(last_reason))
    d.error = DecodeError::bad_reason;
  else if (kv == static_cast<std::uint8_t>(KvOutcome::none) && detail::get_le(in.data() + 28, 4) != 0)
    d.error = DecodeError::bad_reserved;  // no KV leg, so nothing restored
  if (!d.ok()) return d;
  d.record.key = LoadKey{RequestId{detail::get_le(in.data(), 8)}, Generation{detail::get_le(in.data() + 8, 8)}};
  d.record.rank = static_cast<std::uint32_t>(detail::get_le(in.data() + 16, 4));
  d.record.kv = static_cast<KvOutcome>(kv);
  d.record.state = static_cast<StateOutcome>(state);
  d.record.kv_reason = static_cast<Reason>(kv_reason);
  d.record.state_reason = static_cast<Reason>(state_reason);
  d.record.kv_restored = static_cast<std::uint32_t>(detail::get_le(in.data() + 28, 4));
  return d;
}

/// Decodes a SaveRecord. Refuses (never misreads) anything but a well-formed v3 save
/// record. Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr Decoded<SaveRecord> save_from_bytes(std::span<const std::byte> in) noexcept {
  Decoded<SaveRecord> d;
  if ((d.error = detail::check_frame(in, detail::save_record_kind, 26)) != DecodeError::none) return d;
  const auto phase = static_cast<std::uint8_t>(in[22]);
  const auto ok = static_cast<std::uint8_t>(in[23]);
  const auto reason = detail::get_le(in.data() + 24, 2);
  if (phase != static_cast<std::uint8_t>(SavePhase::released) && phase != static_cast<std::uint8_t>(SavePhase::stored))
    d.error = DecodeError::bad_phase;
  else if (ok > 1) d.error = DecodeError::bad_bool;
  else if (reason > static_cast<std::uint16_t>(last_reason)) d.error = DecodeError::bad_reason;
  if (!d.ok()) return d;
  d.record.key = SaveKey{PrefixHash{detail::get_le(in.data(), 8)}, Generation{detail::get_le(in.data() + 8, 8)}};
  d.record.rank = static_cast<std::uint32_t>(detail::get_le(in.data() + 16, 4));
  d.record.phase = static_cast<SavePhase>(phase);
  d.record.ok = ok == 1;
  d.record.reason = static_cast<Reason>(reason);
  return d;
}

/// `from_bytes<CompletionRecord>(bytes)` / `from_bytes<SaveRecord>(bytes)`: the same two
/// decoders, chosen by type for generic transports. Thread-safe, constexpr, noexcept.
template <class Record>
  requires std::same_as<Record, CompletionRecord> || std::same_as<Record, SaveRecord>
[[nodiscard]] constexpr Decoded<Record> from_bytes(std::span<const std::byte> in) noexcept {
  if constexpr (std::same_as<Record, CompletionRecord>) {
    return completion_from_bytes(in);
  } else {
    return save_from_bytes(in);
  }
}

}  // namespace kvfuse
