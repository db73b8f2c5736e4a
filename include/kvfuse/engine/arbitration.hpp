// kvfuse/engine/arbitration.hpp — the vocabulary of a composition's KV-load arbitration
// (R16), shared by compose/multi.hpp (which decides) and engine/coordinator.hpp (which acts
// on the decision): what a sub is asked, what it answers, and what becomes of a state leg.
//
// Everything here runs on the scheduler thread.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include <kvfuse/bridge/ids.hpp>

namespace kvfuse {

/// What a composition asks each sub when a request is admitted.
struct AdmissionQuery {
  RequestId request;
  TokenCount hbm = 0;            ///< tokens already resident on the device
  TokenCount prompt_tokens = 0;  ///< the request's prompt length
  /// The KV tokens beyond hbm the offload tier's plan loads (0 for a state-only plan or
  /// none): the Coordinator plans the tier first and asks the composition with the answer,
  /// which the offload sub offers as its own.
  TokenCount tier_offer = 0;
};

/// An engine-side sub-connector as a composition sees it:
///   S::connector_name           its registered name, any spelling (static, constexpr)
///   sub.matched_tokens(query)   tokens beyond hbm it could load; it may arm a load for them
///   sub.cancel(request)         releases whatever matched_tokens armed (a loser's duty)
/// All calls run on the scheduler thread and must not throw.
template <class S>
concept SubConnector = requires(S& sub, const AdmissionQuery& query, RequestId request) {
  { S::connector_name } -> std::convertible_to<std::string_view>;
  { sub.matched_tokens(query) } noexcept -> std::same_as<TokenCount>;
  { sub.cancel(request) } noexcept;
};

/// A KV transfer a P/D sub won: fill tokens [hbm, hbm + tokens) of `request` into `blocks`
/// (the request's block table from block 0). The spans are read during the call only.
struct PdTransfer {
  RequestId request;
  TokenCount hbm = 0;
  TokenCount tokens = 0;
  std::span<const BlockId> blocks;
};

/// A P/D sub-connector: a SubConnector that, when it wins, moves the KV itself.
///   sub.start(transfer) -> bool          begin the transfer it armed; false: it cannot (nothing started)
///   sub.drain_finished(f) -> size_t      f(request, ok) once for every transfer that ended since the last call
/// A transfer that started ends exactly once, ok or not; until it ends, the sub may still
/// write the request's blocks.
template <class S>
concept PdSubConnector =
    SubConnector<S> && requires(S& sub, const PdTransfer& transfer, void (*f)(RequestId, bool)) {
      { sub.start(transfer) } -> std::convertible_to<bool>;
      { sub.drain_finished(f) } -> std::convertible_to<std::size_t>;
    };

/// What happens to the state leg the index could secure for a request (R16).
enum class StateDisposition : std::uint8_t {
  none,            ///< no state leg was secured
  with_tier_load,  ///< the offload sub won the KV load: the state leg travels with it (a joint load)
  state_only,      ///< no sub owns KV: the state leg runs alone, through the offload sub
  waived,          ///< a P/D sub won the KV load: the state load is never dispatched (never a
                   ///< miss, R7), the boundary is disowned, the request recomputes
};

/// The outcome of one arbitration.
struct Arbitration {
  std::optional<std::size_t> winner;  ///< index of the sub that owns the KV load, if any
  TokenCount tokens = 0;              ///< tokens the winner loads
  StateDisposition state = StateDisposition::none;
};

/// The offload tier as a sub of a composition: it offers what the query says the tier's
/// plan loads (AdmissionQuery::tier_offer) and arms nothing, because the index issues the
/// ticket only after the tier won. `cancelled` counts the times it lost with an offer.
/// Scheduler thread only.
struct OffloadSub {
  static constexpr std::string_view connector_name = "offload";
  std::uint64_t cancelled = 0;
  TokenCount matched_tokens(const AdmissionQuery& query) const noexcept { return query.tier_offer; }
  void cancel(RequestId) noexcept { ++cancelled; }
};

/// A composition the Coordinator can admit through (compose/multi.hpp's Multi models it):
///   A::tier_sub                 index of the offload sub, if any
///   a.arbitrate(query, secured) the decision (R16); losers already cancelled
///   a.start(winner, transfer)   starts the winning P/D sub's transfer; false if it cannot
///   a.drain_finished(f)         f(request, ok) for every P/D transfer that ended
template <class A>
concept KvArbiter = requires(A& a, const AdmissionQuery& query, const PdTransfer& transfer, std::size_t winner,
                             void (*f)(RequestId, bool)) {
  { A::tier_sub } -> std::convertible_to<std::optional<std::size_t>>;
  { a.arbitrate(query, true) } noexcept -> std::same_as<Arbitration>;
  { a.start(winner, transfer) } -> std::convertible_to<bool>;
  { a.drain_finished(f) } -> std::convertible_to<std::size_t>;
};

}  // namespace kvfuse
