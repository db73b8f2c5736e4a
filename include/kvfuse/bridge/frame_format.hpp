// kvfuse/bridge/frame_format.hpp — what every frame shares: the 8-byte header, the kind
// space (WireKind) shared with the records, the format version, the size limits, the result
// types of encoding, and the byte cursors the codecs of bridge/frames.hpp are built from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/detail/little_endian.hpp>

namespace kvfuse {

// ---------------------------------------------------------------------------------------
// Frame header, format version 1: the first 8 bytes of every frame. Integers little-endian,
// written byte by byte (the same bytes on any host, at any alignment). What follows the
// header, kind by kind, is laid out in bridge/frames.hpp.
//
//   [0]     frame format version (1)
//   [1]     kind: 3 load request, 4 KV save, 5 state save (WireKind)
//   [2,4)   zero
//   [4,8)   frame length in bytes, this header included
//
// read_frame_header and every frame decoder refuse, in this order: fewer than 8 bytes,
// another version, a kind outside WireKind or not theirs, a nonzero reserved byte, a length
// below 8 or above max_frame_bytes.

/// What a buffer on the wire is. One kind space for everything kvfuse puts on the wire: the
/// records (bridge/records.hpp, kind at their byte 21, unframed) and the frames
/// (bridge/frames.hpp, kind at byte 1), so a buffer read as the wrong type is refused as wrong_kind, never misread.
/// Values are stable.
enum class WireKind : std::uint8_t {
  completion_record = 1,  ///< a CompletionRecord (32 bytes, no frame header)
  save_record = 2,        ///< a SaveRecord (32 bytes, no frame header)
  load_request = 3,       ///< a LoadRequest frame
  kv_save = 4,            ///< a KvSave frame
  state_save = 5,         ///< a StateSave frame
};

static_assert(static_cast<std::uint8_t>(WireKind::completion_record) == detail::load_record_kind);
static_assert(static_cast<std::uint8_t>(WireKind::save_record) == detail::save_record_kind);

/// The frame format version this build writes and reads. A layout change bumps it.
inline constexpr std::uint8_t frame_format_version = 1;

/// Bytes of the header every frame starts with.
inline constexpr std::size_t frame_header_bytes = 8;

/// Most chunk keys one frame carries (a KvSpec's or a KvSave's): 2^18. A KV range of 2^18
/// chunks is 64 M tokens at 256-token chunks, or 4 M tokens at 16-token chunks; a real
/// engine's load or save stays far below it. With max_frame_blocks it caps a frame at about
/// 3 MiB, so a transport can size its buffers for the largest frame.
inline constexpr std::size_t max_frame_chunks = std::size_t{1} << 18;

/// Most block ids one frame carries: 2^18. A 1 M-token prompt at 16-token blocks is 65,536
/// blocks; 2^18 leaves room for 4 M tokens at 16-token blocks, or 1 M tokens at 4-token ones.
inline constexpr std::size_t max_frame_blocks = std::size_t{1} << 18;

namespace detail {
// The sizes of the parts of each frame's body (layout: bridge/frames.hpp), here because
// max_frame_bytes is made of them.
inline constexpr std::size_t chunk_key_bytes = 8;
inline constexpr std::size_t block_id_bytes = 4;
inline constexpr std::size_t load_request_fixed_bytes = 28;
inline constexpr std::size_t state_leg_bytes = 28;
inline constexpr std::size_t kv_leg_fixed_bytes = 24;
inline constexpr std::size_t kv_save_fixed_bytes = 32;
inline constexpr std::size_t state_save_bytes = 36;

constexpr std::size_t array_bytes(std::size_t chunks, std::size_t blocks) noexcept {
  return chunks * chunk_key_bytes + blocks * block_id_bytes;
}
}  // namespace detail

/// The longest frame this build writes or reads: a joint LoadRequest carrying
/// max_frame_chunks keys and max_frame_blocks blocks, 3 MiB + 80 bytes. Decoders refuse a
/// declared length above it before reading further.
inline constexpr std::size_t max_frame_bytes = detail::load_request_fixed_bytes + detail::state_leg_bytes +
                                               detail::kv_leg_fixed_bytes +
                                               detail::array_bytes(max_frame_chunks, max_frame_blocks);
static_assert(max_frame_bytes >= detail::kv_save_fixed_bytes + detail::array_bytes(max_frame_chunks, max_frame_blocks));
static_assert(max_frame_bytes <= 0xffffffffU, "the length field is 32 bits");

/// Why an encoder refused a value. Values are stable.
enum class EncodeError : std::uint8_t {
  none = 0,
  too_many_chunks = 1,   ///< more than max_frame_chunks chunk keys
  too_many_blocks = 2,   ///< more than max_frame_blocks block ids
  buffer_too_small = 3,  ///< the output buffer is shorter than the frame; Encoded::length says how long it must be
};

/// Short, stable name of an EncodeError, for logs. Thread-safe, constexpr, noexcept.
constexpr std::string_view to_string(EncodeError e) noexcept {
  switch (e) {
    case EncodeError::none: return "none";
    case EncodeError::too_many_chunks: return "too_many_chunks";
    case EncodeError::too_many_blocks: return "too_many_blocks";
    case EncodeError::buffer_too_small: return "buffer_too_small";
  }
  return "unknown_encode_error";
}

/// The result of sizing or encoding a frame: `length` is the frame's length in bytes when
/// `error` is none or buffer_too_small, and 0 when a count is over its limit.
struct Encoded {
  std::size_t length = 0;
  EncodeError error = EncodeError::none;
  [[nodiscard]] constexpr bool ok() const noexcept { return error == EncodeError::none; }
  constexpr explicit operator bool() const noexcept { return ok(); }
  friend bool operator==(const Encoded&, const Encoded&) = default;
};

/// What a frame's header says: its kind and its declared length (header included). A stream
/// transport reads it to learn how many bytes the frame takes, then hands exactly those
/// bytes to the decoder of that kind.
struct FrameHeader {
  WireKind kind = WireKind::load_request;
  std::uint32_t length = 0;
  friend bool operator==(const FrameHeader&, const FrameHeader&) = default;
};

namespace detail {

// A cursor over an output buffer the caller sized: every put stays inside it.
struct FrameWriter {
  std::byte* at;
  constexpr void put(std::uint64_t v, int bytes) noexcept {
    put_le(at, v, bytes);
    at += bytes;
  }
  constexpr void put_arrays(const std::vector<PrefixHash>& keys, const std::vector<BlockId>& blocks) noexcept {
    for (PrefixHash k : keys) put(k.value, static_cast<int>(chunk_key_bytes));
    for (BlockId b : blocks) put(b.value, static_cast<int>(block_id_bytes));
  }
};

// A cursor over an input the decoder already proved long enough for every get.
struct FrameReader {
  const std::byte* at;
  constexpr std::uint64_t get(int bytes) noexcept {
    const std::uint64_t v = get_le(at, bytes);
    at += bytes;
    return v;
  }
  constexpr std::uint32_t get32() noexcept { return static_cast<std::uint32_t>(get(4)); }
  // Fills the two arrays; the caller checked both counts against their limits and the frame.
  void get_arrays(std::uint32_t chunks, std::uint32_t blocks, std::vector<PrefixHash>& keys,
                  std::vector<BlockId>& ids) {
    keys.reserve(chunks);
    ids.reserve(blocks);
    for (std::uint32_t i = 0; i < chunks; ++i) keys.push_back(PrefixHash{get(static_cast<int>(chunk_key_bytes))});
    for (std::uint32_t i = 0; i < blocks; ++i) ids.push_back(BlockId{get32()});
  }
};

// The bytes of a KV part with these arrays, or a refusal if a count is over its limit.
constexpr Encoded sized_arrays(std::size_t fixed, std::size_t chunks, std::size_t blocks) noexcept {
  if (chunks > max_frame_chunks) return Encoded{0, EncodeError::too_many_chunks};
  if (blocks > max_frame_blocks) return Encoded{0, EncodeError::too_many_blocks};
  return Encoded{fixed + array_bytes(chunks, blocks), EncodeError::none};
}

constexpr void put_frame_header(FrameWriter& w, WireKind kind, std::size_t length) noexcept {
  w.put(frame_format_version, 1);
  w.put(static_cast<std::uint8_t>(kind), 1);
  w.put(0, 2);
  w.put(length, 4);
}

// Sizes the frame, then checks the buffer: the one prologue of every encoder.
constexpr Encoded fit(Encoded size, std::span<std::byte> out) noexcept {
  if (size.ok() && out.size() < size.length) size.error = EncodeError::buffer_too_small;
  return size;
}

// Whether the counts' arrays exactly fill the frame after `fixed` bytes: the one check that
// ties counts to the declared length, for both frames that carry arrays.
constexpr DecodeError check_arrays(std::size_t length, std::size_t fixed, std::uint32_t chunks,
                                   std::uint32_t blocks) noexcept {
  if (chunks > max_frame_chunks) return DecodeError::too_many_chunks;
  if (blocks > max_frame_blocks) return DecodeError::too_many_blocks;
  const std::size_t needed = fixed + array_bytes(chunks, blocks);
  if (needed > length) return DecodeError::fields_overrun;
  if (needed < length) return DecodeError::trailing_bytes;
  return DecodeError::none;
}

constexpr DecodeError check_fixed(std::size_t length, std::size_t fixed) noexcept {
  if (fixed > length) return DecodeError::fields_overrun;
  if (fixed < length) return DecodeError::trailing_bytes;
  return DecodeError::none;
}

}  // namespace detail

namespace detail {

// The header's checks, in their documented order. `expected` is the kind a decoder wants, or
// empty for any frame kind.
constexpr Decoded<FrameHeader> check_header(std::span<const std::byte> in, std::optional<WireKind> expected) noexcept {
  Decoded<FrameHeader> d;
  if (in.size() < frame_header_bytes) {
    d.error = DecodeError::truncated;
    return d;
  }
  FrameReader r{in.data()};
  const auto version = r.get(1);
  const auto kind = r.get(1);
  const auto reserved = r.get(2);
  const auto length = r.get(4);
  const bool frame_kind = kind >= static_cast<std::uint8_t>(WireKind::load_request);
  if (version != frame_format_version) d.error = DecodeError::bad_version;
  else if (kind == 0 || kind > static_cast<std::uint8_t>(WireKind::state_save)) d.error = DecodeError::unknown_kind;
  else if (expected ? kind != static_cast<std::uint8_t>(*expected) : !frame_kind) d.error = DecodeError::wrong_kind;
  else if (reserved != 0) d.error = DecodeError::bad_reserved;
  else if (length < frame_header_bytes) d.error = DecodeError::fields_overrun;
  else if (length > max_frame_bytes) d.error = DecodeError::frame_too_large;
  if (!d.ok()) return d;
  d.record = FrameHeader{static_cast<WireKind>(kind), static_cast<std::uint32_t>(length)};
  return d;
}

// The checks every frame decoder starts with: a sound header of `kind` whose declared length
// is exactly the buffer's.
constexpr DecodeError open_frame(std::span<const std::byte> in, WireKind kind) noexcept {
  const Decoded<FrameHeader> h = check_header(in, kind);
  if (!h) return h.error;
  if (in.size() < h.record.length) return DecodeError::truncated;
  if (in.size() > h.record.length) return DecodeError::trailing_bytes;
  return DecodeError::none;
}

}  // namespace detail

/// Reads and checks the header at the front of `in`, which may hold more than one frame.
/// Refuses, in this order: fewer than frame_header_bytes (truncated), another version
/// (bad_version), a kind outside WireKind (unknown_kind) or a record kind (wrong_kind:
/// records are not framed), a nonzero reserved byte (bad_reserved), a length below the
/// header's own (fields_overrun) or above max_frame_bytes (frame_too_large). The length is
/// not checked against `in`: the decoders do that. Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr Decoded<FrameHeader> read_frame_header(std::span<const std::byte> in) noexcept {
  return detail::check_header(in, std::nullopt);
}

namespace detail {

// Every decoder's allocation happens in `fill`; a failed allocation is a refusal.
template <class Value, class Fill>
Decoded<Value> decode_allocating(Fill fill) noexcept {
  try {
    Decoded<Value> d;
    fill(d);
    return d;
  } catch (const std::bad_alloc&) {
    Decoded<Value> d;
    d.error = DecodeError::out_of_memory;
    return d;
  }
}

}  // namespace detail

}  // namespace kvfuse
