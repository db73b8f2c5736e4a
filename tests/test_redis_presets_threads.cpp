// The three presets over RedisTier, 4 ranks as threads, against a redis-server of the test's
// own: store, load back, every byte checked; a server killed or paused mid-load (R1); a
// second engine that re-seeds from the shared tier with SCAN (R18); a server restarted empty.
// Built and run under ThreadSanitizer as well (the *_threads.cpp rule).
#include "redis_engine_harness.hpp"
#include "redis_test_support.hpp"

#include <kvfuse/engine/index_consistency.hpp>
#include <kvfuse/tier/redis_tier.hpp>

#include <atomic>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

/// Makes RedisTiers on `server`.
auto tiers_on(const RedisServer& server) {
  return [&server] { return std::make_unique<RedisTier>(server.options()); };
}

/// Store a 4-chunk prompt, wipe the device, load it back, check every byte on every rank;
/// then a load of a prompt nobody stored fails once.
template <class Conn>
void run_preset(bool one_tier) {
  RedisServer server;
  HostRuntime rt;
  Engine engine;
  Ranks<Conn> ranks(rt, engine, tiers_on(server), one_tier);
  const Prompt p(7, 4);
  save_prompt(engine, ranks, p);
  if constexpr (Conn::has_state) CHECK(engine.index.could_serve(p.state_hash));
  wipe(ranks);
  const LoadRequest request = load_prompt(engine, ranks, p, RequestId{1}, 32);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().key == request.key);
  CHECK(engine.loads.back().kind == Resolution::completed);
  check_every_byte(ranks, p, 32);

  const Prompt absent(8, 2);
  LoadGrant miss =
      engine.index.request_load(RequestId{2}, KvSpec{0, absent.tokens, absent.keys, block_range(40, 8)}, std::nullopt);
  REQUIRE(miss.granted());
  const LoadRequest miss_request = miss.ticket().dispatch();
  for (auto& rank : ranks.ranks) rank->conn.load(miss_request);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::failed);

  for (auto& rank : ranks.ranks) rank->conn.drain();
  const IndexStats stats = engine.index.stats();
  CHECK(stats.outstanding == 0);
  CHECK(stats.invariant_violations == 0);
  CHECK(check_consistency(engine.index).ok);
  std::uint64_t round_trips = 0, loads_hits = 0;
  for (auto& tier : ranks.tiers) {
    round_trips += tier->stats().round_trips;
    loads_hits += tier->stats().hits;
    CHECK(tier->stats().rejected == 0);
    CHECK(tier->stats().get_failures == 0);
  }
  // Each rank's KV load was one round trip for its 4 chunks (state gets are their own).
  CHECK(loads_hits == kWorld * (4 + (Conn::has_state ? 1 : 0)));
  CHECK(round_trips > 0);
}

}  // namespace

TEST_CASE("redis presets: DenseConnector stores and loads every byte across 4 ranks") {
  run_preset<DenseConnector<RedisTier>>(false);
}

TEST_CASE("redis presets: Dsv4Connector stores and loads every byte across 4 ranks") {
  run_preset<Dsv4Connector<RedisTier>>(false);
}

TEST_CASE("redis presets: KimiK3Connector stores and loads every byte across 4 ranks") {
  run_preset<KimiK3Connector<RedisTier>>(false);
}

TEST_CASE("redis presets: KimiK3Connector with one RedisTier shared by the 4 ranks") {
  run_preset<KimiK3Connector<RedisTier>>(true);
}

TEST_CASE("redis presets: a KV load of N chunks is one round trip per rank") {
  using Conn = DenseConnector<RedisTier>;
  RedisServer server;
  HostRuntime rt;
  Engine engine;
  Ranks<Conn> ranks(rt, engine, tiers_on(server), false);
  const Prompt p(9, 16);  // 16 chunks: the geometry's max_chunks_per_load
  save_prompt(engine, ranks, p);
  std::vector<std::uint64_t> before;
  for (auto& tier : ranks.tiers) before.push_back(tier->stats().round_trips);
  wipe(ranks);
  (void)load_prompt(engine, ranks, p, RequestId{3}, 0);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::completed);
  check_every_byte(ranks, p, 0);
  for (std::size_t r = 0; r < kWorld; ++r) CHECK(ranks.tiers[r]->stats().round_trips - before[r] == 1);
}

TEST_CASE("R1 loads in flight when the redis server is killed or paused report once per rank and settle") {
  using Conn = KimiK3Connector<RedisTier>;
  RedisServer server;
  HostRuntime rt;
  Engine engine;
  Ranks<Conn> ranks(rt, engine, tiers_on(server), true);
  const Prompt p(11, 16);
  save_prompt(engine, ranks, p);

  // Killed: loads keep being dispatched while the server dies under them.
  std::size_t dispatched = 0;
  std::atomic<bool> killed{false};
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    server.kill();
    killed = true;
  });
  // Loads go on until three were dispatched after the kill had finished (the server reaped):
  // those cannot complete. A load in flight while it dies may go either way.
  std::size_t after_kill = 0;
  for (std::uint64_t id = 100; after_kill < 3 || dispatched < 40; ++id) {
    const bool dead = killed.load();
    (void)load_prompt(engine, ranks, p, RequestId{id}, 0);
    ++dispatched;
    REQUIRE(engine.settle(1, 0));  // each load settles exactly once, whatever the server did
    if (dead) {
      ++after_kill;
      CHECK(engine.loads.back().kind == Resolution::failed);
    }
  }
  killer.join();
  std::size_t completed = 0, failed = 0;
  for (const LoadResolution& r : engine.loads) (r.kind == Resolution::completed ? completed : failed) += 1;
  CHECK(completed + failed == dispatched);
  CHECK(failed >= after_kill);

  // Paused: the server holds the connections and answers nothing; the timeouts end the loads.
  server.start();
  save_prompt(engine, ranks, p);
  server.pause();
  const auto start = std::chrono::steady_clock::now();
  (void)load_prompt(engine, ranks, p, RequestId{9000}, 0);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::failed);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  server.resume();

  // A later load reconnects and completes.
  (void)load_prompt(engine, ranks, p, RequestId{9001}, 0);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::completed);
  check_every_byte(ranks, p, 0);

  for (auto& rank : ranks.ranks) rank->conn.drain();
  const IndexStats stats = engine.index.stats();
  CHECK(stats.outstanding == 0);
  CHECK(stats.invariant_violations == 0);
  CHECK(stats.completed + stats.failed == dispatched + 2);
  CHECK(engine.pump.stats().group.pending == 0);
  CHECK(check_consistency(engine.index).ok);
}

TEST_CASE("R18 a second engine re-seeds its index from the redis tier with SCAN and serves the first engine's KV and state") {
  using Conn = KimiK3Connector<RedisTier>;
  RedisServer server({"--rename-command", "KEYS", ""});
  const Prompt p(21, 2);
  const PrefixHash partial{0xbad};
  {  // The first engine stores a prompt and a checkpoint; one more checkpoint reaches ranks 0-2 only.
    HostRuntime rt;
    Engine engine;
    Ranks<Conn> ranks(rt, engine, tiers_on(server), true);
    save_prompt(engine, ranks, p);
    for (std::uint32_t r = 0; r + 1 < kWorld; ++r)
      REQUIRE(ranks.tiers[0]->put(TierKey{p.geo.model, partial, kWorld, r, EntryKind::state},
                                  std::vector<std::byte>(p.geo.slot_bytes, std::byte{1})));
  }
  // The second engine: its own index, ranks and tier objects, the same server and prefix.
  HostRuntime rt;
  Engine engine;
  Ranks<Conn> ranks(rt, engine, tiers_on(server), true);
  CHECK_FALSE(engine.index.could_serve(p.state_hash));
  const std::vector<std::vector<TierKey>> lists{ranks.tiers[0]->keys(EntryKind::state)};  // every rank's keys in one list
  CHECK(reseed_state_hashes(engine.index, lists, p.geo.model, kWorld) == 1);
  CHECK(engine.index.could_serve(p.state_hash));
  CHECK_FALSE(engine.index.could_serve(partial));
  (void)load_prompt(engine, ranks, p, RequestId{5}, 40);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::completed);
  check_every_byte(ranks, p, 40);
}

TEST_CASE("redis presets: a server restarted empty makes loads miss and retracts the state hash") {
  using Conn = KimiK3Connector<RedisTier>;
  RedisServer server;
  HostRuntime rt;
  Engine engine;
  Ranks<Conn> ranks(rt, engine, tiers_on(server), false);
  const Prompt p(31, 2);
  save_prompt(engine, ranks, p);
  REQUIRE(engine.index.could_serve(p.state_hash));
  server.restart_empty();
  (void)load_prompt(engine, ranks, p, RequestId{6}, 0);
  REQUIRE(engine.settle(1, 0));
  CHECK(engine.loads.back().kind == Resolution::failed);
  CHECK(engine.loads.back().state_missed);
  CHECK_FALSE(engine.index.could_serve(p.state_hash));  // retracted: the next admission computes
  for (auto& tier : ranks.tiers) {
    CHECK(tier->stats().get_failures == 0);  // a restart is absence, not an error
    CHECK(tier->stats().misses >= 1);
  }
  for (auto& rank : ranks.ranks) rank->conn.drain();
  CHECK(engine.index.stats().outstanding == 0);
  CHECK(check_consistency(engine.index).ok);
}
