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
// of them as they come (detail/redis_cluster_route.hpp, detail/redis_cluster_legs.hpp): a batch that touches three primaries
// is three exchanges running at once, never one per key.
//
// Redirections. MOVED (the slot has a new owner) patches the map, retries the key once at
// the node named, and refreshes the whole map after the call; ASK (the slot is migrating and
// this key already moved) retries once with ASKING at the node named, the map untouched. A
// key redirected again on its retry, TRYAGAIN, CLUSTERDOWN and a slot no primary serves are
// `failed` (a put: false), each counted by reason.
//
// Dead and silent nodes. A node that refuses or drops a connection fails its keys; the tier
// then asks another primary for the map at once and sends the keys once more to their slot's
// new owner if there is one (a promoted replica), so the first call after a failover finds
// it. A node that does not answer is `timed_out`, never `failed` and never rerouted (it may
// still hold the entry). Any failure also asks for a new map after the call (one refresh at
// a time, at most one per refresh_interval). Never hangs, never throws on the hot path: a
// round waits at most one command timeout for replies once its connections exist (opening
// one to a silent node costs up to connect_timeout plus a command timeout for its PING), and
// a key takes at most four rounds (its first, one redirection, one fresh connection for a
// stale pooled one, one reroute); in steady state it takes one.
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
#include <kvfuse/tier/detail/redis_cluster_map.hpp>
#include <kvfuse/tier/detail/redis_cluster_route.hpp>
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
    if (!map_.learn_from_seeds(&why)) throw Error(ErrorCode::io_failure, "RedisClusterTier cannot learn the slot map: " + why);
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
    router_.route(
        n, [&](std::size_t i) { return slot_of(with_hash(first, hashes[i])); },
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
    router_.route(
        n, [&](std::size_t i) { return slot_of(with_hash(first, hashes[i])); },
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
    const std::shared_ptr<const detail::redis::SlotMap> map = map_.current();
    std::vector<detail::redis::ClusterNode*> primaries;
    for (detail::redis::ClusterNode* owner : map->owner)
      if (owner != nullptr && std::find(primaries.begin(), primaries.end(), owner) == primaries.end()) primaries.push_back(owner);
    for (detail::redis::ClusterNode* node : primaries) {
      std::string cursor = "0";
      do {
        detail::redis::Reply page = map_.command(*node, {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
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
    const detail::redis::ClusterNode* node = map_.current()->owner[slot % detail::redis::slot_count];
    return node != nullptr ? node->name : std::string();
  }

  /// Learns the slot map now, from the known primaries or else the seeds. True if one
  /// answered. Any thread; noexcept; blocks up to the timeouts of the nodes it asks.
  bool refresh() noexcept { return map_.refresh(true); }

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
    c.moved = routed_.moved.load(std::memory_order_relaxed);
    c.asks = routed_.asks.load(std::memory_order_relaxed);
    c.tryagain = routed_.tryagain.load(std::memory_order_relaxed);
    c.clusterdown = routed_.clusterdown.load(std::memory_order_relaxed);
    c.redirect_failures = routed_.redirect_failures.load(std::memory_order_relaxed);
    c.map_refreshes = map_.refreshes();
    c.map_refresh_failures = map_.refresh_failures();
    for (const detail::redis::ClusterNode* node : map_.nodes()) {
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
    router_.route(
        1, [&](std::size_t) { return slot_of(key); },
        [&](std::string& cmd, std::size_t) { detail::redis::append_key_command(cmd, command, options_.key_prefix, key); },
        [&](std::size_t, Reply reply) {
          if (reply->type == REDIS_REPLY_INTEGER) result = reply->integer;
        },
        [](std::size_t, Io) {});
    return result;
  }

  RedisClusterTierOptions options_;
  mutable detail::redis::ClusterMap map_{options_, options_.seeds, options_.refresh_interval};
  mutable detail::redis::RouteCounters routed_;
  detail::redis::ClusterRouter router_{map_, options_.command_timeout, routed_};
  mutable std::atomic<std::uint64_t> hits_{0}, misses_{0}, rejected_{0}, get_failures_{0}, timeouts_{0}, puts_{0},
      put_failures_{0};
};

static_assert(Tier<RedisClusterTier>);
static_assert(BatchedTier<RedisClusterTier>);

}  // namespace kvfuse
