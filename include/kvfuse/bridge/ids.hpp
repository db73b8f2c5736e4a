// kvfuse/bridge/ids.hpp — the identifiers every other header speaks in.
//
// Each is a distinct strong type around an integer so a request id can never be passed
// where a generation is expected. All are trivially copyable, totally ordered and hashable,
// so they travel in fixed-layout records and serve as hash-map keys.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include <kvfuse/error.hpp>

namespace kvfuse {

/// The splitmix64 finaliser: a bijection on 64-bit values that spreads the bits of ids that
/// are often small consecutive integers. kvfuse hashes its ids with it, and engines may
/// build their own keys with it (prefix hashes chained token by token, a model id): it is
/// part of the API and gives the same value on every build and version, so a key an
/// engine persisted (in a disk tier, on a Redis server) means the same after an upgrade.
/// Any thread; constexpr, noexcept.
constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// The engine's id of one request. Survives preemption and re-admission.
struct RequestId {
  std::uint64_t value = 0;
  friend constexpr auto operator<=>(RequestId, RequestId) noexcept = default;
};

/// A 64-bit nonce the engine issues per dispatch, never reused while the engine lives.
struct Generation {
  std::uint64_t value = 0;
  friend constexpr auto operator<=>(Generation, Generation) noexcept = default;
};

/// Issues generations. The engine owns exactly one; generations start at 1 so a
/// value-initialised Generation{0} never names a real load. Not thread-safe: call it from
/// the engine's scheduler thread.
class GenerationSource {
 public:
  constexpr GenerationSource() noexcept = default;
  /// Starts after `last_issued`, so an engine restored from a checkpoint never reissues one.
  constexpr explicit GenerationSource(Generation last_issued) noexcept : next_(last_issued.value + 1) {}
  /// The next unused generation. Scheduler thread only; noexcept, O(1).
  constexpr Generation next() noexcept { return Generation{next_++}; }
  /// The last generation next() returned (or the `last_issued` it started after).
  /// Scheduler thread only; noexcept, O(1).
  [[nodiscard]] constexpr Generation last_issued() const noexcept { return Generation{next_ - 1}; }

 private:
  std::uint64_t next_ = 1;
};

/// A chained prefix hash: names a chunk of KV, or the state checkpoint at a boundary.
struct PrefixHash {
  std::uint64_t value = 0;
  friend constexpr auto operator<=>(PrefixHash, PrefixHash) noexcept = default;
};

/// Index of a per-request state slot in the device slot pool.
struct SlotId {
  std::uint32_t value = 0;
  friend constexpr auto operator<=>(SlotId, SlotId) noexcept = default;
};

/// Index of a paged KV block on the device.
struct BlockId {
  std::uint32_t value = 0;
  friend constexpr auto operator<=>(BlockId, BlockId) noexcept = default;
};

/// The one identity of a load, everywhere: records, quorum entries, tombstones, the index.
struct LoadKey {
  RequestId request;
  Generation generation;
  friend constexpr auto operator<=>(const LoadKey&, const LoadKey&) noexcept = default;
};

/// The one identity of a save (a state save or a KV save): what it stores, and which
/// dispatch of it, so a repeated save of the same hash is never confused with the last.
struct SaveKey {
  PrefixHash hash;
  Generation generation;
  friend constexpr auto operator<=>(const SaveKey&, const SaveKey&) noexcept = default;
};

/// Token positions and counts.
using TokenCount = std::uint64_t;

/// A grid of `step` tokens: the chunk grid (the tier stores and retrieves whole chunks) and
/// the block/checkpoint grid (paged KV blocks; state checkpoints) are both TokenGrids.
/// Construct with TokenGrid::make, which refuses zero. All helpers are constexpr, noexcept
/// and thread-safe, and none wraps around: at the top of TokenCount's range, where a step
/// that does not divide 2^64 - 1 leaves a partial last cell, each says below what it does.
struct TokenGrid {
  std::uint32_t step = 256;  ///< tokens per cell (chunk or block)

  /// A grid of `tokens` per cell; throws Error(invalid_argument) naming the value if zero.
  static TokenGrid make(std::uint32_t tokens) {
    if (tokens == 0) throw Error(ErrorCode::invalid_argument, "a token grid's step must be > 0 tokens, got 0");
    return TokenGrid{tokens};
  }
  /// Largest multiple of step <= t.
  [[nodiscard]] constexpr TokenCount floor(TokenCount t) const noexcept { return t - t % step; }
  /// The largest multiple of step a TokenCount holds (2^64 - 1 floored to the grid): the end
  /// of the last whole cell. A t above it lies in a cell whose end does not fit.
  [[nodiscard]] constexpr TokenCount max_aligned() const noexcept {
    return floor(std::numeric_limits<TokenCount>::max());
  }
  /// Smallest multiple of step >= t, for t <= max_aligned(). Above max_aligned() no such
  /// multiple fits in a TokenCount: ceil then saturates to TokenCount's maximum, which is off
  /// the grid (a step that divides 2^64 - 1 leaves no t above max_aligned()), so it never
  /// passes for a cell end; checked_ceil says so instead.
  [[nodiscard]] constexpr TokenCount ceil(TokenCount t) const noexcept {
    const TokenCount down = floor(t);
    if (down == t) return t;
    return down < max_aligned() ? down + step : std::numeric_limits<TokenCount>::max();
  }
  /// Smallest multiple of step >= t, or empty when it does not fit (t > max_aligned()).
  [[nodiscard]] constexpr std::optional<TokenCount> checked_ceil(TokenCount t) const noexcept {
    if (t > max_aligned()) return std::nullopt;
    return ceil(t);
  }
  /// Whether t lies on the grid.
  [[nodiscard]] constexpr bool aligned(TokenCount t) const noexcept { return t % step == 0; }
  /// Index of the cell that holds token t.
  [[nodiscard]] constexpr std::uint64_t cell_of(TokenCount t) const noexcept { return t / step; }
  /// Number of cells needed to cover [0, t), partial last cell included. Exact for every t
  /// (it never forms t + step - 1), even where the last cell's end does not fit.
  [[nodiscard]] constexpr std::uint64_t cells_covering(TokenCount t) const noexcept {
    return t / step + (t % step != 0 ? 1 : 0);
  }
  friend constexpr bool operator==(TokenGrid, TokenGrid) noexcept = default;
};

static_assert(std::is_trivially_copyable_v<LoadKey> && sizeof(LoadKey) == 16);
static_assert(std::is_trivially_copyable_v<SaveKey> && sizeof(SaveKey) == 16);

/// "{request R, generation G}", for logs and error messages. Thread-safe; allocates.
inline std::string to_string(LoadKey key) {
  return "{request " + std::to_string(key.request.value) + ", generation " + std::to_string(key.generation.value) + "}";
}

}  // namespace kvfuse

template <>
struct std::hash<kvfuse::RequestId> {
  std::size_t operator()(kvfuse::RequestId v) const noexcept { return kvfuse::mix64(v.value); }
};
template <>
struct std::hash<kvfuse::Generation> {
  std::size_t operator()(kvfuse::Generation v) const noexcept { return kvfuse::mix64(v.value); }
};
template <>
struct std::hash<kvfuse::PrefixHash> {
  std::size_t operator()(kvfuse::PrefixHash v) const noexcept { return kvfuse::mix64(v.value); }
};
template <>
struct std::hash<kvfuse::SlotId> {
  std::size_t operator()(kvfuse::SlotId v) const noexcept { return kvfuse::mix64(v.value); }
};
template <>
struct std::hash<kvfuse::BlockId> {
  std::size_t operator()(kvfuse::BlockId v) const noexcept { return kvfuse::mix64(v.value); }
};
template <>
struct std::hash<kvfuse::LoadKey> {
  std::size_t operator()(const kvfuse::LoadKey& k) const noexcept {
    return kvfuse::mix64(k.request.value ^ kvfuse::mix64(k.generation.value));
  }
};
template <>
struct std::hash<kvfuse::SaveKey> {
  std::size_t operator()(const kvfuse::SaveKey& k) const noexcept {
    return kvfuse::mix64(k.hash.value ^ kvfuse::mix64(k.generation.value));
  }
};
