// kvfuse/completion/completion_guard.hpp — exactly one record per dispatch per rank (R1).
//
// A load task constructs a CompletionGuard on its first line; a save task a StoreGuard.
// The destructor emits the one record, on every path out of the scope: a return, an early
// return, an exception unwinding, a refused leg, a leg that never ran. No path can skip
// it because no path can skip a destructor.
//
//   void load_task(const LoadRequest& req) {
//     CompletionGuard guard(req, rank, emitter);      // from here on, one record is certain
//     if (!valid(req.state)) guard.state(StateOutcome::refused, Reason::grid_mismatch);
//     ...
//     guard.kv_ok();
//   }                                                  // ~CompletionGuard emits
//
// Defaults are the safe ones: a leg the request has but that never reported is `failed`
// with Reason::leg_not_run (Reason::exception while unwinding) — failed, never `missed`,
// so a leg that did not run never retracts a hash (R2, R4).
#pragma once

#include <concepts>
#include <cstdint>
#include <exception>

#include <kvfuse/completion/group.hpp>
#include <kvfuse/completion/records.hpp>
#include <kvfuse/engine/load_request.hpp>

namespace kvfuse {

/// Which legs a load has, for a guard built without the whole LoadRequest.
struct LoadLegs {
  LoadKey key;
  bool has_kv = false;
  bool has_state = false;
  /// The legs of `request`. noexcept, thread-safe.
  static LoadLegs of(const LoadRequest& request) noexcept {
    return LoadLegs{request.key, request.kv.has_value(), request.state.has_value()};
  }
};

/// Emits exactly one CompletionRecord for one load on one rank when it goes out of scope.
///
/// Leg outcomes start at their safe defaults: KV `failed` if the load has a KV leg, else
/// `none`; state `failed` if it has a state leg, else `none`. Report calls move them on.
/// Failure is sticky within a leg: once a leg reported a failure (failed, missed, refused),
/// a later success report for that leg is ignored, so a failure is never overwritten.
/// The record's reason is the first failure reported; if none was but a leg never
/// reported, it is leg_not_run (exception while unwinding).
///
/// Not thread-safe: one guard belongs to the load task that made it. A concurrent state
/// leg reports its outcome to the task, which joins it and calls state() (R9). Every
/// method is noexcept; the destructor calls E::emit, which is noexcept by RecordEmitter.
/// Non-copyable and non-movable, so it cannot leave the scope it guards.
template <RecordEmitter E>
class CompletionGuard {
 public:
  /// Guards `request` on `rank`. noexcept.
  CompletionGuard(const LoadRequest& request, std::uint32_t rank, E& emitter) noexcept
      : CompletionGuard(LoadLegs::of(request), rank, emitter) {}

  /// Guards a load given by its key and legs. noexcept.
  CompletionGuard(LoadLegs legs, std::uint32_t rank, E& emitter) noexcept
      : emitter_(emitter),
        key_(legs.key),
        rank_(rank),
        kv_(legs.has_kv ? KvOutcome::failed : KvOutcome::none),
        state_(legs.has_state ? StateOutcome::failed : StateOutcome::none),
        has_kv_(legs.has_kv),
        has_state_(legs.has_state),
        uncaught_at_start_(std::uncaught_exceptions()) {}

  CompletionGuard(const CompletionGuard&) = delete;
  CompletionGuard& operator=(const CompletionGuard&) = delete;
  CompletionGuard(CompletionGuard&&) = delete;
  CompletionGuard& operator=(CompletionGuard&&) = delete;

  /// Emits the record. Runs on every path out of the guarded scope.
  ~CompletionGuard() { emitter_.emit(build(std::uncaught_exceptions() > uncaught_at_start_)); }

  /// The KV leg delivered every chunk in [hbm, end). Ignored if the KV leg already failed,
  /// or if the load has no KV leg (its outcome stays `none`).
  void kv_ok() noexcept {
    if (!has_kv_ || kv_failed_) return;
    kv_ = KvOutcome::ok;
    kv_reported_ = true;
  }

  /// The KV leg failed. Recorded even on a load without a KV leg (failure wins over a
  /// misuse); the first failure of the leg stands.
  void kv_failed(Reason reason) noexcept {
    if (kv_failed_) return;
    kv_ = KvOutcome::failed;
    kv_reported_ = kv_failed_ = true;
    note(reason);
  }

  /// The state leg's outcome. `restored` is ignored after a failure of the leg, and on a
  /// load without a state leg. `none` on a load that has a state leg is not an outcome:
  /// it is recorded as `failed` (leg_not_run unless a reason is given), so a state leg can
  /// never be made to vanish from the verdict.
  void state(StateOutcome outcome, Reason reason = Reason::none) noexcept {
    if (state_failed_) return;
    switch (outcome) {
      case StateOutcome::restored:
        if (!has_state_) return;
        state_ = outcome;
        state_reported_ = true;
        return;
      case StateOutcome::none:
        if (!has_state_) return;
        outcome = StateOutcome::failed;
        if (reason == Reason::none) reason = Reason::leg_not_run;
        break;
      case StateOutcome::missed:
      case StateOutcome::failed:
      case StateOutcome::refused:
        break;
    }
    state_ = outcome;
    state_reported_ = state_failed_ = true;
    note(reason);
  }

  /// Fails every leg the load has that has not already reported a failure, with
  /// `reason` (e.g. Reason::exception from a catch block, Reason::shutdown). A miss or a
  /// refusal already reported stands, so an exception never hides a genuine miss.
  void fail_all(Reason reason) noexcept {
    if (has_kv_) kv_failed(reason);
    if (has_state_) state(StateOutcome::failed, reason);
  }

  /// The record as it would be emitted if the scope ended normally now. noexcept.
  [[nodiscard]] CompletionRecord record() const noexcept { return build(false); }

 private:
  void note(Reason reason) noexcept {
    if (first_reason_ == Reason::none) first_reason_ = reason;
  }

  [[nodiscard]] CompletionRecord build(bool unwinding) const noexcept {
    CompletionRecord r;
    r.key = key_;
    r.rank = rank_;
    r.kv = kv_;
    r.state = state_;
    r.reason = first_reason_;
    const bool unreported = (has_kv_ && !kv_reported_) || (has_state_ && !state_reported_);
    if (r.reason == Reason::none && unreported) r.reason = unwinding ? Reason::exception : Reason::leg_not_run;
    if (r.reason == Reason::none && !has_kv_ && !has_state_) r.reason = Reason::invalid_spec;
    return r;
  }

  E& emitter_;
  LoadKey key_;
  std::uint32_t rank_;
  KvOutcome kv_;
  StateOutcome state_;
  Reason first_reason_ = Reason::none;
  bool has_kv_;
  bool has_state_;
  bool kv_reported_ = false;
  bool kv_failed_ = false;
  bool state_reported_ = false;
  bool state_failed_ = false;
  int uncaught_at_start_;
};

/// Emits exactly one StoreRecord for one save (state store or KV save) on one rank when
/// it goes out of scope.
///
/// Defaults: stored = false, source_released = false. The second default is the safe one
/// because the two ways to be wrong are not symmetric: reporting a source released while
/// a gather may still read it lets the engine hand those blocks to another request and
/// corrupts the saved bytes silently; reporting it unreleased only keeps the blocks pinned,
/// which the engine sees (the save settles with source_released = false). So the task
/// calls release_source() when it knows no read of the source can still be pending: after
/// it observed the gather finish, or on a path that provably issued no gather (refused,
/// no tier). An exception between issuing the gather and observing it leaves it false.
///
/// Not thread-safe: one guard belongs to the save task that made it. Non-copyable and
/// non-movable. Every method is noexcept.
template <RecordEmitter E>
class StoreGuard {
 public:
  /// Guards the save `key` on `rank`. noexcept.
  StoreGuard(StoreKey key, std::uint32_t rank, E& emitter) noexcept
      : emitter_(emitter), key_(key), rank_(rank), uncaught_at_start_(std::uncaught_exceptions()) {}

  StoreGuard(const StoreGuard&) = delete;
  StoreGuard& operator=(const StoreGuard&) = delete;
  StoreGuard(StoreGuard&&) = delete;
  StoreGuard& operator=(StoreGuard&&) = delete;

  /// Emits the record. Runs on every path out of the guarded scope.
  ~StoreGuard() { emitter_.emit(build(std::uncaught_exceptions() > uncaught_at_start_)); }

  /// This rank's tier holds the bytes. Ignored after fail() (failure is sticky).
  void stored_ok() noexcept {
    if (!failed_) stored_ = true;
  }

  /// The save failed on this rank; the first reason stands.
  void fail(Reason reason) noexcept {
    if (failed_) return;
    failed_ = true;
    stored_ = false;
    reason_ = reason;
  }

  /// No read of the source can still be pending: the gather finished, or none was issued.
  void release_source() noexcept { released_ = true; }

  /// Applies a save leg's verdict — any type with `stored`, `source_released` and `reason`
  /// members (the worker's SaveVerdict): stored_ok() or fail(reason), then release_source()
  /// if released. The sticky-failure rule still holds.
  template <class Verdict>
    requires requires(const Verdict& v) {
      { v.stored } -> std::convertible_to<bool>;
      { v.source_released } -> std::convertible_to<bool>;
      { v.reason } -> std::convertible_to<Reason>;
    }
  void set(const Verdict& v) noexcept {
    if (static_cast<bool>(v.stored)) {
      stored_ok();
    } else {
      fail(static_cast<Reason>(v.reason));
    }
    if (static_cast<bool>(v.source_released)) release_source();
  }

  /// The record as it would be emitted if the scope ended normally now. noexcept.
  [[nodiscard]] StoreRecord record() const noexcept { return build(false); }

 private:
  [[nodiscard]] StoreRecord build(bool unwinding) const noexcept {
    StoreRecord r;
    r.key = key_;
    r.rank = rank_;
    r.stored = stored_;
    r.source_released = released_;
    r.reason = reason_;
    if (!stored_ && r.reason == Reason::none) r.reason = unwinding ? Reason::exception : Reason::leg_not_run;
    return r;
  }

  E& emitter_;
  StoreKey key_;
  std::uint32_t rank_;
  Reason reason_ = Reason::none;
  bool stored_ = false;
  bool failed_ = false;
  bool released_ = false;
  int uncaught_at_start_;
};

}  // namespace kvfuse
