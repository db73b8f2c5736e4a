// MemoryTier (per-rank pinned LRU) and DelayTier, single-threaded behaviour.
#include "tier_test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/testing/delay_tier.hpp>
#include <kvfuse/tier/memory_tier.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

// Counts live allocations so a test can see exactly when bytes are freed; can be told to fail.
struct CountingSource {
  std::atomic<int> live{0};
  std::atomic<int> allocations{0};
  bool fail = false;
  void* allocate_pinned(std::size_t bytes) {
    if (fail) throw Error(ErrorCode::device_failure, "test source refuses " + std::to_string(bytes) + " bytes");
    ++live;
    ++allocations;
    return ::operator new(bytes == 0 ? 1 : bytes);
  }
  void free_pinned(void* p) noexcept {
    --live;
    ::operator delete(p);
  }
};

struct NotASource {
  void* allocate_pinned(std::size_t) { return nullptr; }
  void free_pinned(void*) {}  // not noexcept
};

std::span<std::byte> no_staging() { return {}; }

}  // namespace

static_assert(Tier<MemoryTier<>>);
static_assert(Tier<MemoryTier<CountingSource>>);
static_assert(Tier<DelayTier<MemoryTier<>>>);
static_assert(PinnedMemorySource<HeapPinnedSource>);
static_assert(PinnedMemorySource<CountingSource>);
static_assert(!PinnedMemorySource<NotASource>);
static_assert(!PinnedMemorySource<int>);

TEST_CASE("memory tier: get returns byte for byte what put stored - an absent key misses") {
  MemoryTier<> tier(1 << 20);
  const auto a = pattern(1, 4096);
  const auto b = pattern(2, 10000);
  const auto empty = std::vector<std::byte>{};
  CHECK(tier.put(key_of(1), a));
  CHECK(tier.put(key_of(2), b));
  CHECK(tier.put(key_of(3), empty));

  {
    const TierView va = tier.get(key_of(1), no_staging());
    REQUIRE(va.hit());
    CHECK(same(va.bytes(), a));
    CHECK(va.bytes().data() != a.data());  // a copy, not the caller's buffer
    const TierView vb = tier.get(key_of(2), no_staging());
    REQUIRE(vb.hit());
    CHECK(same(vb.bytes(), b));
    const TierView ve = tier.get(key_of(3), no_staging());
    REQUIRE(ve.hit());
    CHECK(ve.bytes().empty());
  }
  const TierView miss = tier.get(key_of(4), no_staging());
  CHECK(miss.status() == GetStatus::miss);
  CHECK(miss.bytes().empty());

  CHECK(tier.contains(key_of(1)));
  CHECK_FALSE(tier.contains(key_of(4)));
  const auto s = tier.stats();
  CHECK(s.entries == 3);
  CHECK(s.bytes == a.size() + b.size());
  CHECK(s.capacity == 1 << 20);
  CHECK(s.hits == 3);
  CHECK(s.misses == 1);
  CHECK(s.puts == 3);
  CHECK(s.put_failures == 0);
  CHECK(s.evictions == 0);
  CHECK(s.retired_bytes == 0);
}

TEST_CASE("memory tier: rank / model / world size / kind are all part of the key") {
  MemoryTier<> tier(1 << 20);
  const auto mine = pattern(10, 256);
  REQUIRE(tier.put(key_of(5, /*rank*/ 0), mine));
  CHECK(tier.get(key_of(5, /*rank*/ 1), no_staging()).status() == GetStatus::miss);
  CHECK(tier.get(key_of(5, 0, EntryKind::state), no_staging()).status() == GetStatus::miss);
  CHECK(tier.get(key_of(5, 0, EntryKind::kv_chunk, /*model*/ 8), no_staging()).status() == GetStatus::miss);
  CHECK(tier.get(key_of(5, 0, EntryKind::kv_chunk, 7, /*world*/ 8), no_staging()).status() == GetStatus::miss);
  const TierView v = tier.get(key_of(5, 0), no_staging());
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), mine));
}

TEST_CASE("R19 memory tier: a zero capacity is a typed error that names the value") {
  try {
    MemoryTier<> tier(0);
    FAIL("MemoryTier(0) must throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    const std::string what = e.what();
    CHECK(what.find("capacity_bytes") != std::string::npos);
    CHECK(what.find("got 0") != std::string::npos);
  }
  CountingSource source;
  CHECK_THROWS_AS(MemoryTier<CountingSource>(0, source), Error);
}

TEST_CASE("memory tier: an entry larger than the capacity is refused and counted and keeps the old one") {
  MemoryTier<> tier(1000);
  const auto small = pattern(3, 600);
  REQUIRE(tier.put(key_of(1), small));
  CHECK_FALSE(tier.put(key_of(1), pattern(4, 1001)));
  CHECK_FALSE(tier.put(key_of(2), pattern(5, 5000)));
  CHECK(tier.put(key_of(3), pattern(6, 400)));  // exactly fills the capacity: no eviction
  const auto s = tier.stats();
  CHECK(s.put_failures == 2);
  CHECK(s.evictions == 0);
  CHECK(s.bytes == 1000);
  const TierView v = tier.get(key_of(1), no_staging());
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), small));
  CHECK(tier.put(key_of(4), pattern(7, 1000)));  // exactly the capacity: evicts everything else
  CHECK(tier.stats().entries == 1);
}

TEST_CASE("memory tier: the least recently used entry is evicted first and a get refreshes") {
  MemoryTier<> tier(300);
  for (std::uint64_t h = 1; h <= 3; ++h) REQUIRE(tier.put(key_of(h), pattern(h, 100)));
  (void)tier.get(key_of(1), no_staging());  // 1 is now the most recently used; 2 is coldest
  REQUIRE(tier.put(key_of(4), pattern(4, 100)));
  CHECK(tier.contains(key_of(1)));
  CHECK_FALSE(tier.contains(key_of(2)));
  CHECK(tier.contains(key_of(3)));
  CHECK(tier.contains(key_of(4)));
  REQUIRE(tier.put(key_of(5), pattern(5, 200)));  // needs two: 3 then 1
  CHECK_FALSE(tier.contains(key_of(3)));
  CHECK_FALSE(tier.contains(key_of(1)));
  CHECK(tier.contains(key_of(4)));
  const auto s = tier.stats();
  CHECK(s.evictions == 3);
  CHECK(s.bytes == 300);
  for (std::uint64_t h : {4u, 5u}) {
    const TierView v = tier.get(key_of(h), no_staging());
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), pattern(h, h == 5 ? 200 : 100)));
  }
}

TEST_CASE("memory tier: a view keeps an evicted entry's bytes alive and frees them when it goes") {
  CountingSource source;
  {
    MemoryTier<CountingSource> tier(256, source);
    const auto a = pattern(11, 256);
    REQUIRE(tier.put(key_of(1), a));
    TierView held = tier.get(key_of(1), no_staging());
    REQUIRE(held.hit());
    // The only entry is pinned, so this put must unlink it anyway (it is the last resort).
    REQUIRE(tier.put(key_of(2), pattern(12, 256)));
    CHECK_FALSE(tier.contains(key_of(1)));
    CHECK(tier.get(key_of(1), no_staging()).status() == GetStatus::miss);
    CHECK(source.live == 2);  // the evicted bytes are still there for the view
    CHECK(tier.stats().retired_bytes == 256);
    CHECK(tier.stats().bytes == 256);
    CHECK(same(held.bytes(), a));  // under ASan a premature free would be a use-after-free here

    TierView moved = std::move(held);  // moving hands the pin over, it does not release it
    CHECK(source.live == 2);
    CHECK(same(moved.bytes(), a));
    moved = TierView();  // last view gone: freed now, on this thread
    CHECK(source.live == 1);
    CHECK(tier.stats().retired_bytes == 0);
  }
  CHECK(source.live == 0);
  CHECK(source.allocations == 2);
}

TEST_CASE("memory tier: unpinned entries are evicted before a pinned colder one") {
  MemoryTier<> tier(300);
  REQUIRE(tier.put(key_of(1), pattern(1, 100)));
  REQUIRE(tier.put(key_of(2), pattern(2, 100)));
  REQUIRE(tier.put(key_of(3), pattern(3, 100)));
  TierView pin = tier.get(key_of(1), no_staging());  // refreshes 1; make it the coldest again:
  (void)tier.get(key_of(2), no_staging());
  (void)tier.get(key_of(3), no_staging());
  REQUIRE(tier.put(key_of(4), pattern(4, 100)));  // coldest is 1 (pinned): 2 goes instead
  CHECK(tier.contains(key_of(1)));
  CHECK_FALSE(tier.contains(key_of(2)));
  CHECK(tier.stats().retired_bytes == 0);
  CHECK(same(pin.bytes(), pattern(1, 100)));
}

TEST_CASE("memory tier: an overwrite or erase under a live view leaves the view's bytes intact") {
  CountingSource source;
  MemoryTier<CountingSource> tier(1 << 16, source);
  const auto v1 = pattern(21, 777);
  const auto v2 = pattern(22, 555);
  REQUIRE(tier.put(key_of(1), v1));
  TierView old_view = tier.get(key_of(1), no_staging());
  REQUIRE(tier.put(key_of(1), v2));
  {
    const TierView fresh = tier.get(key_of(1), no_staging());
    REQUIRE(fresh.hit());
    CHECK(same(fresh.bytes(), v2));
  }
  CHECK(same(old_view.bytes(), v1));
  CHECK(tier.stats().entries == 1);
  CHECK(tier.stats().bytes == v2.size());
  CHECK(tier.stats().retired_bytes == v1.size());

  TierView second = tier.get(key_of(1), no_staging());
  CHECK(tier.erase(key_of(1)));
  CHECK_FALSE(tier.erase(key_of(1)));
  CHECK_FALSE(tier.contains(key_of(1)));
  CHECK(same(second.bytes(), v2));
  CHECK(source.live == 2);
  old_view = TierView();
  second = TierView();
  CHECK(source.live == 0);
  CHECK(tier.stats().retired_bytes == 0);
  CHECK(tier.stats().bytes == 0);
}

TEST_CASE("memory tier: a failing pinned source makes put return false (counted) and leaks nothing") {
  CountingSource source;
  MemoryTier<CountingSource> tier(1 << 16, source);
  const auto keep = pattern(31, 100);
  REQUIRE(tier.put(key_of(1), keep));
  source.fail = true;
  CHECK_FALSE(tier.put(key_of(1), pattern(32, 100)));
  CHECK_FALSE(tier.put(key_of(2), pattern(33, 100)));
  source.fail = false;
  const auto s = tier.stats();
  CHECK(s.put_failures == 2);
  CHECK(s.puts == 1);
  CHECK(source.live == 1);
  const TierView v = tier.get(key_of(1), no_staging());
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), keep));
}

TEST_CASE("memory tier: clear and destruction free everything exactly once") {
  CountingSource source;
  {
    MemoryTier<CountingSource> tier(1 << 16, source);
    for (std::uint64_t h = 0; h < 10; ++h) REQUIRE(tier.put(key_of(h), pattern(h, 64 + h)));
    tier.clear();
    CHECK(source.live == 0);
    CHECK(tier.stats().entries == 0);
    CHECK(tier.stats().bytes == 0);
    for (std::uint64_t h = 0; h < 10; ++h) REQUIRE(tier.put(key_of(h), pattern(h, 64)));
    CHECK(source.live == 10);
  }
  CHECK(source.live == 0);
  CHECK(source.allocations == 20);
}

TEST_CASE("HeapPinnedSource: memory is aligned for vector copies") {
  HeapPinnedSource source;
  void* p = source.allocate_pinned(100);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % HeapPinnedSource::alignment == 0);
  source.free_pinned(p);
  void* z = source.allocate_pinned(0);
  CHECK(z != nullptr);
  source.free_pinned(z);
}

TEST_CASE("delay tier: forwards every call and each get takes at least the delay") {
  using namespace std::chrono_literals;
  DelayTier<MemoryTier<>> tier(2ms, std::size_t{1} << 16);
  CHECK(tier.delay() == 2ms);
  const auto a = pattern(41, 300);
  REQUIRE(tier.put(key_of(1), a));
  CHECK(tier.contains(key_of(1)));
  const auto start = std::chrono::steady_clock::now();
  {
    const TierView v = tier.get(key_of(1), no_staging());
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), a));
  }
  CHECK(tier.get(key_of(2), no_staging()).status() == GetStatus::miss);  // a miss pays too
  // A lower bound only: sleep_for never returns early, so this cannot flake on a slow machine.
  CHECK(std::chrono::steady_clock::now() - start >= 4ms);
  CHECK(tier.inner().stats().hits == 1);
  CHECK(tier.inner().stats().misses == 1);
  CHECK(tier.erase(key_of(1)));
  CHECK_FALSE(tier.contains(key_of(1)));
}

TEST_CASE("R19 delay tier: a negative delay is a typed error that names the value") {
  using namespace std::chrono_literals;
  try {
    DelayTier<MemoryTier<>> tier(-5ns, std::size_t{1024});
    FAIL("a negative delay must throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("-5 ns") != std::string::npos);
  }
}
