// kvfuse/bridge/frames.hpp — LoadRequest, KvSave and StateSave as bytes: the versioned frames
// that carry what the engine sends a rank across a process boundary. The records that come
// back have their own fixed 32-byte layout (bridge/records.hpp); both share one kind space
// (WireKind) and one refusal vocabulary (DecodeError).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <kvfuse/bridge/frame_format.hpp>
#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/bridge/save_request.hpp>

namespace kvfuse {

// ---------------------------------------------------------------------------------------
// Frames, format version 1. Every integer little-endian, written byte by byte (the same bytes
// on any host, at any alignment). Bytes [0,8) are the header (bridge/frame_format.hpp:
// version, kind, zero, length). Offsets marked + are from the start of that part.
//
//   LoadRequest (kind 3), 28 bytes + its legs      KvSave (kind 4), 32 + 8C + 4N bytes
//   [8,16)   request id                            [8,16)   key hash
//   [16,24)  generation                            [16,24)  generation
//   [24]     state leg present (0 | 1)             [24,28)  chunk count C
//   [25]     KV leg present (0 | 1)                [28,32)  block count N
//   [26,28)  zero                                  [32, 32+8C)       chunk keys
//   then the state leg, when present (28 bytes):   [32+8C, +4N)      block ids
//   [+0,8)   boundary_tokens
//   [+8,16)  boundary_hash                         StateSave (kind 5), 36 bytes
//   [+16,20) slot                                  [8,16)   key hash
//   [+20,24) block_tokens                          [16,24)  generation
//   [+24,28) chunk_tokens                          [24,28)  source slot
//   then the KV leg, when present:                 [28,36)  boundary_tokens
//   [+0,8)   hbm
//   [+8,16)  end
//   [+16,20) chunk count C
//   [+20,24) block count N
//   [+24, +24+8C)    chunk keys
//   [+24+8C, +4N)    block ids
//
// The fixed parts come first and the arrays last, so no fixed field's offset depends on a
// count. Decoders refuse (never misread) a short buffer, another version, an unknown or
// other kind, a nonzero reserved byte, a length above max_frame_bytes, a leg flag other than
// 0 or 1, a count above its limit, fields that overrun the declared length, and bytes after
// the last field. What remains is a bijection: a frame that decodes re-encodes to the same
// bytes.
//
// The wire checks form, not meaning. A LoadRequest with neither leg, a KvSpec whose keys do
// not cover [hbm, end), a StateSpec with a zero grid, a KvSave whose block count is not a
// whole number of chunks: each is a value the types can hold and the engine can hand a rank
// in process, and the rank refuses it with a Reason (invalid_spec, grid_mismatch, R11) in a
// record the engine settles. A transport carries them unchanged, so a rank process answers
// exactly what a rank thread would, and the quorum still hears from every rank; refusing them
// on the wire would turn a refusal the engine settles into a frame nobody answers.
//
// No checksum: a frame crosses shared memory or a local socket, not a lossy link, and the
// decoder's job is to refuse what is malformed, which a checksum cannot add to.
/// The length of `request`'s frame, or too_many_chunks / too_many_blocks when its KV leg
/// holds more than the format carries. Thread-safe, constexpr, noexcept, no allocation.
[[nodiscard]] constexpr Encoded frame_size(const LoadRequest& request) noexcept {
  Encoded size{detail::load_request_fixed_bytes + (request.state ? detail::state_leg_bytes : 0), EncodeError::none};
  if (request.kv) {
    const Encoded kv =
        detail::sized_arrays(detail::kv_leg_fixed_bytes, request.kv->chunk_keys.size(), request.kv->blocks.size());
    if (!kv) return kv;
    size.length += kv.length;
  }
  return size;
}

/// The length of `save`'s frame, or too_many_chunks / too_many_blocks. Thread-safe,
/// constexpr, noexcept, no allocation.
[[nodiscard]] constexpr Encoded frame_size(const KvSave& save) noexcept {
  return detail::sized_arrays(detail::kv_save_fixed_bytes, save.chunk_keys.size(), save.blocks.size());
}

/// The length of a StateSave's frame: always 36 bytes. Thread-safe, constexpr, noexcept.
[[nodiscard]] constexpr Encoded frame_size(const StateSave&) noexcept {
  return Encoded{detail::state_save_bytes, EncodeError::none};
}

/// Writes `request`'s frame (version 1, kind 3; layout above) to the front of `out` and
/// returns its length. Refuses, writing nothing, a KV leg over the limits (too_many_chunks,
/// too_many_blocks) or an `out` shorter than the frame (buffer_too_small, with the length it
/// needs). Every LoadRequest within the limits encodes, one with neither leg included.
/// Thread-safe, constexpr, noexcept, no allocation.
[[nodiscard]] constexpr Encoded to_bytes(const LoadRequest& request, std::span<std::byte> out) noexcept {
  const Encoded e = detail::fit(frame_size(request), out);
  if (!e) return e;
  detail::FrameWriter w{out.data()};
  detail::put_frame_header(w, WireKind::load_request, e.length);
  w.put(request.key.request.value, 8);
  w.put(request.key.generation.value, 8);
  w.put(request.state ? 1 : 0, 1);
  w.put(request.kv ? 1 : 0, 1);
  w.put(0, 2);
  if (const auto& s = request.state) {
    w.put(s->boundary_tokens, 8);
    w.put(s->boundary_hash.value, 8);
    w.put(s->slot.value, 4);
    w.put(s->block_tokens, 4);
    w.put(s->chunk_tokens, 4);
  }
  if (const auto& kv = request.kv) {
    w.put(kv->hbm, 8);
    w.put(kv->end, 8);
    w.put(kv->chunk_keys.size(), 4);
    w.put(kv->blocks.size(), 4);
    w.put_arrays(kv->chunk_keys, kv->blocks);
  }
  return e;
}

/// Writes `save`'s frame (version 1, kind 4) to the front of `out` and returns its length;
/// refuses as to_bytes(LoadRequest) does. Thread-safe, constexpr, noexcept, no allocation.
[[nodiscard]] constexpr Encoded to_bytes(const KvSave& save, std::span<std::byte> out) noexcept {
  const Encoded e = detail::fit(frame_size(save), out);
  if (!e) return e;
  detail::FrameWriter w{out.data()};
  detail::put_frame_header(w, WireKind::kv_save, e.length);
  w.put(save.key.hash.value, 8);
  w.put(save.key.generation.value, 8);
  w.put(save.chunk_keys.size(), 4);
  w.put(save.blocks.size(), 4);
  w.put_arrays(save.chunk_keys, save.blocks);
  return e;
}

/// Writes `save`'s frame (version 1, kind 5, 36 bytes) to the front of `out`; refuses only an
/// `out` shorter than 36 bytes. Thread-safe, constexpr, noexcept, no allocation.
[[nodiscard]] constexpr Encoded to_bytes(const StateSave& save, std::span<std::byte> out) noexcept {
  const Encoded e = detail::fit(frame_size(save), out);
  if (!e) return e;
  detail::FrameWriter w{out.data()};
  detail::put_frame_header(w, WireKind::state_save, e.length);
  w.put(save.key.hash.value, 8);
  w.put(save.key.generation.value, 8);
  w.put(save.source.value, 4);
  w.put(save.boundary_tokens, 8);
  return e;
}

/// Decodes one LoadRequest frame that fills `in` exactly. Refuses (never misreads) anything
/// else with a named DecodeError: see the layout above. Allocates the KV leg's two vectors,
/// never more than the frame's own size; a failed allocation is out_of_memory. Thread-safe,
/// noexcept.
[[nodiscard]] inline Decoded<LoadRequest> load_request_from_bytes(std::span<const std::byte> in) noexcept {
  Decoded<LoadRequest> d;
  if ((d.error = detail::open_frame(in, WireKind::load_request)) != DecodeError::none) return d;
  if (in.size() < detail::load_request_fixed_bytes) {
    d.error = DecodeError::fields_overrun;
    return d;
  }
  detail::FrameReader r{in.data() + frame_header_bytes};
  const LoadKey key{RequestId{r.get(8)}, Generation{r.get(8)}};
  const auto has_state = r.get(1);
  const auto has_kv = r.get(1);
  const auto reserved = r.get(2);
  if (has_state > 1 || has_kv > 1) d.error = DecodeError::bad_bool;
  else if (reserved != 0) d.error = DecodeError::bad_reserved;
  if (!d.ok()) return d;
  const std::size_t kv_at = detail::load_request_fixed_bytes + (has_state ? detail::state_leg_bytes : 0);
  if (!has_kv) {
    d.error = detail::check_fixed(in.size(), kv_at);
  } else if (in.size() < kv_at + detail::kv_leg_fixed_bytes) {
    d.error = DecodeError::fields_overrun;
  } else {
    detail::FrameReader counts{in.data() + kv_at + 16};
    const std::uint32_t chunks = counts.get32();
    const std::uint32_t blocks = counts.get32();
    d.error = detail::check_arrays(in.size(), kv_at + detail::kv_leg_fixed_bytes, chunks, blocks);
  }
  if (!d.ok()) return d;
  return detail::decode_allocating<LoadRequest>([&](Decoded<LoadRequest>& out) {
    out.record.key = key;
    if (has_state) {
      StateSpec s;
      s.boundary_tokens = r.get(8);
      s.boundary_hash = PrefixHash{r.get(8)};
      s.slot = SlotId{r.get32()};
      s.block_tokens = r.get32();
      s.chunk_tokens = r.get32();
      out.record.state = s;
    }
    if (has_kv) {
      KvSpec& kv = out.record.kv.emplace();
      kv.hbm = r.get(8);
      kv.end = r.get(8);
      const std::uint32_t chunks = r.get32();
      const std::uint32_t blocks = r.get32();
      r.get_arrays(chunks, blocks, kv.chunk_keys, kv.blocks);
    }
  });
}

/// Decodes one KvSave frame that fills `in` exactly; refuses as load_request_from_bytes does.
/// Allocates the two vectors, never more than the frame's own size. Thread-safe, noexcept.
[[nodiscard]] inline Decoded<KvSave> kv_save_from_bytes(std::span<const std::byte> in) noexcept {
  Decoded<KvSave> d;
  if ((d.error = detail::open_frame(in, WireKind::kv_save)) != DecodeError::none) return d;
  if (in.size() < detail::kv_save_fixed_bytes) {
    d.error = DecodeError::fields_overrun;
    return d;
  }
  detail::FrameReader r{in.data() + frame_header_bytes};
  const SaveKey key{PrefixHash{r.get(8)}, Generation{r.get(8)}};
  const std::uint32_t chunks = r.get32();
  const std::uint32_t blocks = r.get32();
  if ((d.error = detail::check_arrays(in.size(), detail::kv_save_fixed_bytes, chunks, blocks)) != DecodeError::none)
    return d;
  return detail::decode_allocating<KvSave>([&](Decoded<KvSave>& out) {
    out.record.key = key;
    r.get_arrays(chunks, blocks, out.record.chunk_keys, out.record.blocks);
  });
}

/// Decodes one StateSave frame that fills `in` exactly (36 bytes); refuses as
/// load_request_from_bytes does. Thread-safe, constexpr, noexcept, no allocation.
[[nodiscard]] constexpr Decoded<StateSave> state_save_from_bytes(std::span<const std::byte> in) noexcept {
  Decoded<StateSave> d;
  if ((d.error = detail::open_frame(in, WireKind::state_save)) != DecodeError::none) return d;
  if ((d.error = detail::check_fixed(in.size(), detail::state_save_bytes)) != DecodeError::none) return d;
  detail::FrameReader r{in.data() + frame_header_bytes};
  d.record.key = SaveKey{PrefixHash{r.get(8)}, Generation{r.get(8)}};
  d.record.source = SlotId{r.get32()};
  d.record.boundary_tokens = r.get(8);
  return d;
}

/// `from_bytes<LoadRequest>(bytes)`, `from_bytes<KvSave>(bytes)`, `from_bytes<StateSave>(bytes)`:
/// the three frame decoders, chosen by type for generic transports (the records' from_bytes
/// takes the record types). Thread-safe, noexcept.
template <class Frame>
  requires std::same_as<Frame, LoadRequest> || std::same_as<Frame, KvSave> || std::same_as<Frame, StateSave>
[[nodiscard]] Decoded<Frame> from_bytes(std::span<const std::byte> in) noexcept {
  if constexpr (std::same_as<Frame, LoadRequest>) {
    return load_request_from_bytes(in);
  } else if constexpr (std::same_as<Frame, KvSave>) {
    return kv_save_from_bytes(in);
  } else {
    return state_save_from_bytes(in);
  }
}

}  // namespace kvfuse
