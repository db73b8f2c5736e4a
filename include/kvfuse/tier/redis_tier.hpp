// kvfuse/tier/redis_tier.hpp — RedisTier: a remote tier over hiredis, shared by engines.
//
// Needs hiredis: link kvfuse::redis (Debian libhiredis-dev). Nothing else in kvfuse
// includes this header.
//
// Keys. `<prefix><stem>`, the stem being the DiskTier file name without ".kvt"
// (tier/disk_format.hpp): `kv-<model:16>-<hash:16>-<world_size:8>-<rank:8>` for a KV chunk,
// `st-...` for a state entry, fixed-width lowercase hex. Two models, world sizes or ranks
// never share a key, and engines of one deployment sharing a server and a prefix share
// their entries.
//
// Values. Exactly a DiskTier file: the 80-byte header (magic, format version, key, payload
// length, payload checksum, header checksum) then the payload, built and checked by the
// same code (encode_entry_header, check_entry). A value under a kvfuse key that fails the
// check (foreign, truncated, corrupt, another key's entry, another type) is a miss,
// counted in `rejected`, and never served.
//
// One round trip per load. get_batch (BatchedTier) writes every GET of a KV load in one
// write and reads the replies in order; PagedKv uses it. A hit's view points into the
// hiredis reply (after the header) and frees the reply when the view goes: no copy beyond
// the one hiredis makes while parsing. With a QueryableRuntime PagedKv releases each view as
// soon as its copy ran, so the next reply reuses that memory while it is still in cache.
//
// Never hangs, never throws on the hot path. Connect and command timeouts come from the
// options; a call returns within about twice the command timeout. A dead, killed or
// restarted server turns the chunks in flight into failed views and puts into false; the
// connection is dropped and a later call connects again. A server that stops answering (a
// stopped process: the kernel still accepts its connections) is timed_out on every call,
// the first on the pooled connection, each later one on the new connection's PING; a
// refused connection is failed. A pooled
// connection found stale (the server restarted) is retried once on a fresh connection, so
// a restarted empty server answers misses rather than failures. Every command RedisTier
// sends is idempotent (GET, SET, EXISTS, DEL, SCAN).
//
// Threads. Connections live in a pool: a call takes one, uses it with no lock held, and
// gives it back (one per lane in steady state). Counters are atomics.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kvfuse/error.hpp>
#include <kvfuse/tier/detail/redis_connection.hpp>
#include <kvfuse/tier/detail/redis_entry.hpp>
#include <kvfuse/tier/disk_format.hpp>
#include <kvfuse/tier/redis_address.hpp>
#include <kvfuse/tier/redis_client_options.hpp>
#include <kvfuse/tier/redis_tier_stats.hpp>
#include <kvfuse/tier/tier.hpp>

namespace kvfuse {

/// Where the server is (and, from RedisClientOptions, how to use it: AUTH, SELECT, key
/// prefix, TTL, timeouts, the pool). Checked by RedisTier's constructor.
struct RedisTierOptions : RedisClientOptions {
  std::string host = "127.0.0.1";  ///< TCP host (name or address); ignored with unix_socket
  int port = 6379;                 ///< TCP port, 1..65535; ignored with unix_socket
  std::string unix_socket;         ///< non-empty: connect to this socket path instead of host:port

  /// Points these options at `address` (`HOST:PORT` or `unix:PATH`, read by
  /// parse_redis_address): sets host and port and clears unix_socket, or sets unix_socket.
  /// Throws Error(invalid_argument) quoting the address. Any thread; allocates.
  RedisTierOptions& set_address(std::string_view address) {
    RedisAddress a = parse_redis_address(address);
    unix_socket = std::move(a.unix_socket);
    if (unix_socket.empty()) {
      host = std::move(a.host);
      port = a.port;
    }
    return *this;
  }
};

/// A tier in a redis-server (or a server speaking its protocol), shared by ranks and by
/// engines. Thread-safe: every member may be called from any thread at once. Not copyable
/// or movable (views may point at replies it handed out; they free themselves, so views may
/// outlive the tier).
class RedisTier {
 public:
  /// Checks `options`, then connects once. Throws Error(invalid_argument) naming a bad
  /// option, Error(io_failure) with the address when the server cannot be reached or
  /// refuses AUTH or SELECT. Blocks up to the timeouts.
  explicit RedisTier(RedisTierOptions options) : options_(checked(std::move(options))), pool_(endpoint(options_), options_.max_idle_connections) {
    address_ = pool_.endpoint().text();
    std::string why;
    std::unique_ptr<detail::redis::Connection> first = detail::redis::connect(pool_.endpoint(), &why);
    if (!first) throw Error(ErrorCode::io_failure, "RedisTier cannot use the server at " + address_ + ": " + why);
    pool_.adopt(std::move(first));
  }

  RedisTier(const RedisTier&) = delete;
  RedisTier& operator=(const RedisTier&) = delete;

  /// The entry for `key`: hit (a view of the reply, freed with the view), miss (absent, or
  /// a value that failed the entry check), failed or timed_out. `staging` is not used. Any
  /// thread; noexcept; one round trip; allocates (hiredis buffers and the reply).
  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept {
    (void)staging;
    TierView out[1];
    get_batch(key, std::span<const PrefixHash>(&key.hash, 1), out);
    return std::move(out[0]);
  }

  /// BatchedTier: out[i] is the entry for `first` with hash `hashes[i]`, every GET sent in
  /// one write, every reply read in order: one round trip. sink(i, out[i]) is called as
  /// each answer lands, so the caller copies a hit while its bytes are hot. A connection lost or timed out
  /// at reply k answers k and later failed (or timed_out); 0..k-1 keep their answers.
  /// Precondition: out.size() >= hashes.size() (extra hashes are ignored). Any thread;
  /// noexcept; allocates.
  void get_batch(const TierKey& first, std::span<const PrefixHash> hashes, std::span<TierView> out,
                 BatchSink sink = {}) noexcept {
    const std::size_t n = std::min(hashes.size(), out.size());
    if (n == 0) return;
    if (!valid_kind(first.kind)) {
      for (std::size_t i = 0; i < n; ++i) sink(i, out[i] = lost(detail::redis::Io::failed));
      return;
    }
    exchange(
        n,
        [&](std::string& cmd) {
          for (std::size_t i = 0; i < n; ++i) {
            TierKey k = first;
            k.hash = hashes[i];
            detail::redis::append_key_command(cmd, "GET", options_.key_prefix, k);
          }
        },
        [&](std::size_t i, detail::redis::Reply reply) {
          TierKey k = first;
          k.hash = hashes[i];
          sink(i, out[i] = view_of(std::move(reply), k));
        },
        [&](std::size_t i, detail::redis::Io io) { sink(i, out[i] = lost(io)); });
  }

  /// Stores header + `bytes` under `key` (SET, with PX when a TTL is set), replacing any
  /// previous value. False, counted, when the server refuses it (OOM under maxmemory with
  /// noeviction, ...) or it could not be sent or confirmed. Any thread; noexcept; one round
  /// trip; allocates (the command holds a copy of the value).
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept {
    bool stored = false;
    if (valid_kind(key.kind)) {
      exchange(
          1, [&](std::string& cmd) { detail::redis::append_set(cmd, options_.key_prefix, key, bytes, options_.ttl); },
          [&](std::size_t, detail::redis::Reply reply) { stored = detail::redis::set_confirmed(*reply); },
          [](std::size_t, detail::redis::Io) {});
    }
    (stored ? puts_ : put_failures_).fetch_add(1, std::memory_order_relaxed);
    return stored;
  }

  /// Whether the server holds a value under `key` (EXISTS; the value is not checked).
  /// False when it cannot be asked. Any thread; noexcept; one round trip.
  bool contains(const TierKey& key) const noexcept { return integer_command("EXISTS", key) > 0; }

  /// Deletes `key` (DEL). True if a value was there. Any thread; noexcept; one round trip.
  bool erase(const TierKey& key) noexcept { return integer_command("DEL", key) > 0; }

  /// Every key of `kind` under this tier's prefix, every model, world size and rank, in
  /// no particular order: how an engine re-seeds its index from the state entries (R18).
  /// Walks the keyspace with SCAN (never KEYS, which blocks the server). Keys that do not
  /// spell an entry are skipped. Any thread; start-up, not the hot path: allocates, one
  /// round trip per SCAN page. Throws Error(io_failure) with the address if a page fails.
  std::vector<TierKey> keys(EntryKind kind) const {
    if (!valid_kind(kind)) return {};
    const std::string pattern = options_.key_prefix + (kind == EntryKind::kv_chunk ? "kv-*" : "st-*");
    std::vector<TierKey> found;
    std::string cursor = "0";
    do {
      detail::redis::Reply page;
      bool lost_page = false;
      exchange(
          1,
          [&](std::string& cmd) {
            detail::redis::append_command(cmd, 6);
            for (const std::string_view arg : {std::string_view("SCAN"), std::string_view(cursor), std::string_view("MATCH"),
                                               std::string_view(pattern), std::string_view("COUNT"), std::string_view("1000")})
              detail::redis::append_bulk(cmd, arg);
          },
          [&](std::size_t, detail::redis::Reply reply) { page = std::move(reply); },
          [&](std::size_t, detail::redis::Io) { lost_page = true; });
      if (lost_page || !page || page->type != REDIS_REPLY_ARRAY || page->elements != 2 ||
          page->element[0]->type != REDIS_REPLY_STRING || page->element[1]->type != REDIS_REPLY_ARRAY)
        throw Error(ErrorCode::io_failure, "RedisTier SCAN of '" + pattern + "' failed at " + address_);
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
    std::sort(found.begin(), found.end());  // SCAN may return a key twice
    found.erase(std::unique(found.begin(), found.end()), found.end());
    return found;
  }

  /// The redis key of `key` (prefix + stem; "" for a kind without one). For operators and
  /// tests. Any thread; allocates.
  [[nodiscard]] std::string key_name(const TierKey& key) const {
    char name[detail::redis::max_key_bytes];
    return std::string(name, detail::redis::format_key(options_.key_prefix, key, name));
  }

  /// A snapshot of the counters. Any thread; noexcept.
  [[nodiscard]] RedisTierStats stats() const noexcept {
    RedisTierStats s;
    s.hits = hits_.load(std::memory_order_relaxed);
    s.misses = misses_.load(std::memory_order_relaxed);
    s.rejected = rejected_.load(std::memory_order_relaxed);
    s.get_failures = get_failures_.load(std::memory_order_relaxed);
    s.timeouts = timeouts_.load(std::memory_order_relaxed);
    s.puts = puts_.load(std::memory_order_relaxed);
    s.put_failures = put_failures_.load(std::memory_order_relaxed);
    s.round_trips = round_trips_.load(std::memory_order_relaxed);
    s.connects = pool_.connects();
    s.connect_failures = pool_.connect_failures();
    s.connect_timeouts = pool_.connect_timeouts();
    s.dropped_connections = pool_.dropped();
    return s;
  }

  /// "unix:<path>" or "<host>:<port>". Any thread; noexcept.
  [[nodiscard]] const std::string& address() const noexcept { return address_; }
  /// The options given at construction. Any thread; noexcept.
  [[nodiscard]] const RedisTierOptions& options() const noexcept { return options_; }

 private:
  using Io = detail::redis::Io;

  static bool valid_kind(EntryKind kind) noexcept { return detail::redis::valid_kind(kind); }

  static RedisTierOptions checked(RedisTierOptions o) {
    auto bad = [](const std::string& what) { throw Error(ErrorCode::invalid_argument, "RedisTierOptions." + what); };
    if (o.unix_socket.empty()) {
      if (o.host.empty()) bad("host is empty and no unix_socket is given");
      if (o.port < 1 || o.port > 65535) bad("port (" + std::to_string(o.port) + ") is outside [1, 65535]");
    } else if (o.unix_socket.size() > 107) {
      bad("unix_socket '" + o.unix_socket + "' is longer than 107 bytes");
    }
    detail::redis::check_client_options(o, "RedisTierOptions");
    return o;
  }

  static detail::redis::Endpoint endpoint(const RedisTierOptions& o) {
    return detail::redis::endpoint_of(o, RedisAddress{o.host, o.port, o.unix_socket});
  }

  TierView view_of(detail::redis::Reply reply, const TierKey& key) noexcept {
    const detail::redis::Judged judged = detail::redis::judge_value(*reply, key);
    switch (judged.verdict) {
      case detail::redis::Verdict::hit:
        hits_.fetch_add(1, std::memory_order_relaxed);
        return TierView(judged.payload, &detail::redis::release_reply, nullptr, reply.release());
      case detail::redis::Verdict::miss:
        misses_.fetch_add(1, std::memory_order_relaxed);
        return TierView(GetStatus::miss);
      case detail::redis::Verdict::error:
        get_failures_.fetch_add(1, std::memory_order_relaxed);  // LOADING, BUSY, ...: the server may have it
        return TierView(GetStatus::failed);
      case detail::redis::Verdict::rejected:
        break;
    }
    rejected_.fetch_add(1, std::memory_order_relaxed);  // foreign, truncated, corrupt, another type
    return TierView(GetStatus::miss);
  }

  TierView lost(Io io) noexcept {
    if (io == Io::timed_out) {
      timeouts_.fetch_add(1, std::memory_order_relaxed);
      return TierView(GetStatus::timed_out);
    }
    get_failures_.fetch_add(1, std::memory_order_relaxed);
    return TierView(GetStatus::failed);
  }

  // DEL / EXISTS of one key: the integer reply, or -1.
  long long integer_command(std::string_view command, const TierKey& key) const noexcept {
    if (!valid_kind(key.kind)) return -1;
    long long result = -1;
    exchange(
        1,
        [&](std::string& cmd) {
          detail::redis::append_key_command(cmd, command, options_.key_prefix, key);
        },
        [&](std::size_t, detail::redis::Reply reply) {
          if (reply->type == REDIS_REPLY_INTEGER) result = reply->integer;
        },
        [](std::size_t, Io) {});
    return result;
  }

  // One round trip on a pooled connection: `build` formats `count` commands into the
  // connection's buffer, they are written at once, and each reply goes to on_reply(i,
  // reply) in order; replies that never came go to on_lost(i, io). A pooled connection that
  // fails before its first reply (stale: the server restarted or closed it) retires every
  // idle connection and is retried once on a fresh one. No lock is held across I/O; the
  // callbacks must not throw.
  template <class Build, class OnReply, class OnLost>
  void exchange(std::size_t count, Build&& build, OnReply&& on_reply, OnLost&& on_lost) const noexcept {
    Io no_connection = Io::failed;
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::unique_ptr<detail::redis::Connection> conn = pool_.take(attempt > 0, &no_connection);
      if (!conn) break;
      try {
        conn->out.clear();
        build(conn->out);
      } catch (...) {  // bad_alloc while formatting: nothing was sent
        pool_.give(std::move(conn));
        break;
      }
      const auto deadline = detail::redis::Clock::now() + options_.command_timeout;
      Io io = detail::redis::send(*conn, deadline);
      std::size_t i = 0;
      if (io == Io::ok) {
        round_trips_.fetch_add(1, std::memory_order_relaxed);
        for (; i < count; ++i) {
          detail::redis::Reply reply;
          io = detail::redis::receive(*conn, deadline, reply);
          if (io != Io::ok) break;
          on_reply(i, std::move(reply));
        }
      }
      if (conn->out.capacity() > (std::size_t{1} << 20)) std::string().swap(conn->out);  // do not pin a huge put's buffer
      if (io == Io::ok) {
        pool_.give(std::move(conn));
        return;
      }
      const bool stale = conn->reused && i == 0 && io == Io::failed;
      conn->broken = true;
      pool_.give(std::move(conn));  // closes it
      if (stale && attempt == 0) {
        pool_.drop_idle();
        continue;
      }
      for (; i < count; ++i) on_lost(i, io);
      return;
    }
    // No connection: timed_out when the connect or its PING got no answer in time (a frozen
    // server, as on the call that found the connection's first timeout), failed otherwise.
    for (std::size_t i = 0; i < count; ++i) on_lost(i, no_connection);
  }

  RedisTierOptions options_;
  mutable detail::redis::Pool pool_;
  std::string address_;
  mutable std::atomic<std::uint64_t> hits_{0}, misses_{0}, rejected_{0}, get_failures_{0}, timeouts_{0}, puts_{0},
      put_failures_{0}, round_trips_{0};
};

static_assert(Tier<RedisTier>);
static_assert(BatchedTier<RedisTier>);

}  // namespace kvfuse
