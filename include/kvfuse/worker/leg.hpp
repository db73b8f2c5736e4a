// kvfuse/worker/leg.hpp — the KvLeg and StateLeg policies and what a lane hands them.
//
// A leg is a small policy object: it knows one tier and one way of moving bytes between
// that tier and the device. The Connector owns the lanes, streams and staging and lends
// them to the leg for one call through a LaneContext, so legs hold no threads and no
// buffers of their own and a user-written leg is a dozen lines.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include <kvfuse/bridge/records.hpp>
#include <kvfuse/device/runtime.hpp>
#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/save_request.hpp>
#include <kvfuse/bridge/state_layout.hpp>
#include <kvfuse/tier/tier.hpp>
#include <kvfuse/worker/rank_geometry.hpp>

namespace kvfuse {

/// The engine's device pools this rank moves bytes into and out of. The engine owns them.
/// Block b is [kv_blocks + b * block_bytes, + block_bytes); slot s likewise with slot_bytes.
struct DeviceMemory {
  std::byte* kv_blocks = nullptr;
  std::byte* slots = nullptr;
};

/// A save leg's way to say "nothing reads the source any more" the moment it knows (after
/// the last gather's synchronize, before the tier puts), so the engine frees the source blocks
/// long before the store lands (docs/reference.md#save-path). Calls after the first do nothing; a
/// default-constructed one does nothing at all (load lanes). A leg that never calls it is
/// still correct: the Connector synchronizes the lane's stream after the leg and releases.
/// Only the lane's own thread calls it; noexcept.
class SourceRelease {
 public:
  SourceRelease() noexcept = default;
  /// Forwards to `guard.release_source()`; `guard` must outlive this object.
  template <class Guard>
  explicit SourceRelease(Guard& guard) noexcept
      : target_(&guard), release_([](void* g) noexcept { static_cast<Guard*>(g)->release_source(); }) {}
  void operator()() const noexcept {
    if (release_ != nullptr) release_(target_);
  }

 private:
  void* target_ = nullptr;
  void (*release_)(void*) noexcept = nullptr;
};

/// Everything one lane lends a leg for one call. Only the lane's own thread uses it.
template <Runtime R>
struct LaneContext {
  R& runtime;
  typename R::Stream& stream;           ///< the lane's copy stream
  /// The lane's staging buffer (R12: allocated at construction). The save lane's holds at
  /// least ConnectorOptions::save_staging_chunks KV chunks, so a save that fits is gathered
  /// whole before its first put.
  std::span<std::byte> staging;
  std::span<std::uint8_t> chunk_mask;   ///< per-chunk arrival mask, max_chunks_per_load long
  const RankGeometry& geometry;
  DeviceMemory memory;
  /// Room to keep tier views alive until one synchronize covers all their copies
  /// (max_chunks_per_load long, allocated with the lane). Empty: synchronize per chunk.
  std::span<TierView> held_views = {};
  /// On the save lane: report the save's source released (see SourceRelease).
  SourceRelease release_source = {};
};

/// Result of a KV leg on one rank.
struct KvVerdict {
  bool ok = false;
  Reason reason = Reason::none;
  std::uint32_t restored = 0;  ///< chunks restored contiguously from the HBM floor (all of them when ok)
};

/// Result of a state leg on one rank.
struct StateVerdict {
  StateOutcome outcome = StateOutcome::failed;
  Reason reason = Reason::leg_not_run;
};

/// Result of a save on one rank: what goes into its `stored` SaveRecord. (The `released`
/// record is sent through LaneContext::release_source, or by the Connector after the leg.)
struct SaveVerdict {
  bool stored = false;
  Reason reason = Reason::none;
};

/// How a state leg is scheduled relative to the KV leg of the same load.
enum class StateOrdering {
  none,        ///< no state leg exists (dense): no state lane, no state branch compiled
  concurrent,  ///< own lane, runs while the KV leg runs; the load task joins it (K3, R9)
  after_kv,    ///< same lane, after the KV leg (DSV4: page retrieve, sidecar check, slot scatter)
};

/// A KV leg: moves chunks of [hbm, end) from a tier into blocks, and saves whole chunks.
/// Both calls run on one lane's thread and should not throw; if one does, the Connector's
/// guard still reports (R1) with Reason::exception.
template <class L, class R>
concept KvLegFor = Runtime<R> && requires(L& leg, const KvSpec& spec, const KvSave& save, LaneContext<R>& lane) {
  { leg.load(spec, lane) } -> std::same_as<KvVerdict>;
  { leg.save(save, lane) } -> std::same_as<SaveVerdict>;
};

/// A state leg: its ordering, the model's state layout it moves (`L::layout`: none exactly
/// when the ordering is none; the engine plans by the same value, so nothing guesses the
/// layout from the scheduling), and (unless ordering is none) load and save calls and the
/// size of one of its tier entries. `kv` is the same load's KV spec, or null for a
/// state-only load, so the leg can check that the engine and the rank agree about where
/// the KV leg ends (R11). `L::entry_bytes(geometry)` (static, noexcept) is the bytes one
/// state entry takes for that rank geometry; the Connector sizes its staging to hold the
/// larger of it and a KV chunk (R12).
template <class L, class R>
concept StateLegFor =
    Runtime<R> && requires {
      { L::ordering } -> std::convertible_to<StateOrdering>;
      { L::layout } -> std::convertible_to<StateLayout>;
    } && ((L::ordering == StateOrdering::none) == (L::layout == StateLayout::none)) &&
    (L::ordering == StateOrdering::none ||
     requires(L& leg, const StateSpec& spec, const KvSpec* kv, const StateSave& save, LaneContext<R>& lane,
              const RankGeometry& geometry) {
       { leg.load(spec, kv, lane) } -> std::same_as<StateVerdict>;
       { leg.save(save, lane) } -> std::same_as<SaveVerdict>;
       { L::entry_bytes(geometry) } noexcept -> std::same_as<std::size_t>;
     });

}  // namespace kvfuse
