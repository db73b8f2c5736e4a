// TieredTier under concurrent get/put/erase from several threads, with a small front that
// evicts all the time and a DiskTier back. Built and run under ThreadSanitizer as well
// (the *_threads.cpp rule).
//
// Every payload describes itself ([hash][version][bytes derived from both]), so a reader
// proves each hit is exactly what some put stored for that key. Once the threads are done,
// the front must agree with the back for every key: a promotion that raced a put or an
// erase was withdrawn, never left holding bytes the back does not. Random interleavings
// rarely hit that window, so three tests force each race with gates.
#include "test_support.hpp"
#include "tier_test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/tier/tiered_tier.hpp>

#include <atomic>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <thread>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

std::size_t size_for(std::uint64_t version) { return 256 + (version % 5) * 128; }

std::byte byte_at(std::uint64_t hash, std::uint64_t version, std::size_t i) {
  const std::uint64_t x = mix64(hash * 1000003 + version) + i * 0x9e3779b97f4a7c15ULL;
  return static_cast<std::byte>(x >> 56 ^ x);
}

void fill(std::vector<std::byte>& out, std::uint64_t hash, std::uint64_t version) {
  out.resize(size_for(version));
  std::memcpy(out.data(), &hash, 8);
  std::memcpy(out.data() + 8, &version, 8);
  for (std::size_t i = 16; i < out.size(); ++i) out[i] = byte_at(hash, version, i);
}

bool valid(std::span<const std::byte> bytes, std::uint64_t hash) {
  if (bytes.size() < 16) return false;
  std::uint64_t h = 0, version = 0;
  std::memcpy(&h, bytes.data(), 8);
  std::memcpy(&version, bytes.data() + 8, 8);
  if (h != hash || bytes.size() != size_for(version)) return false;
  for (std::size_t i = 16; i < bytes.size(); ++i)
    if (bytes[i] != byte_at(hash, version, i)) return false;
  return true;
}

template <class Front, class Back>
void hammer(Front& front, Back& back, int ops_per_thread) {
  constexpr int threads = 4;
  constexpr std::uint64_t keys = 12;
  TieredTier<Front, Back> tier(front, back);
  std::atomic<std::uint64_t> gets{0}, bad{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::uint64_t rng = mix64(static_cast<std::uint64_t>(t) + 17);
      std::vector<std::byte> staging(4096), payload;
      for (int i = 0; i < ops_per_thread; ++i) {
        rng = mix64(rng);
        const std::uint64_t hash = rng % keys;
        const unsigned op = static_cast<unsigned>(rng >> 32) % 10;
        if (op < 6) {
          gets.fetch_add(1, std::memory_order_relaxed);
          const TierView v = tier.get(key_of(hash), staging);
          if (v.status() == GetStatus::failed || (v.hit() && !valid(v.bytes(), hash)))
            bad.fetch_add(1, std::memory_order_relaxed);
        } else if (op < 9) {
          fill(payload, hash, (static_cast<std::uint64_t>(t) << 32) | static_cast<std::uint64_t>(i));
          if (!tier.put(key_of(hash), payload)) bad.fetch_add(1, std::memory_order_relaxed);
        } else {
          (void)tier.erase(key_of(hash));
        }
        if (i % 64 == 0) (void)tier.contains(key_of(hash));
        if (i % 128 == 0) (void)tier.stats();
      }
    });
  }
  for (auto& th : pool) th.join();

  CHECK(bad.load() == 0);
  const TieredTierStats st = tier.stats();
  CHECK(st.front_hits + st.back_hits + st.misses + st.failures == gets.load());
  CHECK(st.failures == 0);
  CHECK(st.put_failures == 0);
  CHECK(st.front_hits > 0);
  CHECK(st.back_hits > 0);  // the front is small: the back served some

  // Quiescent: what the front holds, the back holds, byte for byte.
  std::vector<std::byte> staging(4096);
  for (std::uint64_t hash = 0; hash < keys; ++hash) {
    CAPTURE(hash);
    const TierView f = front.get(key_of(hash), staging);
    if (!f.hit()) continue;
    CHECK(valid(f.bytes(), hash));
    std::vector<std::byte> copy(f.bytes().begin(), f.bytes().end());
    const TierView b = back.get(key_of(hash), staging);
    REQUIRE(b.hit());
    CHECK(same(b.bytes(), copy));
  }
}

/// A MemoryTier with hooks a test sets before any thread starts (and never changes while
/// threads run): after a get's lookup, before a put, before an erase, after an erase.
struct HookedTier {
  MemoryTier<> inner{std::size_t{1} << 20};
  std::function<void()> after_get, before_put, before_erase, after_erase;
  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept {
    TierView view = inner.get(key, staging);
    if (after_get) after_get();
    return view;
  }
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept {
    if (before_put) before_put();
    return inner.put(key, bytes);
  }
  bool contains(const TierKey& key) const noexcept { return inner.contains(key); }
  bool erase(const TierKey& key) noexcept {
    if (before_erase) before_erase();
    const bool had = inner.erase(key);
    if (after_erase) after_erase();
    return had;
  }
};

/// A front and a back whose hooks the test sets, the tier over them, and key 1 stored in
/// the back only (as if the front had evicted it), so a get reads the back and promotes.
struct Race {
  HookedTier front, back;
  TieredTier<HookedTier, HookedTier> tier{front, back};
  std::vector<std::byte> old_bytes, new_bytes;
  Race() {
    fill(old_bytes, 1, 1);
    fill(new_bytes, 1, 2);
    REQUIRE(tier.put(key_of(1), old_bytes));
    REQUIRE(front.inner.erase(key_of(1)));
  }
  /// A get of key 1 on its own thread; what it saw is in `seen`.
  std::thread reader(std::vector<std::byte>& seen) {
    return std::thread([this, &seen] {
      std::vector<std::byte> staging(4096);
      const TierView v = tier.get(key_of(1), staging);
      if (v.hit()) seen.assign(v.bytes().begin(), v.bytes().end());
    });
  }
};

}  // namespace

TEST_CASE("tiered tier threads: an erase between a back read and its promotion withdraws the promotion") {
  Race race;
  Gate read, resume;
  race.back.after_get = [&] {
    read.open();
    (void)resume.pass();
  };
  std::vector<std::byte> seen;
  std::thread reader = race.reader(seen);
  REQUIRE(read.pass());            // the reader holds the old bytes, not yet promoted
  CHECK(race.tier.erase(key_of(1)));  // the erase runs to completion in that window
  resume.open();
  reader.join();
  CHECK(same(seen, race.old_bytes));  // a get that overlaps an erase may see the old entry
  CHECK_FALSE(race.front.contains(key_of(1)));  // but the front does not keep it
  CHECK_FALSE(race.tier.contains(key_of(1)));
}

TEST_CASE("tiered tier threads: a put between a back read and its promotion leaves the front with the new bytes or none") {
  Race race;
  Gate read, resume;
  race.back.after_get = [&] {
    read.open();
    (void)resume.pass();
  };
  std::vector<std::byte> seen;
  std::thread reader = race.reader(seen);
  REQUIRE(read.pass());
  CHECK(race.tier.put(key_of(1), race.new_bytes));
  resume.open();
  reader.join();
  CHECK(same(seen, race.old_bytes));
  race.back.after_get = nullptr;  // no thread is running: the hook may change
  std::vector<std::byte> staging(4096);
  {
    const TierView f = race.front.get(key_of(1), staging);
    if (f.hit()) CHECK(same(f.bytes(), race.new_bytes));
  }
  const TierView v = race.tier.get(key_of(1), staging);
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), race.new_bytes));
}

TEST_CASE("tiered tier threads: a get that begins while an erase is in flight does not promote") {
  // The erase has begun but not reached the back when the get reads the old bytes; the
  // erase then clears both tiers; only then would the get promote. It must not.
  Race race;
  Gate erase_began, erase_go, erase_cleared, erase_finish, read, read_go;
  race.back.before_erase = [&] {
    erase_began.open();
    (void)erase_go.pass();
  };
  race.front.after_erase = [&] {
    erase_cleared.open();
    (void)erase_finish.pass();
  };
  race.back.after_get = [&] {
    read.open();
    (void)read_go.pass();
  };
  std::thread eraser([&] { (void)race.tier.erase(key_of(1)); });
  REQUIRE(erase_began.pass());
  std::vector<std::byte> seen;
  std::thread reader = race.reader(seen);
  REQUIRE(read.pass());  // the reader read the old bytes from the back
  erase_go.open();
  REQUIRE(erase_cleared.pass());  // the eraser cleared the back and the front
  read_go.open();
  reader.join();  // the reader would promote now
  erase_finish.open();
  eraser.join();
  CHECK(same(seen, race.old_bytes));
  CHECK_FALSE(race.front.contains(key_of(1)));
  CHECK_FALSE(race.back.contains(key_of(1)));
  CHECK_FALSE(race.tier.contains(key_of(1)));
}

TEST_CASE("tiered tier threads: two puts of one key that overlap leave the front with the back's bytes or none") {
  // The first put has written the back and not yet the front when the second runs whole:
  // the back ends with the second's bytes, and the first's late front write must not stay.
  Race race;
  Gate first_at_front, first_go;
  std::atomic<bool> hold_first{true};
  race.front.before_put = [&] {
    if (!hold_first.exchange(false)) return;  // only the first put's front write waits
    first_at_front.open();
    (void)first_go.pass();
  };
  std::vector<std::byte> first_bytes;
  fill(first_bytes, 1, 3);
  std::thread first([&] { CHECK(race.tier.put(key_of(1), first_bytes)); });
  REQUIRE(first_at_front.pass());
  CHECK(race.tier.put(key_of(1), race.new_bytes));
  first_go.open();
  first.join();
  race.front.before_put = nullptr;
  std::vector<std::byte> staging(4096);
  const TierView b = race.back.get(key_of(1), staging);
  REQUIRE(b.hit());
  CHECK(same(b.bytes(), race.new_bytes));
  const TierView f = race.front.get(key_of(1), staging);
  if (f.hit()) CHECK(same(f.bytes(), race.new_bytes));
}

TEST_CASE("tiered tier threads: concurrent get/put/erase over a small memory front and a disk back") {
  TempDir dir("kvfuse-tiered-threads");
  MemoryTier<> front(4 * 768);  // three to twelve entries, depending on their sizes
  DiskTier back(dir.path);
  hammer(front, back, 1500);
}

TEST_CASE("tiered tier threads: concurrent get/put/erase over two memory tiers") {
  MemoryTier<> front(4 * 768);
  MemoryTier<> back(std::size_t{1} << 20);
  hammer(front, back, 20000);
}
