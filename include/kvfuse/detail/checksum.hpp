// kvfuse/detail/checksum.hpp — the 64-bit payload checksum DiskTier writes and checks.
//
// XXH64 (the public xxHash 64-bit algorithm, seed 0 unless given), written out here so
// kvfuse needs no extra package. Chosen over FNV-1a or a table CRC because a disk get
// checks every byte it reads: XXH64 mixes 32 bytes per round on four independent lanes,
// so it runs near memory bandwidth where byte-at-a-time hashes run at ~1 GB/s and would
// dominate a page-cache read. Output is the same on every platform (input is read as
// little-endian words), so a file written on one machine validates on another.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace kvfuse::detail {

/// Streaming XXH64. Feed bytes with update() in any split; digest() gives the same value as
/// xxh64() over the concatenation. Not thread-safe (one object per computation); noexcept,
/// never allocates.
class Xxh64 {
 public:
  constexpr explicit Xxh64(std::uint64_t seed = 0) noexcept
      : seed_(seed), v1_(seed + kP1 + kP2), v2_(seed + kP2), v3_(seed), v4_(seed - kP1) {}

  /// Adds `bytes` to the running hash.
  void update(std::span<const std::byte> bytes) noexcept {
    const std::byte* p = bytes.data();
    std::size_t n = bytes.size();
    total_ += n;
    if (buffered_ != 0) {  // top up the partial stripe first
      const std::size_t take = n < kStripe - buffered_ ? n : kStripe - buffered_;
      std::memcpy(buffer_ + buffered_, p, take);
      buffered_ += take;
      p += take;
      n -= take;
      if (buffered_ < kStripe) return;
      stripe(buffer_);
      buffered_ = 0;
    }
    for (; n >= kStripe; p += kStripe, n -= kStripe) stripe(p);
    if (n != 0) {
      std::memcpy(buffer_, p, n);
      buffered_ = n;
    }
  }

  /// The hash of everything fed so far. Does not change the state.
  [[nodiscard]] std::uint64_t digest() const noexcept {
    std::uint64_t h = 0;
    if (total_ >= kStripe) {
      h = std::rotl(v1_, 1) + std::rotl(v2_, 7) + std::rotl(v3_, 12) + std::rotl(v4_, 18);
      h = merge(h, v1_);
      h = merge(h, v2_);
      h = merge(h, v3_);
      h = merge(h, v4_);
    } else {
      h = seed_ + kP5;
    }
    h += total_;
    const std::byte* p = buffer_;
    std::size_t n = buffered_;
    for (; n >= 8; p += 8, n -= 8) {
      h ^= round(0, load64(p));
      h = std::rotl(h, 27) * kP1 + kP4;
    }
    if (n >= 4) {
      h ^= std::uint64_t{load32(p)} * kP1;
      h = std::rotl(h, 23) * kP2 + kP3;
      p += 4;
      n -= 4;
    }
    for (; n != 0; ++p, --n) {
      h ^= std::uint64_t{static_cast<std::uint8_t>(*p)} * kP5;
      h = std::rotl(h, 11) * kP1;
    }
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    h ^= h >> 32;
    return h;
  }

 private:
  static constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ULL;
  static constexpr std::uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
  static constexpr std::uint64_t kP3 = 0x165667B19E3779F9ULL;
  static constexpr std::uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
  static constexpr std::uint64_t kP5 = 0x27D4EB2F165667C5ULL;
  static constexpr std::size_t kStripe = 32;

  static std::uint64_t load64(const std::byte* p) noexcept {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap64(v);
    return v;
  }
  static std::uint32_t load32(const std::byte* p) noexcept {
    std::uint32_t v;
    std::memcpy(&v, p, 4);
    if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap32(v);
    return v;
  }
  static constexpr std::uint64_t round(std::uint64_t acc, std::uint64_t input) noexcept {
    acc += input * kP2;
    return std::rotl(acc, 31) * kP1;
  }
  static constexpr std::uint64_t merge(std::uint64_t acc, std::uint64_t v) noexcept {
    acc ^= round(0, v);
    return acc * kP1 + kP4;
  }
  void stripe(const std::byte* p) noexcept {
    v1_ = round(v1_, load64(p));
    v2_ = round(v2_, load64(p + 8));
    v3_ = round(v3_, load64(p + 16));
    v4_ = round(v4_, load64(p + 24));
  }

  std::uint64_t seed_;
  std::uint64_t v1_, v2_, v3_, v4_;
  std::uint64_t total_ = 0;
  std::size_t buffered_ = 0;
  std::byte buffer_[kStripe] = {};
};

/// XXH64 of `bytes` in one call. Thread-safe (pure), noexcept, never allocates.
inline std::uint64_t xxh64(std::span<const std::byte> bytes, std::uint64_t seed = 0) noexcept {
  Xxh64 h(seed);
  h.update(bytes);
  return h.digest();
}

}  // namespace kvfuse::detail
