// kvfuse/bridge/resolution.hpp — how a load ended, as the scheduler hears it.
//
// The engine side's one stream of answers (OffloadIndex queues them, SettlementPump::step
// hands them out): every admitted load yields exactly one LoadResolution, however it
// ended — its ranks settled it, the engine failed or abandoned it, its ticket was dropped,
// or it was reclaimed as an orphan. Plain data, so a scheduler in another component can
// receive it as it is.
#pragma once

#include <cstdint>
#include <string_view>

#include <kvfuse/bridge/ids.hpp>

namespace kvfuse {

/// How a load ended.
enum class Resolution : std::uint8_t {
  completed,  ///< settled ok
  failed,     ///< settled not ok (state_missed says whether the hash was retracted)
  abandoned,  ///< abandoned: by the ticket (explicitly or dropped) or by key; never retracts
  reclaimed,  ///< an orphan reclaimed after its timeout; counted as abandoned too
};

/// Short, stable name of a Resolution. Thread-safe, noexcept.
constexpr std::string_view to_string(Resolution r) noexcept {
  switch (r) {
    case Resolution::completed: return "completed";
    case Resolution::failed: return "failed";
    case Resolution::abandoned: return "abandoned";
    case Resolution::reclaimed: return "reclaimed";
  }
  return "unknown_resolution";
}

/// One resolved load, as the scheduler drains it: the single event that unparks (or
/// forgets) the request. Every admission yields exactly one.
struct LoadResolution {
  LoadKey key;
  Resolution kind = Resolution::completed;
  bool state_missed = false;  ///< failed with a genuine state miss: the hash was retracted
  bool orphaned = false;      ///< the request was already torn down; its slot is free now (the index's slot-free callback, if any, was called)
  bool dispatched = false;    ///< a LoadRequest was handed out (false: the ticket was abandoned or dropped)
  /// The chunks every live rank restored contiguously from the HBM floor (Settlement::kv_restored);
  /// 0 for a load that did not settle through its ranks (abandoned, reclaimed, failed by key).
  std::uint32_t kv_restored = 0;
  friend constexpr bool operator==(const LoadResolution&, const LoadResolution&) = default;
};

}  // namespace kvfuse
