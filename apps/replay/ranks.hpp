// kvfuse-replay: the ranks of one engine. Each rank is a Connector on its own lane threads,
// with HostRuntime device memory (a block pool and a slot pool) and a tier of its own. The
// engine reaches them only through Ranks, a set of operations: loads and saves, what its
// forward writes, folds and byte checks of device memory, and each rank's tier. RanksOf runs
// them as threads of this process (the connector and tier types live there, built by the
// model table, models.cpp); RankProcesses (rank_process.hpp) as one process per rank.
#pragma once

#include "content.hpp"
#include "rank_memory.hpp"
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
#include <optional>
#include <span>
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
  std::size_t slot_bytes = default_slot_bytes;  ///< bytes of one state slot, and so of one checkpoint, per rank
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

/// Where a load or save went: whether it was sent at all (false: refused, as back-pressure),
/// and to how many ranks.
struct Delivery {
  bool sent = true;
  std::uint32_t ranks = 0;
};

/// What a rank process reported about itself at the end of a pass (ranks as processes).
struct RankCounts {
  std::uint64_t incarnation = 0;  ///< 1 for the first process of the rank, +1 per restart
  std::uint64_t loads = 0, kv_saves = 0, state_saves = 0;  ///< frames it handed its connector
  std::uint64_t records_emitted = 0, records_dropped = 0;
  std::uint64_t bytes_checked = 0, bytes_corrupted = 0;  ///< by its own checks of restored bytes
};

/// An engine's ranks, whatever their connector and tier and wherever they run. The engine
/// reaches them only through these operations, as it would reach ranks in other processes:
/// plain data in (loads, saves, what the forward writes), answers out (a fold of the KV, a
/// byte check), and each rank's tier for the lookup, the faults and the report. Memory
/// operations act on every rank that is up. Scheduler thread only.
class Ranks {
 public:
  virtual ~Ranks() = default;
  std::uint32_t world() const noexcept { return world_; }
  /// Whether rank r can be used now (false: its process was killed and has not come back).
  virtual bool up(std::uint32_t) const { return true; }

  /// The load or save to every rank `alive` names (ranks as processes: to every attached rank).
  virtual Delivery deliver(const kvfuse::LoadRequest& request, const std::vector<bool>& alive) = 0;
  virtual Delivery deliver(const kvfuse::KvSave& save, const std::vector<bool>& alive) = 0;
  /// A dense model's ranks ignore it (the Coordinator never sends one).
  virtual Delivery deliver(const kvfuse::StateSave& save, const std::vector<bool>& alive) = 0;

  /// The forward: the model's KV of `spans` into every rank's blocks.
  virtual void write_kv(std::span<const BlockSpan> spans) = 0;
  /// A slot holding `digest` on every rank.
  virtual void write_state(kvfuse::SlotId slot, std::uint64_t digest) = 0;
  /// The digest rank 0's slot holds.
  virtual std::uint64_t read_state(kvfuse::SlotId slot) = 0;
  /// Each rank's fold of the KV of `spans` (RankMemory::fold_kv) into `out` (world() of them).
  virtual void fold_kv(std::span<const BlockSpan> spans, std::span<std::uint64_t> out) = 0;
  /// Every rank's check of the KV of `spans` and of `slot` against a slot holding `digest`.
  virtual Checked check(std::span<const BlockSpan> spans, std::optional<kvfuse::SlotId> slot, std::uint64_t digest) = 0;
  /// Where a P/D transfer writes rank r's blocks (LoopbackPd's consumer memory).
  virtual std::byte* pd_landing(std::uint32_t r) = 0;
  /// A P/D transfer wrote `blocks` at pd_landing: make them the ranks' device bytes.
  virtual void pd_landed(std::span<const kvfuse::BlockId> blocks) = 0;

  virtual TierControl& tier(std::uint32_t r) = 0;
  virtual kvfuse::ConnectorStats connector_stats(std::uint32_t r) = 0;
  /// Per rank what its process reported (empty for ranks as threads).
  virtual std::vector<RankCounts> rank_counts() { return {}; }
  /// Blocks until every lane of every rank is idle.
  virtual void drain() = 0;

 protected:
  std::uint32_t world_ = 0;
};

/// The state leg `Conn` reads `tier` with (an empty one for a dense model).
template <class Conn, class Tier>
auto state_leg_of(Tier& tier) {
  using S = typename Conn::state_leg_type;
  if constexpr (!Conn::has_state) return S{};
  else if constexpr (std::is_constructible_v<S, Tier&>) return S(tier);
  else return S(typename S::inner_type(tier));
}

/// Ranks as threads: `Conn` over `RankTier<Inner>`, Inner built by `tier` from each rank's
/// options, every rank's memory in this process.
template <class Conn, class Inner>
class RanksOf final : public Ranks {
 public:
  RanksOf(const RankSetup& setup, const TierEntry<Inner>& tier) {
    world_ = setup.world;
    for (std::uint32_t r = 0; r < setup.world; ++r)
      ranks_.push_back(std::make_unique<Rank>(setup.geometry(r), *setup.runtime, tier, setup.tier_options[r], *setup.group));
  }
  ~RanksOf() override { drain(); }

  Delivery deliver(const kvfuse::LoadRequest& request, const std::vector<bool>& alive) override {
    return each(alive, [&](Rank& rank) { rank.conn.load(request); });
  }
  Delivery deliver(const kvfuse::KvSave& save, const std::vector<bool>& alive) override {
    return each(alive, [&](Rank& rank) { rank.conn.save_kv(save); });
  }
  Delivery deliver(const kvfuse::StateSave& save, const std::vector<bool>& alive) override {
    return each(alive, [&](Rank& rank) {
      if constexpr (Conn::has_state) rank.conn.save_state(save);
    });
  }
  void write_kv(std::span<const BlockSpan> spans) override {
    for (auto& rank : ranks_) rank->memory.write_kv(spans);
  }
  void write_state(kvfuse::SlotId slot, std::uint64_t digest) override {
    for (auto& rank : ranks_) rank->memory.write_state(slot, digest);
  }
  std::uint64_t read_state(kvfuse::SlotId slot) override { return ranks_[0]->memory.read_state(slot); }
  void fold_kv(std::span<const BlockSpan> spans, std::span<std::uint64_t> out) override {
    for (std::uint32_t r = 0; r < world_; ++r) out[r] = ranks_[r]->memory.fold_kv(spans);
  }
  Checked check(std::span<const BlockSpan> spans, std::optional<kvfuse::SlotId> slot, std::uint64_t digest) override {
    Checked c;
    for (auto& rank : ranks_) c += rank->memory.check(spans, slot, digest);
    return c;
  }
  std::byte* pd_landing(std::uint32_t r) override { return ranks_[r]->memory.blocks; }
  void pd_landed(std::span<const kvfuse::BlockId>) override {}  // it wrote the device memory itself
  TierControl& tier(std::uint32_t r) override { return ranks_[r]->tier; }
  kvfuse::ConnectorStats connector_stats(std::uint32_t r) override { return ranks_[r]->conn.stats(); }
  void drain() override {
    for (auto& rank : ranks_) rank->conn.drain();
  }

 private:
  using Tier = RankTier<Inner>;
  struct Rank {
    kvfuse::HostRuntime& rt;
    RankMemory memory;
    Tier tier;
    Conn conn;
    Rank(const kvfuse::RankGeometry& g, kvfuse::HostRuntime& runtime, const TierEntry<Inner>& entry, const TierOptions& options,
         kvfuse::TpQuorum& group)
        : rt(runtime),
          memory{static_cast<std::byte*>(runtime.allocate_device(std::size_t{g.num_blocks} * g.block_bytes())),
                 static_cast<std::byte*>(runtime.allocate_device(std::max<std::size_t>(1, std::size_t{g.num_slots} * g.slot_bytes))),
                 g.rank, g.slot_bytes},
          tier([&] { return entry.make(options, g.rank); }),
          conn(g, runtime, kvfuse::DeviceMemory{memory.blocks, memory.slots}, kvfuse::PagedKv<Tier>(tier), make_state_leg(tier),
               group) {}
    ~Rank() {
      conn.drain();
      rt.free_device(memory.blocks);
      rt.free_device(memory.slots);
    }
    static auto make_state_leg(Tier& tier) { return state_leg_of<Conn>(tier); }
  };
  template <class F>
  Delivery each(const std::vector<bool>& alive, F&& f) {
    Delivery d;
    for (std::uint32_t r = 0; r < world_; ++r)
      if (alive[r]) {
        f(*ranks_[r]);
        ++d.ranks;
      }
    return d;
  }
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace replay
