// kvfuse/tier/detail/redis_cluster_map.hpp — what a cluster tier knows of its cluster: the
// primaries it has met (each with its connection pool and counters), which primary serves
// each of the 16384 slots (an immutable snapshot, swapped whole), and how a new map is learnt
// (CLUSTER SLOTS from a primary that has not failed lately, else from the seeds).
//
// Internal: not part of the public API (RedisClusterTier is). Needs hiredis.
//
// Threads. Any thread may call any member at once. One mutex guards the node list and the
// map pointer, held only to copy or swap a pointer or append a node, never across I/O; one
// refresh runs at a time (try_lock: a thread that finds one running goes on with the map it
// has). Nodes are never destroyed before the map, so a snapshot may point at them.
#pragma once

#include <hiredis/hiredis.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kvfuse/tier/detail/redis_cluster_slots.hpp>
#include <kvfuse/tier/detail/redis_connection.hpp>
#include <kvfuse/tier/detail/redis_entry.hpp>
#include <kvfuse/tier/redis_address.hpp>
#include <kvfuse/tier/redis_client_options.hpp>

namespace kvfuse::detail::redis {

/// One primary: its address, its connections, its counters (RedisClusterNodeStats' fields).
/// Never destroyed before its ClusterMap, so a map may point at it without owning it.
struct ClusterNode {
  ClusterNode(const RedisClientOptions& o, RedisAddress a)
      : address(std::move(a)), name(address.text()), pool(endpoint_of(o, address), o.max_idle_connections) {}
  RedisAddress address;
  std::string name;
  mutable Pool pool;
  mutable std::atomic<std::uint64_t> requests{0}, round_trips{0}, redirections{0}, timeouts{0}, failures{0};
  mutable std::atomic<bool> suspect{false};  // its last exchange failed: asked for a map last
};

/// Which primary serves each slot (null: none). Immutable once published.
struct SlotMap {
  std::array<ClusterNode*, slot_count> owner{};
};

/// The nodes and the slot map of one cluster tier, and how it learns a new map.
class ClusterMap {
 public:
  /// Knows no node and no slot until learn_from_seeds or refresh answers. Allocates.
  ClusterMap(const RedisClientOptions& client, std::vector<RedisAddress> seeds, std::chrono::milliseconds refresh_interval)
      : client_(client), seeds_(std::move(seeds)), refresh_interval_(refresh_interval) {}
  ClusterMap(const ClusterMap&) = delete;
  ClusterMap& operator=(const ClusterMap&) = delete;

  /// The current map. Any thread; noexcept.
  std::shared_ptr<const SlotMap> current() const noexcept {
    std::lock_guard lock(mutex_);
    return map_;
  }
  /// Every node met, in the order met. Any thread; allocates.
  std::vector<ClusterNode*> nodes() const {
    std::lock_guard lock(mutex_);
    std::vector<ClusterNode*> out;
    out.reserve(nodes_.size());
    for (const auto& n : nodes_) out.push_back(n.get());
    return out;
  }
  /// The node at `a`, made if new; null if it cannot be made (out of memory). Any thread.
  ClusterNode* node_at(const RedisAddress& a) noexcept {
    try {
      std::lock_guard lock(mutex_);
      for (const auto& n : nodes_)
        if (n->address == a) return n.get();
      nodes_.push_back(std::make_unique<ClusterNode>(client_, a));
      return nodes_.back().get();
    } catch (...) {
      return nullptr;
    }
  }

  /// One command on `node`, outside the routed path (CLUSTER SLOTS, SCAN): the reply, or
  /// null (the node marked suspect). A stale pooled connection is retried once on a fresh
  /// one. Any thread; noexcept; allocates; blocks up to the timeouts.
  Reply command(const ClusterNode& node, std::initializer_list<std::string_view> args) noexcept {
    Io failure = Io::failed;
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::unique_ptr<Connection> conn = node.pool.take(attempt > 0, &failure);
      if (!conn) break;
      Reply reply;
      Io io = Io::failed;
      try {
        conn->out.clear();
        append_command(conn->out, args.size());
        for (const std::string_view a : args) append_bulk(conn->out, a);
        const auto deadline = Clock::now() + client_.command_timeout;
        io = send(*conn, deadline);
        if (io == Io::ok) {
          node.round_trips.fetch_add(1, std::memory_order_relaxed);
          io = receive(*conn, deadline, reply);
        }
      } catch (...) {
        io = Io::failed;
      }
      if (io == Io::ok) {
        node.suspect.store(false, std::memory_order_relaxed);
        node.pool.give(std::move(conn));
        return reply;
      }
      const bool stale = conn->reused && io == Io::failed;
      conn->broken = true;
      node.pool.give(std::move(conn));
      if (stale && attempt == 0) {
        node.pool.drop_idle();
        continue;
      }
      failure = io;
      break;
    }
    (failure == Io::timed_out ? node.timeouts : node.failures).fetch_add(1, std::memory_order_relaxed);
    node.suspect.store(true, std::memory_order_relaxed);
    return nullptr;
  }

  /// Publishes the map a CLUSTER SLOTS reply from `asked` describes; false if the reply is
  /// not one. Any thread; noexcept; allocates.
  bool adopt(const redisReply& reply, const RedisAddress& asked) noexcept {
    try {
      std::vector<SlotRange> ranges;
      if (!parse_cluster_slots(reply, asked, ranges)) return false;
      auto map = std::make_shared<SlotMap>();
      for (const SlotRange& r : ranges) {
        ClusterNode* node = node_at(r.primary);
        if (node == nullptr) return false;
        for (std::size_t s = r.first; s <= r.last; ++s) map->owner[s] = node;
      }
      {
        std::lock_guard lock(mutex_);
        map_ = std::move(map);
      }
      refreshes_.fetch_add(1, std::memory_order_relaxed);
      return true;
    } catch (...) {
      return false;
    }
  }

  /// A map from each seed in turn, on a connection of its own (a seed need not be a
  /// primary): true once one answered; else false, with what each seed said in `why` (when
  /// given). Any thread; noexcept; blocks up to the timeouts.
  bool learn_from_seeds(std::string* why) noexcept {
    for (const RedisAddress& seed : seeds_) {
      std::string reason;
      try {
        std::unique_ptr<Connection> conn =
            connect(endpoint_of(client_, seed), &reason);
        if (conn) {
          Reply reply;
          conn->out.clear();
          const std::string_view args[] = {"CLUSTER", "SLOTS"};
          append_command(conn->out, 2);
          for (const std::string_view a : args) append_bulk(conn->out, a);
          const auto deadline = Clock::now() + client_.command_timeout;
          Io io = send(*conn, deadline);
          if (io == Io::ok) io = receive(*conn, deadline, reply);
          if (io != Io::ok) reason = io == Io::timed_out ? "no answer to CLUSTER SLOTS within the command timeout" : "lost the connection";
          else if (reply->type == REDIS_REPLY_ERROR) reason = "CLUSTER SLOTS refused: " + std::string(reply->str, reply->len);
          else if (adopt(*reply, seed)) return true;
          else reason = "CLUSTER SLOTS answered something that is not a slot map";
        }
        if (why != nullptr) *why += (why->empty() ? "" : "; ") + seed.text() + ": " + reason;
      } catch (...) {
        if (why != nullptr) *why = "out of memory";
      }
    }
    refresh_failures_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }

  /// A new map from a known primary that has not failed lately, else from the seeds; true
  /// if one was learnt. Only one thread refreshes at a time (the others return false at
  /// once); `force` ignores the refresh interval. Any thread; noexcept.
  bool refresh(bool force) noexcept {
    std::unique_lock busy(refresh_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    const auto now = Clock::now().time_since_epoch();
    const auto last = std::chrono::nanoseconds(last_refresh_ns_.load(std::memory_order_relaxed));
    if (!force && now - last < refresh_interval_) return false;
    last_refresh_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count(), std::memory_order_relaxed);
    try {
      for (ClusterNode* node : nodes()) {
        if (node->suspect.load(std::memory_order_relaxed)) continue;  // a frozen node would cost a timeout
        const Reply reply = command(*node, {"CLUSTER", "SLOTS"});
        if (reply && adopt(*reply, node->address)) return true;
      }
    } catch (...) {
    }
    return learn_from_seeds(nullptr);
  }

  /// The map with `slot` given to `to`, as a MOVED said (a full refresh follows). Any
  /// thread; noexcept.
  void patch(std::uint16_t slot, ClusterNode* to) noexcept {
    try {
      std::lock_guard lock(mutex_);
      if (map_->owner[slot] == to) return;
      auto map = std::make_shared<SlotMap>(*map_);
      map->owner[slot] = to;
      map_ = std::move(map);
    } catch (...) {
    }
  }


  /// Maps learnt, refreshes nobody could answer. Any thread; noexcept.
  [[nodiscard]] std::uint64_t refreshes() const noexcept { return refreshes_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t refresh_failures() const noexcept { return refresh_failures_.load(std::memory_order_relaxed); }

 private:
  RedisClientOptions client_;
  std::vector<RedisAddress> seeds_;
  std::chrono::milliseconds refresh_interval_;
  mutable std::mutex mutex_;                       // guards nodes_ and map_; never held across I/O
  std::vector<std::unique_ptr<ClusterNode>> nodes_;  // every primary met; grows only
  std::shared_ptr<const SlotMap> map_ = std::make_shared<SlotMap>();
  std::mutex refresh_mutex_;  // one refresh at a time (try_lock: nobody waits on it)
  std::atomic<std::int64_t> last_refresh_ns_{0};
  std::atomic<std::uint64_t> refreshes_{0}, refresh_failures_{0};
};

}  // namespace kvfuse::detail::redis
