// Multi<Subs...>: the compile-time offload check (R15) and KV-load arbitration (R16).
#include <doctest/doctest.h>

#include <kvfuse/kvfuse.hpp>

#include <vector>

using namespace kvfuse;

namespace {

/// A sub whose offer the test sets; it records what it armed and what it was told to cancel.
template <const char* Name>
struct FakeSub {
  static constexpr std::string_view connector_name = Name;
  TokenCount offer = 0;
  int armed = 0;
  std::vector<RequestId> cancelled;
  TokenCount matched_tokens(const AdmissionQuery&) noexcept {
    armed += offer > 0;
    return offer;
  }
  void cancel(RequestId r) noexcept { cancelled.push_back(r); }
};

constexpr char kMooncake[] = "mooncake";
constexpr char kNixl[] = " NIXL ";
constexpr char kLmcache[] = "LMCacheConnectorV1";
constexpr char kKvfuse[] = "kvfuse";
constexpr char kRedis[] = "redis";
constexpr char kTypo[] = "LMCacheConnectorV2";
using Mooncake = FakeSub<kMooncake>;
using Nixl = FakeSub<kNixl>;
using Offload = FakeSub<kLmcache>;
using OffloadAlias = FakeSub<kKvfuse>;
using Redis = FakeSub<kRedis>;
using OffloadTypo = FakeSub<kTypo>;

/// Whether Multi<Subs...> names a type at all (its constraints hold).
template <class... Subs>
constexpr bool multi_compiles = requires { typename Multi<Subs...>; };

}  // namespace

TEST_CASE("R15 a static Multi refuses two offload subs in any spelling at compile time") {
  CHECK(AtMostOneOffloadSub<Mooncake, Offload>);
  CHECK(AtMostOneOffloadSub<Mooncake, Nixl>);
  CHECK_FALSE(AtMostOneOffloadSub<Offload, OffloadAlias>);  // LMCacheConnectorV1 and kvfuse are both "offload"
  CHECK_FALSE(AtMostOneOffloadSub<Mooncake, Offload, Offload>);
  CHECK(Multi<Mooncake, Offload>::tier_sub == std::optional<std::size_t>(1));
  CHECK_FALSE(Multi<Mooncake, Nixl>::tier_sub.has_value());
  // Naming Multi<Offload, OffloadAlias> does not compile: tests/compile_fail case 6.
}

TEST_CASE("R15 a static Multi with an unknown connector name does not compile") {
  static_assert(KnownConnectorNames<Mooncake, Nixl, Offload, OffloadAlias>);
  static_assert(!KnownConnectorNames<Mooncake, Redis>);
  static_assert(!KnownConnectorNames<OffloadTypo>);  // a typo of the offload name is not "no tier sub"
  static_assert(!AtMostOneOffloadSub<Mooncake, Redis>);
  static_assert(multi_compiles<Mooncake, Offload>);
  static_assert(!multi_compiles<Mooncake, Redis>);
  static_assert(!multi_compiles<OffloadTypo, Mooncake>);
  CHECK(multi_compiles<Nixl>);
  CHECK_FALSE(multi_compiles<Nixl, OffloadTypo>);
  // The diagnostic names the concept and the rule: tests/compile_fail case 7.
}

TEST_CASE("R16 the first sub with tokens wins the KV load and losers cancel what they armed") {
  Mooncake pd;
  Offload tier;
  Multi<Mooncake, Offload> multi(pd, tier);
  const AdmissionQuery q{RequestId{1}, 0, 1024};

  pd.offer = 512;
  tier.offer = 768;
  Arbitration a = multi.arbitrate(q, false);
  CHECK(a.winner == std::optional<std::size_t>(0));
  CHECK(a.tokens == 512);
  CHECK(tier.cancelled == std::vector<RequestId>{RequestId{1}});  // the loser armed, so it cancels
  CHECK(pd.cancelled.empty());

  pd.offer = 0;  // the P/D sub has nothing: the tier sub wins
  a = multi.arbitrate(AdmissionQuery{RequestId{2}, 0, 1024}, false);
  CHECK(a.winner == std::optional<std::size_t>(1));
  CHECK(a.tokens == 768);
  CHECK(pd.cancelled.empty());  // it armed nothing, it cancels nothing
}

TEST_CASE("R16 the state leg travels only with the tier sub's load or alone or is waived") {
  Mooncake pd;
  Offload tier;
  Multi<Mooncake, Offload> multi(pd, tier);
  const AdmissionQuery q{RequestId{1}, 0, 1024};

  tier.offer = 256;
  CHECK(multi.arbitrate(q, true).state == StateDisposition::with_tier_load);
  tier.offer = 0;
  CHECK(multi.arbitrate(q, true).state == StateDisposition::state_only);  // no sub owns KV
  pd.offer = 256;
  CHECK(multi.arbitrate(q, true).state == StateDisposition::waived);  // a P/D sub owns KV
  CHECK(multi.arbitrate(q, false).state == StateDisposition::none);

  Mooncake pd_only;
  Multi<Mooncake> no_tier(pd_only);
  CHECK(no_tier.arbitrate(q, true).state == StateDisposition::waived);  // no tier sub to run it
}

TEST_CASE("R16 a released state load is abandoned (not missed) and unparks nothing else") {
  std::vector<SlotId> released_slots;
  OffloadIndex<> index(OffloadIndexOptions{.hash_capacity = 16, .slot_count = 4},
                       [&](SlotId s) { released_slots.push_back(s); });
  index.note_stored(PrefixHash{9});
  LoadGrant mine = index.request_load(RequestId{1}, std::nullopt, StateSpec{48, PrefixHash{9}, SlotId{0}, 16, 64});
  LoadGrant other = index.request_load(RequestId{2}, std::nullopt, StateSpec{48, PrefixHash{9}, SlotId{1}, 16, 64});
  REQUIRE(mine.granted());
  REQUIRE(other.granted());
  const LoadRequest other_request = other.ticket().dispatch();

  Mooncake pd;
  Offload tier;
  pd.offer = 512;
  Multi<Mooncake, Offload> multi(pd, tier);
  const Arbitration a = multi.arbitrate(AdmissionQuery{RequestId{1}, 0, 1024}, true);
  REQUIRE(a.state == StateDisposition::waived);
  mine.ticket().abandon();  // the engine's response to `released`

  std::vector<LoadResolution> resolved;
  index.drain_resolutions(resolved);
  REQUIRE(resolved.size() == 1);  // exactly the released load's one resolution
  CHECK(resolved[0].key.request == RequestId{1});
  CHECK(resolved[0].kind == Resolution::abandoned);
  CHECK_FALSE(resolved[0].state_missed);
  CHECK(index.could_serve(PrefixHash{9}));  // an abandon never retracts (R7)
  CHECK(index.is_in_flight(other_request.key));  // the other request is still parked on its own load
  CHECK(released_slots.empty());  // a live request's slot stays with it (R8)
}
