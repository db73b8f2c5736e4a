// RedisTier against a real redis-server of the test's own: options, keys and values (the
// DiskTier entry format), batched gets in one round trip, foreign and corrupt values,
// timeouts, a killed and a restarted server, maxmemory eviction and OOM, SCAN.
#include "redis_test_support.hpp"
#include "tier_test_support.hpp"

#include <kvfuse/testing/delay_tier.hpp>
#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/tier/redis_tier.hpp>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;
using namespace std::chrono_literals;

namespace {

std::string error_of(const RedisTierOptions& o) {
  try {
    RedisTier tier(o);
  } catch (const Error& e) {
    return std::string(to_string(e.code())) + " | " + e.what();
  }
  return "no error";
}

std::string_view chars(std::span<const std::byte> b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

std::vector<std::byte> value_of(const RedisServer& server, const std::string& key) {
  const auto r = server.command({"GET", key});
  REQUIRE(r);
  REQUIRE(r->type == REDIS_REPLY_STRING);
  std::vector<std::byte> out(r->len);
  std::memcpy(out.data(), r->str, r->len);
  return out;
}

void set_raw(const RedisServer& server, const std::string& key, std::span<const std::byte> bytes) {
  const auto r = server.command({"SET", key, chars(bytes)});
  REQUIRE(r);
  REQUIRE(r->type == REDIS_REPLY_STATUS);
}

}  // namespace

static_assert(Tier<RedisTier>);
static_assert(BatchedTier<RedisTier>);
static_assert(!BatchedTier<DiskTier>);
// A wrapper keeps what it wraps: batched over a batched tier, not over a plain one.
static_assert(BatchedTier<DelayTier<RedisTier>>);
static_assert(Tier<DelayTier<MemoryTier<>>> && !BatchedTier<DelayTier<MemoryTier<>>>);

TEST_CASE("redis tier: every bad option is an Error naming its value") {
  RedisTierOptions good;
  good.unix_socket = "/nonexistent/redis.sock";
  auto with = [&](auto change) {
    RedisTierOptions o = good;
    change(o);
    return error_of(o);
  };
  CHECK(with([](RedisTierOptions& o) { o.unix_socket.clear(), o.port = 0; }).find("invalid_argument | kvfuse: invalid_argument: RedisTierOptions.port (0)") == 0);
  CHECK(with([](RedisTierOptions& o) { o.unix_socket.clear(), o.port = 70000; }).find("port (70000)") != std::string::npos);
  CHECK(with([](RedisTierOptions& o) { o.unix_socket.clear(), o.host.clear(); }).find("host is empty") != std::string::npos);
  CHECK(with([](RedisTierOptions& o) { o.unix_socket = std::string(120, 'x'); }).find("longer than 107") != std::string::npos);
  CHECK(with([](RedisTierOptions& o) { o.db = -2; }).find("db (-2)") != std::string::npos);
  CHECK(with([](RedisTierOptions& o) { o.key_prefix = "kv*"; }).find("key_prefix 'kv*'") != std::string::npos);
  CHECK(with([](RedisTierOptions& o) { o.key_prefix = "a b"; }).find("key_prefix 'a b'") != std::string::npos);
  CHECK(with([](RedisTierOptions& o) { o.key_prefix = std::string(201, 'p'); }).find("longer than 200") != std::string::npos);
  CHECK(with([](RedisTierOptions& o) { o.ttl = -5ms; }).find("ttl (-5 ms)") != std::string::npos);
  CHECK(with([](RedisTierOptions& o) { o.connect_timeout = 0ms; }).find("connect_timeout (0 ms)") != std::string::npos);
  CHECK(with([](RedisTierOptions& o) { o.command_timeout = -1ms; }).find("command_timeout (-1 ms)") != std::string::npos);
  CHECK(with([](RedisTierOptions& o) { o.max_idle_connections = 0; }).find("max_idle_connections (0)") != std::string::npos);
}

TEST_CASE("redis tier: set_address reads unix:PATH and HOST:PORT and refuses anything else by name") {
  const RedisTierOptions defaults;
  RedisTierOptions on_socket;
  on_socket.set_address("unix:/run/redis/redis.sock");
  CHECK(on_socket.unix_socket == "/run/redis/redis.sock");
  CHECK(on_socket.host == defaults.host);
  CHECK(on_socket.key_prefix == defaults.key_prefix);
  RedisTierOptions on_tcp = on_socket;
  on_tcp.set_address("cache.internal:6380");  // back to TCP: the socket is cleared
  CHECK(on_tcp.unix_socket.empty());
  CHECK(on_tcp.host == "cache.internal");
  CHECK(on_tcp.port == 6380);
  // Split at the last colon: an IPv6 host keeps its own.
  CHECK(parse_redis_address("::1:1") == RedisAddress{"::1", 1, ""});
  CHECK(parse_redis_address("h:65535").port == 65535);
  for (const char* bad : {"", "unix:", "localhost", "localhost:", ":6379", "localhost:0", "localhost:65536",
                          "localhost:6379x", "localhost:-1", "localhost: 6379", "localhost:+80"}) {
    CAPTURE(bad);
    try {
      RedisTierOptions o;
      o.set_address(bad);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      CHECK(std::string(e.what()).find("'" + std::string(bad) + "'") != std::string::npos);
    }
  }
}

TEST_CASE("redis tier: the address a tier reports parses back to options that reach the same server") {
  RedisServer server;
  RedisTier tier(server.options());
  RedisTierOptions again;
  again.set_address(tier.address());
  CHECK(again.unix_socket == server.socket());
  again.key_prefix = tier.options().key_prefix;
  RedisTier second(again);
  REQUIRE(tier.put(key_of(5, 1), pattern(3, 256)));
  CHECK(second.get(key_of(5, 1), {}).status() == GetStatus::hit);
}

TEST_CASE("redis tier: a server that cannot be reached is an Error with its address") {
  RedisTierOptions o;
  o.unix_socket = "/nonexistent/kvfuse-redis.sock";
  o.connect_timeout = 200ms;
  const std::string unix_error = error_of(o);
  CHECK(unix_error.find("io_failure") == 0);
  CHECK(unix_error.find("unix:/nonexistent/kvfuse-redis.sock") != std::string::npos);
  o.unix_socket.clear();
  o.host = "127.0.0.1";
  o.port = 1;  // nothing listens on TCP port 1
  const std::string tcp_error = error_of(o);
  CHECK(tcp_error.find("io_failure") == 0);
  CHECK(tcp_error.find("127.0.0.1:1") != std::string::npos);
}

TEST_CASE("redis tier: a server that closes while a new connection sends AUTH fails the connect, not the process") {
  // Not redis: a listener that accepts one connection, reads nothing and closes it after
  // 50 ms. The 4 MiB password fills the socket's buffer, so the AUTH write is still blocked
  // when the peer goes: the write fails with EPIPE and the kernel raises SIGPIPE, which
  // would kill the process (seen in a test whose server was killed while a lane
  // reconnected). The tier must report a failed connect instead.
  TempDir dir("kvfuse-redis-closer");
  const std::string path = (dir.path / "closer.sock").string();
  const int listener = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(listener >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  REQUIRE(path.size() < sizeof addr.sun_path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  REQUIRE(::bind(listener, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(listener, 4) == 0);
  std::thread closer([listener] {
    const int c = ::accept(listener, nullptr, nullptr);
    std::this_thread::sleep_for(50ms);
    if (c >= 0) ::close(c);
  });
  RedisTierOptions o;
  o.unix_socket = path;
  o.password = std::string(std::size_t{4} << 20, 'p');
  o.connect_timeout = 5000ms;
  o.command_timeout = 5000ms;
  const std::string error = error_of(o);
  closer.join();
  ::close(listener);
  CHECK(error.find("io_failure") == 0);
}

TEST_CASE("redis tier: AUTH and SELECT come from the options and a refusal is an Error") {
  RedisServer server({"--requirepass", "s3cret"});
  RedisTierOptions o = server.options();
  const std::string no_password = error_of(o);
  CHECK(no_password.find("io_failure") == 0);
  CHECK(no_password.find(server.socket()) != std::string::npos);
  o.password = "wrong";
  const std::string wrong = error_of(o);
  CHECK(wrong.find("AUTH refused") != std::string::npos);
  CHECK(wrong.find("wrong") == std::string::npos);  // the password is never quoted
  o.password = "s3cret";
  o.db = 3;
  RedisTier tier(o);
  const TierKey key = key_of(5);
  REQUIRE(tier.put(key, pattern(5, 100)));
  const auto exists = [&](std::string_view db) {
    const timeval t{2, 0};
    redisContext* ctx = redisConnectUnixWithTimeout(server.socket().c_str(), t);
    REQUIRE(ctx != nullptr);
    redisReply* auth = static_cast<redisReply*>(redisCommand(ctx, "AUTH s3cret"));
    freeReplyObject(auth);
    redisReply* sel = static_cast<redisReply*>(redisCommand(ctx, "SELECT %b", db.data(), db.size()));
    freeReplyObject(sel);
    const std::string name = tier.key_name(key);
    redisReply* r = static_cast<redisReply*>(redisCommand(ctx, "EXISTS %b", name.data(), name.size()));
    const long long n = r != nullptr ? r->integer : -1;
    freeReplyObject(r);
    redisFree(ctx);
    return n;
  };
  CHECK(exists("3") == 1);
  CHECK(exists("0") == 0);
  o.db = 99;  // the server has 16 databases
  CHECK(error_of(o).find("SELECT 99 refused") != std::string::npos);
}

TEST_CASE("redis tier: keys spell prefix model hash world size rank and kind and values are DiskTier files") {
  RedisServer server;
  RedisTier tier(server.options("deploy-a:"));
  const TierKey key = key_of(0xfeedULL, 3, EntryKind::kv_chunk, 0x1234, 8);
  CHECK(tier.key_name(key) == "deploy-a:kv-0000000000001234-000000000000feed-00000008-00000003");
  TierKey state = key;
  state.kind = EntryKind::state;
  CHECK(tier.key_name(state) == "deploy-a:st-0000000000001234-000000000000feed-00000008-00000003");

  const auto payload = pattern(9, 3000);
  REQUIRE(tier.put(key, payload));
  const std::vector<std::byte> value = value_of(server, tier.key_name(key));
  // The value is byte for byte what DiskTier writes to the entry's file.
  TempDir dir;
  {
    DiskTier disk(dir.path);
    REQUIRE(disk.put(key, payload));
    std::ifstream in(disk.path_of(key), std::ios::binary);
    std::vector<char> file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(file.size() == value.size());
    CHECK(std::memcmp(file.data(), value.data(), value.size()) == 0);
  }
  CHECK(value.size() == detail::disk::header_bytes + payload.size());
  const auto header = detail::disk::encode_entry_header(key, payload);
  CHECK(std::memcmp(value.data(), header.data(), header.size()) == 0);

  const TierView v = tier.get(key, {});
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), payload));
}

TEST_CASE("redis tier: models ranks world sizes and kinds never read each other") {
  RedisServer server;
  RedisTier tier(server.options());
  const TierKey base = key_of(77, 1, EntryKind::kv_chunk, 7, 4);
  REQUIRE(tier.put(base, pattern(1, 512)));
  for (TierKey other : {key_of(77, 2), key_of(77, 1, EntryKind::state), key_of(77, 1, EntryKind::kv_chunk, 8),
                        key_of(77, 1, EntryKind::kv_chunk, 7, 2), key_of(78, 1)}) {
    CHECK(tier.get(other, {}).status() == GetStatus::miss);
    CHECK_FALSE(tier.contains(other));
  }
  CHECK(tier.contains(base));
  CHECK(tier.erase(base));
  CHECK_FALSE(tier.erase(base));
  CHECK(tier.get(base, {}).status() == GetStatus::miss);
  // Another prefix on the same server is another namespace.
  RedisTier other_prefix(server.options("other:"));
  REQUIRE(tier.put(base, pattern(2, 64)));
  CHECK(other_prefix.get(base, {}).status() == GetStatus::miss);
  CHECK(tier.stats().rejected == 0);
}

TEST_CASE("redis tier: a 64-chunk batch is one round trip with hit or miss per chunk") {
  RedisServer server;
  RedisTier tier(server.options());
  const TierKey first = key_of(0, 2);
  std::vector<PrefixHash> hashes;
  for (std::uint64_t i = 0; i < 64; ++i) {
    hashes.push_back(PrefixHash{1000 + i});
    if (i % 5 != 3) REQUIRE(tier.put(key_of(1000 + i, 2), pattern(i, 16384)));
  }
  std::vector<TierView> views(64);
  const auto before = tier.stats();
  tier.get_batch(first, hashes, views);
  const auto after = tier.stats();
  CHECK(after.round_trips - before.round_trips == 1);
  for (std::uint64_t i = 0; i < 64; ++i) {
    CAPTURE(i);
    if (i % 5 == 3) {
      CHECK(views[i].status() == GetStatus::miss);
    } else {
      REQUIRE(views[i].hit());
      CHECK(same(views[i].bytes(), pattern(i, 16384)));
    }
  }
  CHECK(after.hits - before.hits == 51);
  CHECK(after.misses - before.misses == 13);
  // The views own their replies: they outlive the next batch and the tier's other calls.
  std::vector<TierView> again(64);
  tier.get_batch(first, hashes, again);
  CHECK(same(views[0].bytes(), pattern(0, 16384)));
  CHECK(tier.stats().connects == 1);  // one connection served every call
}

TEST_CASE("redis tier: a DelayTier over it stays batched: a 16-chunk batch is one delay and one round trip") {
  RedisServer server;
  DelayTier<RedisTier> tier(std::chrono::milliseconds(1), server.options());
  std::vector<PrefixHash> hashes;
  for (std::uint64_t i = 0; i < 16; ++i) {
    hashes.push_back(PrefixHash{3000 + i});
    REQUIRE(tier.put(key_of(3000 + i, 2), pattern(i, 4096)));
  }
  std::vector<TierView> views(16);
  const auto before = tier.inner().stats().round_trips;
  tier.get_batch(key_of(0, 2), hashes, views);
  CHECK(tier.inner().stats().round_trips - before == 1);
  for (std::uint64_t i = 0; i < 16; ++i) {
    REQUIRE(views[i].hit());
    CHECK(same(views[i].bytes(), pattern(i, 4096)));
  }
}

TEST_CASE("redis tier: a foreign truncated or corrupt value is a counted miss and never served") {
  RedisServer server;
  RedisTier tier(server.options());
  const TierKey key = key_of(42, 1);
  const auto payload = pattern(42, 4096);
  REQUIRE(tier.put(key, payload));
  const std::string name = tier.key_name(key);
  const std::vector<std::byte> good = value_of(server, name);
  REQUIRE(tier.get(key, {}).hit());

  auto expect_rejected = [&](const char* what) {
    CAPTURE(what);
    const auto before = tier.stats().rejected;
    const TierView v = tier.get(key, {});
    CHECK(v.status() == GetStatus::miss);
    CHECK(v.bytes().empty());
    CHECK(tier.stats().rejected == before + 1);
  };
  set_raw(server, name, pattern(7, 4176));  // garbage of the right length
  expect_rejected("garbage");
  set_raw(server, name, std::span(good).first(good.size() - 1));
  expect_rejected("truncated");
  set_raw(server, name, std::span(good).first(40));
  expect_rejected("shorter than a header");
  std::vector<std::byte> trailing = good;
  trailing.push_back(std::byte{0});
  set_raw(server, name, trailing);
  expect_rejected("trailing byte");
  std::vector<std::byte> flipped = good;
  flipped[detail::disk::header_bytes + 100] ^= std::byte{1};
  set_raw(server, name, flipped);
  expect_rejected("payload bit flip");
  std::vector<std::byte> bad_header = good;
  bad_header[20] ^= std::byte{1};
  set_raw(server, name, bad_header);
  expect_rejected("header bit flip");
  // A valid entry of another key (rank 2's slice) copied under rank 1's key.
  REQUIRE(tier.put(key_of(42, 2), payload));
  set_raw(server, name, value_of(server, tier.key_name(key_of(42, 2))));
  expect_rejected("another key's entry");
  REQUIRE(server.command({"DEL", name}));
  REQUIRE(server.command({"RPUSH", name, "x"}));
  expect_rejected("a list under the key");
  // A batch rejects per chunk.
  REQUIRE(server.command({"DEL", name}));
  REQUIRE(tier.put(key, payload));
  set_raw(server, tier.key_name(key_of(43, 1)), pattern(1, 10));
  const std::array<PrefixHash, 2> hashes{PrefixHash{42}, PrefixHash{43}};
  std::array<TierView, 2> views;
  tier.get_batch(key, hashes, views);
  CHECK(views[0].hit());
  CHECK(views[1].status() == GetStatus::miss);
  CHECK(tier.stats().hits == 2);
  CHECK(tier.stats().get_failures == 0);
}

TEST_CASE("redis tier: entries carry the TTL of the options") {
  RedisServer server;
  RedisTierOptions o = server.options();
  o.ttl = 60000ms;
  RedisTier tier(o);
  REQUIRE(tier.put(key_of(1), pattern(1, 10)));
  const auto pttl = server.command({"PTTL", tier.key_name(key_of(1))});
  REQUIRE(pttl);
  CHECK(pttl->integer > 50000);
  CHECK(pttl->integer <= 60000);
  RedisTier forever(server.options("forever:"));
  REQUIRE(forever.put(key_of(1), pattern(1, 10)));
  CHECK(server.command({"PTTL", forever.key_name(key_of(1))})->integer == -1);
}

TEST_CASE("redis tier: a paused server times out on every call, not only the first, and a later call reconnects") {
  RedisServer server;
  RedisTierOptions o = server.options();
  o.command_timeout = 200ms;
  RedisTier tier(o);
  REQUIRE(tier.put(key_of(1), pattern(1, 1000)));
  const RedisTierStats before = tier.stats();
  server.pause();
  const auto start = std::chrono::steady_clock::now();
  // The pooled connection waits its timeout. Every later call opens a new connection, which
  // the kernel accepts for the frozen server, and whose PING gets no answer: timed out too,
  // never failed (a failure says the server refused or went away, which it did not).
  CHECK(tier.get(key_of(1), {}).status() == GetStatus::timed_out);
  std::array<PrefixHash, 3> hashes{PrefixHash{1}, PrefixHash{2}, PrefixHash{3}};
  std::array<TierView, 3> views;
  tier.get_batch(key_of(1), hashes, views);
  for (const TierView& v : views) CHECK(v.status() == GetStatus::timed_out);
  CHECK(tier.get(key_of(1), {}).status() == GetStatus::timed_out);
  CHECK_FALSE(tier.put(key_of(2), pattern(2, 1000)));
  CHECK(tier.get(key_of(2), {}).status() == GetStatus::timed_out);
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(waited < 4s);  // five calls, each bounded by about twice the command timeout
  const RedisTierStats during = tier.stats();
  CHECK(during.timeouts - before.timeouts == 6);
  CHECK(during.get_failures == before.get_failures);
  CHECK(during.connect_failures == before.connect_failures);  // nothing refused a connection
  CHECK(during.connect_timeouts - before.connect_timeouts == 4);  // one per call after the first
  server.resume();
  const TierView v = tier.get(key_of(1), {});
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), pattern(1, 1000)));
  CHECK(tier.stats().dropped_connections >= 1);
}

TEST_CASE("redis tier: a killed server gives failures and a restarted empty one misses then serves") {
  RedisServer server;
  RedisTier tier(server.options());
  REQUIRE(tier.put(key_of(1), pattern(1, 1000)));
  server.kill();
  CHECK(tier.get(key_of(1), {}).status() == GetStatus::failed);
  CHECK_FALSE(tier.put(key_of(2), pattern(2, 10)));
  CHECK_FALSE(tier.contains(key_of(1)));
  CHECK_FALSE(tier.erase(key_of(1)));
  CHECK(tier.stats().connect_failures > 0);
  CHECK(tier.stats().connect_timeouts == 0);  // refused, not unanswered
  server.start();  // empty: nothing survived
  CHECK(tier.get(key_of(1), {}).status() == GetStatus::miss);
  REQUIRE(tier.put(key_of(1), pattern(3, 1000)));
  const TierView v = tier.get(key_of(1), {});
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), pattern(3, 1000)));
  // A restart while a connection sits idle in the pool: the stale connection is retried
  // once on a fresh one, so the caller sees the truth (a miss), not a failure.
  server.restart_empty();
  CHECK(tier.get(key_of(1), {}).status() == GetStatus::miss);
  CHECK(tier.put(key_of(1), pattern(4, 10)));
}

TEST_CASE("redis tier: maxmemory with LRU eviction makes evicted entries misses") {
  RedisServer server({"--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"});
  RedisTier tier(server.options());
  constexpr std::uint64_t n = 96;
  for (std::uint64_t i = 0; i < n; ++i) CHECK(tier.put(key_of(i), pattern(i, 65536)));  // 6 MiB into 3 MiB
  std::size_t hits = 0, misses = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    const TierView v = tier.get(key_of(i), {});
    if (v.hit()) {
      ++hits;
      CHECK(same(v.bytes(), pattern(i, 65536)));
    } else {
      CHECK(v.status() == GetStatus::miss);
      ++misses;
    }
  }
  CHECK(hits > 0);
  CHECK(misses > 0);
  CHECK(tier.stats().put_failures == 0);
  CHECK(tier.stats().get_failures == 0);
  CHECK(tier.stats().rejected == 0);
}

TEST_CASE("redis tier: a put the server refuses under maxmemory noeviction is a failed save") {
  RedisServer server({"--maxmemory", "2mb", "--maxmemory-policy", "noeviction"});
  RedisTier tier(server.options());
  std::uint64_t refused = 0, i = 0;
  for (; i < 200 && refused == 0; ++i)
    if (!tier.put(key_of(i), pattern(i, 65536))) refused = i + 1;
  REQUIRE(refused != 0);
  CHECK(tier.stats().put_failures == 1);
  CHECK(tier.get(key_of(refused - 1), {}).status() == GetStatus::miss);  // nothing half-stored
  const TierView earlier = tier.get(key_of(0), {});  // what was stored is still served
  REQUIRE(earlier.hit());
  CHECK(same(earlier.bytes(), pattern(0, 65536)));
}

TEST_CASE("redis tier: keys walks the prefix with SCAN and the server never sees KEYS") {
  RedisServer server({"--rename-command", "KEYS", ""});  // KEYS does not exist on this server
  RedisTier tier(server.options("scan:"));
  std::set<TierKey> states;
  for (std::uint32_t rank = 0; rank < 4; ++rank)
    for (std::uint64_t h = 0; h < 700; ++h) {  // more than one SCAN page
      const TierKey k = key_of(h, rank, EntryKind::state);
      REQUIRE(tier.put(k, pattern(h, 8)));
      states.insert(k);
    }
  REQUIRE(tier.put(key_of(5, 0, EntryKind::kv_chunk), pattern(5, 8)));
  set_raw(server, "scan:st-not-an-entry", pattern(1, 8));
  RedisTier other(server.options("elsewhere:"));
  REQUIRE(other.put(key_of(6, 0, EntryKind::state), pattern(6, 8)));

  const auto before = tier.stats().round_trips;
  const std::vector<TierKey> found = tier.keys(EntryKind::state);
  CHECK(tier.stats().round_trips - before > 1);
  CHECK(std::set<TierKey>(found.begin(), found.end()) == states);
  CHECK(found.size() == states.size());
  const std::vector<TierKey> chunks = tier.keys(EntryKind::kv_chunk);
  REQUIRE(chunks.size() == 1);
  CHECK(chunks[0] == key_of(5, 0, EntryKind::kv_chunk));
  server.kill();
  CHECK_THROWS_AS((void)tier.keys(EntryKind::state), Error);
}
