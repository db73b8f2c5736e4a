// stream_blob.hpp — a llama-server slot's sequence blob to and from the one-stream form the
// codec (kvfuse/llama/blob_codec.hpp) reads and writes.
//
// llama-server with --parallel N and no --kv-unified gives each slot a KV stream of its own
// (n_stream = N, seq_id = stream = slot id). llama_state_seq_get_data then writes the stream
// count N, and for each stream its cell count followed, for the slot's stream only, by that
// stream's cells and rows: every other stream writes a bare zero. The codec's grammar is
// that of a one-sequence, one-stream context (state_blob.hpp): the same bytes with the count
// 1 and without the zeros. So a slot's blob is cut down to that form before the codec reads
// it, and a rebuilt blob is padded back before llama_state_seq_set_data reads it; the rows
// are never touched. The recurrent section of a hybrid model (kimi-k3) has no streams and
// follows unchanged. deepseek4's blob carries stream counts in several sections; only its
// one-stream form is supported (the backend serves deepseek4 with --parallel 1 or
// --kv-unified, and says so otherwise).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <kvfuse/error.hpp>
#include <kvfuse/llama/state_blob.hpp>

namespace kvfuse::llama_server {

/// Where a slot's sequence lives in the context's KV cache: `streams` streams, the slot's is
/// `stream`. Plain data.
struct StreamPlace {
  std::uint32_t streams = 1;
  std::uint32_t stream = 0;
};

namespace detail {

inline std::uint32_t u32_at(std::span<const std::uint8_t> b, std::size_t at) {
  if (at + 4 > b.size()) throw Error(ErrorCode::corrupt_data, "a slot blob ends at byte " + std::to_string(b.size()) +
                                                                  " inside its stream counts");
  std::uint32_t v = 0;
  std::memcpy(&v, b.data() + at, 4);
  return v;
}

inline void put_u32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
  out.insert(out.end(), p, p + 4);
}

}  // namespace detail

/// The one-stream form of `blob`, a FULL (or, with `partial`, PARTIAL_ONLY) blob of a slot
/// placed at `place`, for a model of `layout`. Throws Error(corrupt_data) when the blob does
/// not have the stream structure `place` says (another stream holds cells, a count is torn).
/// Any thread.
inline std::vector<std::uint8_t> one_stream(const llama::BlobLayout& layout, std::span<const std::uint8_t> blob,
                                            StreamPlace place, bool partial = false) {
  if (place.streams == 1) return {blob.begin(), blob.end()};
  if (partial && layout.family == llama::BlobFamily::hybrid) return {blob.begin(), blob.end()};  // recurrent only: no streams
  if (layout.family == llama::BlobFamily::deepseek4)
    throw Error(ErrorCode::corrupt_data, "a deepseek4 blob of " + std::to_string(place.streams) +
                                             " streams: only the one-stream form is supported");
  constexpr std::size_t header = 8;  // magic, seq_id
  if (detail::u32_at(blob, header) != place.streams)
    throw Error(ErrorCode::corrupt_data, "a slot blob names " + std::to_string(detail::u32_at(blob, header)) +
                                             " streams, the context has " + std::to_string(place.streams));
  std::size_t at = header + 4;
  for (std::uint32_t s = 0; s < place.stream; ++s, at += 4)
    if (detail::u32_at(blob, at) != 0)
      throw Error(ErrorCode::corrupt_data, "stream " + std::to_string(s) + " of another slot holds cells in this slot's blob");
  std::vector<std::uint8_t> out(blob.begin(), blob.begin() + header);
  detail::put_u32(out, 1);
  const std::size_t section_begin = at;
  // The stream's section, measured by reading it (the codec's own reader).
  std::vector<std::uint8_t> probe(out);
  probe.insert(probe.end(), blob.begin() + static_cast<std::ptrdiff_t>(section_begin), blob.end());
  llama::detail::Reader r(probe);
  r.expect(llama::detail::sequence_magic, "the sequence magic");
  (void)r.get<std::int32_t>();
  const auto value_runs = static_cast<std::uint32_t>(layout.runs.size()) - layout.key_layers;
  (void)llama::detail::read_kv_section(r, value_runs, false);
  const std::size_t section_end = section_begin + (r.offset() - out.size());
  out.insert(out.end(), blob.begin() + static_cast<std::ptrdiff_t>(section_begin),
             blob.begin() + static_cast<std::ptrdiff_t>(section_end));
  at = section_end;
  for (std::uint32_t s = place.stream + 1; s < place.streams; ++s, at += 4)
    if (detail::u32_at(blob, at) != 0)
      throw Error(ErrorCode::corrupt_data, "stream " + std::to_string(s) + " of another slot holds cells in this slot's blob");
  out.insert(out.end(), blob.begin() + static_cast<std::ptrdiff_t>(at), blob.end());  // hybrid: the recurrent section
  return out;
}

/// The blob llama_state_seq_set_data reads for a slot at `place`, from a one-stream blob the
/// codec wrote (taken: with one stream it is that blob, not a copy). Throws
/// Error(corrupt_data) for a blob that is not one-stream, or for a deepseek4 blob and several
/// streams. Any thread.
inline std::vector<std::uint8_t> into_stream(const llama::BlobLayout& layout, std::vector<std::uint8_t>&& one,
                                             StreamPlace place) {
  if (place.streams == 1) return std::move(one);
  if (layout.family == llama::BlobFamily::deepseek4)
    throw Error(ErrorCode::corrupt_data, "a deepseek4 blob cannot be placed in " + std::to_string(place.streams) + " streams");
  constexpr std::size_t header = 8;
  if (detail::u32_at(one, header) != 1) throw Error(ErrorCode::corrupt_data, "a rebuilt blob is not in one-stream form");
  llama::detail::Reader r(one);
  r.expect(llama::detail::sequence_magic, "the sequence magic");
  (void)r.get<std::int32_t>();
  const auto value_runs = static_cast<std::uint32_t>(layout.runs.size()) - layout.key_layers;
  (void)llama::detail::read_kv_section(r, value_runs, false);
  const std::size_t section_end = r.offset();
  std::vector<std::uint8_t> out(one.begin(), one.begin() + header);
  out.reserve(one.size() + 4 * place.streams);
  detail::put_u32(out, place.streams);
  for (std::uint32_t s = 0; s < place.stream; ++s) detail::put_u32(out, 0);
  out.insert(out.end(), one.begin() + header + 4, one.begin() + static_cast<std::ptrdiff_t>(section_end));
  for (std::uint32_t s = place.stream + 1; s < place.streams; ++s) detail::put_u32(out, 0);
  out.insert(out.end(), one.begin() + static_cast<std::ptrdiff_t>(section_end), one.end());
  return out;
}

}  // namespace kvfuse::llama_server
