// MemoryTier's pool under concurrent puts, gets and erases: the block accounting stays
// exact and no reader sees a block another put is filling (run under ThreadSanitizer).
#include "tier_test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/tier/memory_tier.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <thread>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;

TEST_CASE("memory tier pool: threads putting getting and erasing keep the block counts consistent") {
  PoolCountingSource source;
  {
    MemoryTier<PoolCountingSource> tier(1 << 20, source, MemoryTierPool{{256, 16}, {1024, 8}, {4096, 4}});
    constexpr int kThreads = 4;
    constexpr int kOps = 3000;
    std::atomic<std::uint64_t> corrupt{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&tier, &corrupt, t] {
        std::uint64_t x = static_cast<std::uint64_t>(t) * 7919 + 1;
        for (int i = 0; i < kOps; ++i) {
          x = x * 6364136223846793005ULL + 1442695040888963407ULL;
          const std::uint64_t h = (x >> 33) % 40;
          const std::size_t n = static_cast<std::size_t>((x >> 20) % 4200);  // some oversize
          switch ((x >> 45) % 4) {
            case 0:
            case 1:
              (void)tier.put(key_of(h), pattern(h * 10000 + n, n));
              break;
            case 2: {
              const TierView v = tier.get(key_of(h), std::span<std::byte>{});
              // Every value of key h is pattern(h * 10000 + size, size): check it byte for byte.
              if (v.hit() && !same(v.bytes(), pattern(h * 10000 + v.bytes().size(), v.bytes().size()))) ++corrupt;
              break;
            }
            default:
              (void)tier.erase(key_of(h));
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    CHECK(corrupt == 0);
    const auto s = tier.stats();
    const auto p = tier.pool_stats();
    CHECK(p.free_blocks + p.held_blocks + p.retired_blocks + p.filling_blocks == p.blocks);
    CHECK(p.held_blocks == s.entries);
    CHECK(s.bytes <= p.bytes);
    CHECK(p.blocks == 28);
    CHECK(p.retired_blocks == 0);
    CHECK(p.filling_blocks == 0);
    CHECK(s.retired_bytes == 0);
    CHECK(p.oversize > 0);
    CHECK(s.put_failures == p.oversize + p.exhausted);
    CHECK(source.allocate_calls == 3);
    tier.clear();
    CHECK(tier.pool_stats().free_blocks == 28);
  }
  CHECK(source.free_calls == 3);
}
