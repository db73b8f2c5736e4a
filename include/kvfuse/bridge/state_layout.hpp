// kvfuse/bridge/state_layout.hpp — the model's shape: which per-request state, if any, it
// carries next to its paged KV. Both sides speak it: a state leg names the layout it moves
// (worker side), and the planner plans by it (engine side), so the two cannot disagree.
//
// Plain data and pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvfuse {

/// What per-request state the model carries next to its paged KV.
enum class StateLayout : std::uint8_t {
  none,          ///< a dense model: no state tier
  dsv4_slot,     ///< DeepSeek-V4 slot state
  k3_recurrent,  ///< Kimi-K3 recurrent state
};

/// Stable name of a StateLayout, for messages. Constexpr, noexcept, thread-safe.
constexpr std::string_view to_string(StateLayout l) noexcept {
  switch (l) {
    case StateLayout::none: return "none";
    case StateLayout::dsv4_slot: return "dsv4_slot";
    case StateLayout::k3_recurrent: return "k3_recurrent";
  }
  return "unknown_layout";
}

/// Whether `l` is one of the enum's named values. A value cast from an out-of-range integer
/// (a config parsed wrongly, a field never set) is none of them, and is refused by every
/// configuration check rather than read as whatever its comparisons happen to say.
/// Constexpr, noexcept, thread-safe.
constexpr bool is_known(StateLayout l) noexcept {
  return l == StateLayout::none || l == StateLayout::dsv4_slot || l == StateLayout::k3_recurrent;
}

}  // namespace kvfuse
