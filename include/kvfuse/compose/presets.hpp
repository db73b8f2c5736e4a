// kvfuse/compose/presets.hpp — the three shipped compositions. Type aliases, nothing more:
// the same Connector template serves every model, so a fix to it fixes all three.
#pragma once

#include <kvfuse/completion/tp_quorum.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/worker/connector.hpp>
#include <kvfuse/worker/paged_kv.hpp>
#include <kvfuse/worker/state_legs.hpp>

namespace kvfuse {

/// Dense models: paged KV only. No state lane exists and no state branch is compiled.
template <Tier T, class Group = TpQuorum, Runtime R = HostRuntime>
using DenseConnector = Connector<PagedKv<T>, NoState, Group, R>;

/// DeepSeek-V4: paged KV, then the slot state on the same lane (page retrieve, sidecar
/// validation, slot scatter, one record).
template <Tier T, class Group = TpQuorum, Runtime R = HostRuntime>
using Dsv4Connector = Connector<PagedKv<T>, SlotState<T>, Group, R>;

/// Kimi-K3: paged KV and the recurrent state on their own lanes, joined before the one
/// record (R9).
template <Tier T, class Group = TpQuorum, Runtime R = HostRuntime>
using KimiK3Connector = Connector<PagedKv<T>, RecurrentState<T>, Group, R>;

}  // namespace kvfuse
