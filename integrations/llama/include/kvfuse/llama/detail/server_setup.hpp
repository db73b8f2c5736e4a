// kvfuse/llama/detail/server_setup.hpp — what a Server is built from, checked: its options
// against the runner's model and grids, the rank's geometry, and the device pools (host
// memory from the runtime, freed after the connector is gone). Construction only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>

#include <kvfuse/bridge/state_layout.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/error.hpp>
#include <kvfuse/llama/sequence_runner.hpp>
#include <kvfuse/llama/serving.hpp>
#include <kvfuse/worker/rank_geometry.hpp>

namespace kvfuse::llama::detail {

/// `o`, or Error(invalid_argument) naming the value: a state leg of another layout than the
/// model's blob family needs, chunks off the runner's block grid, a request longer than the
/// context, a pool that cannot hold the longest request, no snapshot slot for a stateful one.
inline ServeOptions checked_options(const SequenceRunner& runner, const ServeOptions& o, StateLayout layout) {
  const BlobFamily family = runner.codec().layout().family;
  const StateLayout wanted = family == BlobFamily::attention ? StateLayout::none
                             : family == BlobFamily::hybrid  ? StateLayout::k3_recurrent
                                                             : StateLayout::dsv4_slot;
  if (wanted != layout)
    throw Error(ErrorCode::invalid_argument, "the model '" + runner.model().architecture() + "' needs the state layout " +
                                                 std::string(to_string(wanted)) + ", this server's state leg plans " +
                                                 std::string(to_string(layout)));
  if (o.chunk_tokens == 0 || o.chunk_tokens % runner.options().block_tokens != 0)
    throw Error(ErrorCode::invalid_argument, "chunk_tokens must be a positive multiple of the runner's block_tokens (" +
                                                 std::to_string(runner.options().block_tokens) + "), got " +
                                                 std::to_string(o.chunk_tokens));
  if (o.max_request_tokens > runner.options().context_tokens)
    throw Error(ErrorCode::invalid_argument, "max_request_tokens must fit the runner's context of " +
                                                 std::to_string(runner.options().context_tokens) + " tokens, got " +
                                                 std::to_string(o.max_request_tokens));
  const TokenCount longest = TokenGrid{runner.options().block_tokens}.cells_covering(o.max_request_tokens);
  if (o.num_blocks < longest)
    throw Error(ErrorCode::invalid_argument, "num_blocks must hold the longest request (" + std::to_string(longest) +
                                                 " blocks), got " + std::to_string(o.num_blocks));
  if (layout != StateLayout::none && o.snapshot_slots == 0)
    throw Error(ErrorCode::invalid_argument, "snapshot_slots must be > 0, got 0");
  return o;
}

/// The one rank's geometry: the runner's grids and row sizes, one request slot and the
/// snapshot slots after it (stateful models), world size 1 in every tier key.
inline RankGeometry geometry_for(const SequenceRunner& runner, const ServeOptions& o, bool stateful) {
  RankGeometry g;
  g.model = o.model_id;
  g.rank = 0;
  g.world_size = 1;
  g.block_tokens = runner.options().block_tokens;
  g.chunk_tokens = o.chunk_tokens;
  g.kv_bytes_per_token = runner.codec().kv_bytes_per_token();
  g.num_blocks = o.num_blocks;
  g.num_slots = stateful ? 1 + o.snapshot_slots : 0;
  g.slot_bytes = stateful ? runner.codec().slot_bytes() : 0;
  g.max_chunks_per_load = static_cast<std::uint32_t>(TokenGrid{o.chunk_tokens}.cells_covering(o.max_request_tokens) + 1);
  return g;
}

/// The device pools of a Server's rank: host memory from the runtime, freed on destruction
/// (declared before the connector, so after it is gone).
struct DevicePools {
  HostRuntime& runtime;
  std::byte* blocks;
  std::byte* slots;
  DevicePools(HostRuntime& rt, const RankGeometry& g)
      : runtime(rt),
        blocks(static_cast<std::byte*>(rt.allocate_device(std::size_t{g.num_blocks} * g.block_bytes()))),
        slots(static_cast<std::byte*>(rt.allocate_device(std::max<std::size_t>(1, std::size_t{g.num_slots} * g.slot_bytes)))) {}
  ~DevicePools() {
    runtime.free_device(blocks);
    runtime.free_device(slots);
  }
  DevicePools(const DevicePools&) = delete;
  DevicePools& operator=(const DevicePools&) = delete;
};

}  // namespace kvfuse::llama::detail
