// kvfuse/detail/checksum.hpp — the 64-bit checksums the entry format (tier/disk_format.hpp)
// writes and checks: XXH3-64 (format version 2) and XXH64 (format version 1).
//
// Both come from xxHash (Debian libxxhash-dev), included in its header-only mode
// (XXH_INLINE_ALL): every function is compiled into the caller's unit, nothing links, and the
// library stays header-only. Chosen over FNV-1a or a table CRC because a tier get checks
// every byte it reads: a byte-at-a-time hash would dominate a page-cache read or a Redis
// reply. XXH3 runs near memory bandwidth (SIMD stripes; faster than XXH64, bench/README.md),
// which is why version 2 uses it; XXH64 stays for reading version-1 entries. Output is the
// same on every platform, so an entry written on one machine validates on another.
//
// Coexistence: XXH_INLINE_ALL gives every xxHash name an XXH_INLINE_ prefix, so an engine
// that also includes <xxhash.h> itself (before or after kvfuse, inline or linked to
// libxxhash) gets no clash. We define XXH_INLINE_ALL only around our include and undefine it
// after, unless the includer had defined it.
#pragma once

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#define KVFUSE_DEFINED_XXH_INLINE_ALL
#endif
#include <xxhash.h>
#ifdef KVFUSE_DEFINED_XXH_INLINE_ALL
#undef XXH_INLINE_ALL
#undef KVFUSE_DEFINED_XXH_INLINE_ALL
#endif

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvfuse::detail {

/// XXH64 of `bytes` in one call: the checksum of format-version-1 entries. Any thread
/// (pure); noexcept; never allocates.
[[nodiscard]] inline std::uint64_t xxh64(std::span<const std::byte> bytes, std::uint64_t seed = 0) noexcept {
  return XXH64(bytes.data(), bytes.size(), seed);
}

/// XXH3-64 (seed 0) of `bytes` in one call: the checksum of format-version-2 entries. Any
/// thread (pure); noexcept; never allocates.
[[nodiscard]] inline std::uint64_t xxh3_64(std::span<const std::byte> bytes) noexcept {
  return XXH3_64bits(bytes.data(), bytes.size());
}

/// Streaming XXH64. Feed bytes with update() in any split; digest() gives the same value as
/// xxh64() over the concatenation. For checking a payload read in pieces (DiskTier's opening
/// scan). Not thread-safe (one object per computation); noexcept; never allocates (the
/// state lives in the object).
class Xxh64 {
 public:
  explicit Xxh64(std::uint64_t seed = 0) noexcept { (void)XXH64_reset(&state_, seed); }

  /// Adds `bytes` to the running hash.
  void update(std::span<const std::byte> bytes) noexcept { (void)XXH64_update(&state_, bytes.data(), bytes.size()); }

  /// The hash of everything fed so far. Does not change the state.
  [[nodiscard]] std::uint64_t digest() const noexcept { return XXH64_digest(&state_); }

 private:
  XXH64_state_t state_;
};

/// Streaming XXH3-64 (seed 0). Feed bytes with update() in any split; digest() gives the same
/// value as xxh3_64() over the concatenation. The state is ~600 bytes and must be 64-byte
/// aligned (XXH3_state_t's members say so): a stack object or a member gets that from the
/// compiler, as does `new` (C++17 aligned new); never place one in malloc'd or packed memory.
/// Not thread-safe (one object per computation); noexcept; never allocates.
class Xxh3 {
 public:
  Xxh3() noexcept {
    XXH3_INITSTATE(&state_);
    (void)XXH3_64bits_reset(&state_);
  }

  /// Adds `bytes` to the running hash.
  void update(std::span<const std::byte> bytes) noexcept {
    (void)XXH3_64bits_update(&state_, bytes.data(), bytes.size());
  }

  /// The hash of everything fed so far. Does not change the state.
  [[nodiscard]] std::uint64_t digest() const noexcept { return XXH3_64bits_digest(&state_); }

 private:
  XXH3_state_t state_;
};

static_assert(alignof(Xxh3) >= 64, "XXH3_state_t must keep its 64-byte alignment inside Xxh3");

}  // namespace kvfuse::detail
