// Records: the documented byte layout, round trips, and refusal of corrupt input.
#include <doctest/doctest.h>

#include <kvfuse/bridge/records.hpp>
#include <kvfuse/detail/little_endian.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string_view>
#include <vector>

using namespace kvfuse;

namespace {

std::vector<std::uint8_t> as_u8(const RecordBytes& b) {
  std::vector<std::uint8_t> out;
  for (std::byte x : b) out.push_back(static_cast<std::uint8_t>(x));
  return out;
}

constexpr CompletionRecord sample_load{LoadKey{RequestId{0x0102030405060708ULL}, Generation{0x1112131415161718ULL}},
                                       0x21222324U,          KvOutcome::failed,
                                       StateOutcome::missed, Reason::kv_chunk_missing,
                                       Reason::entry_size_mismatch, 0x31323334U};
constexpr SaveRecord sample_save{SaveKey{PrefixHash{0xA1A2A3A4A5A6A7A8ULL}, Generation{42}}, 7, SavePhase::released, true,
                                 Reason::source_unconfirmed};

// Round trips hold at compile time: the codec is constexpr.
static_assert(completion_from_bytes(to_bytes(sample_load)).record == sample_load);
static_assert(save_from_bytes(to_bytes(sample_save)).record == sample_save);

// The shared little-endian codec is constexpr: width by width, at compile time.
constexpr bool le_round_trips() {
  std::array<std::byte, 8> b{};
  for (int width = 1; width <= 8; ++width) {
    const std::uint64_t v = 0x0102030405060708ULL;
    const std::uint64_t low = width == 8 ? v : v & ((std::uint64_t{1} << (8 * width)) - 1);
    b.fill(std::byte{0xEE});
    detail::put_le(b.data(), v, width);
    if (detail::get_le(b.data(), width) != low) return false;
    if (b[0] != std::byte{0x08}) return false;  // least significant byte first
    if (width < 8 && b[static_cast<std::size_t>(width)] != std::byte{0xEE}) return false;  // writes no further
  }
  return true;
}
static_assert(le_round_trips());

}  // namespace

TEST_CASE("records: the completion layout is the documented little-endian version-3 one") {
  const std::vector<std::uint8_t> expected{0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,   // request id
                                           0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,   // generation
                                           0x24, 0x23, 0x22, 0x21,                           // rank
                                           0x03,                                             // format version 3
                                           0x01,                                             // kind: load
                                           0x02,                                             // kv = failed
                                           0x02,                                             // state = missed
                                           0x01, 0x00,                                       // kv_reason
                                           0x07, 0x00,                                       // state_reason
                                           0x34, 0x33, 0x32, 0x31};                          // kv_restored
  CHECK(as_u8(to_bytes(sample_load)) == expected);
}

TEST_CASE("records: the save layout is the documented little-endian version-3 one") {
  const std::vector<std::uint8_t> expected{0xA8, 0xA7, 0xA6, 0xA5, 0xA4, 0xA3, 0xA2, 0xA1,   // hash
                                           42,   0,    0,    0,    0,    0,    0,    0,      // generation
                                           7,    0,    0,    0,                              // rank
                                           3,                                                // format version 3
                                           2,                                                // kind: save
                                           1,                                                // phase = released
                                           1,                                                // ok
                                           14,   0,                                          // reason = source_unconfirmed
                                           0,    0,    0,    0,    0,    0};                 // reserved
  CHECK(as_u8(to_bytes(sample_save)) == expected);
}

TEST_CASE("records: every outcome and phase and reason round-trips") {
  for (int kv = 0; kv <= 2; ++kv)
    for (int st = 0; st <= 4; ++st)
      for (int reason = 0; reason <= static_cast<int>(last_reason); ++reason) {
        const CompletionRecord r{LoadKey{RequestId{~0ULL}, Generation{1}}, 63, static_cast<KvOutcome>(kv),
                                 static_cast<StateOutcome>(st), static_cast<Reason>(reason),
                                 static_cast<Reason>(static_cast<int>(last_reason) - reason)};
        const auto d = from_bytes<CompletionRecord>(to_bytes(r));
        REQUIRE(d.ok());
        CHECK(d.record == r);
      }
  for (SavePhase phase : {SavePhase::released, SavePhase::stored})
    for (int ok = 0; ok <= 1; ++ok)
      for (int reason = 0; reason <= static_cast<int>(last_reason); ++reason) {
        const SaveRecord r{SaveKey{PrefixHash{5}, Generation{~0ULL}}, ~0U, phase, ok == 1, static_cast<Reason>(reason)};
        const auto d = from_bytes<SaveRecord>(to_bytes(r));
        REQUIRE(d.ok());
        CHECK(d.record == r);
      }
}

TEST_CASE("records: every Reason has its own stable name") {
  std::vector<std::string_view> names;
  for (int r = 0; r <= static_cast<int>(last_reason); ++r) {
    const std::string_view name = to_string(static_cast<Reason>(r));
    CHECK(name != "unknown_reason");
    for (std::string_view seen : names) CHECK(seen != name);
    names.push_back(name);
  }
  CHECK(to_string(Reason::kv_chunk_missing) == "kv_chunk_missing");
}

TEST_CASE("R19 from_bytes refuses a truncated or padded or version-1 buffer") {
  const RecordBytes good = to_bytes(sample_load);
  std::array<std::byte, record_wire_bytes + 1> longer{};
  for (std::size_t i = 0; i < good.size(); ++i) longer[i] = good[i];
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{16}, std::size_t{24}, std::size_t{31}}) {
    CHECK(completion_from_bytes(std::span<const std::byte>(good.data(), n)).error == DecodeError::wrong_size);
    CHECK(save_from_bytes(std::span<const std::byte>(good.data(), n)).error == DecodeError::wrong_size);
  }
  CHECK(completion_from_bytes(longer).error == DecodeError::wrong_size);
  CHECK(save_from_bytes(longer).error == DecodeError::wrong_size);
  CHECK_FALSE(completion_from_bytes(std::span<const std::byte>{}));
}

TEST_CASE("R19 from_bytes refuses another version or kind and out-of-range values and nonzero reserved bytes") {
  auto load_with = [](std::size_t at, int value) {
    RecordBytes b = to_bytes(sample_load);
    b[at] = std::byte{static_cast<unsigned char>(value)};
    return completion_from_bytes(b).error;
  };
  CHECK(load_with(20, 1) == DecodeError::bad_version);
  CHECK(load_with(20, 2) == DecodeError::bad_version);  // a rank of the last version: it cannot say what it restored
  CHECK(load_with(20, 4) == DecodeError::bad_version);
  CHECK(load_with(21, 2) == DecodeError::wrong_kind);  // a save record read as a load
  CHECK(load_with(22, 3) == DecodeError::bad_kv);
  CHECK(load_with(23, 5) == DecodeError::bad_state);
  CHECK(load_with(24, static_cast<int>(last_reason) + 1) == DecodeError::bad_reason);
  CHECK(load_with(25, 1) == DecodeError::bad_reason);  // reason 0x0100 + original
  CHECK(load_with(26, static_cast<int>(last_reason) + 1) == DecodeError::bad_reason);
  // Without a KV leg nothing was restored: kv_restored is reserved there.
  const CompletionRecord state_only{LoadKey{RequestId{1}, Generation{2}}, 0, KvOutcome::none, StateOutcome::restored,
                                    Reason::none, Reason::none, 0};
  for (std::size_t at = 28; at < record_wire_bytes; ++at) {
    RecordBytes b = to_bytes(state_only);
    b[at] = std::byte{1};
    CHECK(completion_from_bytes(b).error == DecodeError::bad_reserved);
  }
  // With one, any count decodes as written (the quorum keeps the minimum).
  RecordBytes any = to_bytes(sample_load);
  any[31] = std::byte{0xFF};
  CHECK(completion_from_bytes(any).record.kv_restored == 0xFF323334U);

  auto save_with = [](std::size_t at, int value) {
    RecordBytes b = to_bytes(sample_save);
    b[at] = std::byte{static_cast<unsigned char>(value)};
    return save_from_bytes(b).error;
  };
  CHECK(save_with(20, 1) == DecodeError::bad_version);
  CHECK(save_with(21, 1) == DecodeError::wrong_kind);
  CHECK(save_with(22, 0) == DecodeError::bad_phase);
  CHECK(save_with(22, 3) == DecodeError::bad_phase);
  CHECK(save_with(23, 2) == DecodeError::bad_bool);
  CHECK(save_with(24, 0xff) == DecodeError::bad_reason);
  for (std::size_t at = 26; at < record_wire_bytes; ++at) CHECK(save_with(at, 1) == DecodeError::bad_reserved);
}

TEST_CASE("R19 from_bytes on random bytes either refuses or decodes exactly what it read") {
  std::mt19937_64 rng(12345);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int> small(0, 20);
  int decoded_load = 0;
  int decoded_store = 0;
  for (int i = 0; i < 20000; ++i) {
    RecordBytes b{};
    for (auto& x : b) x = static_cast<std::byte>(byte(rng));
    // Bias the tag bytes toward valid values so both branches are exercised.
    b[20] = static_cast<std::byte>(small(rng) == 0 ? 2 : 3);
    b[21] = static_cast<std::byte>(1 + small(rng) % 2);
    b[22] = static_cast<std::byte>(small(rng) % 4);
    b[23] = static_cast<std::byte>(small(rng) % 6);
    b[24] = static_cast<std::byte>(small(rng));
    b[25] = static_cast<std::byte>(small(rng) == 0 ? 1 : 0);
    b[26] = static_cast<std::byte>(small(rng));
    for (std::size_t z = 27; z < b.size(); ++z) b[z] = static_cast<std::byte>(small(rng) == 0 ? 1 : 0);
    if (const auto d = completion_from_bytes(b)) {
      ++decoded_load;
      CHECK(to_bytes(d.record) == b);
    } else {
      CHECK(d.error != DecodeError::none);
    }
    if (const auto d = save_from_bytes(b)) {
      ++decoded_store;
      CHECK(to_bytes(d.record) == b);
    } else {
      CHECK(d.error != DecodeError::none);
    }
  }
  CHECK(decoded_load > 0);
  CHECK(decoded_store > 0);
}

TEST_CASE("R2 one record carries the KV and the state outcome together") {
  const CompletionRecord r{LoadKey{RequestId{1}, Generation{2}}, 0, KvOutcome::failed, StateOutcome::missed,
                           Reason::kv_chunk_missing, Reason::none};
  const auto d = completion_from_bytes(to_bytes(r));
  REQUIRE(d.ok());
  CHECK(d.record.kv == KvOutcome::failed);
  CHECK(d.record.state == StateOutcome::missed);
  CHECK_FALSE(record_ok(d.record));
  CHECK(record_missed_state(d.record));
}

TEST_CASE("R4 a record is ok only when every leg it has succeeded and only a miss retracts") {
  const LoadKey k{RequestId{1}, Generation{1}};
  auto rec = [&](KvOutcome kv, StateOutcome st) { return CompletionRecord{k, 0, kv, st, Reason::none, Reason::none}; };
  CHECK(record_ok(rec(KvOutcome::ok, StateOutcome::none)));
  CHECK(record_ok(rec(KvOutcome::ok, StateOutcome::restored)));
  CHECK(record_ok(rec(KvOutcome::none, StateOutcome::restored)));
  CHECK_FALSE(record_ok(rec(KvOutcome::none, StateOutcome::none)));  // no leg at all is not a success
  CHECK_FALSE(record_ok(rec(KvOutcome::failed, StateOutcome::restored)));
  for (StateOutcome st : {StateOutcome::missed, StateOutcome::failed, StateOutcome::refused}) {
    CHECK_FALSE(record_ok(rec(KvOutcome::ok, st)));
    CHECK_FALSE(record_ok(rec(KvOutcome::none, st)));
  }
  CHECK(record_missed_state(rec(KvOutcome::ok, StateOutcome::missed)));
  for (StateOutcome st : {StateOutcome::none, StateOutcome::restored, StateOutcome::failed, StateOutcome::refused})
    CHECK_FALSE(record_missed_state(rec(KvOutcome::failed, st)));
}

namespace sentinel_check {
enum class Three : std::uint8_t { a, b, c };
constexpr std::string_view to_string(Three t) noexcept {
  switch (t) {
    case Three::a: return "a";
    case Three::b: return "b";
    case Three::c: return "c";
  }
  return "unknown_three";
}
}  // namespace sentinel_check

TEST_CASE("records: a last_ constant that is not the enum's last named value fails the compile-time check") {
  using sentinel_check::Three;
  static_assert(kvfuse::detail::is_last_named(Three::c));
  static_assert(!kvfuse::detail::is_last_named(Three::b));  // a value was added after it and the constant not moved
  static_assert(kvfuse::detail::is_last_named(kvfuse::last_reason));
  CHECK(kvfuse::detail::is_last_named(Three::c));
  CHECK_FALSE(kvfuse::detail::is_last_named(Three::b));
}
