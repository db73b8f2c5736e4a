// Helpers shared by the tier tests: keys, position-dependent byte patterns, comparison.
#pragma once

#include <kvfuse/tier/tier.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <vector>

namespace kvfuse::testing {

inline TierKey key_of(std::uint64_t hash, std::uint32_t rank = 0, EntryKind kind = EntryKind::kv_chunk,
                      std::uint64_t model = 7, std::uint32_t world = 4) {
  TierKey k;
  k.model = model;
  k.hash = PrefixHash{hash};
  k.world_size = world;
  k.rank = rank;
  k.kind = kind;
  return k;
}

/// Distinct, position-dependent bytes: a shifted or mixed-up copy never matches.
inline std::vector<std::byte> pattern(std::uint64_t seed, std::size_t n) {
  std::vector<std::byte> out(n);
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    out[i] = static_cast<std::byte>(x);
  }
  return out;
}

inline bool same(std::span<const std::byte> a, const std::vector<std::byte>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

/// A PinnedMemorySource that counts every call, for the pool tests: after construction a
/// pooled MemoryTier must make none. Thread-safe (atomics), so the concurrent test uses it too.
struct PoolCountingSource {
  std::atomic<int> allocate_calls{0};
  std::atomic<int> free_calls{0};
  std::atomic<std::size_t> allocated_bytes{0};
  void* allocate_pinned(std::size_t bytes) {
    ++allocate_calls;
    allocated_bytes += bytes;
    return ::operator new(bytes == 0 ? 1 : bytes);
  }
  void free_pinned(void* p) noexcept {
    ++free_calls;
    ::operator delete(p);
  }
};

}  // namespace kvfuse::testing
