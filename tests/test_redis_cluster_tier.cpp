// RedisClusterTier against a real Redis Cluster of the test's own (3 primaries, 3
// replicas on loopback ports, tests/redis_cluster.hpp): options and seeds, the slot of a
// key, a 64-chunk batch in one round trip per touched node, values RedisTier reads, garbage
// values, a wrong password, a frozen node, a slot migrated while loads run (ASK and MOVED),
// SCAN over every primary.
#include "redis_cluster.hpp"
#include "tier_test_support.hpp"

#include <doctest/doctest.h>

#include <kvfuse/tier/redis_cluster_tier.hpp>
#include <kvfuse/tier/redis_tier.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;
using namespace std::chrono_literals;

namespace {

std::string error_of(const RedisClusterTierOptions& o) {
  try {
    RedisClusterTier tier(o);
  } catch (const Error& e) {
    return std::string(to_string(e.code())) + " | " + e.what();
  }
  return "no error";
}

std::vector<PrefixHash> hashes_from(std::uint64_t first, std::size_t n) {
  std::vector<PrefixHash> out;
  for (std::size_t i = 0; i < n; ++i) out.push_back(PrefixHash{first + i});
  return out;
}

}  // namespace

TEST_CASE("redis cluster tier: a 64-chunk batch is one round trip per touched primary with every byte right") {
  RedisCluster cluster;
  RedisClusterTier tier(cluster.options());
  const std::vector<PrefixHash> hashes = hashes_from(1000, 64);
  std::set<std::string> owners;
  for (std::size_t i = 0; i < 64; ++i) {
    if (i % 5 != 3) REQUIRE(tier.put(key_of(1000 + i, 2), pattern(i, 16384)));
    owners.insert(tier.owner_of(tier.slot_of(key_of(1000 + i, 2))));
  }
  REQUIRE(owners.size() == 3);
  std::vector<TierView> views(64);
  const RedisClusterTierStats before = tier.stats();
  tier.get_batch(key_of(0, 2), hashes, views);
  const RedisClusterTierStats after = tier.stats();
  CHECK(after.totals.round_trips - before.totals.round_trips == 3);
  for (std::size_t n = 0; n < after.nodes.size(); ++n) {
    CAPTURE(after.nodes[n].address);
    const std::uint64_t trips = after.nodes[n].round_trips - (n < before.nodes.size() ? before.nodes[n].round_trips : 0);
    CHECK(trips == (owners.count(after.nodes[n].address) ? 1 : 0));
  }
  for (std::size_t i = 0; i < 64; ++i) {
    CAPTURE(i);
    if (i % 5 == 3) {
      CHECK(views[i].status() == GetStatus::miss);
    } else {
      REQUIRE(views[i].hit());
      CHECK(same(views[i].bytes(), pattern(i, 16384)));
    }
  }
  CHECK(after.totals.hits - before.totals.hits == 51);
  CHECK(after.totals.misses - before.totals.misses == 13);
  CHECK(after.cluster.moved == 0);
}

TEST_CASE("redis cluster tier: every bad option is an Error naming its value") {
  RedisClusterTierOptions good;
  good.add_seeds("127.0.0.1:1");
  auto with = [&](auto change) {
    RedisClusterTierOptions o = good;
    change(o);
    return error_of(o);
  };
  CHECK(with([](RedisClusterTierOptions& o) { o.seeds.clear(); }).find("invalid_argument | kvfuse: invalid_argument: RedisClusterTierOptions.seeds is empty") == 0);
  CHECK(with([](RedisClusterTierOptions& o) { o.db = 2; }).find("RedisClusterTierOptions.db (2) is not 0") != std::string::npos);
  CHECK(with([](RedisClusterTierOptions& o) { o.key_prefix = "kv*"; }).find("RedisClusterTierOptions.key_prefix 'kv*'") != std::string::npos);
  CHECK(with([](RedisClusterTierOptions& o) { o.ttl = -5ms; }).find("ttl (-5 ms)") != std::string::npos);
  CHECK(with([](RedisClusterTierOptions& o) { o.connect_timeout = 0ms; }).find("connect_timeout (0 ms)") != std::string::npos);
  CHECK(with([](RedisClusterTierOptions& o) { o.command_timeout = -1ms; }).find("command_timeout (-1 ms)") != std::string::npos);
  CHECK(with([](RedisClusterTierOptions& o) { o.max_idle_connections = 0; }).find("max_idle_connections (0)") != std::string::npos);
  CHECK(with([](RedisClusterTierOptions& o) { o.refresh_interval = -1ms; }).find("refresh_interval (-1 ms)") != std::string::npos);
  CHECK(with([](RedisClusterTierOptions& o) { o.seeds[0].port = 0; }).find("RedisClusterTierOptions.seeds: redis address '127.0.0.1:0'") != std::string::npos);
  for (const char* bad : {"", "h:1,", "h:1,,h:2", "h:1,localhost", "unix:", "h:70000"}) {
    CAPTURE(bad);
    try {
      RedisClusterTierOptions o;
      o.add_seeds(bad);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      CHECK(std::string(e.what()).find("'") != std::string::npos);
    }
  }
  RedisClusterTierOptions three;
  three.add_seeds("10.0.0.1:7000,unix:/run/redis.sock,[::1]:7002");
  REQUIRE(three.seeds.size() == 3);
  CHECK(three.seeds[0] == RedisAddress{"10.0.0.1", 7000, ""});
  CHECK(three.seeds[1].unix_socket == "/run/redis.sock");
  CHECK(three.seeds[2] == RedisAddress{"::1", 7002, ""});
}

TEST_CASE("redis cluster tier: seeds that cannot serve a map are an Error naming each one and why") {
  RedisClusterTierOptions o;
  o.add_seeds("127.0.0.1:1,unix:/nonexistent/kvfuse-cluster.sock");
  o.connect_timeout = 200ms;
  const std::string e = error_of(o);
  CHECK(e.find("io_failure") == 0);
  CHECK(e.find("127.0.0.1:1: ") != std::string::npos);
  CHECK(e.find("unix:/nonexistent/kvfuse-cluster.sock: ") != std::string::npos);
}

TEST_CASE("redis cluster tier: a key's slot is the cluster's own, hash tags included") {
  RedisCluster cluster;
  for (const std::string prefix : {"kvfuse:", "{tag}:", "a{b}c:", "x{}y:"}) {
    RedisClusterTier tier(cluster.options(prefix));
    for (std::uint64_t h = 0; h < 40; ++h) {
      const TierKey k = key_of(h * 7919, static_cast<std::uint32_t>(h % 4), h % 3 ? EntryKind::kv_chunk : EntryKind::state);
      CAPTURE(tier.key_name(k));
      CHECK(std::to_string(tier.slot_of(k)) == cluster.text(0, {"CLUSTER", "KEYSLOT", tier.key_name(k)}));
      CHECK(tier.owner_of(tier.slot_of(k)) == cluster.address(cluster.owner_of(tier.slot_of(k))));
    }
  }
  // A unix socket seed serves the first map too (the primaries it names are TCP).
}

TEST_CASE("redis cluster tier: values are RedisTier's, so a RedisTier on an all-slots primary reads them") {
  RedisClusterSpec one;
  one.primaries = 1;
  one.replicas_per_primary = 0;
  RedisCluster cluster(one);
  RedisClusterTier tier(cluster.options("shared:"));
  RedisTierOptions single;
  single.set_address(cluster.address(0));
  single.key_prefix = "shared:";
  RedisTier plain(single);
  const TierKey key = key_of(0xfeed, 3, EntryKind::kv_chunk, 0x1234, 8);
  CHECK(tier.key_name(key) == plain.key_name(key));
  REQUIRE(tier.put(key, pattern(9, 3000)));
  const TierView v = plain.get(key, {});
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), pattern(9, 3000)));
  REQUIRE(plain.put(key_of(5), pattern(5, 100)));
  const TierView w = tier.get(key_of(5), {});
  REQUIRE(w.hit());
  CHECK(same(w.bytes(), pattern(5, 100)));
  CHECK(tier.contains(key_of(5)));
  CHECK(tier.erase(key_of(5)));
  CHECK_FALSE(tier.contains(key_of(5)));
  CHECK(plain.get(key_of(5), {}).status() == GetStatus::miss);
}

TEST_CASE("redis cluster tier: garbage, another key's entry and another type under a key are counted misses") {
  RedisCluster cluster;
  RedisClusterTier tier(cluster.options());
  const TierKey key = key_of(42, 1);
  REQUIRE(tier.put(key, pattern(42, 4096)));
  REQUIRE(tier.put(key_of(43, 1), pattern(43, 4096)));
  const std::size_t owner = cluster.owner_of(tier.slot_of(key));
  const std::string name = tier.key_name(key);
  auto expect_rejected = [&](const char* what) {
    CAPTURE(what);
    const auto before = tier.stats().totals.rejected;
    const TierView v = tier.get(key, {});
    CHECK(v.status() == GetStatus::miss);
    CHECK(v.bytes().empty());
    CHECK(tier.stats().totals.rejected == before + 1);
  };
  const std::string garbage(4176, 'g');
  REQUIRE(cluster.text(owner, {"SET", name, garbage}) == "OK");
  expect_rejected("garbage");
  // rank 1's hash 43 entry copied under hash 42's key: the key echo refuses it.
  const std::size_t other = cluster.owner_of(tier.slot_of(key_of(43, 1)));
  const detail::redis::Reply value = cluster.command(other, {"GET", tier.key_name(key_of(43, 1))});
  REQUIRE(value);
  REQUIRE(value->type == REDIS_REPLY_STRING);
  REQUIRE(cluster.text(owner, {"SET", name, std::string(value->str, value->len)}) == "OK");
  expect_rejected("another key's entry");
  REQUIRE(cluster.text(owner, {"DEL", name}) == "1");
  REQUIRE(cluster.text(owner, {"RPUSH", name, "x"}) == "1");
  expect_rejected("a list under the key");
  CHECK(tier.stats().totals.get_failures == 0);
  CHECK(tier.stats().totals.hits == 0);
}

TEST_CASE("redis cluster tier: a wrong password is an Error that never quotes it, the right one serves") {
  RedisClusterSpec spec;
  spec.password = "s3cret";
  RedisCluster cluster(spec);
  RedisClusterTierOptions o = cluster.options();
  o.password = "wrong-one";
  const std::string wrong = error_of(o);
  CHECK(wrong.find("io_failure") == 0);
  CHECK(wrong.find("AUTH refused") != std::string::npos);
  CHECK(wrong.find("wrong-one") == std::string::npos);
  o.password.clear();
  CHECK(error_of(o).find("io_failure") == 0);  // NOAUTH: CLUSTER SLOTS refused
  RedisClusterTier tier(cluster.options());
  for (std::uint64_t h = 0; h < 16; ++h) REQUIRE(tier.put(key_of(h), pattern(h, 512)));
  for (std::uint64_t h = 0; h < 16; ++h) {
    const TierView v = tier.get(key_of(h), {});
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), pattern(h, 512)));
  }
}

TEST_CASE("redis cluster tier: a frozen primary times its keys out, not failed, the others answer, and it serves once thawed") {
  RedisClusterSpec spec;
  spec.node_timeout_ms = 60000;  // no failover while it is frozen
  RedisCluster cluster(spec);
  RedisClusterTierOptions o = cluster.options();
  o.command_timeout = 200ms;
  RedisClusterTier tier(o);
  const std::vector<PrefixHash> hashes = hashes_from(500, 48);
  for (std::size_t i = 0; i < hashes.size(); ++i) REQUIRE(tier.put(key_of(500 + i), pattern(i, 2048)));
  const std::size_t frozen = cluster.owner_of(tier.slot_of(key_of(500)));
  const std::string frozen_at = cluster.address(frozen);
  const RedisClusterTierStats before = tier.stats();
  cluster.pause(frozen);
  for (int round = 0; round < 3; ++round) {  // the pooled connection, then each new one's PING
    CAPTURE(round);
    std::vector<TierView> views(hashes.size());
    tier.get_batch(key_of(0), hashes, views);
    std::size_t timed_out = 0, hits = 0;
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      const bool on_frozen = tier.owner_of(tier.slot_of(key_of(500 + i))) == frozen_at;
      if (on_frozen) {
        CHECK(views[i].status() == GetStatus::timed_out);
        ++timed_out;
      } else {
        REQUIRE(views[i].hit());
        CHECK(same(views[i].bytes(), pattern(i, 2048)));
        ++hits;
      }
    }
    CHECK(timed_out > 0);
    CHECK(hits > 0);
  }
  CHECK_FALSE(tier.put(key_of(500), pattern(1, 10)));
  const RedisClusterTierStats during = tier.stats();
  CHECK(during.totals.get_failures == before.totals.get_failures);
  CHECK(during.totals.connect_failures == before.totals.connect_failures);  // nothing refused
  CHECK(during.totals.timeouts > before.totals.timeouts);
  for (const RedisClusterNodeStats& n : during.nodes)
    if (n.address == frozen_at) CHECK(n.timeouts >= 4);
  cluster.resume(frozen);
  const TierView v = tier.get(key_of(500), {});
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), pattern(0, 2048)));
}

TEST_CASE("redis cluster tier: a slot migrated while loads run takes ASK then MOVED and never serves a wrong byte") {
  RedisCluster cluster;
  // One hash tag in the prefix: every key of this tier is in one slot, the one migrated.
  RedisClusterTier tier(cluster.options("{migrating}:"));
  constexpr std::size_t n = 32;
  const std::vector<PrefixHash> hashes = hashes_from(7000, n);
  for (std::size_t i = 0; i < n; ++i) REQUIRE(tier.put(key_of(7000 + i), pattern(i, 8192)));
  const std::uint16_t slot = tier.slot_of(key_of(7000));
  const std::size_t source = cluster.owner_of(slot);
  std::size_t target = cluster.size();
  for (const std::size_t p : cluster.primaries())
    if (p != source) target = p;
  REQUIRE(target < cluster.size());
  const std::string s = std::to_string(slot);

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> wrong{0}, hits{0}, loads{0};
  // Stopped and joined however the case ends (a failed REQUIRE throws past the join below).
  struct Joiner {
    std::atomic<bool>& stop;
    std::thread& thread;
    ~Joiner() {
      stop = true;
      if (thread.joinable()) thread.join();
    }
  };
  std::thread loader;
  const Joiner joiner{stop, loader};
  loader = std::thread([&] {
    RedisClusterTier own(cluster.options("{migrating}:"));  // a second engine's tier
    while (!stop.load()) {
      std::vector<TierView> views(n);
      own.get_batch(key_of(0), hashes, views);
      for (std::size_t i = 0; i < n; ++i)
        if (views[i].hit()) {
          hits.fetch_add(1);
          if (!same(views[i].bytes(), pattern(i, 8192))) wrong.fetch_add(1);
        }
      loads.fetch_add(1);
    }
  });
  auto all_hit = [&](const char* when) {
    CAPTURE(when);
    std::vector<TierView> views(n);
    tier.get_batch(key_of(0), hashes, views);
    for (std::size_t i = 0; i < n; ++i) {
      CAPTURE(i);
      REQUIRE(views[i].hit());
      CHECK(same(views[i].bytes(), pattern(i, 8192)));
    }
  };
  REQUIRE(cluster.text(target, {"CLUSTER", "SETSLOT", s, "IMPORTING", cluster.node_id(source)}) == "OK");
  REQUIRE(cluster.text(source, {"CLUSTER", "SETSLOT", s, "MIGRATING", cluster.node_id(target)}) == "OK");
  // Half the keys move: the source answers ASK for them, and serves the rest itself.
  std::vector<std::string> migrate = {"MIGRATE", "127.0.0.1", std::to_string(cluster.port(target)), "", "0", "5000", "KEYS"};
  for (std::size_t i = 0; i < n / 2; ++i) migrate.push_back(tier.key_name(key_of(7000 + i)));
  REQUIRE(cluster.text(source, migrate) == "OK");
  all_hit("half migrated");
  const RedisClusterTierStats asked = tier.stats();
  CHECK(asked.cluster.asks == n / 2);
  CHECK(asked.cluster.moved == 0);
  CHECK(tier.owner_of(slot) == cluster.address(source));  // ASK leaves the map alone
  // The rest move and the slot changes hands: the source answers MOVED.
  migrate.resize(7);
  for (std::size_t i = n / 2; i < n; ++i) migrate.push_back(tier.key_name(key_of(7000 + i)));
  REQUIRE(cluster.text(source, migrate) == "OK");
  const std::string target_id = cluster.node_id(target);
  REQUIRE(cluster.text(target, {"CLUSTER", "SETSLOT", s, "NODE", target_id}) == "OK");
  REQUIRE(cluster.text(source, {"CLUSTER", "SETSLOT", s, "NODE", target_id}) == "OK");
  for (const std::size_t p : cluster.primaries()) (void)cluster.text(p, {"CLUSTER", "SETSLOT", s, "NODE", target_id});
  all_hit("moved");
  const RedisClusterTierStats moved = tier.stats();
  CHECK(moved.cluster.moved >= 1);
  CHECK(moved.cluster.redirect_failures == 0);
  CHECK(tier.owner_of(slot) == cluster.address(target));  // patched, then refreshed
  all_hit("after the map changed");
  CHECK(tier.stats().cluster.moved == moved.cluster.moved);  // no more redirections
  CHECK(tier.stats().totals.round_trips - moved.totals.round_trips <= 2);  // the refresh and the batch
  const std::uint64_t seen = loads.load();
  cluster.wait_for([&] { return loads.load() > seen + 2; }, "the loader to load after the move");
  stop = true;
  loader.join();
  CHECK(wrong.load() == 0);
  CHECK(hits.load() > 0);
}

TEST_CASE("redis cluster tier: keys walks every primary with SCAN") {
  RedisCluster cluster({3, 1, "", 1000, {"--rename-command", "KEYS", ""}});
  RedisClusterTier tier(cluster.options("scan:"));
  std::set<TierKey> states;
  for (std::uint32_t rank = 0; rank < 4; ++rank)
    for (std::uint64_t h = 0; h < 300; ++h) {
      const TierKey k = key_of(h, rank, EntryKind::state);
      REQUIRE(tier.put(k, pattern(h, 8)));
      states.insert(k);
    }
  REQUIRE(tier.put(key_of(5, 0, EntryKind::kv_chunk), pattern(5, 8)));
  const std::vector<TierKey> found = tier.keys(EntryKind::state);
  CHECK(std::set<TierKey>(found.begin(), found.end()) == states);
  CHECK(found.size() == states.size());
  const std::vector<TierKey> chunks = tier.keys(EntryKind::kv_chunk);
  REQUIRE(chunks.size() == 1);
}
