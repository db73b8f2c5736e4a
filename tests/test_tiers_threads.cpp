// MemoryTier and DiskTier under concurrent put/get/erase/evict while views are held.
// Built and run under ThreadSanitizer as well (the *_threads.cpp rule).
//
// Every payload describes itself: [hash][version][bytes derived from both], with a length
// derived from the version. A reader can therefore prove, for any view it gets, that the
// bytes are exactly what some put stored for that very key — not a torn mix of two puts,
// not another key's entry, not memory that was freed and reused.
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/memory_tier.hpp>

#include <stdlib.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <thread>
#include <vector>

using namespace kvfuse;
namespace fs = std::filesystem;

namespace {

TierKey key_of(std::uint64_t hash) {
  TierKey k;
  k.model = 3;
  k.hash = PrefixHash{hash};
  k.world_size = 2;
  k.rank = 1;
  return k;
}

std::size_t size_for(std::uint64_t version, std::size_t base) { return base + (version % 7) * 96; }

std::uint8_t byte_at(std::uint64_t hash, std::uint64_t version, std::size_t i) {
  const std::uint64_t x = mix64(hash * 1000003 + version) + i * 0x9e3779b97f4a7c15ULL;
  return static_cast<std::uint8_t>(x >> 56 ^ x);
}

void fill(std::vector<std::byte>& out, std::uint64_t hash, std::uint64_t version, std::size_t base) {
  out.resize(size_for(version, base));
  std::memcpy(out.data(), &hash, 8);
  std::memcpy(out.data() + 8, &version, 8);
  for (std::size_t i = 16; i < out.size(); ++i) out[i] = static_cast<std::byte>(byte_at(hash, version, i));
}

bool valid(std::span<const std::byte> bytes, std::uint64_t hash, std::size_t base) {
  if (bytes.size() < 16) return false;
  std::uint64_t h = 0, version = 0;
  std::memcpy(&h, bytes.data(), 8);
  std::memcpy(&version, bytes.data() + 8, 8);
  if (h != hash || bytes.size() != size_for(version, base)) return false;
  for (std::size_t i = 16; i < bytes.size(); ++i)
    if (bytes[i] != static_cast<std::byte>(byte_at(hash, version, i))) return false;
  return true;
}

struct Rng {
  std::uint64_t s;
  std::uint64_t next() { return s = mix64(s); }
};

struct CountingSource {
  std::atomic<long> live{0};
  void* allocate_pinned(std::size_t bytes) {
    live.fetch_add(1);
    return ::operator new(bytes == 0 ? 1 : bytes);
  }
  void free_pinned(void* p) noexcept {
    live.fetch_sub(1);
    ::operator delete(p);
  }
};

using TempDir = testing::TempDir;  // TempDir dir; / dir.path

}  // namespace

TEST_CASE("memory tier threads: concurrent put/get/erase with held views always read what was put for that key") {
  constexpr int threads = 4;
  constexpr int ops = 20000;
  constexpr std::uint64_t keys = 48;
  constexpr std::size_t base = 256;
  // Room for about a dozen entries: nearly every put evicts, often an entry a view holds.
  constexpr std::size_t capacity = 12 * (base + 3 * 96);

  CountingSource source;
  std::atomic<long> bad{0}, gets{0}, hit_count{0}, overwrote_held{0};
  {
    MemoryTier<CountingSource> tier(capacity, source);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        Rng rng{static_cast<std::uint64_t>(t) + 1};
        std::vector<std::byte> payload;
        struct Held {
          TierView view;
          std::uint64_t hash = 0;
        };
        std::array<Held, 3> held;  // views kept alive across other threads' evictions
        for (int i = 0; i < ops; ++i) {
          const std::uint64_t hash = rng.next() % keys;
          const std::uint64_t op = rng.next() % 10;
          if (op < 4) {
            fill(payload, hash, (static_cast<std::uint64_t>(t) << 32) | static_cast<std::uint64_t>(i), base);
            if (!tier.put(key_of(hash), payload)) bad.fetch_add(1);  // always fits: must succeed
            for (const Held& h : held) {
              // This thread's own view of the key it just replaced pins the old entry: it
              // must now be retired (unlinked, not freed) until the view goes.
              if (h.view.hit() && h.hash == hash) {
                overwrote_held.fetch_add(1);
                if (tier.stats().retired_bytes < h.view.bytes().size()) bad.fetch_add(1);
                if (!valid(h.view.bytes(), h.hash, base)) bad.fetch_add(1);
              }
            }
          } else if (op < 9) {
            TierView v = tier.get(key_of(hash), {});
            gets.fetch_add(1);
            if (v.hit()) {
              hit_count.fetch_add(1);
              if (!valid(v.bytes(), hash, base)) bad.fetch_add(1);
              Held& slot = held[static_cast<std::size_t>(i) % held.size()];
              if (slot.view.hit() && !valid(slot.view.bytes(), slot.hash, base)) bad.fetch_add(1);
              slot.view = std::move(v);  // releases the previous one
              slot.hash = hash;
            } else if (v.status() != GetStatus::miss) {
              bad.fetch_add(1);
            }
          } else {
            (void)tier.erase(key_of(hash));
          }
        }
        for (Held& h : held)
          if (h.view.hit() && !valid(h.view.bytes(), h.hash, base)) bad.fetch_add(1);
      });
    }
    for (auto& th : pool) th.join();

    const auto s = tier.stats();
    CHECK(bad.load() == 0);
    CHECK(s.bytes <= capacity);
    CHECK(s.retired_bytes == 0);  // every view is gone, so every retired entry was freed
    CHECK(s.hits == static_cast<std::uint64_t>(hit_count.load()));
    CHECK(s.hits + s.misses == static_cast<std::uint64_t>(gets.load()));
    CHECK(s.put_failures == 0);
    CHECK(s.evictions > 0);
    CHECK(overwrote_held.load() > 0);  // the pinned-overwrite path really ran
    CHECK(source.live.load() == static_cast<long>(s.entries));
    for (std::uint64_t h = 0; h < keys; ++h) {
      const TierView v = tier.get(key_of(h), {});
      if (v.hit()) CHECK(valid(v.bytes(), h, base));
    }
  }
  CHECK(source.live.load() == 0);
}

namespace {

// Three threads put, get and erase twelve keys at random on `tier`; returns how many calls
// saw something other than a whole entry of their own key (or a miss).
long hammer_disk_tier(DiskTier& tier, std::size_t base) {
  constexpr int threads = 3;
  constexpr int ops = 300;
  constexpr std::uint64_t keys = 12;
  std::atomic<long> bad{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      Rng rng{static_cast<std::uint64_t>(t) + 100};
      std::vector<std::byte> payload;
      std::vector<std::byte> staging(8192);
      for (int i = 0; i < ops; ++i) {
        const std::uint64_t hash = rng.next() % keys;
        const std::uint64_t op = rng.next() % 10;
        if (op < 4) {
          fill(payload, hash, (static_cast<std::uint64_t>(t) << 32) | static_cast<std::uint64_t>(i), base);
          if (!tier.put(key_of(hash), payload)) bad.fetch_add(1);
        } else if (op < 9) {
          const TierView v = tier.get(key_of(hash), staging);
          if (v.hit() ? !valid(v.bytes(), hash, base) : v.status() != GetStatus::miss) bad.fetch_add(1);
        } else {
          (void)tier.erase(key_of(hash));
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  return bad.load();
}

// Reopens `dir` and checks that every entry it holds is whole; returns how many it holds.
std::size_t check_reopened(const fs::path& dir, std::size_t base, DiskTierOptions options = {}) {
  DiskTier reopened(dir, options);
  CHECK(reopened.stats().quarantined == 0);
  std::vector<std::byte> staging(8192);
  std::size_t present = 0;
  for (std::uint64_t h = 0; h < 12; ++h) {
    const TierView v = reopened.get(key_of(h), staging);
    if (v.hit()) {
      ++present;
      CHECK(valid(v.bytes(), h, base));
    } else {
      CHECK(v.status() == GetStatus::miss);
    }
  }
  CHECK(present == reopened.stats().entries);
  return present;
}

}  // namespace

TEST_CASE("disk tier threads: concurrent put/get/erase never tear an entry and a restart reads them all back") {
  constexpr std::size_t base = 1024;
  TempDir dir;
  {
    DiskTier tier(dir.path);
    CHECK(hammer_disk_tier(tier, base) == 0);
    const auto s = tier.stats();
    CHECK(s.get_failures == 0);
    CHECK(s.quarantined == 0);
    CHECK(s.io_errors == 0);
    CHECK(s.evictions == 0);
  }
  check_reopened(dir.path, base);
}

TEST_CASE("disk tier threads: with a capacity, concurrent puts evict and never tear an entry or exceed the capacity") {
  constexpr std::size_t base = 1024;
  DiskTierOptions options;
  options.capacity_bytes = 4 * base;  // four of the twelve keys fit
  TempDir dir;
  {
    DiskTier tier(dir.path, options);
    CHECK(hammer_disk_tier(tier, base) == 0);
    const auto s = tier.stats();
    CHECK(s.evictions > 0);
    CHECK(s.bytes <= *options.capacity_bytes);
    CHECK(s.get_failures == 0);
    CHECK(s.quarantined == 0);
    CHECK(s.io_errors == 0);
  }
  CHECK(check_reopened(dir.path, base, options) <= 4);
}
