// kvfuse-replay: the ranks of one engine. Each rank is a Connector on its own lane threads,
// with HostRuntime device memory (a block pool and a slot pool) and a tier of its own. The
// engine reaches them only through Ranks, as it would reach ranks in other processes: plain
// data in (loads, saves), device memory to read and write (its forward and its byte checks),
// and each rank's tier for the lookup, the faults and the report. The connector type and the
// tier type live in RanksOf, built by the model table (models.cpp).
#pragma once

#include "content.hpp"
#include "rank_tier.hpp"
#include "tiers.hpp"

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/save_request.hpp>
#include <kvfuse/completion/tp_quorum.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/tier/tier.hpp>
#include <kvfuse/worker/connector.hpp>
#include <kvfuse/worker/paged_kv.hpp>
#include <kvfuse/worker/rank_geometry.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

namespace replay {

/// The tier keys of one engine's entries: its model id and world size, a rank and a kind.
struct TierKeys {
  std::uint64_t model = 0;
  std::uint32_t world = 1;
  kvfuse::TierKey kv(kvfuse::PrefixHash h, std::uint32_t rank) const noexcept {
    return kvfuse::TierKey{model, h, world, rank, kvfuse::EntryKind::kv_chunk};
  }
  kvfuse::TierKey state(kvfuse::PrefixHash h, std::uint32_t rank) const noexcept {
    return kvfuse::TierKey{model, h, world, rank, kvfuse::EntryKind::state};
  }
};

/// What an engine builds its ranks with.
struct RankSetup {
  std::uint64_t model = 0;                 ///< the tier keys' model id
  std::uint32_t world = 1;
  std::uint32_t num_blocks = 0;            ///< device KV blocks per rank
  std::uint32_t num_slots = 0;             ///< device state slots per rank (0: a dense model)
  std::uint32_t max_chunks_per_load = 0;
  std::size_t tier = 0;                    ///< index in the tier table (tiers.hpp)
  std::vector<TierOptions> tier_options;   ///< one per rank, after the faults' set-up
  kvfuse::HostRuntime* runtime = nullptr;
  kvfuse::TpQuorum* group = nullptr;

  kvfuse::RankGeometry geometry(std::uint32_t rank) const noexcept {
    kvfuse::RankGeometry g;
    g.model = model;
    g.rank = rank;
    g.world_size = world;
    g.block_tokens = block_tokens;
    g.chunk_tokens = chunk_tokens;
    g.kv_bytes_per_token = kv_bytes_per_token;
    g.num_blocks = num_blocks;
    g.num_slots = num_slots;
    g.slot_bytes = num_slots > 0 ? slot_bytes : 0;
    g.max_chunks_per_load = max_chunks_per_load;
    return g;
  }
};

/// An engine's ranks, whatever their connector and tier. load/save_* are called on the
/// scheduler thread (it plays every rank's rank thread); block/slot memory is shared with
/// the lanes, which write it only while a load the engine is waiting for runs.
class Ranks {
 public:
  virtual ~Ranks() = default;
  std::uint32_t world() const noexcept { return static_cast<std::uint32_t>(memory_.size()); }
  /// Rank r's device memory of block b / slot s.
  std::byte* block(std::uint32_t r, kvfuse::BlockId b) const noexcept {
    return memory_[r].blocks + std::size_t{b.value} * block_bytes;
  }
  std::byte* slot(std::uint32_t r, kvfuse::SlotId s) const noexcept { return memory_[r].slots + std::size_t{s.value} * slot_bytes; }

  virtual void load(std::uint32_t r, const kvfuse::LoadRequest& request) = 0;
  virtual void save_kv(std::uint32_t r, const kvfuse::KvSave& save) = 0;
  /// A dense model's ranks ignore it (the Coordinator never sends one).
  virtual void save_state(std::uint32_t r, const kvfuse::StateSave& save) = 0;
  virtual TierControl& tier(std::uint32_t r) = 0;
  virtual kvfuse::ConnectorStats connector_stats(std::uint32_t r) const = 0;
  /// Blocks until every lane of every rank is idle.
  virtual void drain() = 0;

 protected:
  struct Memory {
    std::byte* blocks = nullptr;
    std::byte* slots = nullptr;
  };
  std::vector<Memory> memory_;
};

/// Ranks running `Conn` over `RankTier<Inner>`, Inner built by `tier` from each rank's options.
template <class Conn, class Inner>
class RanksOf final : public Ranks {
 public:
  RanksOf(const RankSetup& setup, const TierEntry<Inner>& tier) {
    for (std::uint32_t r = 0; r < setup.world; ++r) {
      ranks_.push_back(std::make_unique<Rank>(setup.geometry(r), *setup.runtime, tier, setup.tier_options[r], *setup.group));
      memory_.push_back(Memory{ranks_.back()->blocks, ranks_.back()->slots});
    }
  }
  ~RanksOf() override { drain(); }

  void load(std::uint32_t r, const kvfuse::LoadRequest& request) override { ranks_[r]->conn.load(request); }
  void save_kv(std::uint32_t r, const kvfuse::KvSave& save) override { ranks_[r]->conn.save_kv(save); }
  void save_state(std::uint32_t r, const kvfuse::StateSave& save) override {
    if constexpr (Conn::has_state) ranks_[r]->conn.save_state(save);
  }
  TierControl& tier(std::uint32_t r) override { return ranks_[r]->tier; }
  kvfuse::ConnectorStats connector_stats(std::uint32_t r) const override { return ranks_[r]->conn.stats(); }
  void drain() override {
    for (auto& rank : ranks_) rank->conn.drain();
  }

 private:
  using Tier = RankTier<Inner>;
  struct Rank {
    kvfuse::HostRuntime& rt;
    std::byte* blocks;
    std::byte* slots;
    Tier tier;
    Conn conn;
    Rank(const kvfuse::RankGeometry& g, kvfuse::HostRuntime& runtime, const TierEntry<Inner>& entry, const TierOptions& options,
         kvfuse::TpQuorum& group)
        : rt(runtime),
          blocks(static_cast<std::byte*>(runtime.allocate_device(std::size_t{g.num_blocks} * g.block_bytes()))),
          slots(static_cast<std::byte*>(runtime.allocate_device(std::max<std::size_t>(1, std::size_t{g.num_slots} * g.slot_bytes)))),
          tier([&] { return entry.make(options, g.rank); }),
          conn(g, runtime, kvfuse::DeviceMemory{blocks, slots}, kvfuse::PagedKv<Tier>(tier), make_state_leg(tier), group) {}
    ~Rank() {
      conn.drain();
      rt.free_device(blocks);
      rt.free_device(slots);
    }
    static auto make_state_leg(Tier& tier) {
      using S = typename Conn::state_leg_type;
      if constexpr (!Conn::has_state) return S{};
      else if constexpr (std::is_constructible_v<S, Tier&>) return S(tier);
      else return S(typename S::inner_type(tier));
    }
  };
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace replay
