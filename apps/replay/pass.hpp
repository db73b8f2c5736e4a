// kvfuse-replay: one engine and its ranks replaying a workload, one pass (pass.cpp).
#pragma once

#include "faults.hpp"
#include "models.hpp"
#include "result.hpp"
#include "tiers.hpp"
#include "workload.hpp"

#include <kvfuse/engine/cache_policy.hpp>
#include <kvfuse/engine/checkpoint_policy.hpp>
#include <kvfuse/engine/index_options.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>

namespace replay {

/// How the ranks run: as threads of the engine's process, or one process per rank.
enum class RanksAs { threads, processes };

/// How one engine is built and driven.
struct RunOptions {
  std::uint32_t world = 8;
  RanksAs ranks_as = RanksAs::threads;
  std::size_t tier = 0;        ///< the ranks' tier: an index in the tier table
  TierOptions tier_options;    ///< what every rank's tier is built from (the faults adjust it per rank)
  std::uint32_t num_blocks = 1024;  ///< the device block pool (all ranks alike)
  std::uint32_t num_slots = 16;     ///< the device state slot pool: one per admitted request
  /// Snapshot slots per rank, beside the request slots in the same device slot memory: a
  /// prefill checkpoint is copied into one and read from it by the save. None free at a
  /// checkpoint: that checkpoint is skipped (counted), the prefill never waits.
  std::uint32_t snapshot_slots = 16;
  /// Every state slot, and so every checkpoint, is this many chunks' KV (4 KiB per rank
  /// each): a large hybrid state on the tiny model (--state-scale).
  std::uint32_t state_scale = 1;
  kvfuse::CheckpointPolicy checkpoints{};  ///< where stateful requests capture state checkpoints
  std::size_t state_capacity = std::size_t{1} << 18;             ///< the index's state hash capacity
  kvfuse::HashEviction hash_eviction = kvfuse::HashEviction::lru;  ///< which state hash goes at that capacity
  /// --cache-policy: the engine's CacheLedger owns the tier budget (cache_budget bytes per
  /// rank) and erases what it evicts; the tiers are then unlimited. None: each tier evicts
  /// by its own LRU at tier_options.memory_bytes, as before.
  std::optional<kvfuse::CachePolicy> cache_policy;
  std::uint64_t cache_budget = 0;
  bool offload = true;              ///< false: the first pass of --two-pass (no loads, no saves, no faults)
  bool sync_saves = false;          ///< each request's saves land before the next arrives
  double speed = 0;                 ///< 0: as fast as possible; else simulated ms per wall ms
  FaultSet faults;                  ///< armed when offload is on
  std::uint64_t seed = 1;
  std::function<void(std::size_t done, std::size_t total, std::size_t loads_in_flight)> progress;
};

/// Replays `w` through one engine running `model` and drains it; returns what it measured.
/// Throws kvfuse::Error when the ranks or their tiers cannot be built.
RunResult replay_pass(const Model& model, const Workload& w, const RunOptions& options);

}  // namespace replay
