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

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/arbitration.hpp>
#include <kvfuse/engine/connector_names.hpp>

namespace kvfuse {

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
    else a.state = StateDisposition::waived;
    return a;
  }

  /// Starts the transfer of the P/D sub at `winner` (see PdSubConnector). False if that
  /// sub is not a P/D sub (the offload sub's load goes through the index) or cannot start.
  /// Scheduler thread.
  bool start(std::size_t winner, const PdTransfer& transfer) {
    bool started = false;
    start_at(winner, transfer, started, std::index_sequence_for<Subs...>{});
    return started;
  }

  /// Calls f(request, ok) for every P/D transfer that ended since the last call, sub by
  /// sub; returns how many. Scheduler thread.
  template <class F>
  std::size_t drain_finished(F&& f) {
    std::size_t n = 0;
    drain_all(f, n, std::index_sequence_for<Subs...>{});
    return n;
  }

 private:
  template <std::size_t... I>
  void start_at(std::size_t winner, const PdTransfer& transfer, bool& started, std::index_sequence<I...>) {
    ((I == winner ? start_one(std::get<I>(subs_), transfer, started) : void()), ...);
  }
  template <class S>
  static void start_one(S& sub, const PdTransfer& transfer, bool& started) {
    if constexpr (PdSubConnector<S>) started = static_cast<bool>(sub.start(transfer));
  }
  template <class F, std::size_t... I>
  void drain_all(F& f, std::size_t& n, std::index_sequence<I...>) {
    ((n += drain_one(std::get<I>(subs_), f)), ...);
  }
  template <class S, class F>
  static std::size_t drain_one(S& sub, F& f) {
    if constexpr (PdSubConnector<S>) return static_cast<std::size_t>(sub.drain_finished(f));
    else return 0;
  }

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
