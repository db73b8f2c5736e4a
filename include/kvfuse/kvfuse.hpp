// kvfuse/kvfuse.hpp — everything an engine needs, in one include. HipRuntime is separate
// (<kvfuse/device/hip_runtime.hpp>, link kvfuse::hip) because it needs the HIP headers
// and library.
#pragma once

#include <kvfuse/error.hpp>

// engine side
#include <kvfuse/engine/ids.hpp>
#include <kvfuse/engine/load_request.hpp>
#include <kvfuse/engine/store_request.hpp>
#include <kvfuse/engine/capability.hpp>
#include <kvfuse/engine/connector_names.hpp>
#include <kvfuse/engine/offload_index.hpp>
#include <kvfuse/engine/reseed.hpp>

// completion path
#include <kvfuse/completion/records.hpp>
#include <kvfuse/completion/completion_guard.hpp>
#include <kvfuse/completion/group.hpp>
#include <kvfuse/completion/rank_queue.hpp>
#include <kvfuse/completion/single_rank.hpp>
#include <kvfuse/completion/tp_quorum.hpp>
#include <kvfuse/completion/settlement_pump.hpp>

// devices
#include <kvfuse/device/runtime.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/device/faulty_runtime.hpp>
#include <kvfuse/device/save_fence.hpp>

// tiers
#include <kvfuse/tier/tier.hpp>
#include <kvfuse/tier/pinned_source.hpp>
#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/delay_tier.hpp>

// worker side and compositions
#include <kvfuse/worker/rank_geometry.hpp>
#include <kvfuse/worker/lane.hpp>
#include <kvfuse/worker/staging.hpp>
#include <kvfuse/worker/leg.hpp>
#include <kvfuse/worker/paged_kv.hpp>
#include <kvfuse/worker/state_legs.hpp>
#include <kvfuse/worker/connector.hpp>
#include <kvfuse/compose/presets.hpp>
#include <kvfuse/compose/multi.hpp>
