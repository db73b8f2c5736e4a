// kvfuse/worker/completion_guard.hpp — exactly one record per load and two per save, per rank (R1).
//
// A load task constructs a CompletionGuard on its first line; a save task a SaveGuard.
// The destructor emits the one record (a SaveGuard: the two records), on every path out of the scope: a return, an early
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

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <exception>

#include <kvfuse/completion/group.hpp>
#include <kvfuse/bridge/records.hpp>
#include <kvfuse/bridge/load_request.hpp>

namespace kvfuse {

/// Which legs a load has, for a guard built without the whole LoadRequest.
struct LoadLegs {
  LoadKey key;
  bool has_kv = false;
  bool has_state = false;
  std::uint32_t kv_chunks = 0;  ///< chunks of the KV leg: what a KV leg that succeeded restored
  /// The legs of `request`. noexcept, thread-safe.
  static LoadLegs of(const LoadRequest& request) noexcept {
    return LoadLegs{request.key, request.kv.has_value(), request.state.has_value(),
                    request.kv ? static_cast<std::uint32_t>(request.kv->chunk_keys.size()) : 0};
  }
};

/// Emits exactly one CompletionRecord for one load on one rank when it goes out of scope.
///
/// Leg outcomes start at their safe defaults: KV `failed` if the load has a KV leg, else
/// `none`; state `failed` if it has a state leg, else `none`. Report calls move them on.
/// Failure is sticky within a leg: once a leg reported a failure (failed, missed, refused),
/// a later success report for that leg is ignored, so a failure is never overwritten.
/// Each leg's reason is its first failure; a leg that never reported gets leg_not_run
/// (exception while unwinding). A load with neither leg is invalid_spec on both.
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
        kv_chunks_(legs.kv_chunks),
        has_state_(legs.has_state),
        uncaught_at_start_(std::uncaught_exceptions()) {}

  CompletionGuard(const CompletionGuard&) = delete;
  CompletionGuard& operator=(const CompletionGuard&) = delete;
  CompletionGuard(CompletionGuard&&) = delete;
  CompletionGuard& operator=(CompletionGuard&&) = delete;

  /// Emits the record. Runs on every path out of the guarded scope.
  ~CompletionGuard() { emitter_.emit(build(std::uncaught_exceptions() > uncaught_at_start_)); }

  /// The KV leg delivered every chunk in [hbm, end): all of the leg's chunks restored.
  /// Ignored if the KV leg already failed, or if the load has no KV leg (its outcome stays
  /// `none`).
  void kv_ok() noexcept {
    if (!has_kv_ || kv_failed_) return;
    kv_ = KvOutcome::ok;
    kv_reported_ = true;
    kv_restored_ = kv_chunks_;
  }

  /// The KV leg failed, having restored the first `restored` chunks (0 when it cannot say:
  /// always safe). Recorded even on a load without a KV leg (failure wins over a misuse);
  /// the first failure of the leg stands, and with it the fewest chunks it claimed.
  void kv_failed(Reason reason, std::uint32_t restored = 0) noexcept {
    if (kv_failed_) return;
    kv_ = KvOutcome::failed;
    kv_reported_ = kv_failed_ = true;
    kv_reason_ = reason;
    kv_restored_ = has_kv_ ? std::min(kv_restored_, restored) : 0;
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
    state_reason_ = reason;
  }

  /// Fails every leg the load has that has not already reported a failure, with
  /// `reason` (e.g. Reason::exception from a catch block). A miss or a
  /// refusal already reported stands, so an exception never hides a genuine miss.
  void fail_legs(Reason reason) noexcept {
    if (has_kv_) kv_failed(reason);
    if (has_state_) state(StateOutcome::failed, reason);
  }

  /// The record as it would be emitted if the scope ended normally now. noexcept.
  [[nodiscard]] CompletionRecord record() const noexcept { return build(false); }

 private:
  [[nodiscard]] CompletionRecord build(bool unwinding) const noexcept {
    CompletionRecord r;
    r.key = key_;
    r.rank = rank_;
    r.kv = kv_;
    r.state = state_;
    r.kv_reason = kv_reason_;
    r.state_reason = state_reason_;
    r.kv_restored = kv_reported_ ? kv_restored_ : 0;
    const Reason unrun = unwinding ? Reason::exception : Reason::leg_not_run;
    if (has_kv_ && !kv_reported_) r.kv_reason = unrun;
    if (has_state_ && !state_reported_) r.state_reason = unrun;
    if (!has_kv_ && !has_state_) r.kv_reason = r.state_reason = Reason::invalid_spec;
    return r;
  }

  E& emitter_;
  LoadKey key_;
  std::uint32_t rank_;
  KvOutcome kv_;
  StateOutcome state_;
  Reason kv_reason_ = Reason::none;
  Reason state_reason_ = Reason::none;
  std::uint32_t kv_restored_ = UINT32_MAX;  // lowered by each report; 0 unless the KV leg reported
  bool has_kv_;
  std::uint32_t kv_chunks_;
  bool has_state_;
  bool kv_reported_ = false;
  bool kv_failed_ = false;
  bool state_reported_ = false;
  bool state_failed_ = false;
  int uncaught_at_start_;
};

/// Emits exactly two SaveRecords for one save (state checkpoint or KV save) on one rank:
/// `released` as soon as the task calls release_source() (or, at the latest, when the guard
/// goes out of scope), then `stored` when the guard goes out of scope. Both are certain on
/// every path, so a save can never pin its source or its engine entry by forgetting to
/// report (R1 for saves).
///
/// Releasing is the task's call because the two ways to be wrong are not symmetric:
/// reporting a source released while a gather may still read it lets the engine hand those
/// blocks to another request and corrupts the saved bytes silently; keeping it pinned only
/// costs memory, visibly. So the task calls release_source() when it knows no read of the
/// source can still be pending: after it observed the gather finish (typically before the
/// tier put, so the engine frees blocks long before the store lands), or on a path that
/// provably issued no gather. If the guard dies without that call, the released record
/// says ok = false with Reason::source_unconfirmed: the engine keeps the source pinned.
/// The Connector never lets that happen short of a device that cannot synchronize: after
/// the leg returns or throws it synchronizes the lane's stream and releases.
///
/// Not thread-safe: one guard belongs to the save task that made it. Non-copyable and
/// non-movable. Every method is noexcept.
template <RecordEmitter E>
class SaveGuard {
 public:
  /// Guards the save `key` on `rank`. noexcept.
  SaveGuard(SaveKey key, std::uint32_t rank, E& emitter) noexcept
      : emitter_(emitter), key_(key), rank_(rank), uncaught_at_start_(std::uncaught_exceptions()) {}

  SaveGuard(const SaveGuard&) = delete;
  SaveGuard& operator=(const SaveGuard&) = delete;
  SaveGuard(SaveGuard&&) = delete;
  SaveGuard& operator=(SaveGuard&&) = delete;

  /// Emits what is still owed: `released` (unconfirmed, if release_source() was never
  /// called), then `stored`. Runs on every path out of the guarded scope.
  ~SaveGuard() {
    const bool unwinding = std::uncaught_exceptions() > uncaught_at_start_;
    if (!released_) emitter_.emit(SaveRecord{key_, rank_, SavePhase::released, false, Reason::source_unconfirmed});
    emitter_.emit(stored_record(unwinding));
  }

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

  /// No read of the source can still be pending: emits the `released` record now (once;
  /// later calls do nothing). Call it from the save task's thread only.
  void release_source() noexcept {
    if (released_) return;
    released_ = true;
    emitter_.emit(SaveRecord{key_, rank_, SavePhase::released, true, Reason::none});
  }

  /// Whether the `released` record has been emitted. noexcept.
  [[nodiscard]] bool source_released() const noexcept { return released_; }

  /// Applies a save leg's verdict — any type with `stored` and `reason` members (the
  /// worker's SaveVerdict): stored_ok() or fail(reason). The sticky-failure rule holds.
  template <class Verdict>
    requires requires(const Verdict& v) {
      { v.stored } -> std::convertible_to<bool>;
      { v.reason } -> std::convertible_to<Reason>;
    }
  void set(const Verdict& v) noexcept {
    if (static_cast<bool>(v.stored)) {
      stored_ok();
    } else {
      fail(static_cast<Reason>(v.reason));
    }
  }

  /// The `stored` record as it would be emitted if the scope ended normally now. noexcept.
  [[nodiscard]] SaveRecord record() const noexcept { return stored_record(false); }

 private:
  [[nodiscard]] SaveRecord stored_record(bool unwinding) const noexcept {
    SaveRecord r{key_, rank_, SavePhase::stored, stored_, reason_};
    if (!stored_ && r.reason == Reason::none) r.reason = unwinding ? Reason::exception : Reason::leg_not_run;
    return r;
  }

  E& emitter_;
  SaveKey key_;
  std::uint32_t rank_;
  Reason reason_ = Reason::none;
  bool stored_ = false;
  bool failed_ = false;
  bool released_ = false;
  int uncaught_at_start_;
};

}  // namespace kvfuse
