// The checkpoint policy (docs/reference.md#checkpoint-policy): a table of the edges, the top
// of the token range, the generation-end checkpoint, the policy names, and a property test
// against a brute-force reference written independently here: it walks every block boundary
// in (resume, P - 1] in 128-bit arithmetic, decides each one's membership from the rules as
// stated, and applies the cap by priority.
#include <doctest/doctest.h>

#include <kvfuse/engine/checkpoint_policy.hpp>
#include <kvfuse/testing/alloc_counter.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;

namespace {

constexpr TokenCount top = std::numeric_limits<TokenCount>::max();
constexpr std::uint32_t u32_max = std::numeric_limits<std::uint32_t>::max();
constexpr PlanGrids grids16x64{16, 64};
/// The value plan_checkpoints must leave in every element past the count it returns.
constexpr TokenCount untouched = 0xdeadbeefcafef00dULL;

std::string describe(const CheckpointPolicy& p) {
  return "{branch " + std::to_string(p.at_branch) + " end " + std::to_string(p.at_prompt_end) + " every " +
         std::to_string(p.every_chunks) + " gen " + std::to_string(p.at_generation_end) + " max " +
         std::to_string(p.max_prefill) + "}";
}

std::string describe(const CheckpointInput& in, std::size_t out_size) {
  return "P " + std::to_string(in.prompt_tokens) + " resume " + std::to_string(in.resume) + " branch " +
         std::to_string(in.branch) + " grids " + std::to_string(in.grids.block_tokens) + "/" +
         std::to_string(in.grids.chunk_tokens) + " policy " + describe(in.policy) + " out " + std::to_string(out_size);
}

std::string describe(const std::vector<TokenCount>& v) {
  std::string s = "{";
  for (const TokenCount b : v) s += " " + std::to_string(b);
  return s + " }";
}

/// plan_checkpoints into a span of `out_size`, checking it wrote nothing past its count.
std::vector<TokenCount> plan(const CheckpointInput& in, std::size_t out_size) {
  std::vector<TokenCount> out(out_size + 8, untouched);
  const std::size_t n = plan_checkpoints(in, std::span<TokenCount>(out.data(), out_size));
  REQUIRE(n <= out_size);
  const auto past = out.begin() + static_cast<std::ptrdiff_t>(n);
  REQUIRE(std::all_of(past, out.end(), [](TokenCount t) { return t == untouched; }));
  out.resize(n);
  return out;
}

CheckpointPolicy with_cap(CheckpointPolicy p, std::uint32_t cap) {
  p.max_prefill = cap;
  return p;
}
CheckpointPolicy without_branch(CheckpointPolicy p) {
  p.at_branch = false;
  return p;
}
CheckpointPolicy without_prompt_end(CheckpointPolicy p) {
  p.at_prompt_end = false;
  return p;
}

/// One row of the edge table.
struct Row {
  const char* what;
  TokenCount prompt, resume, branch;
  PlanGrids grids;
  CheckpointPolicy policy;
  std::size_t out_size;
  std::vector<TokenCount> want;
};

void check_rows(const std::vector<Row>& rows) {
  for (const Row& row : rows) {
    const CheckpointInput in{row.prompt, row.resume, row.branch, row.grids, row.policy};
    INFO(row.what, ": ", describe(in, row.out_size));
    const std::vector<TokenCount> got = plan(in, row.out_size);
    INFO("got ", describe(got), " want ", describe(row.want));
    CHECK(got == row.want);
    CHECK(std::min(count_checkpoints(in), row.out_size) == row.want.size());
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Purity.

TEST_CASE("checkpoint policy functions are constexpr and noexcept and allocate nothing") {
  static_assert(noexcept(plan_checkpoints(std::declval<const CheckpointInput&>(), std::span<TokenCount>{})));
  static_assert(noexcept(count_checkpoints(std::declval<const CheckpointInput&>())));
  static_assert(noexcept(generation_end_checkpoint(0, PlanGrids{}, CheckpointPolicy{})));
  static_assert(noexcept(find_checkpoint_policy(std::string_view{})));
  static_assert([] {
    std::array<TokenCount, 8> out{};
    const std::size_t n = plan_checkpoints(CheckpointInput{5000, 0, 2000, grids16x64, {}}, out);
    return n == 4 && out[0] == 2000 && out[1] == 4096 && out[2] == 4608 && out[3] == 4992;
  }());
  static_assert(count_checkpoints(CheckpointInput{5000, 0, 2000, grids16x64, {}}) == 4);
  static_assert(generation_end_checkpoint(1000, grids16x64, CheckpointPolicy{}) == TokenCount{960});
  static_assert(find_checkpoint_policy("every:3") == CheckpointPolicy::every(3));

  REQUIRE(detail::AllocationScope::hook_installed());
  std::array<TokenCount, 64> out{};
  TokenCount total = 0;
  detail::AllocationScope scope;
  for (const CheckpointPolicy policy :
       {CheckpointPolicy{}, CheckpointPolicy::last(), CheckpointPolicy::all(), CheckpointPolicy::every(2)}) {
    const CheckpointInput in{4000, 100, 1500, grids16x64, policy};
    const std::size_t n = plan_checkpoints(in, out);
    total += n + count_checkpoints(in) + generation_end_checkpoint(4100, grids16x64, policy).value_or(0);
    for (std::size_t i = 0; i < n; ++i) total += out[i];
  }
  total += find_checkpoint_policy("every:12").has_value();
  CHECK(scope.this_thread() == 0);
  CHECK(total > 0);
}

// ---------------------------------------------------------------------------------------
// The edges, by hand. Grids 16/64 unless said: the default policy's stride is 8 x 64 = 512.

TEST_CASE("checkpoint table of resume and prompt-length edges") {
  const CheckpointPolicy d{};
  check_rows({
      {"resume on a boundary excludes it", 1000, 512, 0, grids16x64, d, 8, {960}},
      {"resume one below a boundary keeps it", 1000, 511, 0, grids16x64, d, 8, {512, 960}},
      {"resume on the prompt end excludes everything", 1000, 960, 0, grids16x64, d, 8, {}},
      {"resume at P - 1", 1000, 999, 0, grids16x64, d, 8, {}},
      {"resume beyond P", 1000, 5000, 0, grids16x64, d, 8, {}},
      {"P on a chunk boundary: P - 1 floors below it", 1024, 0, 0, grids16x64, d, 8, {512, 960}},
      {"P one past a chunk boundary: that boundary is P - 1", 1025, 0, 0, grids16x64, d, 8, {512, 1024}},
      {"P on a stride boundary: the stride boundary is P itself, excluded", 512, 0, 0, grids16x64, d, 8, {448}},
      {"P within the first chunk: no chunk boundary below P - 1", 64, 0, 0, grids16x64, d, 8, {}},
      {"P one past the first chunk", 65, 0, 0, grids16x64, d, 8, {64}},
      {"P = 1", 1, 0, 0, grids16x64, CheckpointPolicy::all(), 8, {}},
      {"P = 0", 0, 0, 0, grids16x64, CheckpointPolicy::all(), 8, {}},
      {"grids 24/72 that are no powers of two", 1000, 0, 300, PlanGrids{24, 72}, d, 8, {288, 576, 936}},
  });
}

TEST_CASE("checkpoint table of branch-point edges") {
  const CheckpointPolicy d{};
  check_rows({
      {"branch at 0 is no checkpoint", 1000, 0, 0, grids16x64, d, 8, {512, 960}},
      {"branch below the first block floors to 0", 1000, 0, 15, grids16x64, d, 8, {512, 960}},
      {"branch inside on the block grid", 1000, 0, 288, grids16x64, d, 8, {288, 512, 960}},
      {"branch inside off the grid floors to the block", 1000, 0, 303, grids16x64, d, 8, {288, 512, 960}},
      {"branch on P - 1 floors to its block", 1000, 0, 999, grids16x64, d, 8, {512, 960, 992}},
      {"branch at P: the whole prompt is shared", 1000, 0, 1000, grids16x64, d, 8, {512, 960}},
      {"branch beyond P in the block of P - 1 is still ignored", 1000, 0, 1005, grids16x64, d, 8, {512, 960}},
      {"branch at 2^64 - 1", 1000, 0, top, grids16x64, d, 8, {512, 960}},
      {"branch on the prompt end is one checkpoint", 1000, 0, 970, grids16x64, d, 8, {512, 960}},
      {"branch on an every-N boundary is one checkpoint", 1000, 0, 512, grids16x64, d, 8, {512, 960}},
      {"branch flooring to resume is excluded", 1000, 512, 520, grids16x64, d, 8, {960}},
      {"branch above resume", 1000, 512, 530, grids16x64, d, 8, {528, 960}},
      {"branch not asked for", 1000, 0, 300, grids16x64, without_branch(d), 8, {512, 960}},
  });
}

TEST_CASE("checkpoint table of the cap and its priority") {
  // P 5000: prompt end 4992; every-N 512 .. 4608; branch 2000 (off the chunk grid).
  const CheckpointPolicy d{};
  check_rows({
      {"default cap 4: branch, prompt end, then the highest every-N", 5000, 0, 2000, grids16x64, d, 8,
       {2000, 4096, 4608, 4992}},
      {"cap 0", 5000, 0, 2000, grids16x64, with_cap(d, 0), 8, {}},
      {"cap 1 keeps the branch point", 5000, 0, 2000, grids16x64, with_cap(d, 1), 8, {2000}},
      {"cap 2 adds the prompt end", 5000, 0, 2000, grids16x64, with_cap(d, 2), 8, {2000, 4992}},
      {"cap 3 adds the highest every-N", 5000, 0, 2000, grids16x64, with_cap(d, 3), 8, {2000, 4608, 4992}},
      {"cap 1 without a branch keeps the prompt end", 5000, 0, 0, grids16x64, with_cap(d, 1), 8, {4992}},
      {"no branch point: the two highest every-N fill in", 5000, 0, 2000, grids16x64, without_branch(d), 8,
       {3584, 4096, 4608, 4992}},
      {"no prompt end: three every-N", 5000, 0, 2000, grids16x64, without_prompt_end(d), 8,
       {2000, 3584, 4096, 4608}},
      {"every-N at or below resume never fill in", 5000, 4000, 2000, grids16x64, d, 8, {4096, 4608, 4992}},
      {"uncapped: every candidate", 5000, 0, 2000, grids16x64, with_cap(d, CheckpointPolicy::uncapped), 16,
       {512, 1024, 1536, 2000, 2048, 2560, 3072, 3584, 4096, 4608, 4992}},
      {"a span of 3 below the cap of 4", 5000, 0, 2000, grids16x64, d, 3, {2000, 4608, 4992}},
      {"a span of 2", 5000, 0, 2000, grids16x64, d, 2, {2000, 4992}},
      {"a span of 1", 5000, 0, 2000, grids16x64, d, 1, {2000}},
      {"a span of 0", 5000, 0, 2000, grids16x64, d, 0, {}},
      {"all() into a span of 5: branch, end, the three highest chunks", 5000, 0, 2000, grids16x64,
       CheckpointPolicy::all(), 5, {2000, 4800, 4864, 4928, 4992}},
  });
}

TEST_CASE("checkpoint table of the presets and invalid grids") {
  const CheckpointPolicy all = CheckpointPolicy::all();
  check_rows({
      {"default", 1000, 0, 300, grids16x64, CheckpointPolicy{}, 32, {288, 512, 960}},
      {"last takes no prefill checkpoint", 1000, 0, 300, grids16x64, CheckpointPolicy::last(), 32, {}},
      {"all: every chunk boundary and the branch point", 1000, 0, 300, grids16x64, all, 32,
       {64, 128, 192, 256, 288, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960}},
      {"every(2): the 128 grid alone, no branch point, no prompt end", 1000, 0, 300, grids16x64,
       CheckpointPolicy::every(2), 32, {128, 256, 384, 512, 640, 768, 896}},
      {"every(8)", 1000, 0, 300, grids16x64, CheckpointPolicy::every(8), 32, {512}},
      {"every(0) is none", 1000, 0, 300, grids16x64, CheckpointPolicy::every(0), 32, {}},
      {"block grid zero", 1000, 0, 300, PlanGrids{0, 64}, all, 32, {}},
      {"chunk grid zero", 1000, 0, 300, PlanGrids{16, 0}, all, 32, {}},
      {"both zero", 1000, 0, 300, PlanGrids{0, 0}, all, 32, {}},
      {"chunk not a multiple of the block", 1000, 0, 300, PlanGrids{16, 40}, all, 32, {}},
  });
  CHECK(CheckpointPolicy{} == CheckpointPolicy{true, true, 8, true, 4});
  CHECK(CheckpointPolicy::last() == CheckpointPolicy{false, false, 0, true, 0});
  CHECK(CheckpointPolicy::all() == CheckpointPolicy{true, true, 1, true, CheckpointPolicy::uncapped});
  CHECK(CheckpointPolicy::every(5) == CheckpointPolicy{false, false, 5, true, CheckpointPolicy::uncapped});
}

// ---------------------------------------------------------------------------------------
// The top of the token range: 2^64 = 16 (mod 48 and mod 80), 2^64 = 256 (mod 640), and
// 2^32 - 1 divides 2^64 - 1. Every expected value is worked out by hand from those.

TEST_CASE("checkpoint plans near 2^64 tokens are exact and never wrap") {
  const PlanGrids g48{16, 48}, g80{16, 80}, ones{1, 1}, wide_chunk{1, u32_max};
  const CheckpointPolicy all = CheckpointPolicy::all();
  const TokenCount huge_stride = TokenCount{u32_max} * u32_max;  // 2^64 - 2^33 + 1
  check_rows({
      {"48-token chunks below 2^64 - 1", top, top - 200, 0, g48, all, 16, {top - 159, top - 111, top - 63, top - 15}},
      {"branch on P - 1 is the prompt end", top, top - 200, top - 1, g48, all, 16,
       {top - 159, top - 111, top - 63, top - 15}},
      {"branch off both grids", top, top - 200, top - 30, g48, all, 16,
       {top - 159, top - 111, top - 63, top - 31, top - 15}},
      {"branch at 2^64 - 1 = P is ignored", top, top - 200, top, g48, all, 16,
       {top - 159, top - 111, top - 63, top - 15}},
      {"default with 80-token chunks: stride 640", top, top - 2000, 0, g80, CheckpointPolicy{}, 16,
       {top - 1535, top - 895, top - 255, top - 15}},
      {"one-token grids up to 2^64 - 2", top, top - 5, top - 2, ones, all, 16, {top - 4, top - 3, top - 2, top - 1}},
      {"one-token grids from 0 into a span of 3", top, 0, 0, ones, all, 3, {top - 3, top - 2, top - 1}},
      {"a stride of (2^32 - 1)^2 tokens", top, 0, 0, wide_chunk, CheckpointPolicy::every(u32_max), 16, {huge_stride}},
      {"a stride of (2^32 - 1)^2 tokens above resume", top, huge_stride, 0, wide_chunk,
       CheckpointPolicy::every(u32_max), 16, {}},
      // The highest stride boundary is the prompt end itself: one checkpoint, then the next stride down.
      {"the prompt end on 2^32 - 1 chunks", top, top - 10 * TokenCount{u32_max}, 0, wide_chunk,
       without_branch(CheckpointPolicy{}), 16, {top - 9 * TokenCount{u32_max}, top - u32_max}},
  });
  // 2^64 - 2 candidates: the count saturates at the cap instead of wrapping.
  CHECK(count_checkpoints(CheckpointInput{top, 0, 0, ones, all}) == u32_max);
  CHECK(count_checkpoints(CheckpointInput{top, 0, top - 1, ones, with_cap(all, 7)}) == 7);
  CHECK(count_checkpoints(CheckpointInput{top, 0, 0, wide_chunk, CheckpointPolicy::every(u32_max)}) == 1);
}

TEST_CASE("generation-end checkpoint is the last chunk boundary at or below total - 1") {
  const CheckpointPolicy d{};
  CheckpointPolicy off = d;
  off.at_generation_end = false;
  const struct {
    TokenCount total;
    PlanGrids grids;
    CheckpointPolicy policy;
    std::optional<TokenCount> want;
  } rows[] = {
      {0, grids16x64, d, std::nullopt},
      {1, grids16x64, d, std::nullopt},
      {64, grids16x64, d, std::nullopt},  // the last token's state does not exist: boundary 0
      {65, grids16x64, d, 64},
      {128, grids16x64, d, 64},  // total on a chunk boundary: total - 1 floors below it
      {129, grids16x64, d, 128},
      {1000, grids16x64, d, 960},
      {1000, grids16x64, CheckpointPolicy::last(), 960},
      {1000, grids16x64, CheckpointPolicy::all(), 960},
      {1000, grids16x64, CheckpointPolicy::every(3), 960},
      {1000, grids16x64, off, std::nullopt},
      {1000, PlanGrids{16, 40}, d, std::nullopt},
      {1000, PlanGrids{0, 64}, d, std::nullopt},
      {top, PlanGrids{16, 48}, d, top - 15},
      {top, PlanGrids{1, 1}, d, top - 1},
  };
  for (const auto& row : rows) {
    INFO("total ", row.total, " grids ", row.grids.block_tokens, "/", row.grids.chunk_tokens, " policy ",
         describe(row.policy));
    CHECK(generation_end_checkpoint(row.total, row.grids, row.policy) == row.want);
  }
}

// ---------------------------------------------------------------------------------------
// Names.

TEST_CASE("checkpoint policy names are default and last and all and every N") {
  CHECK(find_checkpoint_policy("default") == CheckpointPolicy{});
  CHECK(find_checkpoint_policy("last") == CheckpointPolicy::last());
  CHECK(find_checkpoint_policy("all") == CheckpointPolicy::all());
  CHECK(find_checkpoint_policy("every:1") == CheckpointPolicy::every(1));
  CHECK(find_checkpoint_policy("every:8") == CheckpointPolicy::every(8));
  CHECK(find_checkpoint_policy("every:008") == CheckpointPolicy::every(8));
  CHECK(find_checkpoint_policy("every:4294967295") == CheckpointPolicy::every(u32_max));
  CHECK(checkpoint_policy_named("every:16") == CheckpointPolicy::every(16));
  CHECK(checkpoint_policy_named("default") == CheckpointPolicy{});

  for (const std::string_view bad :
       {"", "Default", " last", "all ", "every", "every:", "every:0", "every:-1", "every:+2", "every:2x", "every: 2",
        "every:4294967296", "every:18446744073709551617", "every:99999999999999999999999", "every8", "none"}) {
    INFO("name '", std::string(bad), "'");
    CHECK_FALSE(find_checkpoint_policy(bad).has_value());
    try {
      (void)checkpoint_policy_named(bad);
      FAIL("no error for a bad name");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      const std::string what = e.what();
      CHECK(what.find("'" + std::string(bad) + "'") != std::string::npos);
      CHECK(what.find("every:N") != std::string::npos);
    }
  }
}

// ---------------------------------------------------------------------------------------
// The property test.

namespace {

// 128-bit arithmetic: room above 2^64, so the reference cannot wrap where the policy might.
__extension__ typedef unsigned __int128 Wide;

/// The rules as stated, walked boundary by boundary: every block boundary in
/// (resume, P - 1], its membership decided on its own, the cap applied by priority.
/// `candidates` receives the number of members before the cap.
std::vector<TokenCount> reference_plan(const CheckpointInput& in, std::size_t out_size, std::size_t& candidates) {
  candidates = 0;
  const Wide block = in.grids.block_tokens, chunk = in.grids.chunk_tokens, prompt = in.prompt_tokens;
  if (block == 0 || chunk == 0 || chunk % block != 0 || prompt == 0) return {};
  const CheckpointPolicy& p = in.policy;
  const Wide stride = Wide{p.every_chunks} * chunk;
  const Wide branch = in.branch;
  const bool branch_in_prompt = p.at_branch && branch + 1 <= prompt;  // branch <= P - 1
  std::vector<std::pair<int, Wide>> members;                           // (priority, boundary)
  const Wide first = (Wide{in.resume} / block + 1) * block;           // the lowest boundary above resume
  REQUIRE((prompt < first || (prompt - first) / block < 1'000'000));  // the generator keeps the walk short
  for (Wide b = first; b + 1 <= prompt; b += block) {
    int priority = -1;
    if (branch_in_prompt && b <= branch && branch < b + block)
      priority = 0;  // the branch point's block
    else if (p.at_prompt_end && b % chunk == 0 && b + chunk > prompt - 1)
      priority = 1;  // the highest chunk boundary at or below P - 1
    else if (p.every_chunks > 0 && b % stride == 0)
      priority = 2;
    if (priority >= 0) members.emplace_back(priority, b);
  }
  candidates = members.size();
  std::sort(members.begin(), members.end(), [](const auto& x, const auto& y) {
    return x.first != y.first ? x.first < y.first : x.second > y.second;
  });
  const std::size_t keep = std::min({members.size(), out_size, static_cast<std::size_t>(p.max_prefill)});
  std::vector<TokenCount> out;
  for (std::size_t i = 0; i < keep; ++i) out.push_back(static_cast<TokenCount>(members[i].second));
  std::sort(out.begin(), out.end());
  return out;
}

struct RandomCase {
  CheckpointInput in;
  std::size_t out_size = 0;
  bool large = false;
};

RandomCase random_case(std::mt19937_64& rng) {
  auto below = [&](std::uint64_t n) { return n == 0 ? 0 : rng() % n; };  // uniform in [0, n)
  auto chance = [&](int percent) { return below(100) < static_cast<std::uint64_t>(percent); };
  RandomCase c;
  PlanGrids& g = c.in.grids;
  constexpr std::array<std::uint32_t, 10> blocks{1, 2, 3, 4, 8, 16, 24, 32, 64, 100};
  g.block_tokens = chance(30) ? static_cast<std::uint32_t>(1 + below(128)) : blocks[below(blocks.size())];
  g.chunk_tokens = g.block_tokens * static_cast<std::uint32_t>(1 + below(12));
  if (chance(3)) {
    switch (below(3)) {
      case 0: g.block_tokens = 0; break;
      case 1: g.chunk_tokens = 0; break;
      default:  // in (3 x block, 4 x block): not a multiple of a block above 1
        g.chunk_tokens = g.block_tokens * 3 + 1 + static_cast<std::uint32_t>(below(std::max(g.block_tokens, 2u) - 1));
        break;
    }
  }
  const TokenCount block = std::max<TokenCount>(g.block_tokens, 1);

  CheckpointPolicy& p = c.in.policy;
  switch (below(8)) {
    case 0: p = CheckpointPolicy{}; break;
    case 1: p = CheckpointPolicy::last(); break;
    case 2: p = CheckpointPolicy::all(); break;
    case 3: p = CheckpointPolicy::every(static_cast<std::uint32_t>(1 + below(6))); break;
    default: {
      p.at_branch = chance(60);
      p.at_prompt_end = chance(60);
      p.at_generation_end = chance(50);
      constexpr std::array<std::uint32_t, 7> everies{0, 1, 2, 3, 4, 8, u32_max};
      p.every_chunks = chance(70) ? everies[below(everies.size())] : static_cast<std::uint32_t>(below(21));
      constexpr std::array<std::uint32_t, 8> caps{0, 1, 2, 3, 4, 5, 8, CheckpointPolicy::uncapped};
      p.max_prefill = chance(70) ? caps[below(caps.size())] : static_cast<std::uint32_t>(below(31));
    }
  }

  // The prompt and resume: the reference walks (resume, P - 1], at most ~700 blocks.
  c.large = chance(25);
  TokenCount& P = c.in.prompt_tokens;
  TokenCount& resume = c.in.resume;
  if (c.large) {
    P = chance(20) ? top : top - below(1'000'000);
    const TokenCount back = below(block * 700);
    resume = chance(50) ? P - back : block * ((P - back) / block);  // on the grid or not
  } else {
    P = below(block * 600 + 2 * block);
    switch (below(6)) {
      case 0: resume = 0; break;
      case 1: resume = block * below(P / block + 2); break;  // on the grid, maybe above P
      case 2: resume = P > 0 ? P - 1 - below(std::min<TokenCount>(P, 3)) : 0; break;
      case 3: resume = P + below(3); break;
      default: resume = below(P + 1); break;
    }
  }

  TokenCount& branch = c.in.branch;
  switch (below(10)) {
    case 0: branch = 0; break;
    case 1: branch = P > 0 ? P - 1 : 0; break;
    case 2: branch = P; break;
    case 3: branch = P + 1 + below(2 * block); break;  // beyond P, may wrap to a small value near 2^64: fine
    case 4: branch = top; break;
    case 5: branch = rng(); break;
    case 6: branch = resume + below(4 * block); break;  // around resume
    case 7: branch = block * ((resume + below(P >= resume ? P - resume + 1 : 1)) / block); break;  // on the grid
    default: branch = resume + below(P >= resume ? P - resume + 1 : 1); break;                    // inside
  }

  constexpr std::array<std::size_t, 9> sizes{0, 1, 2, 3, 4, 5, 7, 64, 2048};
  c.out_size = sizes[below(sizes.size())];
  return c;
}

}  // namespace

TEST_CASE("checkpoint plan agrees with a brute-force reference on 200000 random inputs") {
  constexpr std::uint64_t seed = 0x636b7074ULL;  // "ckpt"
  constexpr int inputs = 200000;
  std::mt19937_64 rng(seed);
  int mismatches = 0, count_mismatches = 0, broken_promises = 0;
  int nonempty = 0, large = 0, large_nonempty = 0, capped_by_policy = 0, capped_by_span = 0, branch_kept = 0,
      branch_beyond_prompt = 0, uncapped = 0;
  for (int i = 0; i < inputs; ++i) {
    const RandomCase c = random_case(rng);
    const CheckpointInput& in = c.in;
    const std::vector<TokenCount> got = plan(in, c.out_size);
    std::size_t candidates = 0;
    const std::vector<TokenCount> want = reference_plan(in, c.out_size, candidates);
    if (got != want && ++mismatches <= 10) {
      INFO("input #", i, ": ", describe(in, c.out_size), " got ", describe(got), " want ", describe(want));
      CHECK(got == want);
    }
    // count_checkpoints: the candidates, capped by the policy alone.
    const std::size_t want_count =
        in.grids.valid() ? std::min<std::size_t>(candidates, in.policy.max_prefill) : std::size_t{0};
    if (count_checkpoints(in) != want_count && ++count_mismatches <= 10) {
      INFO("input #", i, ": ", describe(in, c.out_size), " candidates ", candidates);
      CHECK(count_checkpoints(in) == want_count);
    }
    // The promises, checked directly whatever the reference says.
    bool kept = got.size() <= std::min<std::size_t>(in.policy.max_prefill, c.out_size);
    for (std::size_t k = 0; k < got.size(); ++k) {
      const TokenCount b = got[k];
      kept = kept && b % in.grids.block_tokens == 0 && b > in.resume && b <= in.prompt_tokens - 1 &&
             (k == 0 || got[k - 1] < b);
    }
    if (!kept && ++broken_promises <= 10) {
      INFO("input #", i, ": ", describe(in, c.out_size), " got ", describe(got));
      CHECK(kept);
    }
    nonempty += !got.empty();
    large += c.large;
    large_nonempty += c.large && !got.empty();
    capped_by_policy +=
        candidates > in.policy.max_prefill && in.policy.max_prefill > 0 && c.out_size > in.policy.max_prefill;
    capped_by_span += candidates > c.out_size && c.out_size > 0 && in.policy.max_prefill > c.out_size;
    uncapped += in.policy.max_prefill == CheckpointPolicy::uncapped && got.size() > 8;
    const bool branch_asked = in.grids.valid() && in.policy.at_branch && in.prompt_tokens > 0;
    branch_beyond_prompt += branch_asked && in.branch >= in.prompt_tokens && candidates > 0;
    branch_kept += branch_asked && in.branch < in.prompt_tokens &&
                   std::find(got.begin(), got.end(), in.grids.block_grid().floor(in.branch)) != got.end() &&
                   in.grids.block_grid().floor(in.branch) % in.grids.chunk_tokens != 0;
  }
  CHECK(mismatches == 0);
  CHECK(count_mismatches == 0);
  CHECK(broken_promises == 0);
  MESSAGE("seed ", seed, ": nonempty ", nonempty, ", large ", large, " (nonempty ", large_nonempty,
          "), capped by policy ", capped_by_policy, ", capped by span ", capped_by_span, ", uncapped > 8 ", uncapped,
          ", branch kept off the chunk grid ", branch_kept, ", branch at or beyond P ", branch_beyond_prompt);
  // The generator reaches every region the rules distinguish.
  CHECK(nonempty > inputs / 4);
  CHECK(large_nonempty > inputs / 50);
  CHECK(capped_by_policy > inputs / 100);
  CHECK(capped_by_span > inputs / 100);
  CHECK(uncapped > inputs / 100);
  CHECK(branch_kept > inputs / 100);
  CHECK(branch_beyond_prompt > inputs / 100);
}
