// A small engine + ranks-as-threads harness for connector tests: one HostRuntime, a group,
// an OffloadIndex, a SettlementPump, and per rank its device pools, tiers and connector.
#pragma once

#include <doctest/doctest.h>

#include <kvfuse/kvfuse.hpp>

#include "test_support.hpp"

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace kvfuse::testing {

/// Deterministic bytes: the value of KV byte `j` of token `t` on `rank`, and of state byte
/// `j` of the checkpoint `hash` on `rank`. Different per rank so a cross-rank read shows.
inline std::byte kv_byte(std::uint32_t rank, TokenCount t, std::size_t j) {
  return std::byte(static_cast<unsigned char>((rank * 131u + t * 7u + j * 13u + (t >> 8)) & 0xff));
}
inline std::byte state_byte(std::uint32_t rank, PrefixHash hash, std::size_t j) {
  return std::byte(static_cast<unsigned char>((rank * 31u + hash.value * 17u + j * 5u) & 0xff));
}

/// Small geometry: 16-token blocks, 64-token chunks, 32 bytes per token.
inline RankGeometry small_geometry(std::uint32_t rank, std::uint32_t world) {
  RankGeometry g;
  g.model = 42;
  g.rank = rank;
  g.world_size = world;
  g.block_tokens = 16;
  g.chunk_tokens = 64;
  g.kv_bytes_per_token = 32;
  g.num_blocks = 64;
  g.num_slots = 4;
  g.slot_bytes = 512;
  g.max_chunks_per_load = 16;
  return g;
}

/// One rank's device pools, allocated from the runtime (host memory for HostRuntime).
template <Runtime R>
struct DevicePools {
  R& rt;
  RankGeometry geo;
  std::byte* blocks;
  std::byte* slots;
  DevicePools(R& runtime, const RankGeometry& g)
      : rt(runtime),
        geo(g),
        blocks(static_cast<std::byte*>(runtime.allocate_device(g.num_blocks * g.block_bytes()))),
        slots(static_cast<std::byte*>(runtime.allocate_device(std::max<std::size_t>(1, g.num_slots * g.slot_bytes)))) {
    std::memset(blocks, 0, g.num_blocks * g.block_bytes());
    std::memset(slots, 0, g.num_slots * g.slot_bytes);
  }
  ~DevicePools() {
    rt.free_device(blocks);
    rt.free_device(slots);
  }
  DevicePools(const DevicePools&) = delete;
  DevicePools& operator=(const DevicePools&) = delete;
  DeviceMemory memory() const { return DeviceMemory{blocks, slots}; }
  std::byte* block(BlockId b) const { return blocks + std::size_t{b.value} * geo.block_bytes(); }
  std::byte* slot(SlotId s) const { return slots + std::size_t{s.value} * geo.slot_bytes; }

  /// "The forward": writes the KV of tokens [0, tokens) into `ids` (one block per 16 tokens).
  void write_prompt(const std::vector<BlockId>& ids, TokenCount tokens) const {
    for (TokenCount t = 0; t < tokens; ++t)
      for (std::size_t j = 0; j < geo.kv_bytes_per_token; ++j)
        block(ids[t / geo.block_tokens])[(t % geo.block_tokens) * geo.kv_bytes_per_token + j] = kv_byte(geo.rank, t, j);
  }
  /// Whether tokens [from, to) in `ids` (block i holds tokens from floor(from)+16i) hold the prompt bytes.
  bool holds_prompt(const std::vector<BlockId>& ids, TokenCount from, TokenCount to) const {
    const TokenCount base = from - from % geo.block_tokens;
    for (TokenCount t = from; t < to; ++t)
      for (std::size_t j = 0; j < geo.kv_bytes_per_token; ++j)
        if (block(ids[(t - base) / geo.block_tokens])[(t % geo.block_tokens) * geo.kv_bytes_per_token + j] !=
            kv_byte(geo.rank, t, j))
          return false;
    return true;
  }
  void write_state(SlotId s, PrefixHash h) const {
    for (std::size_t j = 0; j < geo.slot_bytes; ++j) slot(s)[j] = state_byte(geo.rank, h, j);
  }
  bool holds_state(SlotId s, PrefixHash h) const {
    for (std::size_t j = 0; j < geo.slot_bytes; ++j)
      if (slot(s)[j] != state_byte(geo.rank, h, j)) return false;
    return true;
  }
  bool slot_is_zero(SlotId s) const {
    for (std::size_t j = 0; j < geo.slot_bytes; ++j)
      if (slot(s)[j] != std::byte{0}) return false;
    return true;
  }
};

/// Chunk keys of a prompt: a chained toy hash per chunk (distinct per chunk and prompt).
inline std::vector<PrefixHash> chunk_keys(std::uint64_t prompt, std::size_t chunks) {
  std::vector<PrefixHash> keys;
  std::uint64_t h = prompt * 0x9e3779b97f4a7c15ULL + 1;
  for (std::size_t i = 0; i < chunks; ++i) {
    h = mix64(h + i);
    keys.push_back(PrefixHash{h});
  }
  return keys;
}

inline std::vector<BlockId> block_range(std::uint32_t first, std::size_t count) {
  std::vector<BlockId> ids;
  for (std::size_t i = 0; i < count; ++i) ids.push_back(BlockId{static_cast<std::uint32_t>(first + i)});
  return ids;
}

/// Records drained from a group, for tests that look at raw records rather than settlements.
struct RecordLog {
  std::vector<CompletionRecord> loads;
  std::vector<SaveRecord> stores;
  void operator()(std::uint32_t, const CompletionRecord& r) noexcept { loads.push_back(r); }
  void operator()(std::uint32_t, const SaveRecord& r) noexcept { stores.push_back(r); }
};

/// Drains `group` into `log` until `pred()` holds or ~10 s pass (a generous liveness bound,
/// not a timing assertion). Returns pred().
template <class Group, class Pred>
bool drain_until(Group& group, RecordLog& log, Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!pred()) {
    if (group.drain(log) == 0) {
      if (std::chrono::steady_clock::now() > deadline) return pred();
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  return true;
}


/// The engine side of the connector tests: index, quorum and pump over `world` ranks, and
/// every load resolution and save settlement the pump produced, in order.
struct PumpedEngine {
  std::vector<SlotId> released_slots;
  TpQuorum group;
  OffloadIndex<> index;
  SettlementPump<TpQuorum, OffloadIndex<>> pump{group, index};
  std::vector<LoadResolution> loads;
  std::vector<SaveSettlement> stores;

  PumpedEngine(std::uint32_t world, std::uint32_t slots)
      : group(TpQuorumOptions{world, 3, 1024}),
        index(OffloadIndexOptions{.hash_capacity = 1024, .slot_count = slots},
              [this](SlotId s) { released_slots.push_back(s); }) {}

  /// Steps the pump until `n` more load resolutions and `m` more save settlements (two per
  /// save: released, then stored) arrived (20 s bound).
  bool settle(std::size_t n, std::size_t m) {
    const std::size_t want_loads = loads.size() + n, want_stores = stores.size() + m;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (loads.size() < want_loads || stores.size() < want_stores) {
      auto step = pump.step();
      loads.insert(loads.end(), step.resolutions.begin(), step.resolutions.end());
      stores.insert(stores.end(), step.saves.begin(), step.saves.end());
      if (std::chrono::steady_clock::now() > deadline) return false;
      if (step.records == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return loads.size() == want_loads && stores.size() == want_stores;
  }
};

}  // namespace kvfuse::testing
