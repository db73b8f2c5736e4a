// DiskTier: file format, atomic puts, restart (R18), quarantine, and the checksums it uses.
#include "tier_test_support.hpp"
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/detail/checksum.hpp>
#include <kvfuse/testing/delay_tier.hpp>
#include <kvfuse/tier/disk_tier.hpp>

#include <stdlib.h>
#include <sys/resource.h>
#include <xxhash.h>  // again, as an engine might: must coexist with kvfuse's inline include

#include <algorithm>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;
namespace fs = std::filesystem;

namespace {

using TempDir = testing::TempDir;  // TempDir dir; / dir.path

std::vector<std::byte> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(raw.size());
  std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

void write_file(const fs::path& p, std::span<const std::byte> bytes) { REQUIRE(testing::write_bytes(p, bytes)); }

bool has_temp_files(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().starts_with(".tmp-")) return true;
  return false;
}

}  // namespace

static_assert(Tier<DiskTier>);
static_assert(Tier<DelayTier<DiskTier>>);

TEST_CASE("checksum: xxh64 matches the reference vectors whatever the split of the input") {
  const auto hash_of = [](std::string_view s, std::uint64_t seed = 0) {
    return detail::xxh64(std::as_bytes(std::span(s.data(), s.size())), seed);
  };
  // Reference values from the xxHash library (libxxhash 0.8.1).
  CHECK(hash_of("") == 0xef46db3751d8e999ULL);
  CHECK(hash_of("a") == 0xd24ec4f1a98c6e5bULL);
  CHECK(hash_of("abc") == 0x44bc2cf5ad770999ULL);
  CHECK(hash_of("Nobody inspects the spammish repetition") == 0xfbcea83c8a378bf1ULL);
  CHECK(hash_of("", 42) == 0x98b1582b0977e704ULL);
  CHECK(hash_of("Nobody inspects the spammish repetition", 42) == 0x44582824ca1018b5ULL);
  std::string big;
  for (int i = 0; i < 1000; ++i) big.push_back(static_cast<char>((i * 131 + 7) & 0xff));
  CHECK(hash_of(big) == 0x0bf0bdbcc82eb373ULL);

  const auto bytes = std::as_bytes(std::span(big.data(), big.size()));
  for (std::size_t step : {1u, 3u, 7u, 31u, 32u, 33u, 200u}) {
    detail::Xxh64 h;
    for (std::size_t i = 0; i < bytes.size(); i += step) h.update(bytes.subspan(i, std::min(step, bytes.size() - i)));
    CHECK(h.digest() == 0x0bf0bdbcc82eb373ULL);
  }
}

TEST_CASE("checksum: xxh3_64 matches libxxhash's values whatever the split of the input") {
  const auto hash_of = [](std::string_view s) { return detail::xxh3_64(std::as_bytes(std::span(s.data(), s.size()))); };
  // Reference values printed by a C program linked with Debian's libxxhash 0.8.1 (-lxxhash),
  // XXH3_64bits(data, len): not kvfuse's header-only include.
  CHECK(hash_of("") == 0x2d06800538d394c2ULL);
  CHECK(hash_of("a") == 0xe6c632b61e964e1fULL);
  CHECK(hash_of("abc") == 0x78af5f94892f3950ULL);
  CHECK(hash_of("Nobody inspects the spammish repetition") == 0x6cb00603b5cc47e9ULL);
  std::string big;  // the same bytes as the XXH64 test's, longer: XXH3's long-input path
  for (int i = 0; i < 5000; ++i) big.push_back(static_cast<char>((i * 131 + 7) & 0xff));
  CHECK(hash_of(std::string_view(big).substr(0, 200)) == 0xc0fbc0f4e181c826ULL);   // 129..240 bytes
  CHECK(hash_of(std::string_view(big).substr(0, 1000)) == 0x571d5cbfef44331bULL);  // stripes, one block
  CHECK(hash_of(big) == 0xe4007929540f095cULL);                                     // several blocks

  const auto bytes = std::as_bytes(std::span(big.data(), big.size()));
  for (std::size_t step : {1u, 3u, 63u, 64u, 65u, 256u, 1024u, 4999u}) {
    detail::Xxh3 h;
    for (std::size_t i = 0; i < bytes.size(); i += step) h.update(bytes.subspan(i, std::min(step, bytes.size() - i)));
    CHECK(h.digest() == 0xe4007929540f095cULL);
    CHECK(h.digest() == 0xe4007929540f095cULL);  // digest does not change the state
  }
  // The state keeps its 64-byte alignment wherever the hasher lives (XXH3_state_t needs it).
  auto on_heap = std::make_unique<detail::Xxh3>();
  CHECK(reinterpret_cast<std::uintptr_t>(on_heap.get()) % 64 == 0);
  on_heap->update(bytes);
  CHECK(on_heap->digest() == 0xe4007929540f095cULL);
}

TEST_CASE("checksum: kvfuse's header-only xxHash coexists with an engine that includes xxhash.h itself") {
  // This file includes <xxhash.h> again after kvfuse (see the top): both compile in one
  // unit, and the engine's calls give the same values as kvfuse's wrappers.
  const std::string_view s = "Nobody inspects the spammish repetition";
  const auto bytes = std::as_bytes(std::span(s.data(), s.size()));
  CHECK(XXH3_64bits(s.data(), s.size()) == detail::xxh3_64(bytes));
  CHECK(XXH64(s.data(), s.size(), 42) == detail::xxh64(bytes, 42));
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  REQUIRE(XXH3_64bits_reset(&state) == XXH_OK);
  REQUIRE(XXH3_64bits_update(&state, s.data(), s.size()) == XXH_OK);
  CHECK(XXH3_64bits_digest(&state) == 0x6cb00603b5cc47e9ULL);
}

TEST_CASE("disk tier: file names spell the whole key and only canonical names parse") {
  const TierKey k = key_of(0xfedcba9876543210ULL, 3, EntryKind::state, 0x0123456789abcdefULL, 8);
  const std::string name = DiskTier::file_name(k);
  CHECK(name == "st-0123456789abcdef-fedcba9876543210-00000008-00000003.kvt");
  const auto back = detail::disk::parse_name(name);
  REQUIRE(back.has_value());
  CHECK(*back == k);
  CHECK_FALSE(detail::disk::parse_name("st-0123456789ABcdef-fedcba9876543210-00000008-00000003.kvt"));
  CHECK_FALSE(detail::disk::parse_name(name.substr(1)));
  CHECK_FALSE(detail::disk::parse_name("xx" + name.substr(2)));
  CHECK_FALSE(detail::disk::parse_name(name.substr(0, name.size() - 4) + ".tmp"));
  CHECK(DiskTier::file_name(key_of(1, 0, static_cast<EntryKind>(9))).empty());
}

TEST_CASE("disk tier: get returns byte for byte what put stored (read into the staging buffer)") {
  TempDir dir;
  DiskTier tier(dir.path / "tier");  // created on demand
  const auto a = pattern(1, 5000);
  const auto b = pattern(2, 64);
  REQUIRE(tier.put(key_of(1), a));
  REQUIRE(tier.put(key_of(2, 1, EntryKind::state), b));
  REQUIRE(tier.put(key_of(3), std::vector<std::byte>{}));

  std::vector<std::byte> staging(8192);
  const TierView va = tier.get(key_of(1), staging);
  REQUIRE(va.hit());
  CHECK(same(va.bytes(), a));
  CHECK(va.bytes().data() == staging.data());
  const TierView ve = tier.get(key_of(3), staging);
  REQUIRE(ve.hit());
  CHECK(ve.bytes().empty());
  CHECK(tier.get(key_of(2, 1, EntryKind::state), staging).hit());
  CHECK(tier.get(key_of(2, 0, EntryKind::state), staging).status() == GetStatus::miss);  // rank 0 never stored it
  CHECK(tier.get(key_of(9), staging).status() == GetStatus::miss);

  const auto s = tier.stats();
  CHECK(s.entries == 3);
  CHECK(s.bytes == a.size() + b.size());
  CHECK(s.hits == 3);
  CHECK(s.misses == 2);
  CHECK(s.puts == 3);
  CHECK(s.quarantined == 0);
  CHECK(s.io_errors == 0);
  CHECK(fs::exists(tier.path_of(key_of(1))));
  CHECK(fs::file_size(tier.path_of(key_of(1))) == detail::disk::header_bytes + a.size());
}

TEST_CASE("disk tier: puts leave no temporary files - overwrite replaces and erase deletes") {
  TempDir dir;
  DiskTier tier(dir.path);
  for (std::uint64_t h = 0; h < 8; ++h) REQUIRE(tier.put(key_of(h), pattern(h, 100 + h)));
  CHECK_FALSE(has_temp_files(dir.path));
  CHECK(testing::regular_files_in(dir.path) == 8);

  const auto replacement = pattern(99, 3000);
  REQUIRE(tier.put(key_of(3), replacement));
  CHECK(testing::regular_files_in(dir.path) == 8);
  std::vector<std::byte> staging(4096);
  const TierView v = tier.get(key_of(3), staging);
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), replacement));
  std::uint64_t expected_bytes = replacement.size();
  for (std::uint64_t h = 0; h < 8; ++h)
    if (h != 3) expected_bytes += 100 + h;
  CHECK(tier.stats().bytes == expected_bytes);

  CHECK(tier.erase(key_of(3)));
  CHECK_FALSE(tier.erase(key_of(3)));
  CHECK_FALSE(fs::exists(tier.path_of(key_of(3))));
  CHECK(tier.get(key_of(3), staging).status() == GetStatus::miss);
  CHECK(tier.stats().entries == 7);
  CHECK(tier.stats().bytes == expected_bytes - replacement.size());
}

TEST_CASE("disk tier: an entry larger than the staging buffer fails and stays servable") {
  TempDir dir;
  DiskTier tier(dir.path);
  const auto big = pattern(5, 4096);
  REQUIRE(tier.put(key_of(1), big));
  std::vector<std::byte> small(4095);
  CHECK(tier.get(key_of(1), small).status() == GetStatus::failed);
  CHECK(tier.stats().get_failures == 1);
  CHECK(tier.stats().quarantined == 0);
  CHECK(tier.contains(key_of(1)));
  std::vector<std::byte> enough(4096);
  const TierView v = tier.get(key_of(1), enough);
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), big));
}

TEST_CASE("R18 disk tier: entries written before a restart are read back byte for byte after it") {
  TempDir dir;
  struct Written {
    TierKey key;
    std::vector<std::byte> bytes;
  };
  std::vector<Written> written;
  std::uint64_t seed = 100;
  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    for (std::uint64_t h = 1; h <= 5; ++h) written.push_back({key_of(h, rank), pattern(seed++, 1000 * h + rank)});
    written.push_back({key_of(77, rank, EntryKind::state), pattern(seed++, 3333)});
  }
  written.push_back({key_of(78, 0, EntryKind::state, /*model*/ 9), pattern(seed++, 0)});
  // Larger than the scan's 1 MiB read buffer, so the streamed checksum spans several reads.
  written.push_back({key_of(6), pattern(seed++, (std::size_t{3} << 20) / 2 + 17)});

  std::uint64_t total = 0;
  {
    DiskTier tier(dir.path);
    for (const auto& w : written) {
      REQUIRE(tier.put(w.key, w.bytes));
      total += w.bytes.size();
    }
  }  // the tier is gone; only the files remain

  DiskTier reopened(dir.path);
  const auto s = reopened.stats();
  CHECK(s.entries == written.size());
  CHECK(s.bytes == total);
  CHECK(s.quarantined == 0);
  CHECK(s.io_errors == 0);

  std::vector<std::byte> staging(std::size_t{2} << 20);
  for (const auto& w : written) {
    CAPTURE(w.key.hash.value);
    CAPTURE(w.key.rank);
    CHECK(reopened.contains(w.key));
    const TierView v = reopened.get(w.key, staging);
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), w.bytes));
  }
  CHECK(reopened.stats().hits == written.size());

  // The engine re-seeds its index from the state keys that survived.
  const auto states = reopened.keys(EntryKind::state);
  const std::set<TierKey> got(states.begin(), states.end());
  const std::set<TierKey> want{key_of(77, 0, EntryKind::state), key_of(77, 1, EntryKind::state),
                               key_of(78, 0, EntryKind::state, 9)};
  CHECK(got == want);
  CHECK(reopened.keys(EntryKind::kv_chunk).size() == written.size() - want.size());
}

TEST_CASE("R18 disk tier: corrupt / truncated / garbage / misnamed files are quarantined on open and never served") {
  TempDir dir;
  std::vector<std::vector<std::byte>> payload;
  for (std::uint64_t h = 0; h < 10; ++h) payload.push_back(pattern(200 + h, 512 + 16 * h));
  fs::path file[10];
  {
    DiskTier tier(dir.path);
    for (std::uint64_t h = 0; h < 10; ++h) {
      REQUIRE(tier.put(key_of(h), payload[h]));
      file[h] = tier.path_of(key_of(h));
    }
  }
  const std::size_t hdr = detail::disk::header_bytes;

  // 0: one payload bit flipped.
  auto bytes = read_file(file[0]);
  bytes[hdr + 100] ^= std::byte{0x01};
  write_file(file[0], bytes);
  // 1: truncated halfway through the payload.
  fs::resize_file(file[1], hdr + payload[1].size() / 2);
  // 2: garbage over the whole file, same length.
  write_file(file[2], pattern(999, fs::file_size(file[2])));
  // 3: header's rank field changed (and nothing else): the header checksum catches it.
  bytes = read_file(file[3]);
  bytes[36] ^= std::byte{0x01};
  write_file(file[3], bytes);
  // 4: trailing bytes after the payload.
  bytes = read_file(file[4]);
  bytes.push_back(std::byte{0});
  write_file(file[4], bytes);
  // 5, 6, 7: a whole, valid file under the name of the same hash for another rank, world
  // size and model. Each disagrees with its name, so none may be served for that key.
  const TierKey other_rank = key_of(5, 1);
  const TierKey other_world = key_of(6, 0, EntryKind::kv_chunk, 7, 8);
  const TierKey other_model = key_of(7, 0, EntryKind::kv_chunk, 8);
  fs::rename(file[5], dir.path / DiskTier::file_name(other_rank));
  fs::rename(file[6], dir.path / DiskTier::file_name(other_world));
  fs::rename(file[7], dir.path / DiskTier::file_name(other_model));
  // A file that is no entry at all, and a temporary file a crashed put left behind.
  write_file(dir.path / "notes.txt", pattern(1, 10));
  write_file(dir.path / (".tmp-" + DiskTier::file_name(key_of(8)) + "-00000000000000ff"), pattern(2, 10));

  std::optional<DiskTier> reopened(std::in_place, dir.path);
  DiskTier& tier = *reopened;
  const auto s = tier.stats();
  CHECK(s.quarantined == 9);  // 0-7 and notes.txt; the temp file is deleted, not counted
  CHECK(s.entries == 2);      // 8 and 9 survive
  CHECK(s.bytes == payload[8].size() + payload[9].size());
  CHECK(testing::regular_files_in(dir.path / "quarantine") == 9);
  CHECK(testing::regular_files_in(dir.path) == 2);
  CHECK_FALSE(has_temp_files(dir.path));

  std::vector<std::byte> staging(4096);
  for (std::uint64_t h = 0; h < 8; ++h) {
    CAPTURE(h);
    CHECK_FALSE(tier.contains(key_of(h)));
    CHECK(tier.get(key_of(h), staging).status() == GetStatus::miss);
  }
  for (const TierKey& k : {other_rank, other_world, other_model}) {
    CHECK_FALSE(tier.contains(k));
    CHECK(tier.get(k, staging).status() == GetStatus::miss);
  }
  for (std::uint64_t h : {8u, 9u}) {
    const TierView v = tier.get(key_of(h), staging);
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), payload[h]));
  }

  // A second restart finds nothing new to quarantine: quarantine/ is not scanned as entries.
  reopened.reset();
  reopened.emplace(dir.path);
  CHECK(reopened->stats().quarantined == 0);
  CHECK(reopened->stats().entries == 2);
}

TEST_CASE("R18 disk tier: a file corrupted or swapped behind an open tier fails its get and is quarantined and then misses") {
  TempDir dir;
  DiskTier tier(dir.path);
  const auto a = pattern(301, 2048);
  const auto b = pattern(302, 2048);
  REQUIRE(tier.put(key_of(1), a));
  REQUIRE(tier.put(key_of(2), b));
  REQUIRE(tier.put(key_of(2, 1), b));
  std::vector<std::byte> staging(4096);

  // A payload bit flips on disk after the put.
  auto bytes = read_file(tier.path_of(key_of(1)));
  bytes[detail::disk::header_bytes + 2047] ^= std::byte{0x80};
  write_file(tier.path_of(key_of(1)), bytes);
  CHECK(tier.get(key_of(1), staging).status() == GetStatus::failed);
  CHECK(tier.stats().quarantined == 1);
  CHECK(tier.stats().get_failures == 1);
  CHECK_FALSE(tier.contains(key_of(1)));
  CHECK(tier.get(key_of(1), staging).status() == GetStatus::miss);
  CHECK_FALSE(fs::exists(tier.path_of(key_of(1))));

  // Rank 1's (valid) file is copied over rank 0's name: the header key says rank 1.
  fs::copy_file(tier.path_of(key_of(2, 1)), tier.path_of(key_of(2, 0)), fs::copy_options::overwrite_existing);
  CHECK(tier.get(key_of(2, 0), staging).status() == GetStatus::failed);
  CHECK(tier.stats().quarantined == 2);
  CHECK(tier.get(key_of(2, 0), staging).status() == GetStatus::miss);
  const TierView v = tier.get(key_of(2, 1), staging);  // rank 1's own entry is untouched
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), b));
  CHECK(testing::regular_files_in(dir.path / "quarantine") == 2);
}

TEST_CASE("disk tier: with payload checks off at open a corrupt payload is caught by the read") {
  TempDir dir;
  const auto a = pattern(401, 1000);
  fs::path p;
  {
    DiskTier tier(dir.path);
    REQUIRE(tier.put(key_of(1), a));
    p = tier.path_of(key_of(1));
  }
  auto bytes = read_file(p);
  bytes.back() ^= std::byte{0x10};
  write_file(p, bytes);
  DiskTier tier(dir.path, DiskTierOptions{.durable = false, .verify_payloads_on_open = false});
  CHECK(tier.contains(key_of(1)));  // headers and lengths are fine
  std::vector<std::byte> staging(1000);
  CHECK(tier.get(key_of(1), staging).status() == GetStatus::failed);
  CHECK(tier.stats().quarantined == 1);
  CHECK(tier.get(key_of(1), staging).status() == GetStatus::miss);
}

TEST_CASE("disk tier: durable puts fsync and read back the same") {
  TempDir dir;
  DiskTier tier(dir.path, DiskTierOptions{.durable = true});
  const auto a = pattern(501, 777);
  REQUIRE(tier.put(key_of(1, 0, EntryKind::state), a));
  std::vector<std::byte> staging(1024);
  const TierView v = tier.get(key_of(1, 0, EntryKind::state), staging);
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), a));
  CHECK(tier.stats().io_errors == 0);
}

TEST_CASE("disk tier: a key kind without a file name is a failed put and not a crash") {
  TempDir dir;
  DiskTier tier(dir.path);
  CHECK_FALSE(tier.put(key_of(1, 0, static_cast<EntryKind>(9)), pattern(1, 10)));
  CHECK(tier.stats().put_failures == 1);
}

TEST_CASE("R19 disk tier: an unusable directory is an io_failure that names the path") {
  TempDir dir;
  const fs::path blocker = dir.path / "a-file";
  write_file(blocker, pattern(1, 4));
  const fs::path bad = blocker / "tier";
  try {
    DiskTier tier(bad);
    FAIL("a directory under a regular file must not open");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::io_failure);
    CHECK(std::string(e.what()).find(bad.string()) != std::string::npos);
  }
  CHECK_THROWS_AS(DiskTier{blocker}, Error);  // the path itself is a regular file
}

namespace {

DiskTierOptions capped(std::uint64_t bytes) {
  DiskTierOptions o;
  o.capacity_bytes = bytes;
  return o;
}

std::set<std::uint64_t> hashes_held(const DiskTier& tier) {
  std::set<std::uint64_t> out;
  for (const TierKey& k : tier.keys(EntryKind::kv_chunk)) out.insert(k.hash.value);
  return out;
}

}  // namespace

TEST_CASE("disk tier: at its capacity a put deletes the least recently used entries, and a hit makes an entry recent") {
  TempDir dir;
  DiskTier tier(dir.path, capped(3000));
  for (std::uint64_t h = 1; h <= 3; ++h) REQUIRE(tier.put(key_of(h), pattern(h, 1000)));
  std::vector<std::byte> staging(4096);
  REQUIRE(tier.get(key_of(1), staging).hit());  // 2 is now the least recently used
  REQUIRE(tier.put(key_of(4), pattern(4, 1000)));
  CHECK(hashes_held(tier) == std::set<std::uint64_t>{1, 3, 4});
  CHECK_FALSE(fs::exists(tier.path_of(key_of(2))));  // its file is gone, not only its name
  CHECK(tier.get(key_of(2), staging).status() == GetStatus::miss);
  CHECK(testing::regular_files_in(dir.path) == 3);

  // A put that needs two entries' room takes the two oldest (3, then 1).
  REQUIRE(tier.put(key_of(5), pattern(5, 1900)));
  CHECK(hashes_held(tier) == std::set<std::uint64_t>{4, 5});
  auto s = tier.stats();
  CHECK(s.evictions == 3);
  CHECK(s.bytes == 2900);
  CHECK(s.capacity == 3000);
  CHECK(s.bytes <= s.capacity);

  // Larger than the whole capacity: refused, nothing written, nothing evicted.
  CHECK_FALSE(tier.put(key_of(6), pattern(6, 3001)));
  CHECK_FALSE(fs::exists(tier.path_of(key_of(6))));
  s = tier.stats();
  CHECK(s.put_failures == 1);
  CHECK(s.evictions == 3);
  CHECK(hashes_held(tier) == std::set<std::uint64_t>{4, 5});

  // Replacing an entry counts its new size once and makes it the most recent.
  REQUIRE(tier.put(key_of(4), pattern(40, 1100)));
  REQUIRE(tier.put(key_of(7), pattern(7, 1000)));  // 3000 + 1000 > 3000: 5 goes, not 4
  CHECK(hashes_held(tier) == std::set<std::uint64_t>{4, 7});
  CHECK(tier.stats().bytes == 2100);
  const TierView v = tier.get(key_of(4), staging);
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), pattern(40, 1100)));
}

TEST_CASE("R18 disk tier: a restart keeps the capacity and the recency order, and a lower capacity evicts the oldest at open") {
  TempDir dir;
  std::vector<std::byte> staging(4096);
  {
    DiskTier tier(dir.path, capped(4000));
    for (std::uint64_t h = 1; h <= 4; ++h) REQUIRE(tier.put(key_of(h), pattern(h, 1000)));
    REQUIRE(tier.get(key_of(1), staging).hit());
    REQUIRE(tier.get(key_of(2), staging).hit());  // most recent first: 2, 1, 4, 3
  }
  {
    DiskTier tier(dir.path, capped(4000));
    CHECK(tier.stats().evictions == 0);
    CHECK(hashes_held(tier) == std::set<std::uint64_t>{1, 2, 3, 4});
    REQUIRE(tier.put(key_of(5), pattern(5, 1000)));  // the oldest before the restart goes
    CHECK(hashes_held(tier) == std::set<std::uint64_t>{1, 2, 4, 5});
  }  // 5, 2, 1, 4
  DiskTier smaller(dir.path, capped(2000));
  const auto s = smaller.stats();
  CHECK(s.evictions == 2);
  CHECK(s.bytes == 2000);
  CHECK(hashes_held(smaller) == std::set<std::uint64_t>{2, 5});
  CHECK(testing::regular_files_in(dir.path) == 2);
  for (std::uint64_t h : {2, 5}) {
    const TierView v = smaller.get(key_of(h), staging);
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), pattern(h, 1000)));
  }
}

TEST_CASE("disk tier: a full disk during a put is a failed put, counted, and the previous entry is still served whole") {
  TempDir dir;
  DiskTier tier(dir.path);
  const auto old_bytes = pattern(1, 100);
  REQUIRE(tier.put(key_of(1), old_bytes));
  {
    // A file size limit makes write() fail with EFBIG part way through the file, as a full
    // disk fails it with ENOSPC (SIGXFSZ ignored, so the call returns the error).
    rlimit saved{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &saved) == 0);
    const auto previous = std::signal(SIGXFSZ, SIG_IGN);
    rlimit small = saved;
    small.rlim_cur = 4096;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    const bool stored = tier.put(key_of(1), pattern(2, 64 * 1024));
    const bool stored_new = tier.put(key_of(2), pattern(3, 64 * 1024));
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &saved) == 0);
    std::signal(SIGXFSZ, previous);
    CHECK_FALSE(stored);
    CHECK_FALSE(stored_new);
  }
  const auto s = tier.stats();
  CHECK(s.put_failures == 2);
  CHECK(s.io_errors >= 2);
  CHECK(s.entries == 1);
  CHECK(s.bytes == old_bytes.size());
  CHECK_FALSE(has_temp_files(dir.path));  // the torn temporary files were removed
  std::vector<std::byte> staging(128 * 1024);
  const TierView v = tier.get(key_of(1), staging);
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), old_bytes));
  CHECK(tier.get(key_of(2), staging).status() == GetStatus::miss);

  DiskTier reopened(dir.path);  // nothing torn is adopted after a restart either
  CHECK(reopened.stats().entries == 1);
  CHECK(reopened.stats().quarantined == 0);
  const TierView again = reopened.get(key_of(1), staging);
  REQUIRE(again.hit());
  CHECK(same(again.bytes(), old_bytes));
}

TEST_CASE("R19 disk tier: a capacity of 0 is an invalid_argument that names it") {
  TempDir dir;
  try {
    DiskTier tier(dir.path, capped(0));
    FAIL("a capacity of 0 must not open");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("capacity_bytes") != std::string::npos);
    CHECK(std::string(e.what()).find("got 0") != std::string::npos);
  }
}
