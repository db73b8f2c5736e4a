// The property every frame decoder must keep on any input, shared by tests/test_frames.cpp (a
// million mutated frames per run) and fuzz/fuzz_frames.cpp (libFuzzer, for as long as you
// let it run): each decoder either refuses the bytes with a named DecodeError or returns a
// value that re-encodes to exactly those bytes, so nothing is misread.
#pragma once

#include <kvfuse/bridge/frames.hpp>
#include <kvfuse/bridge/records.hpp>

#include <algorithm>
#include <cstddef>
#include <span>

namespace kvfuse::testing {

/// What each decoder said about one buffer (DecodeError::none: it decoded), and whether any
/// decoded value failed to re-encode to the buffer.
struct FrameVerdict {
  DecodeError load_request = DecodeError::none;
  DecodeError kv_save = DecodeError::none;
  DecodeError state_save = DecodeError::none;
  bool misread = false;
};

/// One decoder's answer, judged: its refusal, or none after checking that the value
/// re-encodes to `in` (setting `misread` when it does not).
template <class Value>
DecodeError judge_decoded(const Decoded<Value>& d, std::span<const std::byte> in, std::span<std::byte> scratch,
                          bool& misread) noexcept {
  if (!d.ok()) return d.error;
  const Encoded e = to_bytes(d.record, scratch);
  const auto header = read_frame_header(in);
  const bool same = e.ok() && e.length == in.size() && std::equal(in.begin(), in.end(), scratch.begin()) &&
                    header.ok() && header.record.length == in.size();
  if (!same) misread = true;
  return DecodeError::none;
}

/// Feeds `in` to the three frame decoders and the two record decoders. `scratch` must be at
/// least in.size() bytes: a value that decodes re-encodes into it for the comparison.
inline FrameVerdict judge_frame(std::span<const std::byte> in, std::span<std::byte> scratch) noexcept {
  FrameVerdict v;
  v.load_request = judge_decoded(load_request_from_bytes(in), in, scratch, v.misread);
  v.kv_save = judge_decoded(kv_save_from_bytes(in), in, scratch, v.misread);
  v.state_save = judge_decoded(state_save_from_bytes(in), in, scratch, v.misread);
  // The records' decoders share the refusal vocabulary; the same bytes must not fool them.
  if (const auto c = completion_from_bytes(in); c.ok() && !std::ranges::equal(to_bytes(c.record), in)) v.misread = true;
  if (const auto s = save_from_bytes(in); s.ok() && !std::ranges::equal(to_bytes(s.record), in)) v.misread = true;
  return v;
}

}  // namespace kvfuse::testing
