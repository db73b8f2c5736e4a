// kvfuse/compose/presets.hpp — the shipped compositions. Type aliases, nothing more:
// the same Connector template serves every model, so a fix to it fixes them all. Each
// leg names its own tier type, so "KV in a MemoryTier, state in a DiskTier" is a preset.
#pragma once

#include <kvfuse/completion/tp_quorum.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/worker/connector.hpp>
#include <kvfuse/worker/paged_kv.hpp>
#include <kvfuse/worker/state_legs.hpp>

namespace kvfuse {

/// Dense models: paged KV only. No state lane exists and no state branch is compiled.
template <Tier KvTier, class Group = TpQuorum, Runtime R = HostRuntime>
using DenseConnector = Connector<PagedKv<KvTier>, NoState, Group, R>;

/// DeepSeek-V4: paged KV, then the slot state on the same lane (page retrieve, sidecar
/// validation, slot scatter, one record). The state entries may live in a tier of their
/// own (say KV in memory, state on disk); by default they share the KV tier's type.
template <Tier KvTier, Tier StateTier = KvTier, class Group = TpQuorum, Runtime R = HostRuntime>
using Dsv4Connector = Connector<PagedKv<KvTier>, SlotState<StateTier>, Group, R>;

/// Kimi-K3: paged KV and the recurrent state on their own lanes, joined before the one
/// record (R9). The state tier's type defaults to the KV tier's.
template <Tier KvTier, Tier StateTier = KvTier, class Group = TpQuorum, Runtime R = HostRuntime>
using KimiK3Connector = Connector<PagedKv<KvTier>, RecurrentState<StateTier>, Group, R>;

/// K3 with the state leg after KV: the baseline the fused load is measured against. The
/// same legs as KimiK3Connector, but the recurrent state runs on the load lane after the
/// KV leg (StateAfterKv), so a joint load costs the sum of its legs and there is no state
/// lane. For benchmarks and replay comparisons, not for serving.
template <Tier KvTier, Tier StateTier = KvTier, class Group = TpQuorum, Runtime R = HostRuntime>
using KimiK3SerialConnector = Connector<PagedKv<KvTier>, StateAfterKv<RecurrentState<StateTier>>, Group, R>;

}  // namespace kvfuse
