// kvfuse-replay: what one pass is built from before its loop runs: the ranks' shape, the
// shared memory segment of ranks as processes, the empty result, and the per-request coin
// the faults and the composition draw from. Pure functions of the model, the options and the
// workload (the segment aside, which they describe): the engine's thread.
#pragma once

#include "content.hpp"
#include "faults.hpp"
#include "models.hpp"
#include "pass.hpp"
#include "ranks.hpp"
#include "result.hpp"
#include "workload.hpp"

#include <kvfuse/ipc/shm_engine.hpp>

#include <cstdint>
#include <memory>
#include <string>

namespace replay {

/// Deterministic per-request coin: the same request gets the same answer in every pass.
inline bool request_coin(std::uint64_t seed, std::uint64_t request, std::uint64_t salt, std::uint32_t per_mille) {
  return mix64(seed ^ mix64(request * 0x100000001b3ULL + salt)) % 1000 < per_mille;
}

/// The ranks' shape, before the faults set up their tiers. Request slots and snapshot slots
/// share each rank's device slot memory.
inline RankSetup rank_setup(const Model& model, const RunOptions& o, const Workload& w) {
  RankSetup s;
  s.model = model.id;
  s.world = o.world;
  s.num_blocks = o.num_blocks;
  s.num_slots = model.stateful ? o.num_slots + (o.offload ? o.snapshot_slots : 0) : 0;
  s.max_chunks_per_load = static_cast<std::uint32_t>(w.max_request_tokens / chunk_tokens + 2);
  s.slot_bytes = std::size_t{o.state_scale} * default_slot_bytes;
  s.tier = o.tier;
  return s;
}

/// Ranks as processes: the segment they attach to.
inline std::unique_ptr<kvfuse::ShmEngine> rank_segment(const Model& model, const RunOptions& o, const Workload& w) {
  kvfuse::ShmOptions so;
  so.name_prefix = "kvfuse-replay";
  so.geometry = rank_setup(model, o, w).geometry(0);
  so.lanes_per_rank = static_cast<std::uint32_t>(model.lanes);
  return std::make_unique<kvfuse::ShmEngine>(so);
}

/// The result of a pass before it ran.
inline RunResult empty_result(const Model& model, const RunOptions& o) {
  RunResult r;
  r.model = std::string(model.name);
  r.offload = o.offload;
  r.fault_counts.assign(fault_rows().size(), 0);
  return r;
}

}  // namespace replay
