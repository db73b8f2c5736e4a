// kvfuse/worker/state_legs.hpp — the shipped state legs: NoState, RecurrentState (Kimi-K3),
// SlotState (DeepSeek-V4), and the StateAfterKv adapter that reorders any of them.
//
// All boundary checks of R11 live in check_state_spec, shared by both stateful legs, so a
// slot outside the pool or a grid disagreement is refused the same way whatever the model.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

#include <kvfuse/tier/tier.hpp>
#include <kvfuse/worker/leg.hpp>

namespace kvfuse {

/// Dense models: no state leg. With NoState the Connector has no state lane, and every
/// state branch is compiled out (`if constexpr`), so the load path is a plain KV load.
struct NoState {
  static constexpr StateOrdering ordering = StateOrdering::none;
  static constexpr StateLayout layout = StateLayout::none;
};

/// Why a state spec cannot be served on this rank, or Reason::none (R11).
///   - slot outside the pool;
///   - the engine's grids differ from the rank's, or the boundary is off the checkpoint grid;
///   - in a joint load, the KV leg does not end at the chunk covering the boundary.
inline Reason check_state_spec(const StateSpec& spec, const KvSpec* kv, const RankGeometry& geo) noexcept {
  if (spec.slot.value >= geo.num_slots) return Reason::slot_out_of_range;
  if (spec.block_tokens != geo.block_tokens || spec.chunk_tokens != geo.chunk_tokens) return Reason::grid_mismatch;
  if (!geo.block_grid().aligned(spec.boundary_tokens) || spec.boundary_tokens == 0) return Reason::grid_mismatch;
  if (kv != nullptr && kv->end != geo.chunk_grid().ceil(spec.boundary_tokens)) return Reason::kv_end_mismatch;
  return Reason::none;
}

/// The explicit "this rank has no state tier" (R14), passed to RecurrentState / SlotState
/// instead of a tier. There is no pointer constructor, so a forgotten `&tier` does not
/// compile into a rank that silently stores nothing. Plain data; any thread.
struct NoStateTier {
  explicit constexpr NoStateTier() noexcept = default;
};
/// The one NoStateTier value: `RecurrentState<T>(kvfuse::no_state_tier)`.
inline constexpr NoStateTier no_state_tier{};

namespace detail {
inline TierKey state_key(const RankGeometry& geo, PrefixHash hash) noexcept {
  return TierKey{geo.model, hash, geo.world_size, geo.rank, EntryKind::state};
}

/// Copies `bytes` into a slot and waits for the copy (the view must outlive it).
template <Runtime R>
bool scatter_into_slot(LaneContext<R>& lane, SlotId slot, const std::byte* src) noexcept {
  std::byte* dst = lane.memory.slots + std::size_t{slot.value} * lane.geometry.slot_bytes;
  return lane.runtime.copy_async(dst, src, lane.geometry.slot_bytes, lane.stream) &&
         lane.runtime.synchronize(lane.stream);
}

/// Gathers a slot into `dst`, waits for it, and reports the source released (nothing
/// reads the slot any more). The verdict to report if it failed; the Connector then
/// synchronizes and releases.
template <Runtime R>
std::optional<SaveVerdict> gather_slot(LaneContext<R>& lane, SlotId slot, std::byte* dst) noexcept {
  const std::byte* src = lane.memory.slots + std::size_t{slot.value} * lane.geometry.slot_bytes;
  if (!lane.runtime.copy_async(dst, src, lane.geometry.slot_bytes, lane.stream) ||
      !lane.runtime.synchronize(lane.stream))
    return SaveVerdict{false, Reason::state_transfer_failed};
  lane.release_source();
  return std::nullopt;
}

inline StateVerdict verdict_for(GetStatus status) noexcept {
  return status == GetStatus::miss ? StateVerdict{StateOutcome::missed, Reason::none}
                                   : StateVerdict{StateOutcome::failed, Reason::state_transfer_failed};
}

/// The part every stateful leg's load shares: the R11 checks, the no-tier rule (R14), the
/// tier get. On a hit `verdict` is unset and the caller validates and scatters the view;
/// otherwise `verdict` is the leg's answer.
struct StateFetch {
  TierView view;
  std::optional<StateVerdict> verdict;
};
template <Tier T, Runtime R>
StateFetch fetch_state(T* tier, const StateSpec& spec, const KvSpec* kv, LaneContext<R>& lane) noexcept {
  if (const Reason refused = check_state_spec(spec, kv, lane.geometry); refused != Reason::none)
    return {TierView{}, StateVerdict{StateOutcome::refused, refused}};
  if (tier == nullptr) return {TierView{}, StateVerdict{StateOutcome::failed, Reason::no_tier}};
  TierView view = tier->get(state_key(lane.geometry, spec.boundary_hash), lane.staging);
  if (!view.hit()) return {TierView{}, verdict_for(view.status())};
  return {std::move(view), std::nullopt};
}

/// The part every stateful leg's save shares: no tier, bad source slot, too little
/// staging. Returns the verdict to report, or nothing when the save can go ahead.
template <Tier T, Runtime R>
std::optional<SaveVerdict> refuse_save(const T* tier, const StateSave& save, std::size_t entry_bytes,
                                       const LaneContext<R>& lane) noexcept {
  if (tier == nullptr) return SaveVerdict{false, Reason::no_tier};
  if (save.source.value >= lane.geometry.num_slots) return SaveVerdict{false, Reason::slot_out_of_range};
  if (lane.staging.size() < entry_bytes) return SaveVerdict{false, Reason::state_transfer_failed};
  return std::nullopt;
}
}  // namespace detail

/// Kimi-K3 recurrent state: the entry is the slot's bytes, nothing more. Runs on its own
/// lane, concurrently with the KV leg (R9). Built on `no_state_tier`, this rank has no
/// state tier (R14): loads fail with Reason::no_tier (never a miss), saves report not
/// stored (their untouched source is released).
template <Tier T>
class RecurrentState {
 public:
  static constexpr StateOrdering ordering = StateOrdering::concurrent;
  static constexpr StateLayout layout = StateLayout::k3_recurrent;
  using tier_type = T;
  /// Loads and stores through `tier`, which must outlive the leg. Any thread, before use.
  explicit RecurrentState(T& tier) noexcept : tier_(&tier) {}
  /// This rank has no state tier (R14). Any thread, before use.
  explicit RecurrentState(NoStateTier) noexcept : tier_(nullptr) {}

  /// Bytes of one entry on a rank with `geometry`: the slot's bytes. Any thread.
  static constexpr std::size_t entry_bytes(const RankGeometry& geometry) noexcept { return geometry.slot_bytes; }

  /// Restores the checkpoint into the slot. Noexcept, no allocation.
  template <Runtime R>
  StateVerdict load(const StateSpec& spec, const KvSpec* kv, LaneContext<R>& lane) const noexcept {
    const detail::StateFetch fetched = detail::fetch_state(tier_, spec, kv, lane);
    if (fetched.verdict) return *fetched.verdict;
    const TierView& view = fetched.view;
    if (view.bytes().size() != entry_bytes(lane.geometry)) return {StateOutcome::refused, Reason::entry_size_mismatch};
    if (!detail::scatter_into_slot(lane, spec.slot, view.bytes().data()))
      return {StateOutcome::failed, Reason::state_transfer_failed};
    return {StateOutcome::restored, Reason::none};
  }

  /// Gathers the source slot and puts it in the tier.
  template <Runtime R>
  SaveVerdict save(const StateSave& save, LaneContext<R>& lane) const noexcept {
    if (auto refused = detail::refuse_save(tier_, save, lane.geometry.slot_bytes, lane)) return *refused;
    if (auto failed = detail::gather_slot(lane, save.source, lane.staging.data())) return *failed;
    const bool stored = tier_->put(detail::state_key(lane.geometry, save.key.hash),
                                   lane.staging.first(lane.geometry.slot_bytes));
    return {stored, stored ? Reason::none : Reason::state_transfer_failed};
  }

 private:
  T* tier_;  // null only when built on no_state_tier
};

/// The sidecar a DSV4 slot entry carries in front of the slot bytes, so a load can check
/// it restores the checkpoint the spec asked for. 24 bytes, native endianness (entries
/// never leave the machine that wrote them in a different byte order: tier keys pin rank).
struct SlotSidecar {
  std::uint64_t boundary_hash = 0;
  std::uint64_t boundary_tokens = 0;
  std::uint64_t payload_bytes = 0;
};

/// DeepSeek-V4 slot state: runs after the KV leg on the load lane (page retrieve, sidecar
/// validation, slot scatter, one record). The KV leg may start at any block-aligned HBM
/// floor: the slot state at B depends only on the tokens before B, wherever their KV sits;
/// the sidecar check (the stored entry's boundary hash and length match the spec) is what
/// guards a wrong entry. Built on `no_state_tier`, it behaves like RecurrentState without
/// a tier (R14).
template <Tier T>
class SlotState {
 public:
  static constexpr StateOrdering ordering = StateOrdering::after_kv;
  static constexpr StateLayout layout = StateLayout::dsv4_slot;
  using tier_type = T;
  /// Loads and stores through `tier`, which must outlive the leg. Any thread, before use.
  explicit SlotState(T& tier) noexcept : tier_(&tier) {}
  /// This rank has no state tier (R14). Any thread, before use.
  explicit SlotState(NoStateTier) noexcept : tier_(nullptr) {}

  /// Bytes of one entry on a rank with `geometry`: the sidecar, then the slot's bytes.
  /// Any thread.
  static constexpr std::size_t entry_bytes(const RankGeometry& geometry) noexcept {
    return sizeof(SlotSidecar) + geometry.slot_bytes;
  }

  /// Validates the sidecar, then scatters the payload into the slot. Noexcept, no allocation.
  template <Runtime R>
  StateVerdict load(const StateSpec& spec, const KvSpec* kv, LaneContext<R>& lane) const noexcept {
    const detail::StateFetch fetched = detail::fetch_state(tier_, spec, kv, lane);
    if (fetched.verdict) return *fetched.verdict;
    const TierView& view = fetched.view;
    if (view.bytes().size() != entry_bytes(lane.geometry)) return {StateOutcome::refused, Reason::entry_size_mismatch};
    SlotSidecar sidecar;
    std::memcpy(&sidecar, view.bytes().data(), sizeof sidecar);
    if (sidecar.boundary_hash != spec.boundary_hash.value || sidecar.boundary_tokens != spec.boundary_tokens ||
        sidecar.payload_bytes != lane.geometry.slot_bytes)
      return {StateOutcome::failed, Reason::sidecar_mismatch};
    if (!detail::scatter_into_slot(lane, spec.slot, view.bytes().data() + sizeof sidecar))
      return {StateOutcome::failed, Reason::state_transfer_failed};
    return {StateOutcome::restored, Reason::none};
  }

  /// Writes sidecar + slot bytes into staging and puts them in the tier.
  template <Runtime R>
  SaveVerdict save(const StateSave& save, LaneContext<R>& lane) const noexcept {
    const std::size_t total = sizeof(SlotSidecar) + lane.geometry.slot_bytes;
    if (auto refused = detail::refuse_save(tier_, save, total, lane)) return *refused;
    const SlotSidecar sidecar{save.key.hash.value, save.boundary_tokens, lane.geometry.slot_bytes};
    std::memcpy(lane.staging.data(), &sidecar, sizeof sidecar);
    if (auto failed = detail::gather_slot(lane, save.source, lane.staging.data() + sizeof sidecar)) return *failed;
    const bool stored = tier_->put(detail::state_key(lane.geometry, save.key.hash), lane.staging.first(total));
    return {stored, stored ? Reason::none : Reason::state_transfer_failed};
  }

 private:
  T* tier_;  // null only when built on no_state_tier
};

namespace detail {
/// `tier_type` of a leg that names one; nothing for a leg that does not.
template <class Leg>
struct LegTierType {};
template <class Leg>
  requires requires { typename Leg::tier_type; }
struct LegTierType<Leg> {
  using tier_type = typename Leg::tier_type;
};
}  // namespace detail

/// Runs the state leg `Leg` after the KV leg, on the load lane, whatever order `Leg` asks
/// for: the same load, save and entry_bytes, with `ordering = after_kv`. A joint load then
/// costs the sum of its legs instead of the larger one: `StateAfterKv<RecurrentState<T>>`
/// is Kimi-K3 serialized (KimiK3SerialConnector), the baseline the concurrent load (R9) is
/// measured against. `Leg` must have a state leg (not NoState). Names `tier_type` when Leg
/// does. Like Leg, it is thread-confined to the lane that calls it: load and save are
/// called by the connector's lane threads, and are as noexcept (and as allocation-free)
/// as Leg's.
template <class Leg>
class StateAfterKv : public detail::LegTierType<Leg> {
  static_assert(Leg::ordering != StateOrdering::none, "StateAfterKv needs a state leg; NoState has none");

 public:
  static constexpr StateOrdering ordering = StateOrdering::after_kv;
  /// The wrapped leg's layout: the model is the same, only the scheduling changes.
  static constexpr StateLayout layout = Leg::layout;
  using inner_type = Leg;

  /// Wraps `inner`. Any thread, before use; noexcept if moving Leg is.
  explicit StateAfterKv(Leg inner) noexcept(std::is_nothrow_move_constructible_v<Leg>) : inner_(std::move(inner)) {}

  /// Builds the inner leg in place from what Leg is built from (a tier, or no_state_tier),
  /// so code that builds a preset's state leg from its tier works unchanged for this one.
  /// Any thread, before use; throws what Leg's constructor throws.
  template <class Arg>
    requires(!std::same_as<std::remove_cvref_t<Arg>, StateAfterKv> && !std::same_as<std::remove_cvref_t<Arg>, Leg> &&
             std::constructible_from<Leg, Arg &&>)
  explicit StateAfterKv(Arg&& arg) noexcept(std::is_nothrow_constructible_v<Leg, Arg&&>)
      : inner_(std::forward<Arg>(arg)) {}

  /// Leg's entry size for `geometry`. Any thread.
  static constexpr std::size_t entry_bytes(const RankGeometry& geometry) noexcept { return Leg::entry_bytes(geometry); }

  /// Leg's load, unchanged; the connector calls it on the load lane after the KV leg.
  template <Runtime R>
  StateVerdict load(const StateSpec& spec, const KvSpec* kv, LaneContext<R>& lane) noexcept(
      noexcept(std::declval<Leg&>().load(spec, kv, lane))) {
    return inner_.load(spec, kv, lane);
  }

  /// Leg's save, unchanged (saves run on the save lane whatever the ordering).
  template <Runtime R>
  SaveVerdict save(const StateSave& save, LaneContext<R>& lane) noexcept(
      noexcept(std::declval<Leg&>().save(save, lane))) {
    return inner_.save(save, lane);
  }

  /// The wrapped leg. The lane thread that owns it, or any thread before use.
  [[nodiscard]] Leg& inner() noexcept { return inner_; }
  [[nodiscard]] const Leg& inner() const noexcept { return inner_; }

 private:
  Leg inner_;
};

}  // namespace kvfuse
