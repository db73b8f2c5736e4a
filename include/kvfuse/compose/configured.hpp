// kvfuse/compose/configured.hpp — configured compositions: a plain config (connector name
// or a multi's sub names, kv role, pipeline size, layout, grids, tier settings) picks one
// of the compiled compositions, with no hand-written connector type.
//
// Two steps, both before any rank starts its work:
//   1. configure(options) on the engine: validates the whole config through the name
//      registry (R15) and the capability predicate (R14) and returns the engine-side plan
//      (preset, Capability, OffloadIndexOptions, CoordinatorOptions, the canonical sub list
//      and which sub is the offload one, the tier settings). A bad config is a kvfuse::Error
//      naming the bad value; nothing is half-built.
//   2. make_rank_connector<Group, R>(composition, geometry, runtime, memory, group) on each
//      rank: builds that rank's tiers from the tier settings and the one Connector alias the
//      preset and tier kinds select, held in RankConnector (a std::variant of the compiled
//      alternatives). The rank's geometry must carry the configured grids and world size.
//
// Compiled alternatives (AnyConnector): Dense, Dsv4 and KimiK3 presets, each with
//   KV tier memory, state tier memory   (dense: KV memory)
//   KV tier memory, state tier disk
//   KV tier disk,   state tier disk     (dense: KV disk)
// "KV on disk, state in memory" is not compiled; configure() refuses it.
//
// Threading: everything here is construction-time code. configure() is a pure function of
// its argument (no I/O) and may be called from any thread. make_rank_connector() may be
// called from any thread, once per rank; the RankConnector it returns then follows
// Connector's thread rules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <kvfuse/compose/presets.hpp>
#include <kvfuse/engine/capability.hpp>
#include <kvfuse/engine/connector_names.hpp>
#include <kvfuse/engine/coordinator.hpp>
#include <kvfuse/engine/index_options.hpp>
#include <kvfuse/engine/planner.hpp>
#include <kvfuse/error.hpp>
#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/worker/connector.hpp>
#include <kvfuse/worker/rank_geometry.hpp>

namespace kvfuse {

/// Where a tier keeps its bytes.
enum class TierKind : std::uint8_t {
  memory,  ///< MemoryTier<> (pinned host memory, LRU by bytes)
  disk,    ///< DiskTier (one file per entry under a directory)
};

/// Stable names, for messages. Thread-safe, noexcept.
constexpr std::string_view to_string(TierKind k) noexcept {
  switch (k) {
    case TierKind::memory: return "memory";
    case TierKind::disk: return "disk";
  }
  return "unknown_tier";
}
/// Whether `k` is one of TierKind's named values (configure() refuses any other). Thread-safe.
constexpr bool is_known(TierKind k) noexcept { return k == TierKind::memory || k == TierKind::disk; }

/// The settings of one tier. Plain data.
struct TierOptions {
  TierKind kind = TierKind::memory;
  std::size_t memory_capacity_bytes = std::size_t{1} << 30;  ///< memory: must be > 0
  std::filesystem::path disk_directory;                       ///< disk: must be non-empty
};

/// The whole plain config of a deployment. Plain data; validated by configure().
struct DeploymentOptions {
  EngineOptions engine;          ///< connector name or multi + subs, kv role, pp size, layout
  PlanGrids grids;               ///< block and chunk grid: both > 0, chunk a multiple of block
  std::uint32_t world_size = 1;  ///< tensor-parallel ranks: in [1, 64]
  /// The engine's state slot pool: > 0 (at most 2^24) with a stateful layout, 0 without.
  std::uint32_t slot_count = 0;
  TierOptions kv_tier;     ///< where KV chunks live
  TierOptions state_tier;  ///< where state entries live (ignored for layout=none)
  TokenCount min_load_tokens = 0;  ///< passed to CoordinatorOptions
  BreakEven break_even{};          ///< passed to CoordinatorOptions (off by default)
};

/// Which compiled preset a layout selects.
enum class Preset : std::uint8_t {
  dense,  ///< DenseConnector (layout=none)
  dsv4,   ///< Dsv4Connector (layout=dsv4_slot)
  k3,     ///< KimiK3Connector (layout=k3_recurrent)
};

/// Stable names, for messages. Thread-safe, noexcept.
constexpr std::string_view to_string(Preset p) noexcept {
  switch (p) {
    case Preset::dense: return "dense";
    case Preset::dsv4: return "dsv4";
    case Preset::k3: return "k3";
  }
  return "unknown_preset";
}

/// The engine-side plan configure() returns. Plain data; every field already validated.
struct ConfiguredComposition {
  Preset preset = Preset::dense;
  Capability capability;            ///< state_tier_capability(engine options)
  OffloadIndexOptions index;        ///< index_options_for(capability, slot_count)
  CoordinatorOptions coordinator;   ///< layout, grids, min_load_tokens, break_even
  bool is_multi = false;            ///< the connector is a multi (subs lists its subs)
  /// Canonical sub-connector names, in config order (for a plain connector: just its own
  /// canonical name). The views point into the registry's static tables.
  std::vector<std::string_view> subs;
  std::size_t offload_sub = 0;      ///< index into `subs` of the one offload connector
  std::uint32_t world_size = 1;
  TierOptions kv_tier;
  TierOptions state_tier;           ///< meaningful only when preset != dense
};

namespace detail {
inline constexpr std::uint32_t max_configured_world = 64;
inline constexpr std::uint32_t max_configured_slots = std::uint32_t{1} << 24;

inline void check_tier(const TierOptions& t, std::string_view which) {
  if (!is_known(t.kind))
    throw Error(ErrorCode::invalid_argument, std::string(which) + ".kind=" +
                                                 std::to_string(static_cast<unsigned>(t.kind)) +
                                                 " is not a TierKind (memory, disk)");
  if (t.kind == TierKind::memory && t.memory_capacity_bytes == 0)
    throw Error(ErrorCode::invalid_argument, std::string(which) + ".memory_capacity_bytes must be > 0, got 0");
  if (t.kind == TierKind::disk && t.disk_directory.empty())
    throw Error(ErrorCode::invalid_argument, std::string(which) + ".disk_directory must name a directory, got ''");
}
}  // namespace detail

/// Validates `options` completely and returns the engine-side plan. Throws kvfuse::Error,
/// naming the bad value, for:
///   - what state_tier_capability() refuses: an unknown connector name (unknown_connector),
///     two offload subs in any spellings (duplicate_offload), pipeline_parallel_size > 1
///     with a state tier (unsupported_parallelism), pp = 0, subs on a non-multi, a multi
///     with no subs, a nested multi in any spelling, a kv_role or layout outside its enum
///     (invalid_argument);
///   - a config that hosts no offload connector: there is no composition to build
///     (invalid_argument, naming the connector);
///   - a zero grid, or chunk_tokens not a multiple of block_tokens (invalid_argument);
///   - world_size 0 or > 64; a stateful layout with slot_count 0 or > 2^24; layout=none
///     with slot_count > 0 (invalid_argument);
///   - a tier kind outside TierKind, a memory tier of 0 bytes, a disk tier without a
///     directory, or KV on disk with state in memory (not a compiled alternative)
///     (invalid_argument); the state tier's settings are checked only with a stateful layout.
/// No I/O, no rank touched. Construction time; any thread.
inline ConfiguredComposition configure(const DeploymentOptions& options) {
  const EngineOptions& eng = options.engine;
  const Capability cap = state_tier_capability(eng);  // names, nesting, duplicates, pp

  ConfiguredComposition out;
  out.capability = cap;
  out.is_multi = is_multi_connector(eng.connector);
  if (out.is_multi) {
    std::vector<std::string_view> raw;
    raw.reserve(eng.subs.size());
    for (const SubConnectorOptions& s : eng.subs) raw.emplace_back(s.name);
    out.subs = resolve_multi_subs(std::span<const std::string_view>(raw));
  } else {
    out.subs = {canonical_connector_name(eng.connector)};
  }
  bool found = false;
  for (std::size_t i = 0; i < out.subs.size(); ++i)
    if (out.subs[i] == "offload") {
      out.offload_sub = i;
      found = true;
    }
  if (!found)
    throw Error(ErrorCode::invalid_argument, "connector '" + eng.connector +
                                                 "' hosts no offload connector: configure() has no kvfuse "
                                                 "composition to build (" + cap.reason + ")");

  const PlanGrids& g = options.grids;
  if (g.block_tokens == 0) throw Error(ErrorCode::invalid_argument, "grids.block_tokens must be > 0, got 0");
  if (g.chunk_tokens == 0) throw Error(ErrorCode::invalid_argument, "grids.chunk_tokens must be > 0, got 0");
  if (g.chunk_tokens % g.block_tokens != 0)
    throw Error(ErrorCode::invalid_argument, "grids.chunk_tokens=" + std::to_string(g.chunk_tokens) +
                                                 " is not a multiple of grids.block_tokens=" +
                                                 std::to_string(g.block_tokens));

  if (options.world_size == 0 || options.world_size > detail::max_configured_world)
    throw Error(ErrorCode::invalid_argument, "world_size must be in [1, " +
                                                 std::to_string(detail::max_configured_world) + "], got " +
                                                 std::to_string(options.world_size));

  const bool stateful = eng.layout != StateLayout::none;
  if (stateful && (options.slot_count == 0 || options.slot_count > detail::max_configured_slots))
    throw Error(ErrorCode::invalid_argument, "slot_count must be in [1, 2^24] with layout=" +
                                                 std::string(to_string(eng.layout)) + ", got " +
                                                 std::to_string(options.slot_count));
  if (!stateful && options.slot_count != 0)
    throw Error(ErrorCode::invalid_argument, "slot_count must be 0 with layout=none (a dense model has no state "
                                             "slots), got " + std::to_string(options.slot_count));

  detail::check_tier(options.kv_tier, "kv_tier");
  if (stateful) {
    detail::check_tier(options.state_tier, "state_tier");
    if (options.kv_tier.kind == TierKind::disk && options.state_tier.kind == TierKind::memory)
      throw Error(ErrorCode::invalid_argument,
                  "kv_tier=disk with state_tier=memory is not a compiled composition (use state_tier=disk, or "
                  "kv_tier=memory)");
  }

  switch (eng.layout) {
    case StateLayout::none: out.preset = Preset::dense; break;
    case StateLayout::dsv4_slot: out.preset = Preset::dsv4; break;
    case StateLayout::k3_recurrent: out.preset = Preset::k3; break;
  }
  out.index = index_options_for(cap, options.slot_count);
  out.coordinator.layout = eng.layout;
  out.coordinator.grids = g;
  out.coordinator.min_load_tokens = options.min_load_tokens;
  out.coordinator.break_even = options.break_even;
  out.world_size = options.world_size;
  out.kv_tier = options.kv_tier;
  out.state_tier = options.state_tier;
  return out;
}

/// Every compiled composition a configured rank may run, one unique_ptr alternative each
/// (Connector is neither copyable nor movable). See the header comment for the list.
template <class Group, Runtime R = HostRuntime>
using AnyConnector = std::variant<std::unique_ptr<DenseConnector<MemoryTier<>, Group, R>>,
                                  std::unique_ptr<DenseConnector<DiskTier, Group, R>>,
                                  std::unique_ptr<Dsv4Connector<MemoryTier<>, MemoryTier<>, Group, R>>,
                                  std::unique_ptr<Dsv4Connector<MemoryTier<>, DiskTier, Group, R>>,
                                  std::unique_ptr<Dsv4Connector<DiskTier, DiskTier, Group, R>>,
                                  std::unique_ptr<KimiK3Connector<MemoryTier<>, MemoryTier<>, Group, R>>,
                                  std::unique_ptr<KimiK3Connector<MemoryTier<>, DiskTier, Group, R>>,
                                  std::unique_ptr<KimiK3Connector<DiskTier, DiskTier, Group, R>>>;

/// The tiers of one rank, built from a ConfiguredComposition's tier settings. Exactly one
/// KV tier pointer is non-null; for a stateful preset exactly one state tier is reachable
/// (a disk state tier on the KV tier's directory is the KV DiskTier itself). Addresses are
/// stable for the object's life. Construction time; any thread.
struct RankTiers {
  std::unique_ptr<MemoryTier<>> kv_memory;
  std::unique_ptr<DiskTier> kv_disk;
  std::unique_ptr<MemoryTier<>> state_memory;
  std::unique_ptr<DiskTier> state_disk_owned;
  DiskTier* state_disk = nullptr;

  /// Builds the tiers. Throws what MemoryTier / DiskTier throw (io_failure naming a
  /// directory that cannot be used).
  explicit RankTiers(const ConfiguredComposition& c) {
    if (c.kv_tier.kind == TierKind::memory)
      kv_memory = std::make_unique<MemoryTier<>>(c.kv_tier.memory_capacity_bytes);
    else
      kv_disk = std::make_unique<DiskTier>(c.kv_tier.disk_directory);
    if (c.preset == Preset::dense) return;
    if (c.state_tier.kind == TierKind::memory) {
      state_memory = std::make_unique<MemoryTier<>>(c.state_tier.memory_capacity_bytes);
    } else if (kv_disk && c.state_tier.disk_directory == c.kv_tier.disk_directory) {
      state_disk = kv_disk.get();
    } else {
      state_disk_owned = std::make_unique<DiskTier>(c.state_tier.disk_directory);
      state_disk = state_disk_owned.get();
    }
  }
};

/// One configured rank: its tiers and its connector (declared in that order, so the
/// connector is destroyed first and its legs never outlive their tiers). Movable.
/// `connector` follows Connector's thread rules; use visit() to reach it.
template <class Group, Runtime R = HostRuntime>
struct RankConnector {
  std::unique_ptr<RankTiers> tiers;
  AnyConnector<Group, R> connector;
  Preset preset = Preset::dense;

  /// Calls `f(conn)` with the concrete Connector (by reference) and returns its result.
  template <class F>
  decltype(auto) visit(F&& f) {
    return std::visit([&](auto& p) -> decltype(auto) { return std::forward<F>(f)(*p); }, connector);
  }
};

namespace detail {
template <class Conn, class KvT, class StateT, class Group, Runtime R>
std::unique_ptr<Conn> build_connector(const RankGeometry& geo, R& rt, DeviceMemory memory, KvT& kv, StateT* state,
                                      Group& group, ConnectorOptions options) {
  if constexpr (Conn::has_state)
    return std::make_unique<Conn>(geo, rt, memory, PagedKv<KvT>(kv), typename Conn::state_leg_type(*state), group,
                                  options);
  else
    return std::make_unique<Conn>(geo, rt, memory, PagedKv<KvT>(kv), NoState{}, group, options);
}
}  // namespace detail

/// Builds rank `geometry.rank`'s connector for the configured composition: the preset
/// from the layout, the tier types from the tier kinds. Throws Error(invalid_argument)
/// naming both values when the geometry's grids differ from the configured grids, its
/// world_size from the configured one, or (stateful) its num_slots is below slot_count;
/// and whatever RankTiers and the Connector constructor throw (a bad geometry, a group
/// that is too small). Construction time; any thread, once per rank. `runtime`, `memory`
/// and `group` must outlive the result.
template <class Group, Runtime R>
RankConnector<Group, R> make_rank_connector(const ConfiguredComposition& c, const RankGeometry& geometry, R& runtime,
                                            DeviceMemory memory, Group& group, ConnectorOptions options = {}) {
  const PlanGrids& g = c.coordinator.grids;
  if (geometry.block_tokens != g.block_tokens || geometry.chunk_tokens != g.chunk_tokens)
    throw Error(ErrorCode::invalid_argument,
                "rank " + std::to_string(geometry.rank) + " geometry grids (block_tokens=" +
                    std::to_string(geometry.block_tokens) + ", chunk_tokens=" + std::to_string(geometry.chunk_tokens) +
                    ") differ from the configured grids (block_tokens=" + std::to_string(g.block_tokens) +
                    ", chunk_tokens=" + std::to_string(g.chunk_tokens) + ")");
  if (geometry.world_size != c.world_size)
    throw Error(ErrorCode::invalid_argument, "rank geometry world_size=" + std::to_string(geometry.world_size) +
                                                 " differs from the configured world_size=" +
                                                 std::to_string(c.world_size));
  if (c.preset != Preset::dense && geometry.num_slots < c.index.slot_count)
    throw Error(ErrorCode::invalid_argument, "rank geometry num_slots=" + std::to_string(geometry.num_slots) +
                                                 " is below the configured slot_count=" +
                                                 std::to_string(c.index.slot_count));

  RankConnector<Group, R> out;
  out.preset = c.preset;
  out.tiers = std::make_unique<RankTiers>(c);
  RankTiers& t = *out.tiers;
  using Mem = MemoryTier<>;
  auto make = [&]<class Conn>(auto& kv, auto* state) {
    out.connector = detail::build_connector<Conn>(geometry, runtime, memory, kv, state, group, options);
  };
  const bool kv_mem = t.kv_memory != nullptr;
  const bool state_mem = t.state_memory != nullptr;
  switch (c.preset) {
    case Preset::dense:
      if (kv_mem)
        make.template operator()<DenseConnector<Mem, Group, R>>(*t.kv_memory, static_cast<Mem*>(nullptr));
      else
        make.template operator()<DenseConnector<DiskTier, Group, R>>(*t.kv_disk, static_cast<Mem*>(nullptr));
      break;
    case Preset::dsv4:
      if (kv_mem && state_mem)
        make.template operator()<Dsv4Connector<Mem, Mem, Group, R>>(*t.kv_memory, t.state_memory.get());
      else if (kv_mem)
        make.template operator()<Dsv4Connector<Mem, DiskTier, Group, R>>(*t.kv_memory, t.state_disk);
      else
        make.template operator()<Dsv4Connector<DiskTier, DiskTier, Group, R>>(*t.kv_disk, t.state_disk);
      break;
    case Preset::k3:
      if (kv_mem && state_mem)
        make.template operator()<KimiK3Connector<Mem, Mem, Group, R>>(*t.kv_memory, t.state_memory.get());
      else if (kv_mem)
        make.template operator()<KimiK3Connector<Mem, DiskTier, Group, R>>(*t.kv_memory, t.state_disk);
      else
        make.template operator()<KimiK3Connector<DiskTier, DiskTier, Group, R>>(*t.kv_disk, t.state_disk);
      break;
  }
  return out;
}

}  // namespace kvfuse
