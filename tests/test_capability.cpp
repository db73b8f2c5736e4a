// The config-only capability (R14), the canonical connector names (R15), and their errors
// (R19).
#include <doctest/doctest.h>

#include <kvfuse/engine/capability.hpp>
#include <kvfuse/engine/connector_names.hpp>
#include <kvfuse/engine/offload_index.hpp>

#include <array>
#include <string>
#include <string_view>
#include <vector>

using namespace kvfuse;

namespace {

EngineOptions single(std::string name, KvRole role, StateLayout layout, std::uint32_t pp = 1) {
  EngineOptions c;
  c.connector = std::move(name);
  c.kv_role = role;
  c.layout = layout;
  c.pipeline_parallel_size = pp;
  return c;
}

EngineOptions multi(std::string name, std::vector<SubConnectorOptions> subs, StateLayout layout,
                      KvRole role = KvRole::both, std::uint32_t pp = 1) {
  EngineOptions c = single(std::move(name), role, layout, pp);
  c.subs = std::move(subs);
  return c;
}

bool contains(const std::string& haystack, std::string_view needle) { return haystack.find(needle) != std::string::npos; }

// Runs f, which must throw kvfuse::Error with `code`; returns the message.
template <class F>
std::string error_of(F&& f, ErrorCode code) {
  try {
    f();
  } catch (const Error& e) {
    CHECK(e.code() == code);
    return e.what();
  }
  FAIL("no kvfuse::Error was thrown");
  return {};
}

}  // namespace

// ------------------------------------------------------------------------------ R14

TEST_CASE("R14 the capability is decided from config alone with one answer per config") {
  struct Case {
    const char* what;
    EngineOptions cfg;
    bool state_can_save, state_can_load, kv_can_save, kv_can_load;
    std::string_view reason_mentions;
  };
  const std::vector<Case> cases = {
      {"offload, both, K3", single("offload", KvRole::both, StateLayout::k3_recurrent), true, true, true, true, ""},
      {"offload, both, DSV4", single("kvfuse", KvRole::both, StateLayout::dsv4_slot), true, true, true, true, ""},
      {"consumer loads only", single("offload", KvRole::consumer, StateLayout::k3_recurrent), false, true, false, true,
       "kv_role=consumer"},
      {"producer stores only", single("offload", KvRole::producer, StateLayout::k3_recurrent), true, false, true, false,
       "kv_role=producer"},
      {"dense model: no state tier", single("offload", KvRole::both, StateLayout::none), false, false, true, true,
       "layout=none"},
      {"a P/D connector hosts no tier", single("mooncake", KvRole::both, StateLayout::k3_recurrent), false, false,
       false, false, "'mooncake' hosts no offload connector"},
      {"pp > 1 without a state tier: KV only", single("offload", KvRole::both, StateLayout::none, 4), false, false,
       true, true, "layout=none"},
      {"multi [mooncake producer, offload]: the offload sub inherits the multi's role",
       multi("multi", {{"mooncake", KvRole::producer}, {"LMCacheConnectorV1", std::nullopt}}, StateLayout::k3_recurrent),
       true, true, true, true, ""},
      {"multi: the offload sub's own role decides",
       multi("multi", {{"nixl", std::nullopt}, {"lmcache", KvRole::consumer}}, StateLayout::dsv4_slot), false, true,
       false, true, "'lmcache'"},
      {"multi without an offload sub", multi("MultiConnector", {{"nixl", std::nullopt}, {"mooncake", std::nullopt}},
                                             StateLayout::k3_recurrent),
       false, false, false, false, "hosts no offload connector"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const Capability cap = state_tier_capability(c.cfg);
    CHECK(cap.state_can_save == c.state_can_save);
    CHECK(cap.state_can_load == c.state_can_load);
    CHECK(cap.kv_can_save == c.kv_can_save);
    CHECK(cap.kv_can_load == c.kv_can_load);
    CHECK((cap.reason.empty()) == (c.state_can_save && c.state_can_load));
    CHECK_MESSAGE(contains(cap.reason, c.reason_mentions), cap.reason);
    CHECK(state_tier_capability(c.cfg) == cap);  // deterministic: the same config, the same answer
  }
}

TEST_CASE("R14 pipeline parallelism > 1 with a state tier is refused at engine construction naming the values") {
  // Both entry points refuse it: the capability is never a quiet "no state tier" for it.
  for (const bool capability : {true, false}) {
    CAPTURE(capability);
    auto decide = [&](const EngineOptions& cfg) {
      if (capability) (void)state_tier_capability(cfg);
      else check_engine_options(cfg);
    };
    const std::string msg = error_of([&] { decide(single("offload", KvRole::both, StateLayout::k3_recurrent, 2)); },
                                     ErrorCode::unsupported_parallelism);
    CHECK(contains(msg, "pipeline_parallel_size=2"));
    CHECK(contains(msg, "k3_recurrent"));
    // Through a multi, in an alias spelling, and for a one-sided role too.
    const std::string msg4 = error_of(
        [&] {
          decide(multi(" Multi-Connector ", {{"mooncake", KvRole::producer}, {"lmcache_mp", KvRole::consumer}},
                       StateLayout::dsv4_slot, KvRole::both, 4));
        },
        ErrorCode::unsupported_parallelism);
    CHECK(contains(msg4, "pipeline_parallel_size=4"));
    CHECK(contains(msg4, "dsv4_slot"));
    error_of([&] { decide(single("offload", KvRole::producer, StateLayout::dsv4_slot, 2)); },
             ErrorCode::unsupported_parallelism);
    // A config that would not host a state tier anyway starts under any pp.
    CHECK_NOTHROW(decide(single("offload", KvRole::both, StateLayout::none, 8)));
    CHECK_NOTHROW(decide(single("nixl", KvRole::both, StateLayout::k3_recurrent, 8)));
    CHECK_NOTHROW(decide(single("offload", KvRole::both, StateLayout::k3_recurrent, 1)));
  }
}

TEST_CASE("R14 the index follows the capability: no loads for a producer and no state legs without a state tier") {
  auto admit = [](const Capability& cap, bool with_state) {
    OffloadIndex<> index(index_options_for(cap, 4), [](SlotId) {});
    index.note_stored(PrefixHash{1});
    std::optional<StateSpec> st;
    if (with_state) st = StateSpec{256, PrefixHash{1}, SlotId{0}, 16, 256};
    return index.request_load(RequestId{1}, KvSpec{0, 256, {PrefixHash{9}}, {BlockId{0}}}, st).refusal();
  };
  const Capability k3 = state_tier_capability(single("offload", KvRole::both, StateLayout::k3_recurrent));
  CHECK(admit(k3, true) == LoadRefusal::none);
  const Capability producer = state_tier_capability(single("offload", KvRole::producer, StateLayout::k3_recurrent));
  CHECK(admit(producer, false) == LoadRefusal::role_cannot_load);
  CHECK(admit(producer, true) == LoadRefusal::role_cannot_load);
  const Capability dense = state_tier_capability(single("offload", KvRole::both, StateLayout::none));
  CHECK(admit(dense, false) == LoadRefusal::none);
  CHECK(admit(dense, true) == LoadRefusal::no_state_tier);
  const Capability dense_pp4 = state_tier_capability(single("offload", KvRole::both, StateLayout::none, 4));
  CHECK(admit(dense_pp4, false) == LoadRefusal::none);
  CHECK(admit(dense_pp4, true) == LoadRefusal::no_state_tier);
}

// ------------------------------------------------------------------------------ R15

TEST_CASE("R15 connector names resolve by trimming and case folding and aliases") {
  CHECK(canonical_connector_name("offload") == "offload");
  CHECK(canonical_connector_name("  LMCacheConnectorV1 \t") == "offload");
  CHECK(canonical_connector_name("LMCACHE_MP") == "offload");
  CHECK(canonical_connector_name("lmcache-offload") == "offload");
  CHECK(canonical_connector_name("KVFuse") == "offload");
  CHECK(canonical_connector_name("MultiConnector") == "multi");
  CHECK(canonical_connector_name("multi-connector") == "multi");
  CHECK(canonical_connector_name("MooncakeConnector") == "mooncake");
  CHECK(canonical_connector_name("NIXL") == "nixl");
  CHECK(canonical_connector_name("P2P-NCCL") == "p2p_nccl");
  CHECK(canonical_connector_name("P2pNcclConnector") == "p2p_nccl");
  CHECK(connector_kind(" moriio ") == ConnectorKind::pd);
  // Every canonical name and alias resolves to a known canonical name.
  for (const ConnectorInfo& c : known_connectors) CHECK(canonical_connector_name(c.canonical) == c.canonical);
  for (const ConnectorAlias& a : connector_aliases) {
    CAPTURE(a.alias);
    CHECK(canonical_connector_name(a.alias) == a.canonical);
  }
  // The predicates answer on the canonical name, at compile time too.
  static_assert(is_offload_connector(" LMCacheConnectorV1"));
  static_assert(is_offload_connector("lmcache_mp"));
  static_assert(!is_offload_connector("mooncake"));
  static_assert(is_multi_connector("MULTICONNECTOR"));
  static_assert(canonical_connector_name("Kvfuse") == "offload");
  constexpr std::array<std::string_view, 3> composition{"lmcache_offload", "mooncake", "LMCacheConnectorV1"};
  static_assert(count_offload_connectors(composition) == 2);
}

TEST_CASE("R15 an unknown connector name is an error that lists the known names") {
  for (std::string_view bad : {"redis", "", "   ", "lmcache v1", "offload2"}) {
    CAPTURE(bad);
    const std::string msg = error_of([&] { (void)canonical_connector_name(bad); }, ErrorCode::unknown_connector);
    std::string quoted = "'";  // built with append: GCC 12's -Wrestrict misfires on "'" + string at -O3
    quoted.append(bad).append("'");
    CHECK(contains(msg, quoted));
    for (const ConnectorInfo& c : known_connectors) CHECK(contains(msg, c.canonical));
  }
  // Nor do the predicates: an unknown name is an error, never a quiet "not offload".
  for (std::string_view bad : {"no-such-connector", "LMCacheConnectorV2"}) {
    CAPTURE(bad);
    const std::string offload = error_of([&] { (void)is_offload_connector(bad); }, ErrorCode::unknown_connector);
    CHECK(contains(offload, bad));
    for (const ConnectorInfo& c : known_connectors) CHECK(contains(offload, c.canonical));
    error_of([&] { (void)is_multi_connector(bad); }, ErrorCode::unknown_connector);
    const std::array<std::string_view, 2> composition{"mooncake", bad};
    error_of([&] { (void)count_offload_connectors(composition); }, ErrorCode::unknown_connector);
  }
  // The capability never reads an unknown name as "no connector".
  error_of([] { (void)state_tier_capability(single("LMCacheConnectorV2", KvRole::both, StateLayout::k3_recurrent)); },
           ErrorCode::unknown_connector);
  error_of([] { (void)state_tier_capability(multi("multi", {{"offload", std::nullopt}, {"mooncak", std::nullopt}},
                                                  StateLayout::k3_recurrent)); },
           ErrorCode::unknown_connector);
}

TEST_CASE("R15 two offload sub-connectors in one multi are refused at startup in any spelling") {
  const std::vector<std::vector<std::string>> doubles = {
      {"lmcache_offload", "lmcache_offload"},
      {"lmcache_offload", "LMCacheConnectorV1"},
      {"lmcache_mp", "lmcache_offload"},
      {" kvfuse ", "mooncake", "Offload"},
      {"LMCache", "OffloadingConnector"},
  };
  for (const std::vector<std::string>& names : doubles) {
    CAPTURE(names.front());
    const std::string msg = error_of([&] { (void)resolve_multi_subs(std::span<const std::string>(names)); },
                                     ErrorCode::duplicate_offload);
    CHECK(contains(msg, names.front()));
    CHECK(contains(msg, names.back()));
    std::vector<SubConnectorOptions> subs;
    for (const std::string& n : names) subs.push_back({n, std::nullopt});
    error_of([&] { (void)state_tier_capability(multi("MultiConnector", subs, StateLayout::k3_recurrent)); },
             ErrorCode::duplicate_offload);
    error_of([&] { check_engine_options(multi("multi", subs, StateLayout::none)); }, ErrorCode::duplicate_offload);
  }
  const std::vector<std::string> fine = {"Mooncake", "lmcache"};
  CHECK(resolve_multi_subs(std::span<const std::string>(fine)) == std::vector<std::string_view>{"mooncake", "offload"});
}

TEST_CASE("R15 a multi spelled as an alias still unwraps its offload sub") {
  for (const char* spelling : {"multi", "MultiConnector", " multi_connector ", "MULTI"}) {
    CAPTURE(spelling);
    const Capability cap = state_tier_capability(
        multi(spelling, {{"mooncake", KvRole::producer}, {"LMCacheConnectorV1", KvRole::consumer}}, StateLayout::k3_recurrent));
    CHECK(cap.state_can_load);
    CHECK_FALSE(cap.state_can_save);
    CHECK(cap.kv_can_load);
  }
}

// ------------------------------------------------------------------------------ R19

TEST_CASE("R19 malformed connector configs throw kvfuse::Error naming the value") {
  const std::string pp0 = error_of([] { (void)state_tier_capability(single("offload", KvRole::both, StateLayout::none, 0)); },
                                   ErrorCode::invalid_argument);
  CHECK(contains(pp0, "pipeline_parallel_size"));
  CHECK(contains(pp0, "got 0"));
  error_of([] { check_engine_options(single("offload", KvRole::both, StateLayout::none, 0)); }, ErrorCode::invalid_argument);
  const std::string subs = error_of(
      [] { (void)state_tier_capability(multi("offload", {{"mooncake", std::nullopt}}, StateLayout::none)); },
      ErrorCode::invalid_argument);
  CHECK(contains(subs, "'offload'"));
  error_of([] { (void)state_tier_capability(multi("multi", {}, StateLayout::none)); }, ErrorCode::invalid_argument);
  const std::string nested = error_of(
      [] { (void)state_tier_capability(multi("multi", {{"MultiConnector", std::nullopt}}, StateLayout::none)); },
      ErrorCode::invalid_argument);
  CHECK(contains(nested, "'MultiConnector'"));
  const std::string unknown = error_of([] { check_engine_options(single("Redis", KvRole::both, StateLayout::k3_recurrent, 2)); },
                                       ErrorCode::unknown_connector);
  CHECK(contains(unknown, "'Redis'"));
}

TEST_CASE("R19 a role or layout outside its enum is an Error naming the field and the value") {
  // Not a quiet answer: KvRole(5) used to come back as a role that both loads and saves.
  const std::string role = error_of(
      [] { (void)state_tier_capability(single("offload", static_cast<KvRole>(5), StateLayout::k3_recurrent)); },
      ErrorCode::invalid_argument);
  CHECK(contains(role, "kv_role=5"));
  CHECK(contains(role, "KvRole"));
  const std::string layout = error_of(
      [] { check_engine_options(single("offload", KvRole::both, static_cast<StateLayout>(7))); },
      ErrorCode::invalid_argument);
  CHECK(contains(layout, "layout=7"));
  CHECK(contains(layout, "StateLayout"));
  // Even where the value would not decide anything: no offload connector, pp > 1.
  error_of([] { (void)state_tier_capability(single("nixl", KvRole::both, static_cast<StateLayout>(3))); },
           ErrorCode::invalid_argument);
  error_of([] { (void)state_tier_capability(single("nixl", static_cast<KvRole>(3), StateLayout::none, 4)); },
           ErrorCode::invalid_argument);
  // A sub-connector's own role, named with its index and name.
  const std::string sub = error_of(
      [] {
        (void)state_tier_capability(
            multi("multi", {{"nixl", std::nullopt}, {"LMCacheConnectorV1", static_cast<KvRole>(200)}}, StateLayout::none));
      },
      ErrorCode::invalid_argument);
  CHECK(contains(sub, "subs[1].kv_role=200"));
  CHECK(contains(sub, "'LMCacheConnectorV1'"));
  // Every value inside the enums still answers.
  for (const KvRole r : {KvRole::producer, KvRole::consumer, KvRole::both})
    for (const StateLayout l : {StateLayout::none, StateLayout::dsv4_slot, StateLayout::k3_recurrent})
      CHECK_NOTHROW((void)state_tier_capability(single("offload", r, l)));
}
