// kvfuse-replay: the bytes of what crosses a rank process's control channel (control_channel.hpp).
// Both ends are this binary, so values travel as their trivially copyable bytes; what is
// read back is still checked for size (a short or long payload reads as nothing, or throws),
// so a confused peer cannot make this side read past what it sent.
#pragma once

#include "rank_tier.hpp"
#include "workload.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace replay {

/// `v`'s bytes. Any thread.
template <class T>
std::span<const std::byte> bytes_of(const T& v) noexcept {
  static_assert(std::is_trivially_copyable_v<T>);
  return std::as_bytes(std::span<const T>(&v, 1));
}
/// The bytes of every value of `v`. Any thread.
template <class T>
std::span<const std::byte> bytes_of(std::span<const T> v) noexcept {
  static_assert(std::is_trivially_copyable_v<T>);
  return std::as_bytes(v);
}

/// `payload` as `n` values of T, or an empty span when its size is not exactly that (or it
/// is not aligned for T). Any thread.
template <class T>
std::span<const T> as_items(std::span<const std::byte> payload, std::size_t n) noexcept {
  static_assert(std::is_trivially_copyable_v<T>);
  if (payload.size() != n * sizeof(T) || reinterpret_cast<std::uintptr_t>(payload.data()) % alignof(T) != 0) return {};
  return {reinterpret_cast<const T*>(payload.data()), n};
}

/// `payload` as one T, or a value-initialised T when its size is not exactly sizeof(T). Any thread.
template <class T>
T read_as(std::span<const std::byte> payload) noexcept {
  static_assert(std::is_trivially_copyable_v<T>);
  T v{};
  if (payload.size() == sizeof(T)) std::memcpy(&v, payload.data(), sizeof(T));
  return v;
}

/// Appends values and length-prefixed texts to `out` (a rank process's setup). One thread.
struct ByteWriter {
  std::vector<std::byte> out;
  template <class T>
  void value(const T& v) {
    const auto b = bytes_of(v);
    out.insert(out.end(), b.begin(), b.end());
  }
  void text(const std::string& s) {
    value(static_cast<std::uint32_t>(s.size()));
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    out.insert(out.end(), p, p + s.size());
  }
};

/// Reads back what a ByteWriter wrote, in the same order; `in` is what is left. Throws
/// InputError when the bytes run out. One thread.
struct ByteReader {
  std::span<const std::byte> in;
  template <class T>
  T value() {
    static_assert(std::is_trivially_copyable_v<T>);
    if (in.size() < sizeof(T)) throw InputError("rank process setup: truncated");
    T v;
    std::memcpy(&v, in.data(), sizeof(T));
    in = in.subspan(sizeof(T));
    return v;
  }
  std::string text() {
    const auto n = value<std::uint32_t>();
    if (in.size() < n) throw InputError("rank process setup: truncated text");
    std::string s(reinterpret_cast<const char*>(in.data()), n);
    in = in.subspan(n);
    return s;
  }
};

/// Every counter of a TierSnapshot as one trivially copyable struct: ControlOp::tier_snapshot's reply.
struct TierSnapshotWire {
  TierCalls calls;
  bool has_memory = false, has_disk = false, has_stack = false, has_redis = false, has_cluster = false;
  kvfuse::MemoryTierStats memory;
  kvfuse::DiskTierStats disk;
  kvfuse::TieredTierStats stack;
  kvfuse::RedisTierStats redis;
  kvfuse::RedisClusterCounters cluster;
  std::uint64_t quarantined = 0;
};
static_assert(std::is_trivially_copyable_v<TierSnapshotWire>);

/// `s` as it crosses the channel. Any thread.
inline TierSnapshotWire to_wire(const TierSnapshot& s) noexcept {
  TierSnapshotWire w;
  w.calls = s.calls;
  w.has_memory = s.memory.has_value();
  w.has_disk = s.disk.has_value();
  w.has_stack = s.stack.has_value();
  w.has_redis = s.redis.has_value();
  w.has_cluster = s.cluster.has_value();
  if (s.memory) w.memory = *s.memory;
  if (s.disk) w.disk = *s.disk;
  if (s.stack) w.stack = *s.stack;
  if (s.redis) w.redis = *s.redis;
  if (s.cluster) w.cluster = *s.cluster;
  w.quarantined = s.quarantined;
  return w;
}

/// The TierSnapshot `w` carries. Any thread.
inline TierSnapshot from_wire(const TierSnapshotWire& w) {
  TierSnapshot s;
  s.calls = w.calls;
  if (w.has_memory) s.memory = w.memory;
  if (w.has_disk) s.disk = w.disk;
  if (w.has_stack) s.stack = w.stack;
  if (w.has_redis) s.redis = w.redis;
  if (w.has_cluster) s.cluster = w.cluster;
  s.quarantined = w.quarantined;
  return s;
}

}  // namespace replay
