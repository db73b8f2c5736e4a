// kvfuse/detail/little_endian.hpp — the one little-endian integer codec behind every byte
// layout kvfuse promises: the completion and save records (bridge/records.hpp) and the disk
// tier's file header (tier/disk_format.hpp).
//
// Byte by byte, so the result does not depend on the host's byte order or on alignment.
// Internal: not part of the public API. Pure functions: any thread, constexpr, noexcept.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvfuse::detail {

/// Writes the low `bytes` bytes of `v` (1 <= bytes <= 8) to out[0, bytes), least
/// significant first. Higher bytes of `v` are dropped. Any thread; constexpr; noexcept.
constexpr void put_le(std::byte* out, std::uint64_t v, int bytes) noexcept {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xffU);
}

/// Reads the `bytes`-byte (1 <= bytes <= 8) little-endian unsigned integer at in[0, bytes).
/// Any thread; constexpr; noexcept.
constexpr std::uint64_t get_le(const std::byte* in, int bytes) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<std::uint64_t>(in[i]) << (8 * i);
  return v;
}

}  // namespace kvfuse::detail
