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
#include <thread>
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
static_assert(Tier<MemoryTier<PoolCountingSource>>);
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

// ---- The pool (MemoryTierPool) ----

namespace {

// free + held + retired + filling == blocks, and the catalogue's bytes are block bytes.
void check_pool_consistent(const MemoryTierStats& s, const MemoryTierPoolStats& p) {
  CHECK(p.free_blocks + p.held_blocks + p.retired_blocks + p.filling_blocks == p.blocks);
  CHECK(p.held_blocks == s.entries);
  CHECK(s.bytes <= p.bytes);
  CHECK(s.bytes <= s.capacity);
}

std::string thrown_by(std::size_t capacity, const MemoryTierPool& pool) {
  try {
    MemoryTier<> tier(capacity, pool);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    return e.what();
  }
  FAIL("the pool must be refused");
  return {};
}

}  // namespace

TEST_CASE("memory tier pool: puts make no allocate_pinned call after construction and the slabs go at destruction") {
  PoolCountingSource source;
  {
    MemoryTier<PoolCountingSource> tier(1 << 20, source, MemoryTierPool{{1024, 8}, {4096, 4}, {65536, 2}});
    CHECK(source.allocate_calls == 3);  // one slab per class
    CHECK(source.allocated_bytes == 1024 * 8 + 4096 * 4 + 65536 * 2);
    for (std::uint64_t round = 0; round < 5; ++round)
      for (std::uint64_t h = 0; h < 20; ++h) REQUIRE(tier.put(key_of(h), pattern(h + round, 100 + 311 * h)));
    for (std::uint64_t h = 0; h < 20; ++h) (void)tier.erase(key_of(h));
    CHECK(source.allocate_calls == 3);
    CHECK(source.free_calls == 0);
    const auto p = tier.pool_stats();
    CHECK(p.blocks == 14);
    CHECK(p.free_blocks == 14);
    CHECK(p.bytes == 1024 * 8 + 4096 * 4 + 65536 * 2);
  }
  CHECK(source.free_calls == 3);
}

TEST_CASE("memory tier pool: the smallest fitting class serves a put and stats count block bytes") {
  MemoryTier<> tier(1 << 20, MemoryTierPool{{1024, 2}, {4096, 2}, {65536, 1}});
  const auto a = pattern(1, 1000);
  REQUIRE(tier.put(key_of(1), a));  // 1000 -> the 1024 class
  CHECK(tier.pool_free_blocks(1024) == 1);
  CHECK(tier.pool_free_blocks(4096) == 2);
  REQUIRE(tier.put(key_of(2), pattern(2, 1025)));  // one over: the 4096 class
  CHECK(tier.pool_free_blocks(1024) == 1);
  CHECK(tier.pool_free_blocks(4096) == 1);
  REQUIRE(tier.put(key_of(3), pattern(3, 1024)));  // exactly a class: that class
  CHECK(tier.pool_free_blocks(1024) == 0);
  REQUIRE(tier.put(key_of(4), pattern(4, 10)));  // its class is full, a larger one is free: no eviction
  CHECK(tier.pool_free_blocks(4096) == 0);
  CHECK(tier.pool_free_blocks(65536) == 1);
  REQUIRE(tier.put(key_of(5), std::vector<std::byte>{}));  // zero bytes: the last free block
  const auto s = tier.stats();
  CHECK(s.evictions == 0);
  CHECK(s.entries == 5);
  CHECK(s.bytes == 1024 + 4096 + 1024 + 4096 + 65536);
  const auto p = tier.pool_stats();
  CHECK(p.free_blocks == 0);
  check_pool_consistent(s, p);
  const TierView v = tier.get(key_of(1), no_staging());
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), a));
}

TEST_CASE("memory tier pool: a put larger than the largest class fails and is counted and keeps the old entry") {
  PoolCountingSource source;
  MemoryTier<PoolCountingSource> tier(1 << 20, source, MemoryTierPool{{1024, 2}, {4096, 2}});
  const auto keep = pattern(1, 500);
  REQUIRE(tier.put(key_of(1), keep));
  CHECK_FALSE(tier.put(key_of(1), pattern(2, 4097)));  // fits the capacity, not the pool
  CHECK_FALSE(tier.put(key_of(2), pattern(3, 1 << 19)));
  const auto s = tier.stats();
  const auto p = tier.pool_stats();
  CHECK(s.put_failures == 2);
  CHECK(p.oversize == 2);
  CHECK(p.exhausted == 0);
  CHECK(s.evictions == 0);
  CHECK(source.allocate_calls == 2);  // never outside the pool
  const TierView v = tier.get(key_of(1), no_staging());
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), keep));
}

TEST_CASE("memory tier pool: an exhausted class evicts the least recently used fitting entry and then succeeds") {
  MemoryTier<> tier(1 << 20, MemoryTierPool{{1024, 3}, {4096, 1}});
  REQUIRE(tier.put(key_of(9), pattern(9, 4000)));  // the big block
  for (std::uint64_t h = 1; h <= 3; ++h) REQUIRE(tier.put(key_of(h), pattern(h, 1000)));
  (void)tier.get(key_of(9), no_staging());
  (void)tier.get(key_of(1), no_staging());  // 2 is now the coldest entry
  REQUIRE(tier.put(key_of(4), pattern(4, 1000)));
  CHECK_FALSE(tier.contains(key_of(2)));
  for (std::uint64_t h : {1u, 3u, 4u, 9u}) CHECK(tier.contains(key_of(h)));
  CHECK(tier.stats().evictions == 1);
  // A big put may only evict an entry whose block fits it: 9, although 3 is colder.
  (void)tier.get(key_of(1), no_staging());
  (void)tier.get(key_of(4), no_staging());
  REQUIRE(tier.put(key_of(5), pattern(5, 2000)));
  CHECK_FALSE(tier.contains(key_of(9)));
  CHECK(tier.contains(key_of(3)));
  // A small put with every block full takes the coldest fitting entry of any class.
  (void)tier.get(key_of(5), no_staging());  // 3 is the coldest overall
  REQUIRE(tier.put(key_of(6), pattern(6, 10)));
  CHECK_FALSE(tier.contains(key_of(3)));
  const auto s = tier.stats();
  const auto p = tier.pool_stats();
  CHECK(s.evictions == 3);
  CHECK(p.exhausted == 0);
  CHECK(p.free_blocks == 0);
  check_pool_consistent(s, p);
  const TierView v = tier.get(key_of(5), no_staging());
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), pattern(5, 2000)));
}

TEST_CASE("memory tier pool: with every fitting block pinned by a view the put fails and is counted") {
  MemoryTier<> tier(1 << 20, MemoryTierPool{{1024, 2}, {4096, 1}});
  REQUIRE(tier.put(key_of(1), pattern(1, 1000)));
  REQUIRE(tier.put(key_of(2), pattern(2, 1000)));
  REQUIRE(tier.put(key_of(3), pattern(3, 4000)));
  TierView big = tier.get(key_of(3), no_staging());
  CHECK_FALSE(tier.put(key_of(4), pattern(4, 3000)));  // only the pinned big block fits
  CHECK(tier.contains(key_of(3)));                     // a pinned entry is never evicted for it
  TierView a = tier.get(key_of(1), no_staging());
  TierView b = tier.get(key_of(2), no_staging());
  const auto keep = pattern(5, 100);
  CHECK_FALSE(tier.put(key_of(1), pattern(5, 100)));  // every block pinned: the overwrite fails
  CHECK(same(a.bytes(), pattern(1, 1000)));
  auto s = tier.stats();
  auto p = tier.pool_stats();
  CHECK(s.put_failures == 2);
  CHECK(p.exhausted == 2);
  CHECK(s.evictions == 0);
  check_pool_consistent(s, p);
  b = TierView();  // unpinned, so now it can go
  REQUIRE(tier.put(key_of(6), keep));
  CHECK_FALSE(tier.contains(key_of(2)));
  CHECK(same(a.bytes(), pattern(1, 1000)));
  CHECK(same(big.bytes(), pattern(3, 4000)));
}

TEST_CASE("memory tier pool: blocks return on erase, overwrite, eviction, clear and the last view release") {
  MemoryTier<> tier(1 << 20, MemoryTierPool{{1024, 2}});
  auto free_now = [&] { return tier.pool_stats().free_blocks; };
  REQUIRE(tier.put(key_of(1), pattern(1, 100)));
  CHECK(free_now() == 1);
  CHECK(tier.erase(key_of(1)));  // erase
  CHECK(free_now() == 2);
  REQUIRE(tier.put(key_of(1), pattern(1, 100)));
  REQUIRE(tier.put(key_of(1), pattern(2, 200)));  // overwrite: the old block comes back
  CHECK(free_now() == 1);
  CHECK(tier.stats().bytes == 1024);
  REQUIRE(tier.put(key_of(2), pattern(3, 300)));
  REQUIRE(tier.put(key_of(3), pattern(4, 400)));  // eviction of 1
  CHECK_FALSE(tier.contains(key_of(1)));
  CHECK(free_now() == 0);
  CHECK(tier.pool_stats().held_blocks == 2);

  {  // a view keeps an erased entry's block until it goes
    TierView v = tier.get(key_of(2), no_staging());
    CHECK(tier.erase(key_of(2)));
    auto p = tier.pool_stats();
    CHECK(p.free_blocks == 0);
    CHECK(p.retired_blocks == 1);
    CHECK(tier.stats().retired_bytes == 1024);
    CHECK(same(v.bytes(), pattern(3, 300)));
    TierView moved = std::move(v);
    v = TierView();
    CHECK(tier.pool_stats().retired_blocks == 1);
    moved = TierView();  // last view: back on the free list
    p = tier.pool_stats();
    CHECK(p.free_blocks == 1);
    CHECK(p.retired_blocks == 0);
    CHECK(tier.stats().retired_bytes == 0);
  }
  {  // an overwrite under a view: the old block is retired, then returned
    TierView v = tier.get(key_of(3), no_staging());
    REQUIRE(tier.put(key_of(3), pattern(5, 500)));
    CHECK(tier.pool_stats().retired_blocks == 1);
    CHECK(tier.pool_stats().free_blocks == 0);
    CHECK(same(v.bytes(), pattern(4, 400)));
    v = TierView();
    CHECK(tier.pool_stats().free_blocks == 1);
    CHECK(tier.pool_stats().retired_blocks == 0);
  }
  tier.clear();  // clear
  const auto p = tier.pool_stats();
  CHECK(p.free_blocks == 2);
  CHECK(p.held_blocks == 0);
  CHECK(tier.stats().bytes == 0);
  check_pool_consistent(tier.stats(), p);
}

TEST_CASE("memory tier pool: a bad pool is a typed error that names the bad value") {
  CHECK(thrown_by(1 << 20, {{1024, 2}, {0, 4}}).find("class 1 class_bytes must be > 0, got 0") != std::string::npos);
  CHECK(thrown_by(1 << 20, {{1024, 0}}).find("class_bytes 1024) count must be > 0, got 0") != std::string::npos);
  const std::string too_big = thrown_by(1000, {{2000, 1}});
  CHECK(too_big.find("class_bytes 2000 is larger than capacity_bytes 1000") != std::string::npos);
  const std::string duplicate = thrown_by(1 << 20, {{4096, 1}, {4096, 2}});
  CHECK(duplicate.find("class_bytes 4096 must be larger than the previous class's 4096") != std::string::npos);
  const std::string unsorted = thrown_by(1 << 20, {{4096, 1}, {1024, 2}});
  CHECK(unsorted.find("class 1 class_bytes 1024 must be larger than the previous class's 4096") != std::string::npos);
  const std::string over = thrown_by(10000, {{1000, 5}, {2000, 3}});
  CHECK(over.find("pool bytes (sum of class_bytes x count) 11000 exceed capacity_bytes 10000") != std::string::npos);
  const std::string overflow = thrown_by(std::size_t{1} << 40, {{std::size_t{1} << 30, std::size_t{1} << 40}});
  CHECK(overflow.find("overflows") != std::string::npos);
  CHECK(thrown_by(0, {{1, 1}}).find("capacity_bytes must be > 0, got 0") != std::string::npos);
  // Exactly the capacity is fine, and an empty pool is no pool.
  MemoryTier<> exact(10000, MemoryTierPool{{1000, 6}, {2000, 2}});
  CHECK(exact.pool_stats().bytes == 10000);
  MemoryTier<> none(1000, MemoryTierPool{});
  CHECK(none.pool_stats().blocks == 0);
  CHECK(none.put(key_of(1), pattern(1, 1000)));
}
