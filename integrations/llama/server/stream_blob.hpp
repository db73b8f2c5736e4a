// stream_blob.hpp — a llama-server slot's sequence blob to and from the one-stream form the
// codec (kvfuse/llama/blob_codec.hpp) reads and writes.
//
// llama-server with --parallel N and no --kv-unified gives each slot a KV stream of its own
// (n_stream = N, seq_id = stream = slot id). llama_state_seq_get_data then writes, in each KV
// section, the stream count N and for each stream its cell count followed, for the slot's
// stream only, by that stream's cells and rows: every other stream writes a bare zero. The
// codec's grammar is that of a one-sequence, one-stream context (state_blob.hpp): the same
// bytes with the count 1 and without the zeros. So a slot's blob is cut down to that form
// before the codec reads it, and a rebuilt blob is padded back before
// llama_state_seq_set_data reads it; the rows are never touched. Which sections carry
// streams: the one KV section of llama and kimi-k3 (kimi-k3's recurrent section has none
// and follows unchanged); deepseek4's two raw sections (in a FULL blob the base half, then
// the sliding window; in a PARTIAL_ONLY blob the window alone). deepseek4's compressed
// caches and compressor states already hold the one sequence's stream alone (count 1).
// A unified cache (--kv-unified) is one stream: nothing to cut.
#pragma once

#include <algorithm>
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

namespace detail {

/// The sections of a blob that carry a stream count: where the first starts (they follow one
/// another) and each one's V runs (what read_kv_stream needs to measure a stream's part).
struct StreamSections {
  std::size_t first = 8;  // after the sequence magic and seq_id
  std::uint32_t count = 0;
  std::uint32_t value_runs[2] = {0, 0};
};

inline StreamSections stream_sections(const llama::BlobLayout& layout, bool partial) {
  const auto kv_value_runs = static_cast<std::uint32_t>(layout.runs.size()) - layout.key_layers;
  if (layout.family == llama::BlobFamily::hybrid) return {8, partial ? 0u : 1u, {kv_value_runs, 0}};
  if (layout.family == llama::BlobFamily::attention) return {8, 1, {kv_value_runs, 0}};
  constexpr std::size_t dsv4_header = 8 + 12;  // then its magic, version and mode
  if (partial) return {dsv4_header, 1, {layout.window_value_runs, 0}};
  return {dsv4_header, 2, {0, layout.window_value_runs}};  // the base half has no layers
}

// Where one stream's part of a section ends: it starts at `at` with its cell count.
inline std::size_t stream_part_end(std::span<const std::uint8_t> blob, std::size_t at, std::uint32_t value_runs) {
  if (at > blob.size()) throw Error(ErrorCode::corrupt_data, "a slot blob ends inside its stream sections");
  llama::detail::Reader r(blob.subspan(at));
  (void)llama::detail::read_kv_stream(r, value_runs, false);
  return at + r.offset();
}

inline void append(std::vector<std::uint8_t>& out, std::span<const std::uint8_t> blob, std::size_t from, std::size_t to) {
  out.insert(out.end(), blob.begin() + static_cast<std::ptrdiff_t>(from), blob.begin() + static_cast<std::ptrdiff_t>(to));
}

}  // namespace detail

/// The one-stream form of `blob`, a FULL (or, with `partial`, PARTIAL_ONLY) blob of a slot
/// placed at `place`, for a model of `layout`. Throws Error(corrupt_data) when the blob does
/// not have the stream structure `place` says (another stream holds cells, a count is torn).
/// Any thread.
inline std::vector<std::uint8_t> one_stream(const llama::BlobLayout& layout, std::span<const std::uint8_t> blob,
                                            StreamPlace place, bool partial = false) {
  const detail::StreamSections sections = detail::stream_sections(layout, partial);
  if (place.streams == 1 || sections.count == 0) return {blob.begin(), blob.end()};
  std::vector<std::uint8_t> out;
  out.reserve(blob.size());
  detail::append(out, blob, 0, std::min(sections.first, blob.size()));
  std::size_t at = sections.first;
  for (std::uint32_t k = 0; k < sections.count; ++k) {
    if (detail::u32_at(blob, at) != place.streams)
      throw Error(ErrorCode::corrupt_data, "a slot blob names " + std::to_string(detail::u32_at(blob, at)) +
                                               " streams, the context has " + std::to_string(place.streams));
    at += 4;
    for (std::uint32_t s = 0; s < place.streams; ++s) {
      if (s == place.stream) {
        const std::size_t end = detail::stream_part_end(blob, at, sections.value_runs[k]);
        detail::put_u32(out, 1);
        detail::append(out, blob, at, end);
        at = end;
      } else {
        if (detail::u32_at(blob, at) != 0)
          throw Error(ErrorCode::corrupt_data, "stream " + std::to_string(s) + " of another slot holds cells in this slot's blob");
        at += 4;
      }
    }
  }
  detail::append(out, blob, at, blob.size());  // the recurrent section, deepseek4's compressed rows and states
  return out;
}

/// The blob llama_state_seq_set_data reads for a slot at `place`, from a one-stream FULL
/// blob the codec wrote (taken: with one stream it is that blob, not a copy). Throws
/// Error(corrupt_data) for a blob that is not in one-stream form. Any thread.
inline std::vector<std::uint8_t> into_stream(const llama::BlobLayout& layout, std::vector<std::uint8_t>&& one,
                                             StreamPlace place) {
  const detail::StreamSections sections = detail::stream_sections(layout, false);
  if (place.streams == 1 || sections.count == 0) return std::move(one);
  std::vector<std::uint8_t> out;
  out.reserve(one.size() + 4 * std::size_t{place.streams} * sections.count);
  detail::append(out, one, 0, std::min(sections.first, one.size()));
  std::size_t at = sections.first;
  for (std::uint32_t k = 0; k < sections.count; ++k) {
    if (detail::u32_at(one, at) != 1) throw Error(ErrorCode::corrupt_data, "a rebuilt blob is not in one-stream form");
    const std::size_t end = detail::stream_part_end(one, at + 4, sections.value_runs[k]);
    detail::put_u32(out, place.streams);
    for (std::uint32_t s = 0; s < place.streams; ++s) {
      if (s == place.stream) detail::append(out, one, at + 4, end);
      else detail::put_u32(out, 0);
    }
    at = end;
  }
  detail::append(out, one, at, one.size());
  return out;
}

}  // namespace kvfuse::llama_server
