// kvfuse/tier/detail/redis_cluster_route.hpp — the routed exchange under every call of a
// cluster tier: keys sorted by the primary of their slot, one leg per touched primary, all
// legs of a round at once (detail/redis_cluster_legs.hpp), and the rounds after it for the
// keys that were redirected (MOVED, ASK), met a stale pooled connection, or met a node that
// refused them (sent once to their slot's new owner, if the map learnt then names one).
//
// Internal: not part of the public API (RedisClusterTier is). Needs hiredis.
#pragma once

#include <hiredis/hiredis.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kvfuse/tier/detail/redis_cluster_legs.hpp>
#include <kvfuse/tier/detail/redis_cluster_map.hpp>
#include <kvfuse/tier/detail/redis_cluster_slots.hpp>
#include <kvfuse/tier/detail/redis_connection.hpp>

namespace kvfuse::detail::redis {

/// What routing met, by reason (RedisClusterCounters' fields but the map's two).
struct RouteCounters {
  std::atomic<std::uint64_t> moved{0}, asks{0}, tryagain{0}, clusterdown{0}, redirect_failures{0};
};

/// Routes calls over one ClusterMap. Any thread may route at once; it holds no lock of its
/// own (the map's are never held across I/O).
class ClusterRouter {
 private:
  // What an item has already been given: each at most once, so a call ends within four
  // rounds (in steady state it is one).
  enum Spent : std::uint8_t { redirected = 1, fresh_connection = 2, rerouted = 4 };

  // Where one key goes in a round.
  struct Target {
    ClusterNode* node = nullptr;
    bool asking = false;  // ASKING before the command (an ASK retry)
    bool fresh = false;   // a new connection (the pooled one was stale)
    friend bool operator==(const Target&, const Target&) = default;
  };
  struct Retry {
    std::size_t item;
    Target target;
  };
  using Groups = std::vector<std::pair<Target, std::vector<std::size_t>>>;

 public:
  /// Routes over `map`, each round waiting at most `command_timeout`, counting in
  /// `counters`; both must outlive the router.
  ClusterRouter(ClusterMap& map, std::chrono::milliseconds command_timeout, RouteCounters& counters) noexcept
      : map_(map), command_timeout_(command_timeout), counters_(counters) {}

  /// The routed exchange under every call: item i (of `count`) is in slot slot_of(i), its
  // command formatted by format(cmd, i); its final reply goes to on_reply(i, reply), or
  // on_lost(i, io) if none came. The first round sends each item to the primary of its
  // slot. An item goes once more, in a later round, when it was redirected (MOVED: to the
  // node named, the map patched; ASK: there with ASKING), when its pooled connection was
  // stale (on a fresh one), or when its node refused or dropped it (to the slot's owner in
  // the map learnt right then, if that is another node: a promoted replica). Every touched
  // node of a round is one exchange, all of a round's exchanges run at once. The callbacks
  // must not throw.
  template <class SlotOf, class Format, class OnReply, class OnLost>
  void route(std::size_t count, SlotOf&& slot_of, Format&& format, OnReply&& on_reply, OnLost&& on_lost) const noexcept {
    std::vector<std::uint8_t> spent;
    std::vector<std::uint16_t> slots;
    std::vector<Retry> next, unreachable;
    std::vector<std::size_t> unowned;
    Groups groups;
    bool want_map = false;
    try {
      spent.assign(count, 0);
      slots.resize(count);
      const std::shared_ptr<const SlotMap> map = map_.current();
      for (std::size_t i = 0; i < count; ++i) {
        slots[i] = slot_of(i);
        if (ClusterNode* owner = map->owner[slots[i]]; owner != nullptr) add_to(groups, Target{owner, false, false}, i);
        else unowned.push_back(i);
      }
    } catch (...) {
      for (std::size_t i = 0; i < count; ++i) on_lost(i, Io::failed);  // nothing was sent, nothing settled
      return;
    }
    for (const std::size_t i : unowned) {
      counters_.clusterdown.fetch_add(1, std::memory_order_relaxed);  // no primary serves the slot (yet)
      want_map = true;
      on_lost(i, Io::failed);
    }
    while (!groups.empty()) {
      next.clear();
      unreachable.clear();
      want_map |= run_round(groups, spent, next, unreachable, format, on_reply, on_lost);
      if (!unreachable.empty()) {
        // The node is gone (killed, or failed over): ask the others who serves its slots now.
        (void)map_.refresh(true);
        want_map = false;
        const std::shared_ptr<const SlotMap> map = map_.current();
        for (const Retry& r : unreachable) {
          ClusterNode* owner = map->owner[slots[r.item]];
          if (owner != nullptr && owner != r.target.node) {
            spent[r.item] |= rerouted;
            try {
              next.push_back(Retry{r.item, Target{owner, false, false}});
              continue;
            } catch (...) {
            }
          }
          on_lost(r.item, Io::failed);
        }
      }
      groups.clear();
      bool grouped = true;
      try {
        for (const Retry& r : next) add_to(groups, r.target, r.item);
      } catch (...) {
        grouped = false;
      }
      if (!grouped) {
        for (const Retry& r : next) on_lost(r.item, Io::failed);
        break;
      }
    }
    if (want_map) (void)map_.refresh(false);
  }

 private:
  static void add_to(Groups& groups, Target t, std::size_t i) {
    for (auto& [target, items] : groups)
      if (target == t) {
        items.push_back(i);
        return;
      }
    groups.emplace_back(t, std::vector<std::size_t>{i});
  }

  // One round: every group's commands on its node's connection, then every reply. Items to
  // go again go to `next` (a redirection, a stale connection) or `unreachable` (a node that
  // refused or dropped them), each at most once per kind (`spent`); the rest settle here.
  // Returns whether a new map is wanted.
  template <class Format, class OnReply, class OnLost>
  bool run_round(const Groups& groups, std::vector<std::uint8_t>& spent, std::vector<Retry>& next,
                 std::vector<Retry>& unreachable, Format& format, OnReply& on_reply, OnLost& on_lost) const noexcept {
    bool want_map = false;
    std::vector<Leg> legs;
    try {
      legs.resize(groups.size());
    } catch (...) {
      for (const auto& g : groups)
        for (const std::size_t i : g.second) on_lost(i, Io::failed);
      return false;
    }
    // An item whose node failed it: kept for a reroute if it has not had one.
    auto failed_on = [&](std::size_t i, const Target& target, Io io) noexcept {
      if (io == Io::failed && (spent[i] & rerouted) == 0) {
        try {
          unreachable.push_back(Retry{i, target});
          return;
        } catch (...) {
        }
      }
      on_lost(i, io);
    };
    // Every connection first: a new one to a frozen node waits out its PING, and the
    // round's deadline must not run for the others meanwhile.
    for (std::size_t l = 0; l < groups.size(); ++l) {
      const auto& [target, items] = groups[l];
      Io failure = Io::failed;
      legs[l].conn = target.node->pool.take(target.fresh, &failure);
      if (legs[l].conn) continue;
      (failure == Io::timed_out ? target.node->timeouts : target.node->failures).fetch_add(1, std::memory_order_relaxed);
      target.node->suspect.store(true, std::memory_order_relaxed);
      want_map = true;
      for (const std::size_t i : items) failed_on(i, target, failure);
    }
    const auto deadline = Clock::now() + command_timeout_;
    for (std::size_t l = 0; l < groups.size(); ++l) {
      const auto& [target, items] = groups[l];
      Leg& leg = legs[l];
      if (!leg.conn) continue;
      bool formatted = true;
      try {
        leg.conn->out.clear();
        for (const std::size_t i : items) {
          if (target.asking) {
            append_command(leg.conn->out, 1);
            append_bulk(leg.conn->out, "ASKING");
          }
          format(leg.conn->out, i);
        }
      } catch (...) {  // bad_alloc while formatting: nothing was sent
        formatted = false;
      }
      if (!formatted) {
        target.node->pool.give(std::move(leg.conn));
        for (const std::size_t i : items) on_lost(i, Io::failed);
        continue;
      }
      leg.expected = items.size() * (target.asking ? 2 : 1);
      target.node->requests.fetch_add(items.size(), std::memory_order_relaxed);
      leg.io = send(*leg.conn, deadline);
      if (leg.io == Io::ok) target.node->round_trips.fetch_add(1, std::memory_order_relaxed);
    }
    receive_legs(legs, deadline, [&](std::size_t l, Reply reply) noexcept {
      const auto& [target, items] = groups[l];
      const std::size_t k = legs[l].received - 1;
      if (target.asking && k % 2 == 0) return;  // ASKING's +OK (an error shows in the command's own reply)
      const std::size_t i = items[target.asking ? k / 2 : k];
      if (reply->type == REDIS_REPLY_ERROR) {
        const std::string_view text(reply->str, reply->len);
        if (text.starts_with("MOVED ") || text.starts_with("ASK ")) {
          target.node->redirections.fetch_add(1, std::memory_order_relaxed);
          const bool moved = text.starts_with("MOVED ");
          (moved ? counters_.moved : counters_.asks).fetch_add(1, std::memory_order_relaxed);
          want_map |= moved;
          ClusterNode* to = nullptr;
          Redirect r;
          try {
            r = parse_redirect(text, target.node->address);
            if (r.kind != Redirect::none) to = map_.node_at(r.to);
          } catch (...) {
          }
          if ((spent[i] & redirected) != 0 || to == nullptr) {
            counters_.redirect_failures.fetch_add(1, std::memory_order_relaxed);
            on_lost(i, Io::failed);
            return;
          }
          spent[i] |= redirected;
          if (moved) map_.patch(r.slot, to);
          try {
            next.push_back(Retry{i, Target{to, !moved, false}});
          } catch (...) {
            on_lost(i, Io::failed);
          }
          return;
        }
        if (text.starts_with("TRYAGAIN") || text.starts_with("CLUSTERDOWN")) {
          (text.starts_with("TRYAGAIN") ? counters_.tryagain : counters_.clusterdown).fetch_add(1, std::memory_order_relaxed);
          target.node->failures.fetch_add(1, std::memory_order_relaxed);
          want_map = true;
          on_lost(i, Io::failed);
          return;
        }
      }
      on_reply(i, std::move(reply));
    });
    for (std::size_t l = 0; l < groups.size(); ++l) {
      Leg& leg = legs[l];
      if (!leg.conn) continue;
      const auto& [target, items] = groups[l];
      if (leg.conn->out.capacity() > (std::size_t{1} << 20)) std::string().swap(leg.conn->out);  // do not pin a huge put's buffer
      if (leg.io == Io::ok && leg.received == leg.expected) {
        target.node->suspect.store(false, std::memory_order_relaxed);
        target.node->pool.give(std::move(leg.conn));
        continue;
      }
      // A pooled connection that fails before its first reply went stale while idle (the
      // node restarted or closed it): its items go once more, on a fresh connection.
      const bool stale = leg.conn->reused && leg.received == 0 && leg.io == Io::failed;
      leg.conn->broken = true;
      target.node->pool.give(std::move(leg.conn));  // closes it
      std::size_t first_lost = target.asking ? leg.received / 2 : leg.received;
      if (stale) {
        target.node->pool.drop_idle();
        for (; first_lost < items.size(); ++first_lost) {
          const std::size_t i = items[first_lost];
          if ((spent[i] & fresh_connection) != 0) break;
          spent[i] |= fresh_connection;
          try {
            next.push_back(Retry{i, Target{target.node, target.asking, true}});
          } catch (...) {
            on_lost(i, Io::failed);
          }
        }
        if (first_lost == items.size()) continue;
      }
      (leg.io == Io::timed_out ? target.node->timeouts : target.node->failures).fetch_add(1, std::memory_order_relaxed);
      target.node->suspect.store(true, std::memory_order_relaxed);
      want_map = true;
      for (; first_lost < items.size(); ++first_lost)
        failed_on(items[first_lost], target, leg.io == Io::ok ? Io::failed : leg.io);
    }
    return want_map;
  }

  ClusterMap& map_;
  std::chrono::milliseconds command_timeout_;
  RouteCounters& counters_;
};

}  // namespace kvfuse::detail::redis
