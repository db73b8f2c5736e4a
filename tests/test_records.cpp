// Records: the documented byte layout, round trips, and refusal of corrupt input.
#include <doctest/doctest.h>

#include <kvfuse/completion/records.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

using namespace kvfuse;

namespace {

std::vector<std::uint8_t> as_u8(const RecordBytes& b) {
  std::vector<std::uint8_t> out;
  for (std::byte x : b) out.push_back(static_cast<std::uint8_t>(x));
  return out;
}

constexpr CompletionRecord sample_load{LoadKey{RequestId{0x0102030405060708ULL}, Generation{0x1112131415161718ULL}},
                                       0x21222324U, KvOutcome::failed, StateOutcome::missed, Reason::kv_chunk_missing};
constexpr StoreRecord sample_store{StoreKey{PrefixHash{0xA1A2A3A4A5A6A7A8ULL}, Generation{42}}, 7, true, false,
                                   Reason::shutdown};

// Round trips hold at compile time: the codec is constexpr.
static_assert(completion_from_bytes(to_bytes(sample_load)).record == sample_load);
static_assert(store_from_bytes(to_bytes(sample_store)).record == sample_store);

}  // namespace

TEST_CASE("records: the completion layout is the documented little-endian one") {
  const std::vector<std::uint8_t> expected{0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,   // request id
                                           0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,   // generation
                                           0x24, 0x23, 0x22, 0x21,                           // rank
                                           0x02,                                             // kv = failed
                                           0x02,                                             // state = missed
                                           0x01, 0x00};                                      // reason
  CHECK(as_u8(to_bytes(sample_load)) == expected);
}

TEST_CASE("records: the store layout is the documented little-endian one") {
  const std::vector<std::uint8_t> expected{0xA8, 0xA7, 0xA6, 0xA5, 0xA4, 0xA3, 0xA2, 0xA1,   // hash
                                           42,   0,    0,    0,    0,    0,    0,    0,      // generation
                                           7,    0,    0,    0,                              // rank
                                           1,                                                // stored
                                           0,                                                // source released
                                           14,   0};                                         // reason = shutdown
  CHECK(as_u8(to_bytes(sample_store)) == expected);
}

TEST_CASE("records: every outcome and reason round-trips") {
  for (int kv = 0; kv <= 2; ++kv)
    for (int st = 0; st <= 4; ++st)
      for (int reason = 0; reason <= static_cast<int>(last_reason); ++reason) {
        const CompletionRecord r{LoadKey{RequestId{~0ULL}, Generation{1}}, 63, static_cast<KvOutcome>(kv),
                                 static_cast<StateOutcome>(st), static_cast<Reason>(reason)};
        const auto d = from_bytes<CompletionRecord>(to_bytes(r));
        REQUIRE(d.ok());
        CHECK(d.record == r);
      }
  for (int stored = 0; stored <= 1; ++stored)
    for (int released = 0; released <= 1; ++released) {
      const StoreRecord r{StoreKey{PrefixHash{5}, Generation{~0ULL}}, ~0U, stored == 1, released == 1, Reason::none};
      const auto d = from_bytes<StoreRecord>(to_bytes(r));
      REQUIRE(d.ok());
      CHECK(d.record == r);
    }
}

TEST_CASE("R19 from_bytes refuses a truncated or padded buffer") {
  const RecordBytes good = to_bytes(sample_load);
  std::array<std::byte, 25> longer{};
  for (std::size_t i = 0; i < good.size(); ++i) longer[i] = good[i];
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{16}, std::size_t{23}}) {
    CHECK(completion_from_bytes(std::span<const std::byte>(good.data(), n)).error == DecodeError::wrong_size);
    CHECK(store_from_bytes(std::span<const std::byte>(good.data(), n)).error == DecodeError::wrong_size);
  }
  CHECK(completion_from_bytes(longer).error == DecodeError::wrong_size);
  CHECK(store_from_bytes(longer).error == DecodeError::wrong_size);
  CHECK_FALSE(completion_from_bytes(std::span<const std::byte>{}));
}

TEST_CASE("R19 from_bytes refuses out-of-range enum values and non-0/1 flags") {
  RecordBytes b = to_bytes(sample_load);
  b[20] = std::byte{3};
  CHECK(completion_from_bytes(b).error == DecodeError::bad_kv);
  b = to_bytes(sample_load);
  b[21] = std::byte{5};
  CHECK(completion_from_bytes(b).error == DecodeError::bad_state);
  b = to_bytes(sample_load);
  b[22] = std::byte{static_cast<unsigned char>(static_cast<int>(last_reason) + 1)};
  CHECK(completion_from_bytes(b).error == DecodeError::bad_reason);
  b = to_bytes(sample_load);
  b[23] = std::byte{1};  // reason 0x0100 + original
  CHECK(completion_from_bytes(b).error == DecodeError::bad_reason);

  RecordBytes s = to_bytes(sample_store);
  s[20] = std::byte{2};
  CHECK(store_from_bytes(s).error == DecodeError::bad_bool);
  s = to_bytes(sample_store);
  s[21] = std::byte{0xff};
  CHECK(store_from_bytes(s).error == DecodeError::bad_bool);
  s = to_bytes(sample_store);
  s[22] = std::byte{0xff};
  CHECK(store_from_bytes(s).error == DecodeError::bad_reason);
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
    b[20] = static_cast<std::byte>(small(rng));
    b[21] = static_cast<std::byte>(small(rng));
    b[22] = static_cast<std::byte>(small(rng));
    b[23] = static_cast<std::byte>(small(rng) == 0 ? 1 : 0);
    if (const auto d = completion_from_bytes(b)) {
      ++decoded_load;
      CHECK(to_bytes(d.record) == b);
    } else {
      CHECK(d.error != DecodeError::none);
    }
    if (const auto d = store_from_bytes(b)) {
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
                           Reason::kv_chunk_missing};
  const auto d = completion_from_bytes(to_bytes(r));
  REQUIRE(d.ok());
  CHECK(d.record.kv == KvOutcome::failed);
  CHECK(d.record.state == StateOutcome::missed);
  CHECK_FALSE(record_ok(d.record));
  CHECK(record_missed_state(d.record));
}

TEST_CASE("R4 a record is ok only when every leg it has succeeded and only a miss retracts") {
  const LoadKey k{RequestId{1}, Generation{1}};
  auto rec = [&](KvOutcome kv, StateOutcome st) { return CompletionRecord{k, 0, kv, st, Reason::none}; };
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
