// Frames: LoadRequest, KvSave and StateSave on the wire. The documented byte layout, round
// trips, one case per named refusal, and a million hostile frames.
#include <doctest/doctest.h>

#include <kvfuse/bridge/frames.hpp>
#include <kvfuse/testing/alloc_counter.hpp>

#include "frame_judge.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;

namespace {

using Bytes = std::vector<std::byte>;

Bytes bytes(std::initializer_list<int> values) {
  Bytes out;
  for (int v : values) out.push_back(static_cast<std::byte>(v));
  return out;
}

template <class Value>
Bytes encode(const Value& value) {
  Bytes out(frame_size(value).length);
  const Encoded e = to_bytes(value, out);
  REQUIRE(e.ok());
  REQUIRE(e.length == out.size());
  return out;
}

void set_u32(Bytes& b, std::size_t at, std::uint32_t v) { detail::put_le(b.data() + at, v, 4); }

LoadRequest joint_request() {
  LoadRequest r;
  r.key = LoadKey{RequestId{0x0102030405060708ULL}, Generation{0x1112131415161718ULL}};
  r.state = StateSpec{512, PrefixHash{0xA1A2A3A4A5A6A7A8ULL}, SlotId{7}, 16, 256};
  r.kv = KvSpec{256, 768, {PrefixHash{0xB1B2B3B4B5B6B7B8ULL}, PrefixHash{0xC1C2C3C4C5C6C7C8ULL}},
                {BlockId{16}, BlockId{17}, BlockId{0xDEADBEEFU}}};
  return r;
}

KvSave sample_kv_save() {
  return KvSave{SaveKey{PrefixHash{0xA1A2A3A4A5A6A7A8ULL}, Generation{42}}, {PrefixHash{0x0102030405060708ULL}},
                {BlockId{1}, BlockId{2}}};
}

constexpr StateSave sample_state_save{SaveKey{PrefixHash{0x0102030405060708ULL}, Generation{9}}, SlotId{0x11223344U}, 4096};

// Encoding a StateSave is constexpr: its layout holds at compile time.
constexpr bool state_save_round_trips() {
  std::array<std::byte, 36> b{};
  const Encoded e = to_bytes(sample_state_save, b);
  const Decoded<StateSave> d = state_save_from_bytes(b);
  return e.length == 36 && d.ok() && d.record == sample_state_save && b[1] == std::byte{5};
}
static_assert(state_save_round_trips());

// The errors every frame decoder can name (the record-only ones excluded).
constexpr std::array frame_errors{DecodeError::truncated,       DecodeError::trailing_bytes, DecodeError::frame_too_large,
                                  DecodeError::fields_overrun,  DecodeError::too_many_chunks, DecodeError::too_many_blocks,
                                  DecodeError::unknown_kind,    DecodeError::wrong_kind,      DecodeError::bad_version,
                                  DecodeError::bad_bool,        DecodeError::bad_reserved};

}  // namespace

TEST_CASE("frames: a joint LoadRequest has the documented little-endian version-1 layout") {
  const Bytes expected = bytes({
      0x01, 0x03, 0x00, 0x00,                          // version 1, kind 3 (load request), zero
      0x6C, 0x00, 0x00, 0x00,                          // length 108
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // request id
      0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,  // generation
      0x01, 0x01, 0x00, 0x00,                          // state leg, KV leg, zero
      0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // state: boundary_tokens 512
      0xA8, 0xA7, 0xA6, 0xA5, 0xA4, 0xA3, 0xA2, 0xA1,  //        boundary_hash
      0x07, 0x00, 0x00, 0x00,                          //        slot 7
      0x10, 0x00, 0x00, 0x00,                          //        block_tokens 16
      0x00, 0x01, 0x00, 0x00,                          //        chunk_tokens 256
      0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // kv: hbm 256
      0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  //     end 768
      0x02, 0x00, 0x00, 0x00,                          //     2 chunk keys
      0x03, 0x00, 0x00, 0x00,                          //     3 blocks
      0xB8, 0xB7, 0xB6, 0xB5, 0xB4, 0xB3, 0xB2, 0xB1,  //     chunk key 0
      0xC8, 0xC7, 0xC6, 0xC5, 0xC4, 0xC3, 0xC2, 0xC1,  //     chunk key 1
      0x10, 0x00, 0x00, 0x00,                          //     block 16
      0x11, 0x00, 0x00, 0x00,                          //     block 17
      0xEF, 0xBE, 0xAD, 0xDE,                          //     block 0xDEADBEEF
  });
  CHECK(frame_size(joint_request()) == Encoded{108, EncodeError::none});
  CHECK(encode(joint_request()) == expected);
  const auto d = load_request_from_bytes(expected);
  REQUIRE(d.ok());
  CHECK(d.record == joint_request());
}

TEST_CASE("frames: a LoadRequest without a leg leaves that leg's bytes out") {
  LoadRequest neither;
  neither.key = LoadKey{RequestId{3}, Generation{4}};
  const Bytes neither_bytes = bytes({
      0x01, 0x03, 0x00, 0x00, 0x1C, 0x00, 0x00, 0x00,  // version 1, kind 3, length 28
      0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // request id
      0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // generation
      0x00, 0x00, 0x00, 0x00,                          // no state leg, no KV leg
  });
  CHECK(encode(neither) == neither_bytes);

  LoadRequest state_only = neither;
  state_only.state = StateSpec{16, PrefixHash{0x55}, SlotId{2}, 16, 256};
  const Bytes state_only_bytes = bytes({
      0x01, 0x03, 0x00, 0x00, 0x38, 0x00, 0x00, 0x00,  // length 56
      0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // request id
      0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // generation
      0x01, 0x00, 0x00, 0x00,                          // state leg only
      0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // boundary_tokens 16
      0x55, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // boundary_hash
      0x02, 0x00, 0x00, 0x00,                          // slot 2
      0x10, 0x00, 0x00, 0x00,                          // block_tokens 16
      0x00, 0x01, 0x00, 0x00,                          // chunk_tokens 256
  });
  CHECK(encode(state_only) == state_only_bytes);

  LoadRequest kv_only = neither;
  kv_only.kv = KvSpec{0, 0, {}, {}};
  const Bytes kv_only_bytes = bytes({
      0x01, 0x03, 0x00, 0x00, 0x34, 0x00, 0x00, 0x00,  // length 52
      0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // request id
      0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // generation
      0x00, 0x01, 0x00, 0x00,                          // KV leg only
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // hbm
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // end
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // no chunk keys, no blocks
  });
  CHECK(encode(kv_only) == kv_only_bytes);

  for (const auto& [frame, value] : {std::pair{neither_bytes, neither}, std::pair{state_only_bytes, state_only},
                                     std::pair{kv_only_bytes, kv_only}}) {
    const auto d = load_request_from_bytes(frame);
    REQUIRE(d.ok());
    CHECK(d.record == value);
  }
}

TEST_CASE("frames: the KvSave and StateSave layouts are the documented version-1 ones") {
  const Bytes kv_expected = bytes({
      0x01, 0x04, 0x00, 0x00, 0x30, 0x00, 0x00, 0x00,  // version 1, kind 4 (KV save), length 48
      0xA8, 0xA7, 0xA6, 0xA5, 0xA4, 0xA3, 0xA2, 0xA1,  // key hash
      0x2A, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // generation 42
      0x01, 0x00, 0x00, 0x00,                          // 1 chunk key
      0x02, 0x00, 0x00, 0x00,                          // 2 blocks
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // chunk key
      0x01, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00,  // blocks 1, 2
  });
  CHECK(encode(sample_kv_save()) == kv_expected);
  const auto kv = kv_save_from_bytes(kv_expected);
  REQUIRE(kv.ok());
  CHECK(kv.record == sample_kv_save());

  const Bytes state_expected = bytes({
      0x01, 0x05, 0x00, 0x00, 0x24, 0x00, 0x00, 0x00,  // version 1, kind 5 (state save), length 36
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // key hash
      0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // generation 9
      0x44, 0x33, 0x22, 0x11,                          // source slot
      0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // boundary_tokens 4096
  });
  CHECK(encode(sample_state_save) == state_expected);
  const auto state = state_save_from_bytes(state_expected);
  REQUIRE(state.ok());
  CHECK(state.record == sample_state_save);
}

TEST_CASE("frames: extreme values and frames at the count limits round-trip") {
  constexpr std::uint64_t all = ~0ULL;
  LoadRequest r;
  r.key = LoadKey{RequestId{all}, Generation{all}};
  r.state = StateSpec{all, PrefixHash{all}, SlotId{~0U}, 0, 0};  // zero grids: the rank refuses those, not the wire
  r.kv = KvSpec{all, 0, std::vector<PrefixHash>(max_frame_chunks, PrefixHash{all}),
                std::vector<BlockId>(max_frame_blocks, BlockId{~0U})};
  const Bytes big = encode(r);
  CHECK(big.size() == max_frame_bytes);
  const auto d = from_bytes<LoadRequest>(big);
  REQUIRE(d.ok());
  CHECK(d.record == r);

  KvSave s{SaveKey{PrefixHash{all}, Generation{0}}, std::vector<PrefixHash>(max_frame_chunks, PrefixHash{1}),
           std::vector<BlockId>(max_frame_blocks, BlockId{2})};
  const auto ds = from_bytes<KvSave>(encode(s));
  REQUIRE(ds.ok());
  CHECK(ds.record == s);

  const StateSave st{SaveKey{PrefixHash{all}, Generation{all}}, SlotId{~0U}, all};
  CHECK(from_bytes<StateSave>(encode(st)).record == st);
}

TEST_CASE("R19 frame encoders refuse what the format cannot carry, write nothing and never allocate") {
  REQUIRE(detail::AllocationScope::hook_installed());
  LoadRequest r = joint_request();
  r.kv->chunk_keys.resize(max_frame_chunks + 1);
  KvSave s = sample_kv_save();
  s.blocks.resize(max_frame_blocks + 1);
  LoadRequest blocks_over = joint_request();
  blocks_over.kv->blocks.resize(max_frame_blocks + 1);
  KvSave chunks_over = sample_kv_save();
  chunks_over.chunk_keys.resize(max_frame_chunks + 1);

  const LoadRequest joint = joint_request();
  const KvSave kv_save = sample_kv_save();
  Bytes out(256, std::byte{0xEE});
  // Every result is taken inside the scope and checked after it: doctest's checks allocate.
  std::array<Encoded, 9> got{};
  std::uint64_t allocations = 0;
  {
    const detail::AllocationScope scope;
    got = {frame_size(r),
           to_bytes(r, out),
           to_bytes(blocks_over, out),
           to_bytes(s, out),
           to_bytes(chunks_over, out),
           to_bytes(joint, std::span(out).first(107)),
           to_bytes(kv_save, std::span(out).first(47)),
           to_bytes(sample_state_save, std::span(out).first(35)),
           to_bytes(sample_state_save, std::span<std::byte>{})};
    allocations = scope.this_thread();
  }
  CHECK(got[0] == Encoded{0, EncodeError::too_many_chunks});
  CHECK(got[1] == Encoded{0, EncodeError::too_many_chunks});
  CHECK(got[2] == Encoded{0, EncodeError::too_many_blocks});
  CHECK(got[3] == Encoded{0, EncodeError::too_many_blocks});
  CHECK(got[4] == Encoded{0, EncodeError::too_many_chunks});
  // A short buffer is refused with the length the frame needs.
  CHECK(got[5] == Encoded{108, EncodeError::buffer_too_small});
  CHECK(got[6] == Encoded{48, EncodeError::buffer_too_small});
  CHECK(got[7] == Encoded{36, EncodeError::buffer_too_small});
  CHECK(got[8] == Encoded{36, EncodeError::buffer_too_small});
  CHECK(std::all_of(out.begin(), out.end(), [](std::byte b) { return b == std::byte{0xEE}; }));
  // A frame that fits is written without allocating.
  Encoded written;
  {
    const detail::AllocationScope scope;
    written = to_bytes(joint, out);
    allocations += scope.this_thread();
  }
  CHECK(written == Encoded{108, EncodeError::none});
  CHECK(allocations == 0);
  CHECK(to_string(EncodeError::buffer_too_small) == "buffer_too_small");
}

TEST_CASE("R19 frame decoders refuse a short buffer as truncated") {
  const Bytes good = encode(joint_request());
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{27},
                        std::size_t{80}, good.size() - 1}) {
    const std::span<const std::byte> cut(good.data(), n);
    CHECK(load_request_from_bytes(cut).error == DecodeError::truncated);
  }
  CHECK(read_frame_header(std::span(good).first(7)).error == DecodeError::truncated);
  const Bytes kv = encode(sample_kv_save());
  CHECK(kv_save_from_bytes(std::span(kv).first(kv.size() - 1)).error == DecodeError::truncated);
  const Bytes st = encode(sample_state_save);
  CHECK(state_save_from_bytes(std::span(st).first(35)).error == DecodeError::truncated);
}

TEST_CASE("R19 frame decoders refuse bytes after the last field as trailing_bytes") {
  // Past the declared length, in the buffer.
  Bytes r = encode(joint_request());
  Bytes kv_past = encode(sample_kv_save());
  Bytes st_past = encode(sample_state_save);
  for (Bytes* b : {&r, &kv_past, &st_past}) b->push_back(std::byte{0});
  CHECK(load_request_from_bytes(r).error == DecodeError::trailing_bytes);
  CHECK(kv_save_from_bytes(kv_past).error == DecodeError::trailing_bytes);
  CHECK(state_save_from_bytes(st_past).error == DecodeError::trailing_bytes);
  // Inside the declared length: the frame says it is longer than its fields.
  Bytes neither = encode(LoadRequest{});
  neither.push_back(std::byte{0});
  set_u32(neither, 4, static_cast<std::uint32_t>(neither.size()));
  CHECK(load_request_from_bytes(neither).error == DecodeError::trailing_bytes);
  Bytes kv = encode(sample_kv_save());
  set_u32(kv, 24, 0);  // one chunk key fewer than the frame holds
  CHECK(kv_save_from_bytes(kv).error == DecodeError::trailing_bytes);
  Bytes st = encode(sample_state_save);
  st.push_back(std::byte{0});
  set_u32(st, 4, 37);
  CHECK(state_save_from_bytes(st).error == DecodeError::trailing_bytes);
}

TEST_CASE("R19 frame decoders refuse counts and leg flags that overrun the frame as fields_overrun") {
  Bytes r = encode(joint_request());
  set_u32(r, 28 + 28 + 20, 4);  // four blocks, three present
  CHECK(load_request_from_bytes(r).error == DecodeError::fields_overrun);
  Bytes neither = encode(LoadRequest{});
  neither[24] = std::byte{1};  // a state leg flagged, none present
  CHECK(load_request_from_bytes(neither).error == DecodeError::fields_overrun);
  neither[24] = std::byte{0};
  neither[25] = std::byte{1};  // a KV leg flagged, none present
  CHECK(load_request_from_bytes(neither).error == DecodeError::fields_overrun);
  Bytes kv = encode(sample_kv_save());
  set_u32(kv, 24, 0x10000);  // within the limit, far past the frame: refused before any allocation
  DecodeError got = DecodeError::none;
  std::uint64_t allocations = 0;
  {
    const detail::AllocationScope scope;
    got = kv_save_from_bytes(kv).error;
    allocations = scope.this_thread();
  }
  CHECK(got == DecodeError::fields_overrun);
  CHECK(allocations == 0);
  // A length too short for the fixed part or even for the header.
  Bytes header_only = encode(LoadRequest{});
  header_only.resize(8);
  set_u32(header_only, 4, 8);
  CHECK(load_request_from_bytes(header_only).error == DecodeError::fields_overrun);
  set_u32(header_only, 4, 7);
  CHECK(read_frame_header(header_only).error == DecodeError::fields_overrun);
  header_only[1] = std::byte{4};
  set_u32(header_only, 4, 8);
  CHECK(kv_save_from_bytes(header_only).error == DecodeError::fields_overrun);
  header_only[1] = std::byte{5};
  CHECK(state_save_from_bytes(header_only).error == DecodeError::fields_overrun);
}

TEST_CASE("R19 frame decoders refuse a declared length above max_frame_bytes before reading on") {
  Bytes b = encode(sample_kv_save());
  set_u32(b, 4, static_cast<std::uint32_t>(max_frame_bytes + 1));
  CHECK(kv_save_from_bytes(b).error == DecodeError::frame_too_large);
  CHECK(read_frame_header(std::span(b).first(8)).error == DecodeError::frame_too_large);
  set_u32(b, 4, 0xFFFFFFFFU);
  CHECK(kv_save_from_bytes(b).error == DecodeError::frame_too_large);
  set_u32(b, 4, static_cast<std::uint32_t>(max_frame_bytes));
  CHECK(kv_save_from_bytes(b).error == DecodeError::truncated);  // at the limit the length is believable
}

TEST_CASE("R19 frame decoders refuse counts above the limits as too_many_chunks or too_many_blocks") {
  Bytes kv_chunks = encode(sample_kv_save());
  set_u32(kv_chunks, 24, static_cast<std::uint32_t>(max_frame_chunks + 1));
  Bytes kv_chunks_huge = kv_chunks;
  set_u32(kv_chunks_huge, 24, 0xFFFFFFFFU);
  Bytes kv_blocks = encode(sample_kv_save());
  set_u32(kv_blocks, 28, static_cast<std::uint32_t>(max_frame_blocks + 1));
  Bytes r_chunks = encode(joint_request());
  set_u32(r_chunks, 28 + 28 + 16, 0x80000000U);
  Bytes r_blocks = encode(joint_request());
  set_u32(r_blocks, 28 + 28 + 20, 0xFFFFFFFFU);

  std::array<DecodeError, 5> got{};
  std::uint64_t allocations = 0;
  {
    const detail::AllocationScope scope;  // counts are judged before anything is allocated
    got = {kv_save_from_bytes(kv_chunks).error, kv_save_from_bytes(kv_chunks_huge).error,
           kv_save_from_bytes(kv_blocks).error, load_request_from_bytes(r_chunks).error,
           load_request_from_bytes(r_blocks).error};
    allocations = scope.this_thread();
  }
  CHECK(got[0] == DecodeError::too_many_chunks);
  CHECK(got[1] == DecodeError::too_many_chunks);
  CHECK(got[2] == DecodeError::too_many_blocks);
  CHECK(got[3] == DecodeError::too_many_chunks);
  CHECK(got[4] == DecodeError::too_many_blocks);
  CHECK(allocations == 0);
}

TEST_CASE("R19 frame decoders refuse an unknown kind, another kind and another version") {
  Bytes r = encode(joint_request());
  for (int kind : {0, 6, 0x7F, 0xFF}) {
    r[1] = static_cast<std::byte>(kind);
    CHECK(load_request_from_bytes(r).error == DecodeError::unknown_kind);
    CHECK(kv_save_from_bytes(r).error == DecodeError::unknown_kind);
    CHECK(state_save_from_bytes(r).error == DecodeError::unknown_kind);
    CHECK(read_frame_header(r).error == DecodeError::unknown_kind);
  }
  // A record kind in a frame header, and each frame handed to the other two decoders.
  r[1] = std::byte{1};
  CHECK(read_frame_header(r).error == DecodeError::wrong_kind);
  CHECK(load_request_from_bytes(r).error == DecodeError::wrong_kind);
  r[1] = std::byte{2};
  CHECK(state_save_from_bytes(r).error == DecodeError::wrong_kind);
  const Bytes load = encode(joint_request());
  const Bytes kv = encode(sample_kv_save());
  const Bytes st = encode(sample_state_save);
  CHECK(kv_save_from_bytes(load).error == DecodeError::wrong_kind);
  CHECK(state_save_from_bytes(load).error == DecodeError::wrong_kind);
  CHECK(load_request_from_bytes(kv).error == DecodeError::wrong_kind);
  CHECK(state_save_from_bytes(kv).error == DecodeError::wrong_kind);
  CHECK(load_request_from_bytes(st).error == DecodeError::wrong_kind);
  CHECK(kv_save_from_bytes(st).error == DecodeError::wrong_kind);
  Bytes kv_too_long = kv;  // the kind is judged before the reserved bytes and the length
  kv_too_long[2] = std::byte{1};
  set_u32(kv_too_long, 4, 0xFFFFFFFFU);
  CHECK(load_request_from_bytes(kv_too_long).error == DecodeError::wrong_kind);
  CHECK(kv_save_from_bytes(kv_too_long).error == DecodeError::bad_reserved);
  // A record read as a frame is refused too (its byte 0 is the low byte of an id).
  const RecordBytes record = to_bytes(SaveRecord{SaveKey{PrefixHash{0x0301}, Generation{1}}, 0, SavePhase::stored, true});
  CHECK_FALSE(load_request_from_bytes(record).ok());

  for (int version : {0, 2, 0xFF}) {
    Bytes v = encode(sample_state_save);
    v[0] = static_cast<std::byte>(version);
    CHECK(state_save_from_bytes(v).error == DecodeError::bad_version);
    CHECK(read_frame_header(v).error == DecodeError::bad_version);
  }
}

TEST_CASE("R19 frame decoders refuse a leg flag other than 0 or 1 and a nonzero reserved byte") {
  for (std::size_t at : {std::size_t{24}, std::size_t{25}})
    for (int value : {2, 0x80, 0xFF}) {
      Bytes r = encode(joint_request());
      r[at] = static_cast<std::byte>(value);
      CHECK(load_request_from_bytes(r).error == DecodeError::bad_bool);
    }
  for (std::size_t at : {std::size_t{26}, std::size_t{27}}) {
    Bytes r = encode(joint_request());
    r[at] = std::byte{1};
    CHECK(load_request_from_bytes(r).error == DecodeError::bad_reserved);
  }
  for (std::size_t at : {std::size_t{2}, std::size_t{3}}) {
    Bytes b = encode(sample_kv_save());
    b[at] = std::byte{1};
    CHECK(kv_save_from_bytes(b).error == DecodeError::bad_reserved);
    CHECK(read_frame_header(b).error == DecodeError::bad_reserved);
  }
}

TEST_CASE("R19 a frame decoder that cannot allocate refuses as out_of_memory") {
  REQUIRE(detail::AllocationScope::hook_installed());
  const Bytes kv = encode(sample_kv_save());
  const Bytes r = encode(joint_request());
  for (std::uint64_t failing : {1, 2}) {  // the first vector, then the second
    detail::AllocationScope::fail_next(failing);
    const auto dk = kv_save_from_bytes(kv);
    detail::AllocationScope::fail_next(failing);
    const auto dr = load_request_from_bytes(r);
    detail::AllocationScope::fail_next(0);
    CHECK(dk.error == DecodeError::out_of_memory);
    CHECK(dk.record == KvSave{});
    CHECK(dr.error == DecodeError::out_of_memory);
    CHECK(dr.record == LoadRequest{});
  }
  CHECK(kv_save_from_bytes(kv).ok());  // and decodes once memory is back
}

TEST_CASE("frames: read_frame_header finds the first frame of a stream") {
  Bytes stream = encode(sample_state_save);
  const Bytes second = encode(joint_request());
  stream.insert(stream.end(), second.begin(), second.end());
  const auto first = read_frame_header(stream);
  REQUIRE(first.ok());
  CHECK(first.record == FrameHeader{WireKind::state_save, 36});
  const auto next = read_frame_header(std::span(stream).subspan(first.record.length));
  REQUIRE(next.ok());
  CHECK(next.record == FrameHeader{WireKind::load_request, 108});
  CHECK(from_bytes<LoadRequest>(std::span(stream).subspan(36, next.record.length)).record == joint_request());
}

TEST_CASE("frames: every DecodeError has its own stable name") {
  std::vector<std::string_view> names;
  for (int e = 0; e <= static_cast<int>(last_decode_error); ++e) {
    const std::string_view name = to_string(static_cast<DecodeError>(e));
    CHECK(name != "unknown_decode_error");
    CHECK(std::find(names.begin(), names.end(), name) == names.end());
    names.push_back(name);
  }
  CHECK(to_string(DecodeError::fields_overrun) == "fields_overrun");
  // The record errors kept their numbers when the frame errors were appended.
  CHECK(static_cast<int>(DecodeError::bad_reserved) == 9);
  CHECK(static_cast<int>(DecodeError::truncated) == 10);
}

namespace {

// splitmix64: fast under the sanitizers, and the same stream on every run.
struct Rng {
  std::uint64_t state;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  std::uint32_t below(std::uint64_t n) noexcept { return static_cast<std::uint32_t>(next() % n); }
};

// A valid frame to mutate, with where its counts sit (0: it has none).
struct Seed {
  Bytes frame;
  std::size_t chunk_count_at = 0;
};

std::vector<Seed> seeds() {
  std::vector<Seed> out;
  auto add_request = [&](const LoadRequest& r) {
    const std::size_t kv_at = 28 + (r.state ? 28 : 0);
    out.push_back(Seed{encode(r), r.kv ? kv_at + 16 : 0});
  };
  LoadRequest r;
  r.key = LoadKey{RequestId{77}, Generation{5}};
  add_request(r);
  r.state = StateSpec{256, PrefixHash{99}, SlotId{3}, 16, 256};
  add_request(r);
  r.kv = KvSpec{0, 256, {PrefixHash{1}}, {BlockId{1}, BlockId{2}}};
  add_request(r);
  add_request(joint_request());
  r.state.reset();
  r.kv = KvSpec{0, 0, {}, {}};
  add_request(r);
  r.kv = KvSpec{16, 512, {PrefixHash{7}, PrefixHash{8}, PrefixHash{9}}, {BlockId{4}}};
  add_request(r);
  for (const KvSave& s : {sample_kv_save(), KvSave{}, KvSave{SaveKey{PrefixHash{3}, Generation{1}}, {PrefixHash{1}, PrefixHash{2}},
                                                           {BlockId{5}, BlockId{6}, BlockId{7}, BlockId{8}}}})
    out.push_back(Seed{encode(s), 24});
  out.push_back(Seed{encode(sample_state_save), 0});
  out.push_back(Seed{encode(StateSave{}), 0});
  return out;
}

std::uint32_t interesting_u32(Rng& rng, std::uint32_t original) {
  const std::uint32_t values[] = {0,
                                  1,
                                  original - 1,
                                  original + 1,
                                  static_cast<std::uint32_t>(max_frame_chunks),
                                  static_cast<std::uint32_t>(max_frame_chunks + 1),
                                  static_cast<std::uint32_t>(max_frame_bytes),
                                  static_cast<std::uint32_t>(max_frame_bytes + 1),
                                  0x80000000U,
                                  0xFFFFFFFFU,
                                  static_cast<std::uint32_t>(rng.next())};
  return values[rng.below(std::size(values))];
}

void mutate(Bytes& b, const Seed& seed, const std::vector<Seed>& all, Rng& rng) {
  const auto at = [&] { return rng.below(b.size()); };
  switch (rng.below(9)) {
    case 0:  // one bit
      if (!b.empty()) b[at()] ^= static_cast<std::byte>(1U << rng.below(8));
      break;
    case 1:  // one byte, any value
      if (!b.empty()) b[at()] = static_cast<std::byte>(rng.next());
      break;
    case 2: {  // one byte, a boundary value
      constexpr int values[] = {0, 1, 2, 3, 4, 5, 6, 0x7F, 0x80, 0xFF};
      if (!b.empty()) b[at()] = static_cast<std::byte>(values[rng.below(std::size(values))]);
      break;
    }
    case 3:  // truncated
      b.resize(rng.below(b.size() + 1));
      break;
    case 4: {  // extended, the length field following the buffer or not
      const std::size_t extra = 1 + rng.below(16);
      for (std::size_t i = 0; i < extra; ++i) b.push_back(static_cast<std::byte>(rng.next()));
      if (rng.below(2) == 0 && b.size() >= 8) set_u32(b, 4, static_cast<std::uint32_t>(b.size()));
      break;
    }
    case 5:  // a count set to a huge, boundary or off-by-one value
      if (seed.chunk_count_at != 0) {
        const std::size_t count_at = seed.chunk_count_at + 4 * rng.below(2);
        if (count_at + 4 <= b.size())
          set_u32(b, count_at, interesting_u32(rng, static_cast<std::uint32_t>(detail::get_le(b.data() + count_at, 4))));
      }
      break;
    case 6:  // the length field
      if (b.size() >= 8) set_u32(b, 4, interesting_u32(rng, static_cast<std::uint32_t>(b.size())));
      break;
    case 7:  // a tag byte: version, kind, leg flags
      if (b.size() >= 26) b[std::array<std::size_t, 4>{0, 1, 24, 25}[rng.below(4)]] = static_cast<std::byte>(rng.below(7));
      break;
    default:  // the body of another seed spliced behind this header
      if (b.size() >= 8) {
        const Bytes& other = all[rng.below(all.size())].frame;
        b.resize(8);
        b.insert(b.end(), other.begin() + 8, other.end());
      }
      break;
  }
}

}  // namespace

// Tallies what the decoders said over the whole stream.
struct Tally {
  std::map<DecodeError, long> refusals;
  std::array<long, 3> decoded{};  // load requests, KV saves, state saves
  long misreads = 0;

  void add(const testing::FrameVerdict& v) {
    const std::array<DecodeError, 3> answers{v.load_request, v.kv_save, v.state_save};
    for (std::size_t i = 0; i < answers.size(); ++i) {
      if (answers[i] == DecodeError::none) ++decoded[i];
      else ++refusals[answers[i]];
    }
    if (v.misread && ++misreads <= 5) FAIL_CHECK("a buffer decoded to a value that does not re-encode to its bytes");
  }
};

TEST_CASE("R19 a million mutated and random frames: every decoder refuses by name or decodes exactly what it read") {
  const std::vector<Seed> all = seeds();
  Rng rng{20261201};
  Tally tally;
  Bytes scratch(4096);
  Bytes b;
  b.reserve(256);
  // Each frame is judged at the very end of a heap block, so a read one byte past it lands in
  // AddressSanitizer's redzone (a vector's spare capacity would not).
  Bytes tail(4096);
  constexpr long frames = 1'000'000;
  for (long i = 0; i < frames; ++i) {
    if (rng.below(8) == 0) {
      // Random bytes, half of them behind a plausible header so they reach the fields.
      b.resize(rng.below(97));
      for (std::byte& x : b) x = static_cast<std::byte>(rng.next());
      if (b.size() >= 8 && rng.below(2) == 0) {
        b[0] = std::byte{1};
        b[1] = static_cast<std::byte>(3 + rng.below(3));
        b[2] = b[3] = std::byte{0};
        set_u32(b, 4, static_cast<std::uint32_t>(b.size()));
      }
    } else {
      const Seed& seed = all[rng.below(all.size())];
      b.assign(seed.frame.begin(), seed.frame.end());
      for (std::uint32_t m = 1 + rng.below(3); m > 0; --m) mutate(b, seed, all, rng);
    }
    if (b.size() > tail.size()) FAIL("a mutated frame outgrew the buffer it is judged in");
    const auto at_end = tail.end() - static_cast<std::ptrdiff_t>(b.size());
    std::copy(b.begin(), b.end(), at_end);
    tally.add(testing::judge_frame(std::span<const std::byte>(std::to_address(at_end), b.size()), scratch));
  }
  CHECK(tally.misreads == 0);
  // The stream reached every refusal and every decoder's success, so the property was tested
  // where it matters, not only on garbage refused at the first byte.
  for (DecodeError e : frame_errors) {
    INFO("refusal: " << to_string(e));
    CHECK(tally.refusals[e] > 0);
  }
  for (long n : tally.decoded) CHECK(n > 1000);
  MESSAGE("decoded: " << tally.decoded[0] << " load requests, " << tally.decoded[1] << " KV saves, " << tally.decoded[2]
                      << " state saves of " << frames << " frames");
}
