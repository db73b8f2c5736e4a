// kvfuse/compose/multi.hpp — Multi<Subs...>: one offload sub-connector plus P/D connectors,
// composed at compile time, and the arbitration of who loads a request (R15, R16).
//
// Multi is the engine-side half of a composition: when a request is admitted it asks
// every sub how many tokens it could load, gives the KV load to the first that can, and
// tells the engine what happens to a state leg the index already secured. It owns no
// load: the loads themselves stay with the OffloadIndex (the offload sub's) or with the
// winning P/D connector, so a parked request has exactly one owning load and unparks on
// that load's one settlement.
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <optional>
#include <string_view>
#include <tuple>
#include <utility>

#include <kvfuse/engine/connector_names.hpp>
#include <kvfuse/bridge/ids.hpp>

namespace kvfuse {

/// What Multi asks each sub when a request is admitted.
struct AdmissionQuery {
  RequestId request;
  TokenCount hbm = 0;            ///< tokens already resident on the device
  TokenCount prompt_tokens = 0;  ///< the request's prompt length
};

/// An engine-side sub-connector as Multi sees it:
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

namespace detail {
/// Whether the registry knows S::connector_name in some spelling or alias (R15).
template <class S>
inline constexpr bool connector_name_is_registered = find_connector(S::connector_name).has_value();
}  // namespace detail

/// R15 at compile time: every sub's connector_name is a connector the registry knows, in
/// any spelling or alias. A static Multi<...> with an unknown connector name does not
/// compile, as a configured multi with one throws Error(unknown_connector) at startup.
/// (The comment below sits on the line GCC quotes when the constraint fails.)
template <class... Subs>
concept KnownConnectorNames =
    (detail::connector_name_is_registered<Subs> && ...);  // R15: unknown connector name in a static Multi<...>

/// R15 at compile time: every sub's name is known and at most one resolves to the
/// canonical offload connector, in any spelling or alias.
template <class... Subs>
concept AtMostOneOffloadSub =
    KnownConnectorNames<Subs...> &&
    (count_offload_connectors(std::array<std::string_view, sizeof...(Subs)>{Subs::connector_name...}) <= 1);

/// What happens to the state leg the index secured for a request (R16).
enum class StateDisposition {
  none,            ///< no state leg was secured
  with_tier_load,  ///< the offload sub won the KV load: the state leg travels with it (a joint load)
  state_only,      ///< no sub owns KV: the state leg runs alone, through the offload sub
  released,        ///< a P/D sub won the KV load: abandon the state load (never a miss, R7),
                   ///< disown the boundary, recompute
};

/// The outcome of one arbitration.
struct Arbitration {
  std::optional<std::size_t> winner;  ///< index of the sub that owns the KV load, if any
  TokenCount tokens = 0;              ///< tokens the winner loads
  StateDisposition state = StateDisposition::none;
};

/// A static composition of sub-connectors. Every sub's connector_name must be registered
/// and at most one may be the offload connector (R15: compile errors naming
/// KnownConnectorNames / AtMostOneOffloadSub). The first sub with tokens > 0 wins the KV
/// load; every other sub that armed something cancels it. Not thread-safe: the scheduler
/// thread only. Holds references: the subs must outlive it.
template <SubConnector... Subs>
  requires KnownConnectorNames<Subs...> && AtMostOneOffloadSub<Subs...>
class Multi {
 public:
  static constexpr std::size_t size = sizeof...(Subs);

  /// Index of the offload (tier) sub, if the composition has one.
  static constexpr std::optional<std::size_t> tier_sub = [] {
    constexpr std::array<std::string_view, size> names{Subs::connector_name...};
    for (std::size_t i = 0; i < size; ++i)
      if (is_offload_connector(names[i])) return std::optional<std::size_t>(i);
    return std::optional<std::size_t>();
  }();

  explicit Multi(Subs&... subs) noexcept : subs_(subs...) {}

  /// Asks every sub, picks the first with tokens > 0, cancels every other sub that armed
  /// something, and decides the secured state leg's fate. noexcept; no allocation.
  Arbitration arbitrate(const AdmissionQuery& query, bool state_leg_secured) noexcept {
    std::array<TokenCount, size> offered{};
    ask(query, offered, std::index_sequence_for<Subs...>{});
    Arbitration a;
    for (std::size_t i = 0; i < size; ++i)
      if (offered[i] > 0) {
        a.winner = i;
        a.tokens = offered[i];
        break;
      }
    cancel_losers(query.request, offered, a.winner, std::index_sequence_for<Subs...>{});
    if (!state_leg_secured) a.state = StateDisposition::none;
    else if (a.winner && a.winner == tier_sub) a.state = StateDisposition::with_tier_load;
    else if (!a.winner && tier_sub) a.state = StateDisposition::state_only;
    else a.state = StateDisposition::released;
    return a;
  }

 private:
  template <std::size_t... I>
  void ask(const AdmissionQuery& query, std::array<TokenCount, size>& offered, std::index_sequence<I...>) noexcept {
    ((offered[I] = std::get<I>(subs_).matched_tokens(query)), ...);
  }
  template <std::size_t... I>
  void cancel_losers(RequestId request, const std::array<TokenCount, size>& offered,
                     std::optional<std::size_t> winner, std::index_sequence<I...>) noexcept {
    ((offered[I] > 0 && winner != I ? std::get<I>(subs_).cancel(request) : void()), ...);
  }

  std::tuple<Subs&...> subs_;
};

}  // namespace kvfuse
