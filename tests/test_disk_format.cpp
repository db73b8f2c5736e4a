// The disk tier's on-disk format (tier/disk_format.hpp): golden bytes, and refusal of every
// header defect. The expected bytes below were computed outside kvfuse (an independent
// XXH64 checked against the reference vectors), so they pin the format, not the code.
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/detail/checksum.hpp>
#include <kvfuse/tier/disk_format.hpp>
#include <kvfuse/tier/disk_tier.hpp>

#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

using namespace kvfuse;
namespace disk = kvfuse::detail::disk;
namespace fs = std::filesystem;

namespace {

constexpr std::string_view golden_payload = "kvfuse disk tier golden entry!\n";  // 31 bytes

TierKey golden_key() {
  TierKey k;
  k.model = 0x0102030405060708ULL;
  k.hash = PrefixHash{0x1112131415161718ULL};
  k.world_size = 8;
  k.rank = 3;
  k.kind = EntryKind::state;
  return k;
}

std::span<const std::byte> payload_bytes() { return std::as_bytes(std::span(golden_payload.data(), golden_payload.size())); }

disk::Header golden_header() { return {golden_key(), golden_payload.size(), 0x4B2B17FA73DD1FD2ULL}; }

// Format version 1, byte by byte.
const std::vector<std::uint8_t> golden_header_bytes{
    0x4B, 0x56, 0x46, 0x55, 0x53, 0x45, 0x44, 0x54,  // [0,8)   magic "KVFUSEDT"
    0x01, 0x00, 0x00, 0x00,                          // [8,12)  format version 1
    0x50, 0x00, 0x00, 0x00,                          // [12,16) header size 80
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // [16,24) key.model
    0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,  // [24,32) key.hash
    0x08, 0x00, 0x00, 0x00,                          // [32,36) key.world_size 8
    0x03, 0x00, 0x00, 0x00,                          // [36,40) key.rank 3
    0x02,                                            // [40]    key.kind = state
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,        // [41,48) zero
    0x1F, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // [48,56) payload length 31
    0xD2, 0x1F, 0xDD, 0x73, 0xFA, 0x17, 0x2B, 0x4B,  // [56,64) XXH64 of the payload
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // [64,72) reserved
    0xCE, 0xAF, 0x2A, 0x3B, 0x7E, 0x13, 0x79, 0x91,  // [72,80) XXH64 of [0,72)
};

std::vector<std::uint8_t> as_u8(std::span<const std::byte> b) {
  std::vector<std::uint8_t> out;
  for (std::byte x : b) out.push_back(static_cast<std::uint8_t>(x));
  return out;
}

disk::HeaderBytes golden_raw() {
  disk::HeaderBytes raw{};
  for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<std::byte>(golden_header_bytes[i]);
  return raw;
}

// Recomputes the header checksum, so a test of one field is not caught by the checksum first.
void reseal(disk::HeaderBytes& raw) {
  detail::put_le(raw.data() + 72, detail::xxh64(std::span<const std::byte>(raw.data(), 72)), 8);
}

bool same_header(const disk::Header& a, const disk::Header& b) {
  return a.key == b.key && a.payload_bytes == b.payload_bytes && a.payload_checksum == b.payload_checksum;
}

using TempDir = testing::TempDir;  // TempDir dir; / dir.path

}  // namespace

TEST_CASE("disk format: a fixed entry's header is exactly the documented version-1 bytes") {
  CHECK(detail::xxh64(payload_bytes()) == golden_header().payload_checksum);
  CHECK(as_u8(disk::encode(golden_header())) == golden_header_bytes);

  const disk::DecodedHeader d = disk::decode(golden_raw());
  REQUIRE(d.ok());
  CHECK(same_header(d.header, golden_header()));
  CHECK(disk::file_size_matches(d.header, disk::header_bytes + golden_payload.size()));
}

TEST_CASE("disk format: DiskTier writes exactly header then payload under the documented file name") {
  TempDir dir;
  {
    DiskTier tier(dir.path);
    REQUIRE(tier.put(golden_key(), payload_bytes()));
  }
  const fs::path file = dir.path / "st-0102030405060708-1112131415161718-00000008-00000003.kvt";
  REQUIRE(fs::exists(file));
  std::ifstream in(file, std::ios::binary);
  const std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::uint8_t> expected = golden_header_bytes;
  for (char c : golden_payload) expected.push_back(static_cast<std::uint8_t>(c));
  CHECK(as_u8(std::as_bytes(std::span(raw.data(), raw.size()))) == expected);
}

TEST_CASE("R18 disk format: decode refuses a wrong magic or version or header size or checksum or kind or padding") {
  auto with = [](std::size_t at, std::uint8_t value, bool seal) {
    disk::HeaderBytes raw = golden_raw();
    raw[at] = std::byte{value};
    if (seal) reseal(raw);
    return disk::decode(raw).error;
  };
  for (std::size_t at = 0; at < 8; ++at) CHECK(with(at, 0x00, true) == disk::HeaderError::bad_magic);
  CHECK(with(7, 'U', false) == disk::HeaderError::bad_magic);  // the first check wins
  CHECK(with(8, 0x02, true) == disk::HeaderError::bad_version);  // a version-2 file is refused, not misread
  CHECK(with(8, 0x00, true) == disk::HeaderError::bad_version);
  CHECK(with(11, 0x01, true) == disk::HeaderError::bad_version);
  CHECK(with(12, 0x48, true) == disk::HeaderError::bad_header_size);
  CHECK(with(15, 0x01, true) == disk::HeaderError::bad_header_size);
  CHECK(with(40, 0x00, true) == disk::HeaderError::bad_kind);
  CHECK(with(40, 0x03, true) == disk::HeaderError::bad_kind);
  for (std::size_t at = 41; at < 48; ++at) CHECK(with(at, 0x01, true) == disk::HeaderError::bad_padding);
  // Any changed byte of [0,80) without a new checksum is a torn header.
  for (std::size_t at = 16; at < disk::header_bytes; ++at) {
    if (at >= 40 && at < 48) continue;  // kind and padding: refused either way, checked above
    CHECK(with(at, static_cast<std::uint8_t>(golden_header_bytes[at] ^ 0x10), false) == disk::HeaderError::bad_checksum);
  }
  // The reserved word is not checked by itself (documented): a sealed nonzero one decodes.
  CHECK(with(64, 0x01, true) == disk::HeaderError::none);
}

TEST_CASE("R18 disk format: a file must be exactly header plus the payload length it declares") {
  const disk::Header h = golden_header();
  const std::uint64_t exact = disk::header_bytes + golden_payload.size();
  CHECK(disk::file_size_matches(h, exact));
  CHECK_FALSE(disk::file_size_matches(h, exact - 1));  // truncated payload
  CHECK_FALSE(disk::file_size_matches(h, exact + 1));  // trailing bytes
  CHECK_FALSE(disk::file_size_matches(h, disk::header_bytes));
  CHECK_FALSE(disk::file_size_matches(h, disk::header_bytes - 1));  // not even a header
  CHECK_FALSE(disk::file_size_matches(h, 0));
  disk::Header empty = h;
  empty.payload_bytes = 0;
  CHECK(disk::file_size_matches(empty, disk::header_bytes));
  disk::Header huge = h;
  huge.payload_bytes = ~std::uint64_t{0};
  CHECK_FALSE(disk::file_size_matches(huge, disk::header_bytes - 1));
}

TEST_CASE("disk format: temporary and quarantine names are the documented spellings") {
  char entry[64];
  REQUIRE(disk::format_name(golden_key(), entry));
  CHECK(std::string_view(entry) == "st-0102030405060708-1112131415161718-00000008-00000003.kvt");
  CHECK(std::strlen(entry) == disk::name_length);

  char temp[96];
  disk::format_temp_name(entry, 0x00000000DEADBEEFULL, temp);
  CHECK(std::string_view(temp) == ".tmp-st-0102030405060708-1112131415161718-00000008-00000003.kvt-00000000deadbeef");

  char quarantined[256];
  disk::format_quarantine_name("junk.bin", 0xABCULL, quarantined);
  CHECK(std::string_view(quarantined) == "junk.bin.q0000000000000abc");
  const std::string long_name(300, 'x');
  disk::format_quarantine_name(long_name, 1, quarantined);
  CHECK(std::string_view(quarantined) == std::string(200, 'x') + ".q0000000000000001");
}
