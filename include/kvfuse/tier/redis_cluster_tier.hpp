// kvfuse/tier/redis_cluster_tier.hpp — RedisClusterTier: RedisTier's keys and values spread
// over a Redis Cluster (or a Valkey cluster: the same protocol), routed by kvfuse itself
// over hiredis.
//
// Needs hiredis: link kvfuse::redis (Debian libhiredis-dev). Debian ships no C cluster
// client that builds on its hiredis 0.14, so the routing is here: the slot of a key is
// CRC16 of the key (or of its hash tag) modulo 16384, the slot map comes from CLUSTER SLOTS
// of any reachable node, and every primary has a pool of its own connections.
//
// Keys and values are RedisTier's, spelled and checked by the same code
// (tier/detail/redis_entry.hpp): a value one writes the other reads, and a value that fails
// the entry check is a miss, counted in `rejected`.
//
// One round trip per node per batch. get_batch and put_batch sort their keys by the primary
// that owns each slot, write every primary's commands on its own connection, then read all
// of them as they come (detail/redis_cluster_legs.hpp): a batch that touches three primaries
// is three exchanges running at once, never one per key.
//
// Redirections. MOVED (the slot has a new owner) patches the map, retries the key once at
// the node named, and refreshes the whole map after the call; ASK (the slot is migrating and
// this key already moved) retries once with ASKING at the node named, the map untouched. A
// key redirected again on its retry, TRYAGAIN, CLUSTERDOWN, a slot no primary serves, and a
// node that refuses, closes or fails are `failed` (a put: false), each counted by reason; a
// node that does not answer is `timed_out`. A failure also asks for a new map (at most one
// refresh at a time and one per refresh interval), so a promoted replica is found without
// waiting for a MOVED. Never hangs, never throws on the hot path: a call returns within about
// connect_timeout + 2 command timeouts, plus one command timeout when it refreshes the map.
//
// Threads. Every member may be called from any thread at once. The slot map is an immutable
// snapshot behind a shared_ptr, swapped under a mutex held only to copy the pointer; no lock
// is held across I/O. Counters are atomics.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kvfuse/error.hpp>
#include <kvfuse/tier/detail/redis_cluster_legs.hpp>
#include <kvfuse/tier/detail/redis_cluster_slots.hpp>
#include <kvfuse/tier/detail/redis_connection.hpp>
#include <kvfuse/tier/detail/redis_entry.hpp>
#include <kvfuse/tier/redis_address.hpp>
#include <kvfuse/tier/redis_client_options.hpp>
#include <kvfuse/tier/redis_cluster_tier_stats.hpp>
#include <kvfuse/tier/tier.hpp>

namespace kvfuse {

/// Where the cluster can be found (seeds) and, from RedisClientOptions, how to use its
/// nodes (AUTH, key prefix, TTL, timeouts, each primary's pool; `db` must stay 0, the only
/// database a cluster has). Checked by RedisClusterTier's constructor.
struct RedisClusterTierOptions : RedisClientOptions {
  /// Nodes to learn the slot map from, tried in order: any node of the cluster will do,
  /// primary or replica. A unix socket seed works for the first map, but the primaries it
  /// names are TCP addresses (the cluster bus is TCP).
  std::vector<RedisAddress> seeds;
  /// Least time between two map refreshes that failures ask for (a MOVED refreshes anyway).
  std::chrono::milliseconds refresh_interval{100};

  /// Appends every address of a comma-separated list (`HOST:PORT` or `unix:PATH`, each read
  /// by parse_redis_address). Throws Error(invalid_argument) quoting the bad (or empty)
  /// address. Any thread; allocates.
  RedisClusterTierOptions& add_seeds(std::string_view list) {
    for (;;) {  // every part must be an address: an empty one (",," or a trailing comma) is refused by name
      const std::size_t comma = list.find(',');
      seeds.push_back(parse_redis_address(list.substr(0, comma)));
      if (comma == std::string_view::npos) break;
      list.remove_prefix(comma + 1);
    }
    return *this;
  }
};

/// A tier in a Redis Cluster, shared by ranks and by engines. Thread-safe: every member
/// may be called from any thread at once. Not copyable or movable (views may point at
/// replies it handed out; they free themselves, so views may outlive the tier).
class RedisClusterTier {
 public:
  /// Checks `options`, then learns the slot map from the first seed that answers CLUSTER
  /// SLOTS. Throws Error(invalid_argument) naming a bad option; Error(io_failure) listing
  /// every seed and why it could not serve the map (unreachable, AUTH refused, not in
  /// cluster mode) when none could; the password is never quoted. Blocks up to the timeouts.
  explicit RedisClusterTier(RedisClusterTierOptions options) : options_(checked(std::move(options))) {
    std::string why;
    if (!refresh_from_seeds(&why)) throw Error(ErrorCode::io_failure, "RedisClusterTier cannot learn the slot map: " + why);
  }

  RedisClusterTier(const RedisClusterTier&) = delete;
  RedisClusterTier& operator=(const RedisClusterTier&) = delete;

  /// The entry for `key`, as RedisTier::get says: hit (a view of the reply), miss (absent,
  /// or a value that failed the check), failed or timed_out. `staging` is not used. Any
  /// thread; noexcept; one round trip (two when redirected); allocates.
  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept {
    (void)staging;
    TierView out[1];
    get_batch(key, std::span<const PrefixHash>(&key.hash, 1), out);
    return std::move(out[0]);
  }

  /// BatchedTier: out[i] is the entry for `first` with hash `hashes[i]`. The GETs are split
  /// by the primary owning each key's slot and written to every touched primary before any
  /// reply is read: one round trip per touched node, all at once. sink(i, out[i]) is called
  /// in index order as soon as the answers of 0..i are in. A node lost or timed out answers
  /// its keys failed (or timed_out); the others keep theirs. Precondition: out.size() >=
  /// hashes.size() (extra hashes are ignored). Any thread; noexcept; allocates.
  void get_batch(const TierKey& first, std::span<const PrefixHash> hashes, std::span<TierView> out,
                 BatchSink sink = {}) noexcept {
    const std::size_t n = std::min(hashes.size(), out.size());
    if (n == 0) return;
    if (!detail::redis::valid_kind(first.kind)) {
      for (std::size_t i = 0; i < n; ++i) sink(i, out[i] = lost(Io::failed));
      return;
    }
    std::vector<char> landed;
    try {
      landed.assign(n, 0);
    } catch (...) {
      for (std::size_t i = 0; i < n; ++i) sink(i, out[i] = lost(Io::failed));
      return;
    }
    std::size_t next = 0;
    auto land = [&](std::size_t i, TierView view) noexcept {
      out[i] = std::move(view);
      landed[i] = 1;
      for (; next < n && landed[next] != 0; ++next) sink(next, out[next]);
    };
    route(
        n, [&](std::size_t i) { return with_hash(first, hashes[i]); },
        [&](std::string& cmd, std::size_t i) {
          detail::redis::append_key_command(cmd, "GET", options_.key_prefix, with_hash(first, hashes[i]));
        },
        [&](std::size_t i, detail::redis::Reply reply) { land(i, view_of(std::move(reply), with_hash(first, hashes[i]))); },
        [&](std::size_t i, Io io) { land(i, lost(io)); });
  }

  /// Stores header + `bytes` under `key` (SET, with PX when a TTL is set) on the primary of
  /// its slot. False, counted, when refused (OOM, CLUSTERDOWN, TRYAGAIN, redirected twice)
  /// or not confirmed (the node died or did not answer). Any thread; noexcept; one round trip
  /// (two when redirected); allocates (the command holds a copy of the value).
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept {
    bool stored = false;
    put_batch(key, std::span<const PrefixHash>(&key.hash, 1), std::span<const std::span<const std::byte>>(&bytes, 1),
              std::span<bool>(&stored, 1));
    return stored;
  }

  /// Many puts of one rank in one call: values[i] under `first` with hash `hashes[i]`,
  /// split by primary and written to every touched primary at once, one round trip per
  /// node. stored[i] (when `stored` has room) says whether put i was confirmed. Returns how
  /// many were. Any thread; noexcept; allocates (the commands hold copies of the values).
  std::size_t put_batch(const TierKey& first, std::span<const PrefixHash> hashes,
                        std::span<const std::span<const std::byte>> values, std::span<bool> stored = {}) noexcept {
    const std::size_t n = std::min(hashes.size(), values.size());
    std::size_t confirmed = 0;
    auto settle = [&](std::size_t i, bool ok) noexcept {
      if (i < stored.size()) stored[i] = ok;
      confirmed += ok ? 1 : 0;
      (ok ? puts_ : put_failures_).fetch_add(1, std::memory_order_relaxed);
    };
    if (!detail::redis::valid_kind(first.kind)) {
      for (std::size_t i = 0; i < n; ++i) settle(i, false);
      return 0;
    }
    route(
        n, [&](std::size_t i) { return with_hash(first, hashes[i]); },
        [&](std::string& cmd, std::size_t i) {
          detail::redis::append_set(cmd, options_.key_prefix, with_hash(first, hashes[i]), values[i], options_.ttl);
        },
        [&](std::size_t i, detail::redis::Reply reply) { settle(i, detail::redis::set_confirmed(*reply)); },
        [&](std::size_t i, Io) { settle(i, false); });
    return confirmed;
  }

  /// Whether the cluster holds a value under `key` (EXISTS; the value is not checked).
  /// False when it cannot be asked. Any thread; noexcept; one round trip.
  bool contains(const TierKey& key) const noexcept { return integer_command("EXISTS", key) > 0; }

  /// Deletes `key` (DEL). True if a value was there. Any thread; noexcept; one round trip.
  bool erase(const TierKey& key) noexcept { return integer_command("DEL", key) > 0; }

  /// Every key of `kind` under this tier's prefix on every primary of the current map (SCAN
  /// ... MATCH on each, never KEYS), every model, world size and rank, sorted, for
  /// reseed_state_hashes (R18). Any thread; start-up, not the hot path: allocates, one
  /// round trip per SCAN page per primary. Throws Error(io_failure) naming the node whose
  /// page failed.
  std::vector<TierKey> keys(EntryKind kind) const {
    if (!detail::redis::valid_kind(kind)) return {};
    const std::string pattern = options_.key_prefix + (kind == EntryKind::kv_chunk ? "kv-*" : "st-*");
    std::vector<TierKey> found;
    const std::shared_ptr<const SlotMap> map = current_map();
    std::vector<Node*> primaries;
    for (Node* owner : map->owner)
      if (owner != nullptr && std::find(primaries.begin(), primaries.end(), owner) == primaries.end()) primaries.push_back(owner);
    for (Node* node : primaries) {
      std::string cursor = "0";
      do {
        detail::redis::Reply page = single_command(*node, {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
        if (!page || page->type != REDIS_REPLY_ARRAY || page->elements != 2 || page->element[0]->type != REDIS_REPLY_STRING ||
            page->element[1]->type != REDIS_REPLY_ARRAY)
          throw Error(ErrorCode::io_failure, "RedisClusterTier SCAN of '" + pattern + "' failed at " + node->name);
        cursor.assign(page->element[0]->str, page->element[0]->len);
        const redisReply* names = page->element[1];
        for (std::size_t i = 0; i < names->elements; ++i) {
          const redisReply* name = names->element[i];
          if (name->type != REDIS_REPLY_STRING) continue;
          if (const auto key = detail::redis::parse_key(options_.key_prefix, std::string_view(name->str, name->len));
              key && key->kind == kind)
            found.push_back(*key);
        }
      } while (cursor != "0");
    }
    std::sort(found.begin(), found.end());  // SCAN may return a key twice
    found.erase(std::unique(found.begin(), found.end()), found.end());
    return found;
  }

  /// The redis key of `key` (prefix + stem; "" for a kind without one), as RedisTier spells
  /// it. For operators and tests. Any thread; allocates.
  [[nodiscard]] std::string key_name(const TierKey& key) const {
    char name[detail::redis::max_key_bytes];
    return std::string(name, detail::redis::format_key(options_.key_prefix, key, name));
  }

  /// The hash slot of `key`'s redis key (CRC16 of it or of its hash tag, modulo 16384).
  /// Any thread; noexcept.
  [[nodiscard]] std::uint16_t slot_of(const TierKey& key) const noexcept {
    char name[detail::redis::max_key_bytes];
    return detail::redis::key_slot(std::string_view(name, detail::redis::format_key(options_.key_prefix, key, name)));
  }

  /// `HOST:PORT` of the primary the current map gives `slot` to ("" if none). For operators
  /// and tests. Any thread; allocates.
  [[nodiscard]] std::string owner_of(std::uint16_t slot) const {
    const Node* node = current_map()->owner[slot % detail::redis::slot_count];
    return node != nullptr ? node->name : std::string();
  }

  /// Learns the slot map now, from the known primaries or else the seeds. True if one
  /// answered. Any thread; noexcept; blocks up to the timeouts of the nodes it asks.
  bool refresh() noexcept { return refresh_map(true); }

  /// A snapshot of the counters, the tier's and every known primary's. Any thread;
  /// allocates (the node list) and may throw std::bad_alloc.
  [[nodiscard]] RedisClusterTierStats stats() const {
    RedisClusterTierStats s;
    RedisTierStats& t = s.totals;
    t.hits = hits_.load(std::memory_order_relaxed);
    t.misses = misses_.load(std::memory_order_relaxed);
    t.rejected = rejected_.load(std::memory_order_relaxed);
    t.get_failures = get_failures_.load(std::memory_order_relaxed);
    t.timeouts = timeouts_.load(std::memory_order_relaxed);
    t.puts = puts_.load(std::memory_order_relaxed);
    t.put_failures = put_failures_.load(std::memory_order_relaxed);
    RedisClusterCounters& c = s.cluster;
    c.moved = moved_.load(std::memory_order_relaxed);
    c.asks = asks_.load(std::memory_order_relaxed);
    c.tryagain = tryagain_.load(std::memory_order_relaxed);
    c.clusterdown = clusterdown_.load(std::memory_order_relaxed);
    c.redirect_failures = redirect_failures_.load(std::memory_order_relaxed);
    c.map_refreshes = map_refreshes_.load(std::memory_order_relaxed);
    c.map_refresh_failures = map_refresh_failures_.load(std::memory_order_relaxed);
    for (const Node* node : node_list()) {
      RedisClusterNodeStats n;
      n.address = node->name;
      n.requests = node->requests.load(std::memory_order_relaxed);
      n.round_trips = node->round_trips.load(std::memory_order_relaxed);
      n.redirections = node->redirections.load(std::memory_order_relaxed);
      n.timeouts = node->timeouts.load(std::memory_order_relaxed);
      n.failures = node->failures.load(std::memory_order_relaxed);
      t.round_trips += n.round_trips;
      t.connects += node->pool.connects();
      t.connect_failures += node->pool.connect_failures();
      t.connect_timeouts += node->pool.connect_timeouts();
      t.dropped_connections += node->pool.dropped();
      s.nodes.push_back(std::move(n));
    }
    return s;
  }

  /// The options given at construction. Any thread; noexcept.
  [[nodiscard]] const RedisClusterTierOptions& options() const noexcept { return options_; }

 private:
  using Io = detail::redis::Io;
  using Reply = detail::redis::Reply;

  // One primary: its address, its connections, its counters. Never destroyed before the
  // tier, so a map may point at it without owning it.
  struct Node {
    Node(const RedisClientOptions& o, RedisAddress a)
        : address(std::move(a)), name(address.text()), pool(detail::redis::endpoint_of(o, address), o.max_idle_connections) {}
    RedisAddress address;
    std::string name;
    mutable detail::redis::Pool pool;
    mutable std::atomic<std::uint64_t> requests{0}, round_trips{0}, redirections{0}, timeouts{0}, failures{0};
    mutable std::atomic<bool> suspect{false};  // its last exchange failed: asked for a map last
  };

  // Which primary serves each slot. Immutable once published.
  struct SlotMap {
    std::array<Node*, detail::redis::slot_count> owner{};
  };

  // Where one key goes in a round.
  struct Target {
    Node* node = nullptr;
    bool asking = false;  // ASKING before the command (an ASK retry)
    bool fresh = false;   // a new connection (the pooled one was stale)
    friend bool operator==(const Target&, const Target&) = default;
  };
  struct Retry {
    std::size_t item;
    Target target;
  };
  using Groups = std::vector<std::pair<Target, std::vector<std::size_t>>>;

  static TierKey with_hash(TierKey k, PrefixHash h) noexcept {
    k.hash = h;
    return k;
  }

  static RedisClusterTierOptions checked(RedisClusterTierOptions o) {
    if (o.seeds.empty()) throw Error(ErrorCode::invalid_argument, "RedisClusterTierOptions.seeds is empty");
    for (const RedisAddress& a : o.seeds) {
      RedisAddress again;
      if (const std::string_view why = detail::redis::read_address(a.text(), again); !why.empty())
        throw Error(ErrorCode::invalid_argument, "RedisClusterTierOptions.seeds: " + detail::redis::address_problem(a.text(), why));
    }
    if (o.db != 0) throw Error(ErrorCode::invalid_argument, "RedisClusterTierOptions.db (" + std::to_string(o.db) + ") is not 0: a cluster has one database");
    if (o.refresh_interval.count() < 0)
      throw Error(ErrorCode::invalid_argument,
                  "RedisClusterTierOptions.refresh_interval (" + std::to_string(o.refresh_interval.count()) + " ms) is negative");
    detail::redis::check_client_options(o, "RedisClusterTierOptions");
    return o;
  }

  std::shared_ptr<const SlotMap> current_map() const noexcept {
    std::lock_guard lock(mutex_);
    return map_;
  }
  std::vector<Node*> node_list() const {
    std::lock_guard lock(mutex_);
    std::vector<Node*> out;
    out.reserve(nodes_.size());
    for (const auto& n : nodes_) out.push_back(n.get());
    return out;
  }
  // The node at `a`, made if new; null if it cannot be made (out of memory).
  Node* node_at(const RedisAddress& a) const noexcept {
    try {
      std::lock_guard lock(mutex_);
      for (const auto& n : nodes_)
        if (n->address == a) return n.get();
      nodes_.push_back(std::make_unique<Node>(options_, a));
      return nodes_.back().get();
    } catch (...) {
      return nullptr;
    }
  }

  TierView view_of(Reply reply, const TierKey& key) const noexcept {
    const detail::redis::Judged judged = detail::redis::judge_value(*reply, key);
    switch (judged.verdict) {
      case detail::redis::Verdict::hit:
        hits_.fetch_add(1, std::memory_order_relaxed);
        return TierView(judged.payload, &detail::redis::release_reply, nullptr, reply.release());
      case detail::redis::Verdict::miss:
        misses_.fetch_add(1, std::memory_order_relaxed);
        return TierView(GetStatus::miss);
      case detail::redis::Verdict::error:
        get_failures_.fetch_add(1, std::memory_order_relaxed);  // LOADING, BUSY, OOM...: the node may have it
        return TierView(GetStatus::failed);
      case detail::redis::Verdict::rejected:
        break;
    }
    rejected_.fetch_add(1, std::memory_order_relaxed);  // foreign, truncated, corrupt, another type
    return TierView(GetStatus::miss);
  }

  TierView lost(Io io) const noexcept {
    if (io == Io::timed_out) {
      timeouts_.fetch_add(1, std::memory_order_relaxed);
      return TierView(GetStatus::timed_out);
    }
    get_failures_.fetch_add(1, std::memory_order_relaxed);
    return TierView(GetStatus::failed);
  }

  // DEL / EXISTS of one key: the integer reply, or -1.
  long long integer_command(std::string_view command, const TierKey& key) const noexcept {
    if (!detail::redis::valid_kind(key.kind)) return -1;
    long long result = -1;
    route(
        1, [&](std::size_t) { return key; },
        [&](std::string& cmd, std::size_t) { detail::redis::append_key_command(cmd, command, options_.key_prefix, key); },
        [&](std::size_t, Reply reply) {
          if (reply->type == REDIS_REPLY_INTEGER) result = reply->integer;
        },
        [](std::size_t, Io) {});
    return result;
  }

  // One command on one node, outside the routed path (CLUSTER SLOTS, SCAN): the reply, or
  // null. Marks the node suspect when it fails. noexcept; allocates.
  Reply single_command(const Node& node, std::initializer_list<std::string_view> args) const noexcept {
    Io failure = Io::failed;
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::unique_ptr<detail::redis::Connection> conn = node.pool.take(attempt > 0, &failure);
      if (!conn) break;
      Reply reply;
      Io io = Io::failed;
      try {
        conn->out.clear();
        detail::redis::append_command(conn->out, args.size());
        for (const std::string_view a : args) detail::redis::append_bulk(conn->out, a);
        const auto deadline = detail::redis::Clock::now() + options_.command_timeout;
        io = detail::redis::send(*conn, deadline);
        if (io == Io::ok) {
          node.round_trips.fetch_add(1, std::memory_order_relaxed);
          io = detail::redis::receive(*conn, deadline, reply);
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

  // Publishes the map a CLUSTER SLOTS reply describes. False if the reply is not one.
  bool adopt_slots(const redisReply& reply, const RedisAddress& asked) const noexcept {
    try {
      std::vector<detail::redis::SlotRange> ranges;
      if (!detail::redis::parse_cluster_slots(reply, asked, ranges)) return false;
      auto map = std::make_shared<SlotMap>();
      for (const detail::redis::SlotRange& r : ranges) {
        Node* node = node_at(r.primary);
        if (node == nullptr) return false;
        for (std::size_t s = r.first; s <= r.last; ++s) map->owner[s] = node;
      }
      {
        std::lock_guard lock(mutex_);
        map_ = std::move(map);
      }
      map_refreshes_.fetch_add(1, std::memory_order_relaxed);
      return true;
    } catch (...) {
      return false;
    }
  }

  // The first map: from each seed in turn, on a connection of its own (a seed need not be a
  // primary). `why` lists what each seed said.
  bool refresh_from_seeds(std::string* why) const noexcept {
    for (const RedisAddress& seed : options_.seeds) {
      std::string reason;
      try {
        std::unique_ptr<detail::redis::Connection> conn =
            detail::redis::connect(detail::redis::endpoint_of(options_, seed), &reason);
        if (conn) {
          Reply reply;
          conn->out.clear();
          const std::string_view args[] = {"CLUSTER", "SLOTS"};
          detail::redis::append_command(conn->out, 2);
          for (const std::string_view a : args) detail::redis::append_bulk(conn->out, a);
          const auto deadline = detail::redis::Clock::now() + options_.command_timeout;
          Io io = detail::redis::send(*conn, deadline);
          if (io == Io::ok) io = detail::redis::receive(*conn, deadline, reply);
          if (io != Io::ok) reason = io == Io::timed_out ? "no answer to CLUSTER SLOTS within the command timeout" : "lost the connection";
          else if (reply->type == REDIS_REPLY_ERROR) reason = "CLUSTER SLOTS refused: " + std::string(reply->str, reply->len);
          else if (adopt_slots(*reply, seed)) return true;
          else reason = "CLUSTER SLOTS answered something that is not a slot map";
        }
        if (why != nullptr) *why += (why->empty() ? "" : "; ") + seed.text() + ": " + reason;
      } catch (...) {
        if (why != nullptr) *why = "out of memory";
      }
    }
    map_refresh_failures_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }

  // A new map from a known primary that has not failed lately, else from the seeds. Only
  // one thread refreshes at a time (the others go on with the map they have); `force`
  // ignores the refresh interval. noexcept.
  bool refresh_map(bool force) const noexcept {
    std::unique_lock busy(refresh_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    const auto now = detail::redis::Clock::now().time_since_epoch();
    const auto last = std::chrono::nanoseconds(last_refresh_ns_.load(std::memory_order_relaxed));
    if (!force && now - last < options_.refresh_interval) return false;
    last_refresh_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count(), std::memory_order_relaxed);
    try {
      for (Node* node : node_list()) {
        if (node->suspect.load(std::memory_order_relaxed)) continue;  // a frozen node would cost a timeout
        const Reply reply = single_command(*node, {"CLUSTER", "SLOTS"});
        if (reply && adopt_slots(*reply, node->address)) return true;
      }
    } catch (...) {
    }
    return refresh_from_seeds(nullptr);
  }

  // What an item has already been given: each at most once, so a call ends within four
  // rounds (in steady state it is one).
  enum Spent : std::uint8_t { redirected = 1, fresh_connection = 2, rerouted = 4 };

  // The routed exchange under every call: item i (of `count`) has key key_of(i), its
  // command formatted by format(cmd, i); its final reply goes to on_reply(i, reply), or
  // on_lost(i, io) if none came. The first round sends each item to the primary of its
  // slot. An item goes once more, in a later round, when it was redirected (MOVED: to the
  // node named, the map patched; ASK: there with ASKING), when its pooled connection was
  // stale (on a fresh one), or when its node refused or dropped it (to the slot's owner in
  // the map learnt right then, if that is another node: a promoted replica). Every touched
  // node of a round is one exchange, all of a round's exchanges run at once. The callbacks
  // must not throw.
  template <class KeyOf, class Format, class OnReply, class OnLost>
  void route(std::size_t count, KeyOf&& key_of, Format&& format, OnReply&& on_reply, OnLost&& on_lost) const noexcept {
    std::vector<std::uint8_t> spent;
    std::vector<std::uint16_t> slots;
    std::vector<Retry> next, unreachable;
    Groups groups;
    bool want_map = false;
    try {
      spent.assign(count, 0);
      slots.resize(count);
      const std::shared_ptr<const SlotMap> map = current_map();
      for (std::size_t i = 0; i < count; ++i) {
        slots[i] = slot_of(key_of(i));
        Node* owner = map->owner[slots[i]];
        if (owner == nullptr) {
          clusterdown_.fetch_add(1, std::memory_order_relaxed);  // no primary serves the slot (yet)
          want_map = true;
          on_lost(i, Io::failed);
          continue;
        }
        add_to(groups, Target{owner, false, false}, i);
      }
    } catch (...) {
      for (std::size_t i = 0; i < count; ++i) on_lost(i, Io::failed);  // nothing was sent
      return;
    }
    for (int round = 0; !groups.empty(); ++round) {
      next.clear();
      unreachable.clear();
      want_map |= run_round(groups, spent, next, unreachable, format, on_reply, on_lost);
      if (!unreachable.empty()) {
        // The node is gone (killed, or failed over): ask the others who serves its slots now.
        (void)refresh_map(true);
        want_map = false;
        const std::shared_ptr<const SlotMap> map = current_map();
        for (const Retry& r : unreachable) {
          Node* owner = map->owner[slots[r.item]];
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
    if (want_map) (void)refresh_map(false);
  }

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
    std::vector<detail::redis::Leg> legs;
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
    const auto deadline = detail::redis::Clock::now() + options_.command_timeout;
    for (std::size_t l = 0; l < groups.size(); ++l) {
      const auto& [target, items] = groups[l];
      detail::redis::Leg& leg = legs[l];
      if (!leg.conn) continue;
      bool formatted = true;
      try {
        leg.conn->out.clear();
        for (const std::size_t i : items) {
          if (target.asking) {
            detail::redis::append_command(leg.conn->out, 1);
            detail::redis::append_bulk(leg.conn->out, "ASKING");
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
      leg.io = detail::redis::send(*leg.conn, deadline);
      if (leg.io == Io::ok) target.node->round_trips.fetch_add(1, std::memory_order_relaxed);
    }
    detail::redis::receive_legs(legs, deadline, [&](std::size_t l, Reply reply) noexcept {
      const auto& [target, items] = groups[l];
      const std::size_t k = legs[l].received - 1;
      if (target.asking && k % 2 == 0) return;  // ASKING's +OK (an error shows in the command's own reply)
      const std::size_t i = items[target.asking ? k / 2 : k];
      if (reply->type == REDIS_REPLY_ERROR) {
        const std::string_view text(reply->str, reply->len);
        if (text.starts_with("MOVED ") || text.starts_with("ASK ")) {
          target.node->redirections.fetch_add(1, std::memory_order_relaxed);
          const bool moved = text.starts_with("MOVED ");
          (moved ? moved_ : asks_).fetch_add(1, std::memory_order_relaxed);
          want_map |= moved;
          Node* to = nullptr;
          detail::redis::Redirect r;
          try {
            r = detail::redis::parse_redirect(text, target.node->address);
            if (r.kind != detail::redis::Redirect::none) to = node_at(r.to);
          } catch (...) {
          }
          if ((spent[i] & redirected) != 0 || to == nullptr) {
            redirect_failures_.fetch_add(1, std::memory_order_relaxed);
            on_lost(i, Io::failed);
            return;
          }
          spent[i] |= redirected;
          if (moved) patch_map(r.slot, to);
          try {
            next.push_back(Retry{i, Target{to, !moved, false}});
          } catch (...) {
            on_lost(i, Io::failed);
          }
          return;
        }
        if (text.starts_with("TRYAGAIN") || text.starts_with("CLUSTERDOWN")) {
          (text.starts_with("TRYAGAIN") ? tryagain_ : clusterdown_).fetch_add(1, std::memory_order_relaxed);
          target.node->failures.fetch_add(1, std::memory_order_relaxed);
          want_map = true;
          on_lost(i, Io::failed);
          return;
        }
      }
      on_reply(i, std::move(reply));
    });
    for (std::size_t l = 0; l < groups.size(); ++l) {
      detail::redis::Leg& leg = legs[l];
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

  // The map with `slot` given to `to`, as a MOVED said (the full map follows the call).
  void patch_map(std::uint16_t slot, Node* to) const noexcept {
    try {
      std::lock_guard lock(mutex_);
      if (map_->owner[slot] == to) return;
      auto map = std::make_shared<SlotMap>(*map_);
      map->owner[slot] = to;
      map_ = std::move(map);
    } catch (...) {
    }
  }

  RedisClusterTierOptions options_;
  mutable std::mutex mutex_;                       // guards nodes_ and map_; never held across I/O
  mutable std::vector<std::unique_ptr<Node>> nodes_;  // every primary met; grows only
  mutable std::shared_ptr<const SlotMap> map_ = std::make_shared<SlotMap>();
  mutable std::mutex refresh_mutex_;  // one refresh at a time (try_lock: nobody waits on it)
  mutable std::atomic<std::int64_t> last_refresh_ns_{0};
  mutable std::atomic<std::uint64_t> hits_{0}, misses_{0}, rejected_{0}, get_failures_{0}, timeouts_{0}, puts_{0},
      put_failures_{0}, moved_{0}, asks_{0}, tryagain_{0}, clusterdown_{0}, redirect_failures_{0}, map_refreshes_{0},
      map_refresh_failures_{0};
};

static_assert(Tier<RedisClusterTier>);
static_assert(BatchedTier<RedisClusterTier>);

}  // namespace kvfuse
