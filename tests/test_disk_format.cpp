// The disk tier's on-disk format (tier/disk_format.hpp): golden bytes of both format
// versions, refusal of every header defect in each, and a DiskTier serving a directory of
// version-1 files (R18). The expected bytes below were computed outside kvfuse, so they pin
// the format, not the code:
//  - version 1 (XXH64): an independent XXH64 checked against the reference vectors (these
//    are the bytes kvfuse 0.2.0 wrote; they must never change);
//  - version 2 (XXH3-64): a small C program linked with Debian's libxxhash (0.8.1, -lxxhash,
//    not kvfuse's header-only include) that lays the 80 header bytes out by hand from the
//    table in disk_format.hpp and prints
//      XXH3_64bits(payload, 31)      = 0x12886ED3A72F6119  -> [56,64)
//      XXH3_64bits(header, 72)       = 0xD1B9FF339F8DB1BC  -> [72,80)
//    and the 80 bytes, pasted below.
#include "tier_test_support.hpp"
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/detail/checksum.hpp>
#include <kvfuse/detail/little_endian.hpp>
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

constexpr std::uint64_t golden_xxh64 = 0x4B2B17FA73DD1FD2ULL;  // XXH64 (seed 0) of the payload
constexpr std::uint64_t golden_xxh3 = 0x12886ED3A72F6119ULL;   // XXH3_64bits of the payload (libxxhash)

disk::Header golden_header() { return {golden_key(), golden_payload.size(), golden_xxh3, 2}; }
disk::Header golden_header_v1() { return {golden_key(), golden_payload.size(), golden_xxh64, 1}; }

// Format version 2 (what this build writes), byte by byte, from the libxxhash program above.
const std::vector<std::uint8_t> golden_header_bytes{
    0x4B, 0x56, 0x46, 0x55, 0x53, 0x45, 0x44, 0x54,  // [0,8)   magic "KVFUSEDT"
    0x02, 0x00, 0x00, 0x00,                          // [8,12)  format version 2
    0x50, 0x00, 0x00, 0x00,                          // [12,16) header size 80
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // [16,24) key.model
    0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,  // [24,32) key.hash
    0x08, 0x00, 0x00, 0x00,                          // [32,36) key.world_size 8
    0x03, 0x00, 0x00, 0x00,                          // [36,40) key.rank 3
    0x02,                                            // [40]    key.kind = state
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,        // [41,48) zero
    0x1F, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // [48,56) payload length 31
    0x19, 0x61, 0x2F, 0xA7, 0xD3, 0x6E, 0x88, 0x12,  // [56,64) XXH3-64 of the payload
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // [64,72) reserved
    0xBC, 0xB1, 0x8D, 0x9F, 0x33, 0xFF, 0xB9, 0xD1,  // [72,80) XXH3-64 of [0,72)
};

// Format version 1 (kvfuse 0.2.0), byte by byte: what every version-1 file of that key and
// payload holds. Read forever (R18), never written again.
const std::vector<std::uint8_t> golden_header_v1_bytes{
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

const std::vector<std::uint8_t>& golden_bytes_of(std::uint32_t version) {
  return version == 1 ? golden_header_v1_bytes : golden_header_bytes;
}

std::vector<std::uint8_t> as_u8(std::span<const std::byte> b) {
  std::vector<std::uint8_t> out;
  for (std::byte x : b) out.push_back(static_cast<std::uint8_t>(x));
  return out;
}

disk::HeaderBytes golden_raw(std::uint32_t version = 2) {
  const std::vector<std::uint8_t>& bytes = golden_bytes_of(version);
  disk::HeaderBytes raw{};
  for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<std::byte>(bytes[i]);
  return raw;
}

// The checksum of format `version`, named here rather than asked of disk_format.hpp, so a
// reader that picks the wrong algorithm for a version fails these tests.
std::uint64_t checksum_of_version(std::uint32_t version, std::span<const std::byte> bytes) {
  return version == 1 ? detail::xxh64(bytes) : detail::xxh3_64(bytes);
}

// Recomputes the header checksum with `version`'s algorithm, so a test of one field is not
// caught by the checksum first.
void reseal(disk::HeaderBytes& raw, std::uint32_t version) {
  detail::put_le(raw.data() + 72, checksum_of_version(version, std::span<const std::byte>(raw.data(), 72)), 8);
}

// A whole version-1 entry (header then payload) laid out by hand from the version-1 table,
// as kvfuse 0.2.0 wrote it; checked against the golden version-1 bytes below.
std::vector<std::byte> v1_entry(const TierKey& key, std::span<const std::byte> payload) {
  // Sized once, payload copied in place: an insert() at the end trips GCC 12's
  // -Warray-bounds false positive at -O2.
  std::vector<std::byte> out(disk::header_bytes + payload.size());
  std::memcpy(out.data(), "KVFUSEDT", 8);
  detail::put_le(out.data() + 8, 1, 4);
  detail::put_le(out.data() + 12, 80, 4);
  detail::put_le(out.data() + 16, key.model, 8);
  detail::put_le(out.data() + 24, key.hash.value, 8);
  detail::put_le(out.data() + 32, key.world_size, 4);
  detail::put_le(out.data() + 36, key.rank, 4);
  detail::put_le(out.data() + 40, static_cast<std::uint8_t>(key.kind), 1);
  detail::put_le(out.data() + 48, payload.size(), 8);
  detail::put_le(out.data() + 56, detail::xxh64(payload), 8);
  detail::put_le(out.data() + 72, detail::xxh64(std::span<const std::byte>(out.data(), 72)), 8);
  if (!payload.empty()) std::memcpy(out.data() + disk::header_bytes, payload.data(), payload.size());
  return out;
}

void write_file(const fs::path& p, std::span<const std::byte> bytes) { REQUIRE(testing::write_bytes(p, bytes)); }

bool same_header(const disk::Header& a, const disk::Header& b) {
  return a.key == b.key && a.payload_bytes == b.payload_bytes && a.payload_checksum == b.payload_checksum &&
         a.version == b.version;
}

using TempDir = testing::TempDir;  // TempDir dir; / dir.path

}  // namespace

TEST_CASE("disk format: a fixed entry's header is exactly the documented version-2 bytes") {
  CHECK(disk::format_version == 2);
  CHECK(detail::xxh3_64(payload_bytes()) == golden_xxh3);
  CHECK(disk::entry_checksum(2, payload_bytes()) == golden_xxh3);
  CHECK(as_u8(disk::encode(golden_header())) == golden_header_bytes);
  CHECK(as_u8(disk::encode_entry_header(golden_key(), payload_bytes())) == golden_header_bytes);
  disk::Header asks_v1 = golden_header();
  asks_v1.version = 1;  // ignored: a build writes one version
  CHECK(as_u8(disk::encode(asks_v1)) == golden_header_bytes);

  const disk::DecodedHeader d = disk::decode(golden_raw());
  REQUIRE(d.ok());
  CHECK(d.header.version == 2);
  CHECK(same_header(d.header, golden_header()));
  CHECK(disk::file_size_matches(d.header, disk::header_bytes + golden_payload.size()));

  const disk::HeaderBytes raw = golden_raw();
  std::vector<std::byte> entry(raw.begin(), raw.end());
  entry.insert(entry.end(), payload_bytes().begin(), payload_bytes().end());
  const disk::CheckedEntry checked = disk::check_entry(entry, golden_key());
  REQUIRE(checked.ok());
  CHECK(as_u8(checked.payload) == as_u8(payload_bytes()));
  entry.back() ^= std::byte{0x01};
  CHECK(disk::check_entry(entry, golden_key()).error == disk::EntryError::bad_payload_checksum);
}

TEST_CASE("R18 disk format: a version-1 entry (kvfuse 0.2.0) still decodes and its payload checks with XXH64") {
  CHECK(detail::xxh64(payload_bytes()) == golden_xxh64);
  CHECK(disk::entry_checksum(1, payload_bytes()) == golden_xxh64);
  CHECK(disk::readable_version(1));
  CHECK(disk::readable_version(2));
  CHECK_FALSE(disk::readable_version(0));
  CHECK_FALSE(disk::readable_version(3));

  const disk::DecodedHeader d = disk::decode(golden_raw(1));
  REQUIRE(d.ok());
  CHECK(d.header.version == 1);
  CHECK(same_header(d.header, golden_header_v1()));

  // The by-hand version-1 writer the DiskTier test below uses is the golden bytes.
  std::vector<std::uint8_t> expected = golden_header_v1_bytes;
  for (char c : golden_payload) expected.push_back(static_cast<std::uint8_t>(c));
  const std::vector<std::byte> entry = v1_entry(golden_key(), payload_bytes());
  CHECK(as_u8(entry) == expected);

  const disk::CheckedEntry checked = disk::check_entry(entry, golden_key());
  REQUIRE(checked.ok());
  CHECK(as_u8(checked.payload) == as_u8(payload_bytes()));
  std::vector<std::byte> flipped = entry;
  flipped[disk::header_bytes + 5] ^= std::byte{0x20};
  CHECK(disk::check_entry(flipped, golden_key()).error == disk::EntryError::bad_payload_checksum);

  // The version field picks the algorithm: each version's checksum under the other's
  // version number is a bad header (never misread as the other format).
  disk::HeaderBytes v1_as_v2 = golden_raw(1);
  v1_as_v2[8] = std::byte{2};
  reseal(v1_as_v2, 1);
  CHECK(disk::decode(v1_as_v2).error == disk::HeaderError::bad_checksum);
  disk::HeaderBytes v2_as_v1 = golden_raw(2);
  v2_as_v1[8] = std::byte{1};
  reseal(v2_as_v1, 2);
  CHECK(disk::decode(v2_as_v1).error == disk::HeaderError::bad_checksum);
  // A version-1 header whose payload checksum is XXH3's decodes (the header is sound) but
  // its payload fails: check_entry checks a version-1 payload with XXH64 only.
  std::vector<std::byte> v1_with_xxh3 = entry;
  detail::put_le(v1_with_xxh3.data() + 56, golden_xxh3, 8);
  disk::HeaderBytes resealed;
  std::memcpy(resealed.data(), v1_with_xxh3.data(), resealed.size());
  reseal(resealed, 1);
  std::memcpy(v1_with_xxh3.data(), resealed.data(), resealed.size());
  REQUIRE(disk::decode(resealed).ok());
  CHECK(disk::check_entry(v1_with_xxh3, golden_key()).error == disk::EntryError::bad_payload_checksum);

  // The streaming form follows the version too, whatever the split.
  const std::vector<std::byte> big = testing::pattern(11, 3000);
  for (std::uint32_t version : {1u, 2u}) {
    CAPTURE(version);
    for (std::size_t step : {1u, 7u, 64u, 1000u, 3000u}) {
      disk::EntryChecksum h(version);
      for (std::size_t i = 0; i < big.size(); i += step)
        h.update(std::span<const std::byte>(big).subspan(i, std::min(step, big.size() - i)));
      CHECK(h.digest() == checksum_of_version(version, big));
    }
  }
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

TEST_CASE("R18 disk tier: a directory of version-1 files (kvfuse 0.2.0) is served byte-exact and a corrupt one quarantined") {
  const fs::path golden_name = "st-0102030405060708-1112131415161718-00000008-00000003.kvt";
  // Larger than the opening scan's 1 MiB read buffer: its XXH64 is streamed over reads.
  const TierKey big_key = testing::key_of(42, 1);
  const std::vector<std::byte> big = testing::pattern(42, (std::size_t{3} << 19) + 5);
  std::vector<std::byte> staging(big.size());

  SUBCASE("whole version-1 files are adopted on open and served, beside new version-2 ones") {
    TempDir dir;
    write_file(dir.path / golden_name, v1_entry(golden_key(), payload_bytes()));
    write_file(dir.path / DiskTier::file_name(big_key), v1_entry(big_key, big));
    for (int open = 0; open < 2; ++open) {  // and again after a restart
      CAPTURE(open);
      DiskTier tier(dir.path);
      CHECK(tier.stats().entries == (open == 0 ? 2u : 3u));
      CHECK(tier.stats().quarantined == 0);
      const TierView g = tier.get(golden_key(), staging);
      REQUIRE(g.hit());
      CHECK(as_u8(g.bytes()) == as_u8(payload_bytes()));
      const TierView b = tier.get(big_key, staging);
      REQUIRE(b.hit());
      CHECK(testing::same(b.bytes(), big));
      if (open == 0) REQUIRE(tier.put(testing::key_of(43), big));  // written as version 2
      const TierView n = tier.get(testing::key_of(43), staging);
      REQUIRE(n.hit());
      CHECK(testing::same(n.bytes(), big));
      CHECK(tier.stats().get_failures == 0);
    }
  }

  SUBCASE("a version-1 file with a flipped payload bit is quarantined on open") {
    TempDir dir;
    std::vector<std::byte> golden = v1_entry(golden_key(), payload_bytes());
    golden[disk::header_bytes + 3] ^= std::byte{0x04};
    write_file(dir.path / golden_name, golden);
    std::vector<std::byte> large = v1_entry(big_key, big);
    large[disk::header_bytes + (std::size_t{1} << 20) + 17] ^= std::byte{0x01};  // in the scan's second read
    write_file(dir.path / DiskTier::file_name(big_key), large);

    DiskTier tier(dir.path);
    CHECK(tier.stats().quarantined == 2);
    CHECK(tier.stats().entries == 0);
    CHECK(testing::regular_files_in(dir.path / "quarantine") == 2);
    CHECK(tier.get(golden_key(), staging).status() == GetStatus::miss);
    CHECK(tier.get(big_key, staging).status() == GetStatus::miss);
  }

  SUBCASE("a version-1 file with a flipped payload bit fails its get and is quarantined when the scan skips payloads") {
    TempDir dir;
    std::vector<std::byte> golden = v1_entry(golden_key(), payload_bytes());
    golden[disk::header_bytes + 30] ^= std::byte{0x80};
    write_file(dir.path / golden_name, golden);

    DiskTier tier(dir.path, DiskTierOptions{.verify_payloads_on_open = false});
    CHECK(tier.stats().entries == 1);
    CHECK(tier.get(golden_key(), staging).status() == GetStatus::failed);
    CHECK(tier.stats().quarantined == 1);
    CHECK(tier.get(golden_key(), staging).status() == GetStatus::miss);
    CHECK(testing::regular_files_in(dir.path / "quarantine") == 1);
  }
}

TEST_CASE("R18 disk format: decode refuses a wrong magic or version or header size or checksum or kind or padding") {
  for (std::uint32_t version : {1u, 2u}) {  // every readable version, resealed with its own checksum
    CAPTURE(version);
    const std::vector<std::uint8_t>& golden = golden_bytes_of(version);
    auto with = [&](std::size_t at, std::uint8_t value, bool seal) {
      disk::HeaderBytes raw = golden_raw(version);
      raw[at] = std::byte{value};
      if (seal) reseal(raw, version);
      return disk::decode(raw).error;
    };
    REQUIRE(disk::decode(golden_raw(version)).ok());
    for (std::size_t at = 0; at < 8; ++at) CHECK(with(at, 0x00, true) == disk::HeaderError::bad_magic);
    CHECK(with(7, 'U', false) == disk::HeaderError::bad_magic);    // the first check wins
    CHECK(with(8, 0x03, true) == disk::HeaderError::bad_version);  // a later version is refused, not misread
    CHECK(with(8, 0x00, true) == disk::HeaderError::bad_version);
    CHECK(with(8, 0xFF, true) == disk::HeaderError::bad_version);
    CHECK(with(11, 0x01, true) == disk::HeaderError::bad_version);
    CHECK(with(8, version == 1 ? 0x02 : 0x01, true) == disk::HeaderError::bad_checksum);  // the other version's algorithm
    CHECK(with(12, 0x48, true) == disk::HeaderError::bad_header_size);
    CHECK(with(15, 0x01, true) == disk::HeaderError::bad_header_size);
    CHECK(with(40, 0x00, true) == disk::HeaderError::bad_kind);
    CHECK(with(40, 0x03, true) == disk::HeaderError::bad_kind);
    for (std::size_t at = 41; at < 48; ++at) CHECK(with(at, 0x01, true) == disk::HeaderError::bad_padding);
    // Any changed byte of [0,80) without a new checksum is a torn header.
    for (std::size_t at = 16; at < disk::header_bytes; ++at) {
      if (at >= 40 && at < 48) continue;  // kind and padding: refused either way, checked above
      CHECK(with(at, static_cast<std::uint8_t>(golden[at] ^ 0x10), false) == disk::HeaderError::bad_checksum);
    }
    // The reserved word is not checked by itself (documented): a sealed nonzero one decodes.
    CHECK(with(64, 0x01, true) == disk::HeaderError::none);
  }
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
