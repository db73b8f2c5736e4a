// The Planner (docs/reference.md#planner): one test per NoLoadReason, a table of the edges the seed
// got wrong, and a property test against a brute-force planner written independently here.
// Every plan the property test sees is also handed to the ranks' own checks
// (check_kv_spec, check_state_spec, the DSV4 floor rule), so "ranks accept it" is tested
// against the rank code, not restated.
#include <doctest/doctest.h>

#include <kvfuse/engine/planner.hpp>
#include <kvfuse/testing/alloc_counter.hpp>
#include <kvfuse/worker/paged_kv.hpp>
#include <kvfuse/worker/rank_geometry.hpp>
#include <kvfuse/worker/state_legs.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;

namespace {

std::string describe(const LoadPlan& plan) {
  if (const auto* p = std::get_if<NoLoad>(&plan)) return "no_load(" + std::string(to_string(p->reason)) + ")";
  if (const auto* p = std::get_if<KvOnlyLoad>(&plan))
    return "kv_only{hbm " + std::to_string(p->hbm) + " end " + std::to_string(p->end) + "}";
  if (const auto* p = std::get_if<JointLoad>(&plan))
    return "joint{hbm " + std::to_string(p->hbm) + " end " + std::to_string(p->end) + " B " +
           std::to_string(p->boundary) + "}";
  if (const auto* p = std::get_if<StateOnlyLoad>(&plan)) return "state_only{B " + std::to_string(p->boundary) + "}";
  return "valueless";
}

std::string describe(const PlanInput& in) {
  std::string s = "P " + std::to_string(in.prompt_tokens) + " hbm " + std::to_string(in.hbm) + " lookup " +
                  std::to_string(in.lookup_tokens) + " layout " + std::string(to_string(in.layout)) + " grids " +
                  std::to_string(in.grids.block_tokens) + "/" + std::to_string(in.grids.chunk_tokens) + " min " +
                  std::to_string(in.min_load_tokens) + " servable {";
  for (const TokenCount b : in.servable_boundaries) s += " " + std::to_string(b);
  s += " }";
  if (in.break_even.enabled())
    s += " cost{recompute " + std::to_string(in.break_even.recompute_ns_per_token) + " ns/token, " +
         std::to_string(in.break_even.tier_ns_per_byte) + " ns/byte, latency " +
         std::to_string(in.break_even.tier_latency_ns) + ", chunk " + std::to_string(in.break_even.kv_chunk_bytes) +
         " B, state " + std::to_string(in.break_even.state_bytes) + " B}";
  return s;
}

/// One input, owning its servable list.
struct Case {
  TokenCount prompt = 0, hbm = 0, lookup = 0;
  std::vector<TokenCount> servable;
  StateLayout layout = StateLayout::none;
  PlanGrids grids{16, 256};
  TokenCount min_load = 0;
  BreakEven cost{};

  [[nodiscard]] PlanInput input() const {
    PlanInput in;
    in.prompt_tokens = prompt;
    in.hbm = hbm;
    in.lookup_tokens = lookup;
    in.servable_boundaries = servable;
    in.layout = layout;
    in.grids = grids;
    in.min_load_tokens = min_load;
    in.break_even = cost;
    return in;
  }
  [[nodiscard]] LoadPlan plan() const { return plan_load(input()); }
};

constexpr std::array<StateLayout, 3> all_layouts{StateLayout::none, StateLayout::dsv4_slot, StateLayout::k3_recurrent};
constexpr std::array<StateLayout, 2> stateful_layouts{StateLayout::dsv4_slot, StateLayout::k3_recurrent};

/// Checks the plan is NoLoad with `reason`.
void check_no_load(const Case& c, NoLoadReason reason) {
  const LoadPlan got = c.plan();
  INFO(describe(c.input()), " -> ", describe(got));
  const auto* no = std::get_if<NoLoad>(&got);
  REQUIRE(no != nullptr);
  CHECK(no->reason == reason);
  CHECK(claimed_tokens(got) == 0);
  CHECK(chunk_range(got, c.grids).empty());
  CHECK(block_range(got, c.grids).empty());
  CHECK_FALSE(state_boundary(got).has_value());
}

/// What ranks say about the plan: Reason::none when every leg would be accepted.
Reason rank_verdict(const LoadPlan& plan, const PlanInput& in) {
  RankGeometry geo;
  geo.block_tokens = in.grids.block_tokens;
  geo.chunk_tokens = in.grids.chunk_tokens;
  geo.kv_bytes_per_token = 1;
  geo.num_blocks = 1u << 20;
  geo.num_slots = 1;
  geo.slot_bytes = 1;
  geo.validate();
  std::optional<KvSpec> kv;
  if (const auto* p = std::get_if<KvOnlyLoad>(&plan)) kv = KvSpec{p->hbm, p->end, {}, {}};
  if (const auto* p = std::get_if<JointLoad>(&plan)) kv = KvSpec{p->hbm, p->end, {}, {}};
  if (kv) {
    kv->chunk_keys.assign(chunk_range(plan, in.grids).size(), PrefixHash{1});
    kv->blocks.assign(block_range(plan, in.grids).size(), BlockId{0});
    if (const Reason r = check_kv_spec(*kv, geo); r != Reason::none) return r;
  }
  if (const std::optional<TokenCount> b = state_boundary(plan)) {
    const StateSpec spec{*b, PrefixHash{2}, SlotId{0}, in.grids.block_tokens, in.grids.chunk_tokens};
    if (const Reason r = check_state_spec(spec, kv ? &*kv : nullptr, geo); r != Reason::none) return r;
  }
  return Reason::none;
}

}  // namespace

template <>
struct doctest::StringMaker<LoadPlan> {
  static doctest::String convert(const LoadPlan& plan) { return describe(plan).c_str(); }
};
template <>
struct doctest::StringMaker<IndexRange> {
  static doctest::String convert(IndexRange r) {
    return ("[" + std::to_string(r.first) + ", " + std::to_string(r.last) + ")").c_str();
  }
};

// ---------------------------------------------------------------------------------------
// 1. One test case per NoLoadReason.

TEST_CASE("no_load bad_grids when a grid is zero or the chunk is not a multiple of the block") {
  for (const StateLayout layout : all_layouts) {
    for (const PlanGrids grids : {PlanGrids{0, 256}, PlanGrids{16, 0}, PlanGrids{0, 0}, PlanGrids{16, 40},
                                  PlanGrids{256, 16}}) {
      Case c{1000, 0, 512, {400}, layout, grids, 0};
      check_no_load(c, NoLoadReason::bad_grids);
    }
  }
  CHECK(to_string(NoLoadReason::bad_grids) == "bad_grids");
}

TEST_CASE("no_load unknown_layout for a StateLayout value outside the enum") {
  Case c{1000, 0, 512, {400}, static_cast<StateLayout>(7)};
  check_no_load(c, NoLoadReason::unknown_layout);
  CHECK(to_string(NoLoadReason::unknown_layout) == "unknown_layout");
}

TEST_CASE("no_load empty_prompt when the prompt has no tokens") {
  for (const StateLayout layout : all_layouts) check_no_load(Case{0, 0, 0, {16}, layout}, NoLoadReason::empty_prompt);
  CHECK(to_string(NoLoadReason::empty_prompt) == "empty_prompt");
}

TEST_CASE("no_load hbm_off_block_grid because ranks refuse a floor that is not block aligned") {
  for (const StateLayout layout : all_layouts) {
    check_no_load(Case{1000, 40, 512, {400}, layout}, NoLoadReason::hbm_off_block_grid);
    check_no_load(Case{1000, 1, 512, {400}, layout}, NoLoadReason::hbm_off_block_grid);
  }
  // On the block grid but off the chunk grid is loadable (see the table test).
  CHECK(std::holds_alternative<KvOnlyLoad>(Case{1000, 48, 512, {}, StateLayout::none}.plan()));
  CHECK(to_string(NoLoadReason::hbm_off_block_grid) == "hbm_off_block_grid");
}

TEST_CASE("no_load lookup_off_chunk_grid because the tier holds whole chunks only") {
  for (const StateLayout layout : all_layouts) {
    check_no_load(Case{1000, 0, 300, {256}, layout}, NoLoadReason::lookup_off_chunk_grid);
    check_no_load(Case{1000, 0, 16, {16}, layout}, NoLoadReason::lookup_off_chunk_grid);
  }
  CHECK(to_string(NoLoadReason::lookup_off_chunk_grid) == "lookup_off_chunk_grid");
}

TEST_CASE("no_load lookup_beyond_prompt when the lookup claims more tokens than the prompt has") {
  for (const StateLayout layout : all_layouts) {
    check_no_load(Case{500, 0, 512, {256}, layout}, NoLoadReason::lookup_beyond_prompt);
    check_no_load(Case{1000, 0, 1024, {256}, layout}, NoLoadReason::lookup_beyond_prompt);
  }
  // lookup == P is the whole prompt in the tier: allowed.
  CHECK(std::holds_alternative<KvOnlyLoad>(Case{1024, 0, 1024, {}, StateLayout::none}.plan()));
  CHECK(to_string(NoLoadReason::lookup_beyond_prompt) == "lookup_beyond_prompt");
}

TEST_CASE("no_load lookup_within_hbm when the tier holds nothing above the HBM floor") {
  // Dense: lookup below and equal to hbm.
  check_no_load(Case{1000, 512, 256, {}, StateLayout::none}, NoLoadReason::lookup_within_hbm);
  check_no_load(Case{1000, 512, 512, {}, StateLayout::none}, NoLoadReason::lookup_within_hbm);
  check_no_load(Case{1000, 0, 0, {}, StateLayout::none}, NoLoadReason::lookup_within_hbm);
  // Stateful: a boundary above hbm, none at or below it, and nothing in the tier above hbm.
  check_no_load(Case{1000, 512, 512, {640}, StateLayout::k3_recurrent}, NoLoadReason::lookup_within_hbm);
  check_no_load(Case{1000, 0, 0, {400}, StateLayout::k3_recurrent}, NoLoadReason::lookup_within_hbm);
  check_no_load(Case{1000, 0, 0, {400}, StateLayout::dsv4_slot}, NoLoadReason::lookup_within_hbm);
  CHECK(to_string(NoLoadReason::lookup_within_hbm) == "lookup_within_hbm");
}

TEST_CASE("no_load chunk_holds_last_token when every tier chunk above hbm reaches the last prompt token") {
  // P = 256: the one chunk holds token 255, which is always computed.
  check_no_load(Case{256, 0, 256, {}, StateLayout::none}, NoLoadReason::chunk_holds_last_token);
  // P = 512, hbm = 256: chunk [256, 512) holds token 511.
  check_no_load(Case{512, 256, 512, {}, StateLayout::none}, NoLoadReason::chunk_holds_last_token);
  check_no_load(Case{512, 272, 512, {}, StateLayout::none}, NoLoadReason::chunk_holds_last_token);
  // One more prompt token and the chunk is loadable.
  CHECK(Case{257, 0, 256, {}, StateLayout::none}.plan() == LoadPlan{KvOnlyLoad{0, 256}});
  CHECK(to_string(NoLoadReason::chunk_holds_last_token) == "chunk_holds_last_token");
}

TEST_CASE("no_load nothing_servable_above_hbm when no servable boundary lies in the prompt") {
  for (const StateLayout layout : stateful_layouts) {
    check_no_load(Case{1000, 0, 768, {}, layout}, NoLoadReason::nothing_servable_above_hbm);
    // B = P (the last token at a boundary) is never chosen; neither are zero, entries
    // above the prompt or off the block grid.
    check_no_load(Case{1024, 0, 1024, {0, 1024, 1040, 2048, 401}, layout}, NoLoadReason::nothing_servable_above_hbm);
  }
  // Dense models ignore boundaries: an empty servable list is not a reason for them.
  CHECK(std::holds_alternative<KvOnlyLoad>(Case{1000, 0, 768, {}, StateLayout::none}.plan()));
  CHECK(to_string(NoLoadReason::nothing_servable_above_hbm) == "nothing_servable_above_hbm");
}

TEST_CASE("R11 a DSV4 joint load starts from a nonzero HBM floor, as K3's does, and its ranks accept it") {
  // The state at B depends only on the tokens before B, wherever their KV sits.
  for (const StateLayout layout : {StateLayout::dsv4_slot, StateLayout::k3_recurrent}) {
    CAPTURE(to_string(layout));
    CHECK(Case{1000, 256, 768, {400}, layout}.plan() == LoadPlan{JointLoad{256, 512, 400}});
    CHECK(Case{1000, 48, 512, {400, 512}, layout}.plan() == LoadPlan{JointLoad{48, 512, 512}});
    CHECK(Case{1000, 0, 768, {400}, layout}.plan() == LoadPlan{JointLoad{0, 512, 400}});
    // The joint load above the floor is preferred to a state-only load below it.
    CHECK(Case{1000, 256, 768, {128, 400}, layout}.plan() == LoadPlan{JointLoad{256, 512, 400}});
    // What the planner hands out, the ranks take (check_kv_spec and check_state_spec).
    const Case c{1000, 48, 512, {400}, layout};
    CHECK(rank_verdict(c.plan(), c.input()) == Reason::none);
  }
}

TEST_CASE("no_load covering_chunk_beyond_lookup when the chunk covering every boundary is not all in the tier") {
  for (const StateLayout layout : stateful_layouts) {
    // B = 272 needs chunk [256, 512); the tier holds only [0, 256).
    check_no_load(Case{1000, 0, 256, {272}, layout}, NoLoadReason::covering_chunk_beyond_lookup);
    check_no_load(Case{1000, 0, 256, {272, 496, 768}, layout}, NoLoadReason::covering_chunk_beyond_lookup);
  }
  check_no_load(Case{1000, 256, 512, {528}, StateLayout::k3_recurrent}, NoLoadReason::covering_chunk_beyond_lookup);
  CHECK(to_string(NoLoadReason::covering_chunk_beyond_lookup) == "covering_chunk_beyond_lookup");
}

TEST_CASE("no_load load_too_small when the best load spares fewer than the minimum tokens") {
  // Dense spares end - hbm = 256.
  CHECK(Case{1000, 256, 512, {}, StateLayout::none, {16, 256}, 256}.plan() == LoadPlan{KvOnlyLoad{256, 512}});
  check_no_load(Case{1000, 256, 512, {}, StateLayout::none, {16, 256}, 257}, NoLoadReason::load_too_small);
  for (const StateLayout layout : stateful_layouts) {
    // Joint spares all of B = 400 (hbm 0 so DSV4 may load too).
    CHECK(Case{1000, 0, 512, {400}, layout, {16, 256}, 400}.plan() == LoadPlan{JointLoad{0, 512, 400}});
    check_no_load(Case{1000, 0, 512, {400}, layout, {16, 256}, 401}, NoLoadReason::load_too_small);
    // State-only spares B = 128; a lower boundary never rescues a too-small best.
    CHECK(Case{1000, 256, 0, {64, 128}, layout, {16, 256}, 128}.plan() == LoadPlan{StateOnlyLoad{128}});
    check_no_load(Case{1000, 256, 0, {64, 128}, layout, {16, 256}, 129}, NoLoadReason::load_too_small);
  }
  // K3 joint from hbm 256: still spares B = 400, not B - hbm.
  CHECK(Case{1000, 256, 512, {400}, StateLayout::k3_recurrent, {16, 256}, 400}.plan() ==
        LoadPlan{JointLoad{256, 512, 400}});
  CHECK(to_string(NoLoadReason::load_too_small) == "load_too_small");
}

TEST_CASE("no_load slower_than_recompute when every load costs more time than the prefill it spares") {
  // A tier at 1 ns per byte with 1000-byte chunks: a KV leg of n chunks takes latency + 1000 n ns.
  const auto costs = [](double recompute, double latency, std::uint64_t chunk_bytes, std::uint64_t state_bytes) {
    return BreakEven{recompute, 1.0, latency, chunk_bytes, state_bytes};
  };
  // Dense, hbm 0, lookup 768: three chunks (3000 ns) against 768 tokens of prefill.
  Case dense{1000, 0, 768, {}, StateLayout::none, {16, 256}, 0, costs(4.0, 0, 1000, 0)};  // 3072 ns spared
  CHECK(dense.plan() == LoadPlan{KvOnlyLoad{0, 768}});
  dense.cost = costs(3.5, 0, 1000, 0);  // 2688 ns spared
  check_no_load(dense, NoLoadReason::slower_than_recompute);
  dense.cost = costs(4.0, 100, 1000, 0);  // the round trip tips it: 3100 > 3072
  check_no_load(dense, NoLoadReason::slower_than_recompute);
  // From hbm 48 the leg still reads the whole first chunk: 3 chunks for 720 tokens.
  dense.hbm = 48;
  dense.cost = costs(4.2, 0, 1000, 0);  // 3024 spared, 3000 cost
  CHECK(dense.plan() == LoadPlan{KvOnlyLoad{48, 768}});
  dense.cost = costs(4.1, 0, 1000, 0);  // 2952 spared
  check_no_load(dense, NoLoadReason::slower_than_recompute);

  for (const StateLayout layout : stateful_layouts) {
    // A joint load costs the longer leg, not the sum: KV 2 chunks = 2000 ns, state 5000 ns,
    // against B = 400 tokens. At 12.5 ns per token it pays (5000 <= 5000; the sum, 7000, would not).
    Case joint{1000, 0, 512, {400}, layout, {16, 256}, 0, costs(12.5, 0, 1000, 5000)};
    CHECK(joint.plan() == LoadPlan{JointLoad{0, 512, 400}});
    joint.cost = costs(12.0, 0, 1000, 5000);
    check_no_load(joint, NoLoadReason::slower_than_recompute);
    // A lower joint candidate that pays is taken when the higher ones do not, at 16 ns per
    // token and 4000-byte chunks: B = 700 reads 3 chunks (12000 ns > 11200), B = 400 reads 2
    // (8000 > 6400), B = 256 reads 1 (4000 <= 4096).
    Case lower{1000, 0, 768, {256, 400, 700}, layout, {16, 256}, 0, costs(16.0, 0, 4000, 0)};
    CHECK(lower.plan() == LoadPlan{JointLoad{0, 256, 256}});
    // A slow KV leg leaves the state-only load, which moves no KV: from hbm 256, joint B = 600
    // reads 2 chunks of 100000 bytes; the state at 128 (1000 bytes) pays against 128 tokens.
    Case fallback{1000, 256, 768, {128, 600}, layout, {16, 256}, 0, costs(10.0, 0, 100000, 1000)};
    CHECK(fallback.plan() == LoadPlan{StateOnlyLoad{128}});
    fallback.cost = costs(7.0, 0, 100000, 1000);  // 896 < 1000: nothing pays
    check_no_load(fallback, NoLoadReason::slower_than_recompute);
    // Rule 5 then weighs what rule 4 left: the paying load spares 128, the minimum asks 129.
    fallback.cost = costs(10.0, 0, 100000, 1000);
    fallback.min_load = 129;
    check_no_load(fallback, NoLoadReason::load_too_small);
    // Where rule 3 finds no candidate, its own reasons stand.
    check_no_load(Case{1000, 0, 512, {}, layout, {16, 256}, 0, costs(1.0, 1e9, 1000, 1000)},
                  NoLoadReason::nothing_servable_above_hbm);
  }

  // Off: recompute 0 (the default) or NaN: every load pays, however slow the tier.
  for (const double off : {0.0, std::numeric_limits<double>::quiet_NaN()}) {
    Case slow{1000, 0, 768, {}, StateLayout::none, {16, 256}, 0, costs(off, 1e12, 1000000, 0)};
    CHECK_FALSE(slow.cost.enabled());
    CHECK(slow.plan() == LoadPlan{KvOnlyLoad{0, 768}});
  }
  // From a bandwidth: 1 GB/s is 1 ns per byte; an unknown bandwidth (0) reads for free.
  constexpr BreakEven gbps = BreakEven::from_bandwidth(4.0, 1e9, 100, 1000, 0);
  static_assert(gbps.tier_ns_per_byte == 1.0 && gbps.kv_leg_ns(3) == 3100.0 && gbps.enabled());
  static_assert(BreakEven::from_bandwidth(4.0, 0, 100, 1000, 0).kv_leg_ns(3) == 100.0);
  CHECK(to_string(NoLoadReason::slower_than_recompute) == "slower_than_recompute");
}

TEST_CASE("to_string names every NoLoadReason distinctly") {
  std::set<std::string_view> names;
  for (unsigned r = 0; r <= static_cast<unsigned>(last_no_load_reason); ++r) {
    const std::string_view name = to_string(static_cast<NoLoadReason>(r));
    CHECK_FALSE(name.empty());
    CHECK(name != "unknown_no_load_reason");
    names.insert(name);
  }
  CHECK(names.size() == static_cast<std::size_t>(last_no_load_reason) + 1);
  CHECK(to_string(static_cast<NoLoadReason>(static_cast<unsigned>(last_no_load_reason) + 1)) ==
        "unknown_no_load_reason");
}

// ---------------------------------------------------------------------------------------
// Purity and the helpers.

TEST_CASE("plan_load is constexpr and noexcept and allocates nothing") {
  static_assert(noexcept(plan_load(std::declval<const PlanInput&>())));
  static_assert(noexcept(claimed_tokens(std::declval<const LoadPlan&>())));
  static_assert(noexcept(chunk_range(std::declval<const LoadPlan&>(), PlanGrids{})));
  static_assert(noexcept(block_range(std::declval<const LoadPlan&>(), PlanGrids{})));
  static_assert(noexcept(state_boundary(std::declval<const LoadPlan&>())));
  static_assert(std::is_trivially_copyable_v<LoadPlan>);
  static constexpr std::array<TokenCount, 3> servable{128, 400, 1008};
  constexpr PlanInput in{1000, 0, 768, servable, StateLayout::k3_recurrent, PlanGrids{16, 256}, 0};
  static_assert(plan_load(in) == LoadPlan{JointLoad{0, 512, 400}});
  static_assert(claimed_tokens(plan_load(in)) == 400);
  static_assert(chunk_range(plan_load(in), in.grids) == IndexRange{0, 2});

  const std::vector<TokenCount> many{16, 32, 48, 400, 512, 1008};
  REQUIRE(detail::AllocationScope::hook_installed());
  detail::AllocationScope scope;
  TokenCount total = 0;
  for (const StateLayout layout : all_layouts) {
    const PlanInput input{1000, 48, 768, many, layout, PlanGrids{16, 256}, 0};
    const LoadPlan plan = plan_load(input);
    total += claimed_tokens(plan) + chunk_range(plan, input.grids).size() + block_range(plan, input.grids).size() +
             state_boundary(plan).value_or(0);
  }
  CHECK(scope.this_thread() == 0);
  CHECK(total > 0);
}

TEST_CASE("claimed_tokens and the index ranges of each plan kind") {
  const PlanGrids grids{16, 256};
  const LoadPlan kv = KvOnlyLoad{48, 768};
  CHECK(claimed_tokens(kv) == 768);
  CHECK(chunk_range(kv, grids) == IndexRange{0, 3});
  CHECK(block_range(kv, grids) == IndexRange{3, 48});
  CHECK_FALSE(state_boundary(kv).has_value());

  const LoadPlan joint = JointLoad{272, 512, 400};
  CHECK(claimed_tokens(joint) == 400);  // B, never end
  CHECK(chunk_range(joint, grids) == IndexRange{1, 2});
  CHECK(block_range(joint, grids) == IndexRange{17, 32});
  CHECK(state_boundary(joint) == std::optional<TokenCount>{400});

  const LoadPlan state = StateOnlyLoad{496};
  CHECK(claimed_tokens(state) == 496);
  CHECK(chunk_range(state, grids).empty());  // no KV spec at all (R10)
  CHECK(block_range(state, grids).empty());
  CHECK(state_boundary(state) == std::optional<TokenCount>{496});

  const LoadPlan none = NoLoad{NoLoadReason::load_too_small};
  CHECK(claimed_tokens(none) == 0);
  CHECK(chunk_range(none, grids).empty());
  CHECK_FALSE(state_boundary(none).has_value());

  // Invalid grids give empty ranges rather than dividing by zero.
  CHECK(chunk_range(kv, PlanGrids{0, 0}).empty());
  CHECK(block_range(kv, PlanGrids{16, 40}).empty());
}

// ---------------------------------------------------------------------------------------
// 2. The edges the seed got wrong, as a table.

namespace {
struct Row {
  const char* what;
  Case input;
  LoadPlan want;
  IndexRange chunks{};  // expected chunk_range (empty: no KV leg)
  IndexRange blocks{};  // expected block_range
};
}  // namespace

TEST_CASE("planner table of grid and boundary edges for dense and DSV4 and K3") {
  using L = StateLayout;
  const std::vector<Row> rows{
      // The HBM floor off the chunk grid (on the block grid) loads from hbm; keys start at
      // the chunk containing hbm, blocks at hbm / block.
      {"dense floor mid-chunk", {1000, 48, 768, {}, L::none}, KvOnlyLoad{48, 768}, {0, 3}, {3, 48}},
      {"dense floor mid-second-chunk", {1000, 496, 512, {}, L::none}, KvOnlyLoad{496, 512}, {1, 2}, {31, 32}},
      {"k3 floor mid-chunk", {1000, 48, 512, {400}, L::k3_recurrent}, JointLoad{48, 512, 400}, {0, 2}, {3, 32}},
      {"k3 floor and B in one chunk", {1000, 272, 512, {400}, L::k3_recurrent}, JointLoad{272, 512, 400}, {1, 2},
       {17, 32}},
      {"dsv4 floor mid-chunk", {1000, 48, 512, {400}, L::dsv4_slot}, JointLoad{48, 512, 400}, {0, 2}, {3, 32}},
      {"dsv4 floor mid-chunk: the joint load above it beats the state-only one below", {1000, 48, 512, {32, 400}, L::dsv4_slot},
       JointLoad{48, 512, 400}, {0, 2}, {3, 32}},
      // A boundary on the checkpoint grid but not the chunk grid: the KV leg runs to the
      // chunk covering B, the request claims B.
      {"k3 B off chunk grid", {1000, 0, 512, {272}, L::k3_recurrent}, JointLoad{0, 512, 272}, {0, 2}, {0, 32}},
      {"dsv4 B off chunk grid", {1000, 0, 512, {272}, L::dsv4_slot}, JointLoad{0, 512, 272}, {0, 2}, {0, 32}},
      {"k3 B on chunk grid", {1000, 0, 512, {256}, L::k3_recurrent}, JointLoad{0, 256, 256}, {0, 1}, {0, 16}},
      {"k3 end past P-1", {512, 0, 512, {304}, L::k3_recurrent}, JointLoad{0, 512, 304}, {0, 2}, {0, 32}},
      // A lookup shorter than the covering chunk: a lower B, or no load.
      {"k3 lookup short lower B", {1000, 0, 256, {128, 272}, L::k3_recurrent}, JointLoad{0, 256, 128}, {0, 1},
       {0, 16}},
      {"dsv4 lookup short lower B", {1000, 0, 256, {240, 272}, L::dsv4_slot}, JointLoad{0, 256, 240}, {0, 1}, {0, 16}},
      {"k3 lookup short no B", {1000, 0, 256, {272, 400}, L::k3_recurrent},
       NoLoad{NoLoadReason::covering_chunk_beyond_lookup}},
      {"k3 lookup short falls to state-only", {1000, 256, 256, {128, 272}, L::k3_recurrent}, StateOnlyLoad{128}},
      // B <= hbm: the KV is resident, only the state moves, no KV at all.
      {"k3 B below hbm", {1000, 512, 0, {160, 496}, L::k3_recurrent}, StateOnlyLoad{496}},
      {"k3 B equal hbm", {1000, 512, 512, {512}, L::k3_recurrent}, StateOnlyLoad{512}},
      {"dsv4 B below hbm", {1000, 512, 0, {160, 496}, L::dsv4_slot}, StateOnlyLoad{496}},
      {"k3 hbm above prompt", {600, 640, 512, {512, 592, 608}, L::k3_recurrent}, StateOnlyLoad{592}},
      // The highest servable boundary among several; joint wins over state-only.
      {"k3 highest of several", {2000, 0, 1024, {64, 512, 700, 1008, 1040}, L::k3_recurrent},
       JointLoad{0, 1024, 1008}, {0, 4}, {0, 64}},
      {"k3 highest of several unsorted", {2000, 0, 1024, {1040, 64, 1008, 512, 1008}, L::k3_recurrent},
       JointLoad{0, 1024, 1008}, {0, 4}, {0, 64}},
      {"dsv4 highest of several", {2000, 0, 1024, {64, 512, 1008, 1040}, L::dsv4_slot}, JointLoad{0, 1024, 1008},
       {0, 4}, {0, 64}},
      {"k3 joint beats state-only", {1000, 256, 512, {128, 256, 400}, L::k3_recurrent}, JointLoad{256, 512, 400},
       {1, 2}, {16, 32}},
      {"k3 off-grid boundary ignored", {1000, 0, 512, {401, 384}, L::k3_recurrent}, JointLoad{0, 512, 384}, {0, 2},
       {0, 32}},
      // The last prompt token at a boundary: B = P is never chosen.
      {"k3 last token at boundary", {512, 0, 512, {496, 512}, L::k3_recurrent}, JointLoad{0, 512, 496}, {0, 2},
       {0, 32}},
      {"dsv4 last token at boundary", {512, 0, 512, {496, 512}, L::dsv4_slot}, JointLoad{0, 512, 496}, {0, 2},
       {0, 32}},
      {"k3 only B = P", {512, 0, 512, {512}, L::k3_recurrent}, NoLoad{NoLoadReason::nothing_servable_above_hbm}},
      {"k3 B = P - 1 on a fine grid", {17, 0, 16, {16}, L::k3_recurrent, {4, 16}}, JointLoad{0, 16, 16}, {0, 1},
       {0, 4}},
      {"dense P on chunk grid", {512, 0, 512, {}, L::none}, KvOnlyLoad{0, 256}, {0, 1}, {0, 16}},
      {"dense P one past chunk grid", {513, 0, 512, {}, L::none}, KvOnlyLoad{0, 512}, {0, 2}, {0, 32}},
      {"dense lookup caps end", {2000, 0, 512, {}, L::none}, KvOnlyLoad{0, 512}, {0, 2}, {0, 32}},
      {"dense ignores boundaries", {1000, 0, 768, {400, 999}, L::none}, KvOnlyLoad{0, 768}, {0, 3}, {0, 48}},
      {"dense 96-token chunks", {1000, 32, 960, {}, L::none, {32, 96}}, KvOnlyLoad{32, 960}, {0, 10}, {1, 30}},
  };
  for (const Row& row : rows) {
    const PlanInput in = row.input.input();
    const LoadPlan got = plan_load(in);
    INFO(row.what, ": ", describe(in), " -> ", describe(got));
    CHECK(got == row.want);
    CHECK(chunk_range(got, in.grids) == row.chunks);
    CHECK(block_range(got, in.grids) == row.blocks);
    if (!std::holds_alternative<NoLoad>(got)) {
      CHECK(claimed_tokens(got) < in.prompt_tokens);
      CHECK(rank_verdict(got, in) == Reason::none);
    }
    if (const auto* joint = std::get_if<JointLoad>(&got)) CHECK(claimed_tokens(got) == joint->boundary);
  }
}

// ---------------------------------------------------------------------------------------
// 3. A brute-force reference planner, written from the planner contract without looking at the
// planner's arithmetic: it enumerates every candidate end / boundary on the grids, checks
// each chunk the KV leg would read against the tier one by one, and picks by the rules.

namespace {

LoadPlan reference_plan(const PlanInput& in) {
  const std::uint64_t block = in.grids.block_tokens, chunk = in.grids.chunk_tokens;
  if (block == 0 || chunk == 0 || chunk % block != 0) return NoLoad{NoLoadReason::bad_grids};
  const bool dense = in.layout == StateLayout::none;
  const bool dsv4 = in.layout == StateLayout::dsv4_slot;
  if (!dense && !dsv4 && in.layout != StateLayout::k3_recurrent) return NoLoad{NoLoadReason::unknown_layout};
  const TokenCount P = in.prompt_tokens, hbm = in.hbm, lookup = in.lookup_tokens;
  if (P == 0) return NoLoad{NoLoadReason::empty_prompt};
  __extension__ typedef unsigned __int128 Wide;
  if ((Wide{P} + chunk - 1) / chunk * chunk > std::numeric_limits<TokenCount>::max())
    return NoLoad{NoLoadReason::prompt_too_long_for_grids};  // the last chunk's end does not fit
  if (hbm % block != 0) return NoLoad{NoLoadReason::hbm_off_block_grid};
  if (lookup % chunk != 0) return NoLoad{NoLoadReason::lookup_off_chunk_grid};
  if (lookup > P) return NoLoad{NoLoadReason::lookup_beyond_prompt};

  // Chunk c holds tokens [c * chunk, (c + 1) * chunk); the tier holds the leading run.
  auto tier_holds = [&](std::uint64_t c) { return (c + 1) * chunk <= lookup; };
  // Every chunk overlapping [hbm, end) is in the tier.
  auto leg_available = [&](TokenCount end) {
    for (std::uint64_t c = hbm / chunk; c * chunk < end; ++c)
      if (!tier_holds(c)) return false;
    return true;
  };
  bool tier_above_hbm = false;  // some tier chunk holds a token at or above hbm
  for (std::uint64_t c = 0; tier_holds(c); ++c)
    if ((c + 1) * chunk > hbm) tier_above_hbm = true;

  // Every feasible plan, then the one that claims the most.
  std::vector<LoadPlan> feasible;
  bool boundary_above = false;
  if (dense) {
    for (TokenCount end = chunk; end <= P; end += chunk)
      if (end > hbm && end < P && leg_available(end)) feasible.emplace_back(KvOnlyLoad{hbm, end});
    if (feasible.empty())
      return NoLoad{tier_above_hbm ? NoLoadReason::chunk_holds_last_token : NoLoadReason::lookup_within_hbm};
  } else {
    std::vector<bool> servable(P + 1, false);
    for (const TokenCount b : in.servable_boundaries)
      if (b <= P) servable[b] = true;
    for (TokenCount b = block; b < P; b += block) {
      if (!servable[b]) continue;
      if (b <= hbm) {
        feasible.emplace_back(StateOnlyLoad{b});
        continue;
      }
      boundary_above = true;
      TokenCount end = 0;
      while (end < b) end += chunk;  // the chunk covering b
      if (leg_available(end)) feasible.emplace_back(JointLoad{hbm, end, b});
    }
    if (feasible.empty()) {
      if (!boundary_above) return NoLoad{NoLoadReason::nothing_servable_above_hbm};
      if (!tier_above_hbm) return NoLoad{NoLoadReason::lookup_within_hbm};
      return NoLoad{NoLoadReason::covering_chunk_beyond_lookup};
    }
  }
  // What each plan lets the request skip: the KV end, or the boundary (never a joint end).
  auto claim = [](const LoadPlan& p) -> TokenCount {
    if (const auto* kv = std::get_if<KvOnlyLoad>(&p)) return kv->end;
    if (const auto* joint = std::get_if<JointLoad>(&p)) return joint->boundary;
    return std::get<StateOnlyLoad>(p).boundary;
  };
  // Break-even, weighed on every feasible plan: the time of its legs (run at once: the
  // longer counts) against the prefill it spares (dense: above hbm; stateful: from 0).
  const BreakEven& cost = in.break_even;
  auto load_ns = [&](const LoadPlan& p) {
    double kv = 0, state = 0;
    if (const auto range = kv_tokens(p)) {
      std::uint64_t chunks_read = 0;
      for (std::uint64_t c = 0; c * chunk < range->last; ++c)
        if ((c + 1) * chunk > range->first) ++chunks_read;
      kv = cost.tier_latency_ns + static_cast<double>(chunks_read * cost.kv_chunk_bytes) * cost.tier_ns_per_byte;
    }
    if (state_boundary(p)) state = cost.tier_latency_ns + static_cast<double>(cost.state_bytes) * cost.tier_ns_per_byte;
    return kv > state ? kv : state;
  };
  if (cost.recompute_ns_per_token > 0) {
    std::vector<LoadPlan> paying;
    for (const LoadPlan& p : feasible) {
      const TokenCount spared = claim(p) - (dense ? hbm : 0);
      if (load_ns(p) <= static_cast<double>(spared) * cost.recompute_ns_per_token) paying.push_back(p);
    }
    if (paying.empty()) return NoLoad{NoLoadReason::slower_than_recompute};
    feasible = std::move(paying);
  }
  const LoadPlan* best = &feasible.front();
  for (const LoadPlan& p : feasible)
    if (claim(p) > claim(*best)) best = &p;
  const TokenCount spared = claim(*best) - (dense ? hbm : 0);
  if (spared < in.min_load_tokens) return NoLoad{NoLoadReason::load_too_small};
  return *best;
}

/// A random input: grids among a few valid pairs (rarely invalid), each layout, P, hbm on
/// the block grid (rarely off it), lookup on the chunk grid (rarely off it or beyond P), a
/// random servable set of some density, sometimes shuffled, sometimes with junk entries.
Case random_case(std::mt19937_64& rng) {
  auto pick = [&](std::uint64_t n) { return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng); };
  auto chance = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  static constexpr std::array<PlanGrids, 7> valid{PlanGrids{16, 256}, PlanGrids{16, 64}, PlanGrids{8, 32},
                                                  PlanGrids{4, 16},   PlanGrids{16, 16}, PlanGrids{32, 96},
                                                  PlanGrids{4, 4}};
  static constexpr std::array<PlanGrids, 3> invalid{PlanGrids{0, 256}, PlanGrids{16, 0}, PlanGrids{16, 40}};
  Case c;
  c.grids = chance(0.003) ? invalid[pick(invalid.size())] : valid[pick(valid.size())];
  c.layout = chance(0.002) ? static_cast<StateLayout>(3 + pick(5)) : all_layouts[pick(all_layouts.size())];
  const std::uint64_t block = std::max<std::uint32_t>(c.grids.block_tokens, 1);
  const std::uint64_t chunk = std::max<std::uint32_t>(c.grids.chunk_tokens, 1);

  c.prompt = 1 + pick(8 * chunk);
  if (chance(0.3)) c.prompt = std::max(block, c.prompt - c.prompt % block);  // last token at a boundary
  if (chance(0.003)) c.prompt = 0;
  const TokenCount top = std::numeric_limits<TokenCount>::max();
  if (const TokenCount spill = top % chunk; spill > 0 && chance(0.002)) {
    // A prompt that ends in the partial cell above the last whole chunk (its covering chunk
    // would end past 2^64 - 1), with a floor, lookup and boundaries near it.
    c.prompt = top - pick(spill);
    c.hbm = c.prompt - c.prompt % chunk - chunk * pick(4);
    c.lookup = c.hbm;
    c.servable = {c.hbm, c.hbm + block};
    return c;
  }

  if (!chance(0.4)) c.hbm = pick(c.prompt / block + 2) * block;
  if (chance(0.005)) c.hbm += 1 + pick(block);

  const std::uint64_t whole_chunks = c.prompt / chunk;
  c.lookup = chance(0.4) ? whole_chunks * chunk : pick(whole_chunks + 1) * chunk;
  if (chance(0.005)) c.lookup += 1 + pick(chunk);
  if (chance(0.005)) c.lookup = (whole_chunks + 1) * chunk;

  static constexpr std::array<double, 6> densities{0.0, 0.02, 0.1, 0.3, 0.7, 1.0};
  const double density = densities[pick(densities.size())];
  for (std::uint64_t b = 0; b <= c.prompt + chunk; b += block)
    if (chance(density)) c.servable.push_back(b);
  if (chance(0.02)) c.servable.push_back(1 + pick(c.prompt + 1));  // maybe off the grid
  if (chance(0.3)) std::shuffle(c.servable.begin(), c.servable.end(), rng);
  else std::sort(c.servable.begin(), c.servable.end());

  if (chance(0.4)) c.min_load = pick(c.prompt + 1);
  if (chance(0.3)) {
    // Costs in multiples of 1/8 ns per token and 1/64 ns per byte, with whole latencies and
    // byte counts: every time the planner and the reference compute is exact in a double,
    // so a tie is a tie for both.
    c.cost.recompute_ns_per_token = static_cast<double>(pick(64)) / 8;  // sometimes 0: off
    c.cost.tier_ns_per_byte = static_cast<double>(pick(65)) / 64;
    c.cost.tier_latency_ns = static_cast<double>(chance(0.5) ? 0 : pick(4000));
    c.cost.kv_chunk_bytes = pick(8 * chunk + 1);
    c.cost.state_bytes = chance(0.2) ? 0 : pick(16 * chunk + 1);
  }
  return c;
}

}  // namespace

TEST_CASE("planner agrees with a brute-force reference on 100000 random inputs") {
  constexpr std::uint64_t seed = 0x6b7666757365ULL;  // "kvfuse"
  constexpr int inputs = 100000;
  std::mt19937_64 rng(seed);
  std::array<int, 4> kinds{};  // no_load, kv_only, joint, state_only
  std::array<int, static_cast<std::size_t>(last_no_load_reason) + 1> reasons{};
  std::array<std::array<int, 4>, 3> kinds_by_layout{};
  int mismatches = 0, rank_refusals = 0, broken_promises = 0;
  for (int i = 0; i < inputs; ++i) {
    const Case c = random_case(rng);
    const PlanInput in = c.input();
    const LoadPlan got = plan_load(in);
    const LoadPlan want = reference_plan(in);
    if (got != want && ++mismatches <= 10) {
      INFO("input #", i, ": ", describe(in));
      CHECK(got == want);
    }
    ++kinds[got.index()];
    if (static_cast<unsigned>(c.layout) < 3) ++kinds_by_layout[static_cast<unsigned>(c.layout)][got.index()];
    if (const auto* no = std::get_if<NoLoad>(&got)) {
      ++reasons[static_cast<std::size_t>(no->reason)];
      continue;
    }
    // Promises checked directly, whatever the reference says.
    const bool dense = c.layout == StateLayout::none;
    bool kept = claimed_tokens(got) >= 1 && claimed_tokens(got) <= c.prompt - 1;
    if (const auto* kv = std::get_if<KvOnlyLoad>(&got))
      kept = kept && dense && kv->hbm == c.hbm && kv->end <= c.lookup;
    if (const auto* joint = std::get_if<JointLoad>(&got))
      kept = kept && !dense && joint->hbm == c.hbm && joint->boundary > c.hbm && joint->end <= c.lookup &&
             std::find(c.servable.begin(), c.servable.end(), joint->boundary) != c.servable.end();
    if (const auto* state = std::get_if<StateOnlyLoad>(&got))
      kept = kept && !dense && state->boundary <= c.hbm &&
             std::find(c.servable.begin(), c.servable.end(), state->boundary) != c.servable.end();
    if (!kept && ++broken_promises <= 10) {
      INFO("input #", i, ": ", describe(in), " -> ", describe(got));
      CHECK(kept);
    }
    if (rank_verdict(got, in) != Reason::none && ++rank_refusals <= 10) {
      INFO("input #", i, ": ", describe(in), " -> ", describe(got));
      CHECK(rank_verdict(got, in) == Reason::none);
    }
  }
  CHECK(mismatches == 0);
  CHECK(broken_promises == 0);
  CHECK(rank_refusals == 0);

  std::string report = "seed " + std::to_string(seed) + ": no_load " + std::to_string(kinds[0]) + ", kv_only " +
                       std::to_string(kinds[1]) + ", joint " + std::to_string(kinds[2]) + ", state_only " +
                       std::to_string(kinds[3]) + "\n";
  for (std::size_t l = 0; l < all_layouts.size(); ++l)
    report += "  " + std::string(to_string(all_layouts[l])) + ": no_load " + std::to_string(kinds_by_layout[l][0]) +
              " kv_only " + std::to_string(kinds_by_layout[l][1]) + " joint " + std::to_string(kinds_by_layout[l][2]) +
              " state_only " + std::to_string(kinds_by_layout[l][3]) + "\n";
  for (std::size_t r = 0; r < reasons.size(); ++r)
    report += "  " + std::string(to_string(static_cast<NoLoadReason>(r))) + " " + std::to_string(reasons[r]) + "\n";
  MESSAGE(report);
  for (const int n : kinds) CHECK(n > 0);
  for (std::size_t r = 0; r < reasons.size(); ++r) {
    INFO(to_string(static_cast<NoLoadReason>(r)));
    CHECK(reasons[r] > 0);
  }
  CHECK(kinds_by_layout[0][1] > 0);  // dense kv_only
  for (const std::size_t l : {1u, 2u}) {
    CHECK(kinds_by_layout[l][1] == 0);  // a stateful model never gets a KV-only load
    CHECK(kinds_by_layout[l][2] > 0);
    CHECK(kinds_by_layout[l][3] > 0);
  }
  CHECK(kinds_by_layout[0][2] == 0);
  CHECK(kinds_by_layout[0][3] == 0);
}

// ---------------------------------------------------------------------------------------
// 4. The top of the token range: a prompt near 2^64 tokens, grids that do not divide 2^64.
// Grid arithmetic that would wrap is refused (R11), never wrapped; everything below that
// plans as it does for small prompts.

namespace {

// 128-bit arithmetic: room above 2^64, so the reference cannot wrap where the planner might.
__extension__ typedef unsigned __int128 Wide;
constexpr Wide token_max = std::numeric_limits<TokenCount>::max();
constexpr TokenCount top = std::numeric_limits<TokenCount>::max();
Wide wide_ceil(Wide t, Wide step) { return (t + step - 1) / step * step; }

constexpr NoLoadReason too_long = NoLoadReason::prompt_too_long_for_grids;

/// The planner contract in 128-bit arithmetic, for inputs of any size whose prompt is within
/// a few chunks of its HBM floor (it walks the chunks and boundaries above hbm one by one).
LoadPlan wide_reference_plan(const PlanInput& in) {
  const Wide block = in.grids.block_tokens, chunk = in.grids.chunk_tokens;
  if (block == 0 || chunk == 0 || chunk % block != 0) return NoLoad{NoLoadReason::bad_grids};
  const bool dense = in.layout == StateLayout::none;
  const bool dsv4 = in.layout == StateLayout::dsv4_slot;
  if (!dense && !dsv4 && in.layout != StateLayout::k3_recurrent) return NoLoad{NoLoadReason::unknown_layout};
  const Wide P = in.prompt_tokens, hbm = in.hbm, lookup = in.lookup_tokens;
  if (P == 0) return NoLoad{NoLoadReason::empty_prompt};
  if (wide_ceil(P, chunk) > token_max) return NoLoad{too_long};  // the last chunk's end does not fit
  if (hbm % block != 0) return NoLoad{NoLoadReason::hbm_off_block_grid};
  if (lookup % chunk != 0) return NoLoad{NoLoadReason::lookup_off_chunk_grid};
  if (lookup > P) return NoLoad{NoLoadReason::lookup_beyond_prompt};

  auto tier_holds = [&](Wide c) { return (c + 1) * chunk <= lookup; };  // chunk c: [c * chunk, (c + 1) * chunk)
  auto leg_available = [&](Wide end) {
    for (Wide c = hbm / chunk; c * chunk < end; ++c)
      if (!tier_holds(c)) return false;
    return true;
  };
  // The tier holds a leading run of chunks, so it holds a token at or above hbm exactly when
  // it holds the chunk containing hbm.
  const bool tier_above_hbm = tier_holds(hbm / chunk);

  std::vector<LoadPlan> feasible;
  bool boundary_above = false;
  if (dense) {
    for (Wide end = (hbm / chunk + 1) * chunk; end < P; end += chunk)
      if (leg_available(end)) feasible.emplace_back(KvOnlyLoad{in.hbm, static_cast<TokenCount>(end)});
    if (feasible.empty())
      return NoLoad{tier_above_hbm ? NoLoadReason::chunk_holds_last_token : NoLoadReason::lookup_within_hbm};
  } else {
    std::set<TokenCount> candidates(in.servable_boundaries.begin(), in.servable_boundaries.end());
    for (const TokenCount tb : candidates) {
      const Wide b = tb;
      if (b == 0 || b >= P || b % block != 0) continue;
      if (b <= hbm) {
        feasible.emplace_back(StateOnlyLoad{tb});
        continue;
      }
      boundary_above = true;
      const Wide end = wide_ceil(b, chunk);
      if (leg_available(end)) feasible.emplace_back(JointLoad{in.hbm, static_cast<TokenCount>(end), tb});
    }
    if (feasible.empty()) {
      if (!boundary_above) return NoLoad{NoLoadReason::nothing_servable_above_hbm};
      if (!tier_above_hbm) return NoLoad{NoLoadReason::lookup_within_hbm};
      return NoLoad{NoLoadReason::covering_chunk_beyond_lookup};
    }
  }
  auto claim = [](const LoadPlan& p) -> TokenCount {
    if (const auto* kv = std::get_if<KvOnlyLoad>(&p)) return kv->end;
    if (const auto* joint = std::get_if<JointLoad>(&p)) return joint->boundary;
    return std::get<StateOnlyLoad>(p).boundary;
  };
  const LoadPlan* best = &feasible.front();
  for (const LoadPlan& p : feasible)
    if (claim(p) > claim(*best)) best = &p;
  const TokenCount spared = claim(*best) - (dense ? in.hbm : 0);
  if (spared < in.min_load_tokens) return NoLoad{NoLoadReason::load_too_small};
  return *best;
}

/// A large input: P anywhere up to 2^64 - 1 (a third of them within three chunks of the top),
/// hbm within eight chunks below P, a lookup and boundaries around them.
Case large_case(std::mt19937_64& rng) {
  auto pick = [&](std::uint64_t n) { return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng); };
  static constexpr std::array<PlanGrids, 8> grids{PlanGrids{8, 24},  PlanGrids{16, 48}, PlanGrids{16, 80},
                                                  PlanGrids{24, 72}, PlanGrids{4, 12},  PlanGrids{16, 256},
                                                  PlanGrids{1, 3},   PlanGrids{40, 120}};
  Case c;
  c.grids = grids[pick(grids.size())];
  c.layout = all_layouts[pick(all_layouts.size())];
  const std::uint64_t block = c.grids.block_tokens, chunk = c.grids.chunk_tokens;
  const TokenCount last_chunk = top - top % chunk;  // the largest multiple of the chunk that fits
  switch (pick(3)) {
    case 0: c.prompt = top - pick(3 * chunk); break;               // the very top, often too long
    case 1: c.prompt = last_chunk - pick(2 * chunk) + pick(2 * chunk); break;  // around the last whole chunk
    default: c.prompt = std::max<TokenCount>(rng(), 16 * chunk); break;        // anywhere large
  }
  const TokenCount below = std::min<TokenCount>(c.prompt, 8 * chunk);
  c.hbm = c.prompt - below + pick(below + 1);
  c.hbm -= c.hbm % block;
  if (pick(50) == 0) c.hbm += 1 + pick(block);  // off the block grid, now and then
  const TokenCount lookup_floor = c.hbm > 2 * chunk ? c.hbm - 2 * chunk : 0;
  c.lookup = lookup_floor + pick(c.prompt - lookup_floor + 1);
  c.lookup -= c.lookup % chunk;
  if (pick(50) == 0) c.lookup += 1 + pick(chunk - 1 + (chunk == 1));
  const std::size_t n = pick(6);
  for (std::size_t i = 0; i < n; ++i) {
    const TokenCount span = c.prompt - lookup_floor + chunk;
    TokenCount b = lookup_floor + pick(span);
    if (b < lookup_floor) b = top;  // wrapped past the top: keep a junk entry
    if (pick(4) != 0) b -= b % block;
    c.servable.push_back(b);
  }
  if (pick(4) == 0) c.min_load = pick(3 * chunk);
  return c;
}

}  // namespace

TEST_CASE("R11 a prompt whose chunk grid would run past 2^64 - 1 tokens is refused, never wrapped") {
  for (const PlanGrids grids : {PlanGrids{8, 24}, PlanGrids{16, 48}, PlanGrids{16, 80}}) {
    const TokenCount chunk = grids.chunk_tokens, block = grids.block_tokens;
    const TokenCount last_chunk = top - 15;  // 2^64 = 16 (mod 24, 48, 80)
    REQUIRE(last_chunk % chunk == 0);
    const TokenCount hbm = last_chunk - 3 * chunk;
    for (const StateLayout layout : all_layouts) {
      INFO("grids ", grids.block_tokens, "/", chunk, " layout ", to_string(layout));
      // The prompt's last chunk would end past 2^64 - 1: refused, whatever else is asked.
      for (const TokenCount prompt : {top, top - 1, last_chunk + 1}) {
        const Case c{prompt, hbm, last_chunk, {last_chunk, last_chunk - block, hbm - block}, layout, grids};
        check_no_load(c, too_long);
        const Case from_zero{prompt, 0, last_chunk, {last_chunk}, layout, grids};
        check_no_load(from_zero, too_long);
      }
    }
    // A prompt of exactly the last whole chunk plans as any other, its arithmetic exact.
    const TokenCount P = last_chunk;
    const Case dense{P, hbm, P, {}, StateLayout::none, grids};
    const LoadPlan d = dense.plan();
    CHECK(d == LoadPlan{KvOnlyLoad{hbm, P - chunk}});
    CHECK(chunk_range(d, grids) == IndexRange{hbm / chunk, P / chunk - 1});
    CHECK(block_range(d, grids) == IndexRange{hbm / block, (P - chunk) / block});
    CHECK(rank_verdict(d, dense.input()) == Reason::none);
    const Case k3{P, hbm, P, {P - block, P}, StateLayout::k3_recurrent, grids};
    const LoadPlan j = k3.plan();
    CHECK(j == LoadPlan{JointLoad{hbm, P, P - block}});
    CHECK(chunk_range(j, grids) == IndexRange{hbm / chunk, P / chunk});
    CHECK(block_range(j, grids) == IndexRange{hbm / block, P / block});
    CHECK(rank_verdict(j, k3.input()) == Reason::none);
    const Case state_only{P, P - chunk, 0, {P - chunk - block}, StateLayout::dsv4_slot, grids};
    CHECK(state_only.plan() == LoadPlan{StateOnlyLoad{P - chunk - block}});
  }
  CHECK(to_string(NoLoadReason::prompt_too_long_for_grids) == "prompt_too_long_for_grids");
}

TEST_CASE("planner agrees with a 128-bit reference on 20000 inputs near 2^64 tokens") {
  std::mt19937_64 rng(0x746f70ULL);  // "top"
  constexpr int inputs = 20000;
  std::array<int, 4> kinds{};
  int too_long_seen = 0, mismatches = 0, rank_refusals = 0, bad_ranges = 0;
  for (int i = 0; i < inputs; ++i) {
    const Case c = large_case(rng);
    const PlanInput in = c.input();
    const LoadPlan got = plan_load(in);
    const LoadPlan want = wide_reference_plan(in);
    if (got != want && ++mismatches <= 10) {
      INFO("input #", i, ": ", describe(in));
      CHECK(got == want);
    }
    ++kinds[got.index()];
    if (const auto* no = std::get_if<NoLoad>(&got)) {
      too_long_seen += no->reason == too_long;
      continue;
    }
    // The index ranges, from 128-bit arithmetic: never wrapped.
    if (const std::optional<IndexRange> kv = kv_tokens(got)) {
      const IndexRange tokens = *kv;
      const Wide chunk = c.grids.chunk_tokens, block = c.grids.block_tokens;
      const bool ok = chunk_range(got, c.grids) == IndexRange{static_cast<std::uint64_t>(tokens.first / chunk),
                                                               static_cast<std::uint64_t>(wide_ceil(tokens.last, chunk) / chunk)} &&
                      block_range(got, c.grids) == IndexRange{static_cast<std::uint64_t>(tokens.first / block),
                                                               static_cast<std::uint64_t>(wide_ceil(tokens.last, block) / block)} &&
                      tokens.first < tokens.last;
      if (!ok && ++bad_ranges <= 10) {
        INFO("input #", i, ": ", describe(in), " -> ", describe(got));
        CHECK(ok);
      }
    }
    if (rank_verdict(got, in) != Reason::none && ++rank_refusals <= 10) {
      INFO("input #", i, ": ", describe(in), " -> ", describe(got));
      CHECK(rank_verdict(got, in) == Reason::none);
    }
  }
  CHECK(mismatches == 0);
  CHECK(bad_ranges == 0);
  CHECK(rank_refusals == 0);
  MESSAGE("no_load ", kinds[0], " (too long ", too_long_seen, "), kv_only ", kinds[1], ", joint ", kinds[2],
          ", state_only ", kinds[3]);
  for (const int n : kinds) CHECK(n > 0);
  CHECK(too_long_seen > 0);
}
