// kvfuse/kvfuse.hpp — everything an engine needs, in one include, in the order the data
// flows. HipRuntime is separate (<kvfuse/device/hip_runtime.hpp>, link kvfuse::hip)
// because it needs the HIP headers and library. Two kits are opt-in, each included by
// name: ranks as processes (<kvfuse/ipc/...>) and the engine-side host kit that engine loops
// build on (<kvfuse/host/...>). Test doubles (FaultyRuntime, DelayTier, the allocation
// counter) are under <kvfuse/testing/...> and are not included here.
#pragma once

#include <kvfuse/error.hpp>
#include <kvfuse/version.hpp>

// bridge: the plain data both sides share
#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/save_request.hpp>
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/bridge/frames.hpp>
#include <kvfuse/bridge/resolution.hpp>

// engine side
#include <kvfuse/engine/capability.hpp>
#include <kvfuse/engine/connector_names.hpp>
#include <kvfuse/engine/planner.hpp>
#include <kvfuse/engine/checkpoint_policy.hpp>
#include <kvfuse/engine/cache_policy.hpp>
#include <kvfuse/engine/cache_ledger.hpp>
#include <kvfuse/engine/arbitration.hpp>
#include <kvfuse/engine/coordinator_types.hpp>
#include <kvfuse/engine/coordinator.hpp>
#include <kvfuse/engine/index_options.hpp>
#include <kvfuse/engine/tickets.hpp>
#include <kvfuse/engine/offload_index.hpp>
#include <kvfuse/engine/index_consistency.hpp>
#include <kvfuse/engine/reseed.hpp>

// completion path
#include <kvfuse/completion/group.hpp>
#include <kvfuse/completion/group_wrapper.hpp>
#include <kvfuse/completion/rank_queue.hpp>
#include <kvfuse/completion/single_rank.hpp>
#include <kvfuse/completion/tp_quorum.hpp>
#include <kvfuse/completion/settlement_pump.hpp>

// worker side
#include <kvfuse/worker/rank_geometry.hpp>
#include <kvfuse/worker/lane.hpp>
#include <kvfuse/worker/staging.hpp>
#include <kvfuse/worker/leg.hpp>
#include <kvfuse/worker/completion_guard.hpp>
#include <kvfuse/worker/paged_kv.hpp>
#include <kvfuse/worker/state_legs.hpp>
#include <kvfuse/worker/connector.hpp>

// tiers
#include <kvfuse/tier/tier.hpp>
#include <kvfuse/tier/pinned_source.hpp>
#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/tiered_tier.hpp>

// devices
#include <kvfuse/device/runtime.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/device/save_fence.hpp>

// compositions
#include <kvfuse/compose/presets.hpp>
#include <kvfuse/compose/multi.hpp>
#include <kvfuse/compose/loopback_pd.hpp>
#include <kvfuse/compose/configured.hpp>
#include <kvfuse/compose/prometheus.hpp>
