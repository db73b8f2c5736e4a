// Configured compositions: a plain config picks a compiled composition through the name
// registry and the capability predicate; a bad config is an Error naming the bad value
// before any rank starts.
#include "connector_harness.hpp"

#include <kvfuse/compose/configured.hpp>

#include <filesystem>
#include <string>
#include <type_traits>

#include <stdlib.h>
#include <unistd.h>

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

/// A good dense config on the harness grids (16-token blocks, 64-token chunks).
DeploymentOptions dense_options() {
  DeploymentOptions o;
  o.engine.connector = "offload";
  o.grids = PlanGrids{16, 64};
  o.world_size = 1;
  o.kv_tier.memory_capacity_bytes = std::size_t{1} << 20;
  o.state_tier.memory_capacity_bytes = std::size_t{1} << 20;
  return o;
}

DeploymentOptions stateful_options(StateLayout layout) {
  DeploymentOptions o = dense_options();
  o.engine.layout = layout;
  o.slot_count = 4;
  return o;
}

/// configure(o) throws an Error with `code` whose message holds every one of `needles`.
void expect_error(const DeploymentOptions& o, ErrorCode code, std::initializer_list<std::string_view> needles) {
  try {
    (void)configure(o);
    FAIL("configure accepted a bad config");
  } catch (const Error& e) {
    CHECK(e.code() == code);
    const std::string what = e.what();
    for (std::string_view n : needles) {
      INFO("message: " << what << " | expected to name: " << n);
      CHECK(what.find(n) != std::string::npos);
    }
  }
}

using TempDir = testing::TempDir;  // TempDir dir; / dir.path

}  // namespace

// ---- bad configs: one per kind ----------------------------------------------------------

TEST_CASE("configured: an unknown connector name is unknown_connector naming it") {
  DeploymentOptions o = dense_options();
  o.engine.connector = "LMCacheConnectorV2";
  expect_error(o, ErrorCode::unknown_connector, {"'LMCacheConnectorV2'"});

  DeploymentOptions m = dense_options();
  m.engine.connector = "multi";
  m.engine.subs = {{"nixl", {}}, {"lmcache-v9", {}}};
  expect_error(m, ErrorCode::unknown_connector, {"'lmcache-v9'"});
}

TEST_CASE("configured: two offload subs in different spellings are duplicate_offload naming both") {
  DeploymentOptions o = dense_options();
  o.engine.connector = "MultiConnector";
  o.engine.subs = {{"LMCacheConnectorV1", {}}, {"nixl", {}}, {"lmcache_offload", {}}};
  expect_error(o, ErrorCode::duplicate_offload, {"'LMCacheConnectorV1'", "'lmcache_offload'"});
}

TEST_CASE("configured: pipeline parallelism with a state tier is unsupported_parallelism naming pp") {
  DeploymentOptions o = stateful_options(StateLayout::dsv4_slot);
  o.engine.pipeline_parallel_size = 2;
  expect_error(o, ErrorCode::unsupported_parallelism, {"pipeline_parallel_size=2", "dsv4_slot"});
  // Dense under pp > 1 is fine: there is no state tier to refuse.
  DeploymentOptions d = dense_options();
  d.engine.pipeline_parallel_size = 2;
  CHECK(configure(d).preset == Preset::dense);
}

TEST_CASE("configured: a zero grid is invalid_argument naming it") {
  DeploymentOptions o = dense_options();
  o.grids.block_tokens = 0;
  expect_error(o, ErrorCode::invalid_argument, {"grids.block_tokens", "got 0"});
  o = dense_options();
  o.grids.chunk_tokens = 0;
  expect_error(o, ErrorCode::invalid_argument, {"grids.chunk_tokens", "got 0"});
}

TEST_CASE("configured: a chunk grid that is not a multiple of the block grid names both") {
  DeploymentOptions o = dense_options();
  o.grids = PlanGrids{16, 40};
  expect_error(o, ErrorCode::invalid_argument, {"chunk_tokens=40", "block_tokens=16"});
}

TEST_CASE("configured: a nested multi in an alias spelling is invalid_argument naming it") {
  DeploymentOptions o = dense_options();
  o.engine.connector = "multi";
  o.engine.subs = {{"nixl", {}}, {" Multi-Connector ", {}}, {"offload", {}}};
  expect_error(o, ErrorCode::invalid_argument, {"' Multi-Connector '", "do not nest"});
}

TEST_CASE("configured: a world size of 0 or above 64 is invalid_argument naming it") {
  DeploymentOptions o = dense_options();
  o.world_size = 0;
  expect_error(o, ErrorCode::invalid_argument, {"world_size", "got 0"});
  o.world_size = 65;
  expect_error(o, ErrorCode::invalid_argument, {"world_size", "got 65"});
  o.world_size = 64;
  CHECK(configure(o).world_size == 64);
}

TEST_CASE("configured: slot_count must match the layout") {
  DeploymentOptions o = stateful_options(StateLayout::k3_recurrent);
  o.slot_count = 0;
  expect_error(o, ErrorCode::invalid_argument, {"slot_count", "k3_recurrent", "got 0"});
  DeploymentOptions d = dense_options();
  d.slot_count = 3;
  expect_error(d, ErrorCode::invalid_argument, {"slot_count", "layout=none", "got 3"});
}

TEST_CASE("configured: a config with no offload connector has nothing to build") {
  DeploymentOptions o = stateful_options(StateLayout::dsv4_slot);
  o.engine.connector = "NixlConnector";
  expect_error(o, ErrorCode::invalid_argument, {"'NixlConnector'", "no offload connector"});
  DeploymentOptions m = dense_options();
  m.engine.connector = "multi";
  m.engine.subs = {{"nixl", {}}, {"mooncake", {}}};
  expect_error(m, ErrorCode::invalid_argument, {"'multi'", "no offload connector"});
}

TEST_CASE("configured: bad tier settings are invalid_argument naming the field") {
  DeploymentOptions o = dense_options();
  o.kv_tier.memory_capacity_bytes = 0;
  expect_error(o, ErrorCode::invalid_argument, {"kv_tier.memory_capacity_bytes"});
  o = stateful_options(StateLayout::dsv4_slot);
  o.state_tier.kind = TierKind::disk;
  expect_error(o, ErrorCode::invalid_argument, {"state_tier.disk_directory"});
  o = stateful_options(StateLayout::dsv4_slot);
  o.kv_tier = TierOptions{TierKind::disk, 0, "/tmp/kv"};
  expect_error(o, ErrorCode::invalid_argument, {"kv_tier=disk", "state_tier=memory"});
  // A dense model ignores the state tier's settings.
  DeploymentOptions d = dense_options();
  d.state_tier.memory_capacity_bytes = 0;
  CHECK(configure(d).preset == Preset::dense);
}

TEST_CASE("configured: an enum value outside its enum is invalid_argument naming the field and the value") {
  DeploymentOptions o = stateful_options(StateLayout::k3_recurrent);
  o.engine.layout = static_cast<StateLayout>(7);
  expect_error(o, ErrorCode::invalid_argument, {"layout=7", "StateLayout"});
  o = dense_options();
  o.engine.kv_role = static_cast<KvRole>(5);
  expect_error(o, ErrorCode::invalid_argument, {"kv_role=5", "KvRole"});
  o = dense_options();
  o.engine.connector = "multi";
  o.engine.subs = {{"nixl", {}}, {"offload", static_cast<KvRole>(5)}};
  expect_error(o, ErrorCode::invalid_argument, {"subs[1].kv_role=5", "'offload'"});
  o = dense_options();
  o.kv_tier.kind = static_cast<TierKind>(9);
  expect_error(o, ErrorCode::invalid_argument, {"kv_tier.kind=9", "TierKind"});
  o = stateful_options(StateLayout::dsv4_slot);
  o.state_tier.kind = static_cast<TierKind>(9);
  expect_error(o, ErrorCode::invalid_argument, {"state_tier.kind=9", "TierKind"});
}

// ---- good configs -----------------------------------------------------------------------

TEST_CASE("configured: a plain dense offload config") {
  DeploymentOptions o = dense_options();
  o.engine.connector = " kvfuse ";
  o.min_load_tokens = 32;
  o.break_even = BreakEven::from_bandwidth(20.0, 1e9, 5000, 2048, 0);
  const ConfiguredComposition c = configure(o);
  CHECK(c.preset == Preset::dense);
  CHECK_FALSE(c.is_multi);
  REQUIRE(c.subs.size() == 1);
  CHECK(c.subs[0] == "offload");
  CHECK(c.offload_sub == 0);
  CHECK(c.capability.kv_can_save);
  CHECK(c.capability.kv_can_load);
  CHECK_FALSE(c.capability.state_can_load);
  CHECK(c.index.role_loads);
  CHECK_FALSE(c.index.state_tier);
  CHECK(c.index.slot_count == 0);
  CHECK(c.coordinator.layout == StateLayout::none);
  CHECK(c.coordinator.grids == PlanGrids{16, 64});
  CHECK(c.coordinator.min_load_tokens == 32);
  CHECK(c.coordinator.break_even == o.break_even);
  CHECK(c.coordinator.break_even.enabled());
}

TEST_CASE("configured: a DSV4 multi of a P/D sub and the offload sub in alias spellings") {
  DeploymentOptions o = stateful_options(StateLayout::dsv4_slot);
  o.engine.connector = " multiconnector ";
  o.engine.subs = {{"nixl", {}}, {"lmcache", {}}};
  o.slot_count = 8;
  const ConfiguredComposition c = configure(o);
  CHECK(c.preset == Preset::dsv4);
  CHECK(c.is_multi);
  REQUIRE(c.subs.size() == 2);
  CHECK(c.subs[0] == "nixl");
  CHECK(c.subs[1] == "offload");
  CHECK(c.offload_sub == 1);
  CHECK(c.capability.state_can_save);
  CHECK(c.capability.state_can_load);
  CHECK(c.index.slot_count == 8);
  CHECK(c.index.state_tier);
  CHECK(c.index.role_loads);
  CHECK(c.coordinator.layout == StateLayout::dsv4_slot);
  CHECK(c.coordinator.grids == PlanGrids{16, 64});
}

TEST_CASE("configured: a K3 producer under an alias name and a K3 multi whose offload sub has its own role") {
  DeploymentOptions o = stateful_options(StateLayout::k3_recurrent);
  o.engine.connector = "LMCacheConnectorV1";
  o.engine.kv_role = KvRole::producer;
  const ConfiguredComposition c = configure(o);
  CHECK(c.preset == Preset::k3);
  CHECK(c.subs == std::vector<std::string_view>{"offload"});
  CHECK(c.capability.state_can_save);
  CHECK_FALSE(c.capability.state_can_load);
  CHECK_FALSE(c.index.role_loads);
  CHECK_FALSE(c.index.state_tier);
  CHECK(c.coordinator.layout == StateLayout::k3_recurrent);

  DeploymentOptions m = stateful_options(StateLayout::k3_recurrent);
  m.engine.connector = "Multi_Connector";
  m.engine.subs = {{"MooncakeConnectorV1", {}}, {"OffloadingConnector", KvRole::consumer}, {"p2p-nccl", {}}};
  const ConfiguredComposition k = configure(m);
  CHECK(k.subs == std::vector<std::string_view>{"mooncake", "offload", "p2p_nccl"});
  CHECK(k.offload_sub == 1);
  CHECK_FALSE(k.capability.state_can_save);
  CHECK(k.capability.state_can_load);
  CHECK(k.index.role_loads);
  CHECK(k.index.state_tier);
}

// ---- the rank side ----------------------------------------------------------------------

namespace {

/// Builds rank 0 of `c` over SingleRank and a HostRuntime, saves one chunk (and, with
/// state, one checkpoint) through it and loads them back into fresh blocks / a fresh slot.
void round_trip(const ConfiguredComposition& c) {
  HostRuntime rt;
  SingleRank group;
  DevicePools<HostRuntime> pools(rt, small_geometry(0, 1));
  RecordLog log;
  RankConnector<SingleRank, HostRuntime> rank = make_rank_connector(c, pools.geo, rt, pools.memory(), group);
  CHECK(rank.preset == c.preset);
  const PrefixHash key = chunk_keys(3, 1)[0];
  const PrefixHash state_hash{5};
  rank.visit([&](auto& conn) {
    using Conn = std::remove_cvref_t<decltype(conn)>;
    CHECK(Conn::has_state == (c.preset != Preset::dense));
    CHECK(Conn::has_state_lane == (c.preset == Preset::k3));
    pools.write_prompt(block_range(0, 4), pools.geo.chunk_tokens);
    conn.save_kv(KvSave{SaveKey{key, Generation{1}}, {key}, block_range(0, 4)});
    std::size_t stores = 2;
    if constexpr (Conn::has_state) {
      pools.write_state(SlotId{0}, state_hash);
      conn.save_state(StateSave{SaveKey{state_hash, Generation{2}}, SlotId{0}, 48});
      stores = 4;
    }
    REQUIRE(drain_until(group, log, [&] { return log.stores.size() == stores; }));
    for (const SaveRecord& s : log.stores) CHECK(s.ok);

    LoadRequest r;
    r.key = LoadKey{RequestId{7}, Generation{3}};
    r.kv = KvSpec{0, pools.geo.chunk_tokens, {key}, block_range(8, 4)};
    if constexpr (Conn::has_state)
      r.state = StateSpec{48, state_hash, SlotId{2}, pools.geo.block_tokens, pools.geo.chunk_tokens};
    conn.load(std::move(r));
    REQUIRE(drain_until(group, log, [&] { return log.loads.size() == 1; }));
    CHECK(log.loads[0].kv == KvOutcome::ok);
    CHECK(pools.holds_prompt(block_range(8, 4), 0, pools.geo.chunk_tokens));
    if constexpr (Conn::has_state) {
      CHECK(log.loads[0].state == StateOutcome::restored);
      CHECK(pools.holds_state(SlotId{2}, state_hash));
    } else {
      CHECK(log.loads[0].state == StateOutcome::none);
    }
  });
}

}  // namespace

TEST_CASE("configured: the rank connector built from a config saves and loads for each preset") {
  SUBCASE("dense") { round_trip(configure(dense_options())); }
  SUBCASE("dsv4") { round_trip(configure(stateful_options(StateLayout::dsv4_slot))); }
  SUBCASE("k3") { round_trip(configure(stateful_options(StateLayout::k3_recurrent))); }
  SUBCASE("k3 with KV in memory and state on disk") {
    TempDir dir;
    DeploymentOptions o = stateful_options(StateLayout::k3_recurrent);
    o.state_tier = TierOptions{TierKind::disk, 0, dir.path};
    const ConfiguredComposition c = configure(o);
    round_trip(c);
    CHECK_FALSE(std::filesystem::is_empty(dir.path));  // the state entry went to disk
  }
}

TEST_CASE("configured: a rank whose geometry disagrees with the config is refused naming both values") {
  HostRuntime rt;
  SingleRank group;
  const ConfiguredComposition c = configure(stateful_options(StateLayout::dsv4_slot));
  auto refused = [&](RankGeometry geo, std::initializer_list<std::string_view> needles) {
    DevicePools<HostRuntime> pools(rt, geo);
    try {
      (void)make_rank_connector(c, geo, rt, pools.memory(), group);
      FAIL("make_rank_connector accepted a mismatched geometry");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      const std::string what = e.what();
      for (std::string_view n : needles) {
        INFO("message: " << what << " | expected to name: " << n);
        CHECK(what.find(n) != std::string::npos);
      }
    }
  };
  RankGeometry g = small_geometry(0, 1);
  g.chunk_tokens = 128;
  refused(g, {"chunk_tokens=128", "chunk_tokens=64"});
  g = small_geometry(0, 2);
  refused(g, {"world_size=2", "world_size=1"});
  g = small_geometry(0, 1);
  g.num_slots = 2;
  refused(g, {"num_slots=2", "slot_count=4"});
}
