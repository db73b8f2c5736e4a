// kvfuse's header-only xxHash (detail/checksum.hpp, XXH_INLINE_ALL) beside an engine that
// includes <xxhash.h> first, plainly, and links Debian's libxxhash: the unit compiles, links
// without duplicate symbols, and both give the same values. (tests/test_disk_tier.cpp covers
// the other order: kvfuse first, <xxhash.h> after.)
#include <xxhash.h>  // first, without XXH_INLINE_ALL: declarations of libxxhash's symbols

#include <cstddef>
#include <cstdint>

namespace {
// The engine's own calls, bound here to libxxhash's exported functions (the names are not
// yet renamed by kvfuse's include below).
std::uint64_t engine_xxh3(const void* p, std::size_t n) { return XXH3_64bits(p, n); }
std::uint64_t engine_xxh64(const void* p, std::size_t n) { return XXH64(p, n, 0); }
unsigned engine_version() { return XXH_versionNumber(); }
}  // namespace

#include "tier_test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/detail/checksum.hpp>
#include <kvfuse/tier/disk_format.hpp>

#include <span>
#include <vector>

using namespace kvfuse;

TEST_CASE("checksum: kvfuse's inline xxHash and a linked libxxhash in one unit agree") {
  CHECK(engine_version() >= 800u);  // libxxhash 0.8 or later answered
  for (std::size_t n : {0u, 1u, 16u, 17u, 128u, 129u, 240u, 241u, 1024u, 100000u}) {
    CAPTURE(n);
    const std::vector<std::byte> bytes = testing::pattern(n + 1, n);
    CHECK(detail::xxh3_64(bytes) == engine_xxh3(bytes.data(), bytes.size()));
    CHECK(detail::xxh64(bytes) == engine_xxh64(bytes.data(), bytes.size()));
    CHECK(detail::disk::entry_checksum(2, bytes) == engine_xxh3(bytes.data(), bytes.size()));
    CHECK(detail::disk::entry_checksum(1, bytes) == engine_xxh64(bytes.data(), bytes.size()));
  }
  // After kvfuse's include, the engine's spelling XXH3_64bits is the inline one: same value.
  const std::vector<std::byte> bytes = testing::pattern(5, 4096);
  CHECK(XXH3_64bits(bytes.data(), bytes.size()) == engine_xxh3(bytes.data(), bytes.size()));
}
