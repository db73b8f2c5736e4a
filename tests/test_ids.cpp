// Identifiers, the chunk grid and the error type.
#include <doctest/doctest.h>

#include <kvfuse/kvfuse.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <unordered_set>
#include <vector>

using namespace kvfuse;

TEST_CASE("ids: generations are unique and nonzero and resume after a checkpoint") {
  GenerationSource source;
  std::unordered_set<Generation> seen;
  for (int i = 0; i < 1000; ++i) CHECK(seen.insert(source.next()).second);
  CHECK_FALSE(seen.contains(Generation{0}));
  GenerationSource resumed(Generation{41});
  CHECK(resumed.next() == Generation{42});
}

// Engines persist keys built with mix64 (tier keys on disk, on a Redis server): its values
// are part of the API. These are splitmix64's, computed independently.
TEST_CASE("ids: mix64 gives the splitmix64 finaliser's values on every build") {
  static_assert(mix64(0) == 0xe220a8397b1dcdafULL);
  CHECK(mix64(0) == 0xe220a8397b1dcdafULL);
  CHECK(mix64(1) == 0x910a2dec89025cc1ULL);
  CHECK(mix64(~std::uint64_t{0}) == 0xe4d971771b652c20ULL);
}

TEST_CASE("ids: load keys compare and hash by both fields") {
  const LoadKey a{RequestId{1}, Generation{2}};
  const LoadKey b{RequestId{1}, Generation{3}};
  CHECK(a != b);
  CHECK(a < b);
  std::unordered_set<LoadKey> keys{a, b, a};
  CHECK(keys.size() == 2);
}

TEST_CASE("ids: the chunk grid floors / ceils / checks alignment") {
  const TokenGrid grid = TokenGrid::make(256);
  CHECK(grid.floor(0) == 0);
  CHECK(grid.floor(255) == 0);
  CHECK(grid.floor(256) == 256);
  CHECK(grid.ceil(1) == 256);
  CHECK(grid.ceil(256) == 256);
  CHECK(grid.ceil(257) == 512);
  CHECK(grid.aligned(512));
  CHECK_FALSE(grid.aligned(500));
  CHECK(grid.cells_covering(513) == 3);
  CHECK(grid.cell_of(511) == 1);
}

namespace {

// 128-bit references for the grid helpers: the same arithmetic with room above 2^64, so the
// answer is right even where 64-bit arithmetic would wrap.
__extension__ typedef unsigned __int128 Wide;
constexpr Wide token_max = std::numeric_limits<TokenCount>::max();
Wide wide_floor(Wide t, Wide step) { return t / step * step; }
Wide wide_ceil(Wide t, Wide step) { return (t + step - 1) / step * step; }

std::string text(Wide v) {
  std::string digits;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  } while (v != 0);
  return digits;
}

/// Checks every helper of `grid` at `t` against the 128-bit reference; returns what differs.
std::string grid_mismatch(TokenGrid grid, TokenCount t) {
  const Wide step = grid.step, w = t;
  std::string bad;
  auto expect = [&](const char* what, Wide got, Wide want) {
    if (got != want) bad += std::string(what) + " " + text(got) + " (want " + text(want) + ") ";
  };
  expect("floor", grid.floor(t), wide_floor(w, step));
  expect("cell_of", grid.cell_of(t), w / step);
  expect("aligned", grid.aligned(t), w % step == 0);
  expect("cells_covering", grid.cells_covering(t), wide_ceil(w, step) / step);
  const Wide up = wide_ceil(w, step);
  // Above the last multiple of step a TokenCount holds, ceil saturates to TokenCount's
  // maximum, which is then off the grid.
  expect("ceil", grid.ceil(t), up <= token_max ? up : token_max);
  if (up > token_max && grid.aligned(grid.ceil(t))) bad += "ceil past the range is on the grid ";
  const std::optional<TokenCount> checked = grid.checked_ceil(t);
  if (checked.has_value() != (up <= token_max) || (checked && *checked != up)) bad += "checked_ceil ";
  expect("max_aligned", grid.max_aligned(), wide_floor(token_max, step));
  return bad;
}

}  // namespace

TEST_CASE("ids: the grid helpers at 2^64 - 1 with grids that are not powers of two") {
  constexpr TokenCount top = std::numeric_limits<TokenCount>::max();
  // 2^64 = 16 (mod 24, 48, 80): the last whole cell of each ends at 2^64 - 16.
  for (const std::uint32_t step : {24u, 48u, 80u}) {
    const TokenGrid grid = TokenGrid::make(step);
    INFO("step ", step);
    CHECK(grid.floor(top) == top - 15);
    CHECK(grid.ceil(top - 15) == top - 15);
    CHECK(grid.ceil(top - 16) == top - 15);
    CHECK(grid.ceil(top - 15 - step + 1) == top - 15);
    CHECK(grid.ceil(top) == top);  // no multiple of step >= top fits: saturated, off the grid
    CHECK(grid.ceil(top - 14) == top);
    CHECK_FALSE(grid.aligned(grid.ceil(top)));
    CHECK(grid.max_aligned() == top - 15);
    CHECK(grid.checked_ceil(top - 15) == std::optional<TokenCount>{top - 15});
    CHECK(grid.checked_ceil(top - 30) == std::optional<TokenCount>{top - 15});
    CHECK_FALSE(grid.checked_ceil(top - 14).has_value());
    CHECK_FALSE(grid.checked_ceil(top).has_value());
    CHECK(grid.cells_covering(top) == (top - 15) / step + 1);
    CHECK(grid.cells_covering(top - 15) == (top - 15) / step);
    CHECK(grid.cell_of(top) == (top - 15) / step);
    for (TokenCount back = 0; back < 3 * step; ++back) {
      const std::string bad = grid_mismatch(grid, top - back);
      INFO("t = 2^64 - 1 - ", back);
      CHECK(bad == "");
    }
  }
}

TEST_CASE("ids: the grid helpers agree with 128-bit arithmetic on random large values") {
  std::mt19937_64 rng(0x6772696473ULL);  // "grids"
  std::vector<std::uint32_t> steps{1, 2, 3, 5, 7, 16, 24, 48, 80, 96, 256, 512, 1000, 4096, 65535,
                                   std::numeric_limits<std::uint32_t>::max()};
  for (int i = 0; i < 16; ++i) steps.push_back(1 + static_cast<std::uint32_t>(rng() % std::numeric_limits<std::uint32_t>::max()));
  constexpr TokenCount top = std::numeric_limits<TokenCount>::max();
  int mismatches = 0, checked = 0;
  for (const std::uint32_t step : steps) {
    const TokenGrid grid = TokenGrid::make(step);
    const TokenCount last_cell = top - top % step;  // the largest multiple of step that fits
    for (int i = 0; i < 4000; ++i) {
      TokenCount t = 0;
      switch (i % 4) {
        case 0: t = rng(); break;                                  // anywhere
        case 1: t = top - rng() % (3 * TokenCount{step}); break;   // the top of the range
        case 2: t = last_cell - rng() % 4 + rng() % 4; break;      // around the last whole cell
        case 3: t = rng() % (1u << 20); break;                     // small values still right
      }
      ++checked;
      const std::string bad = grid_mismatch(grid, t);
      if (!bad.empty() && ++mismatches <= 10) {
        INFO("step ", step, " t ", t, ": ", bad);
        CHECK(bad == "");
      }
    }
  }
  CHECK(mismatches == 0);
  CHECK(checked == static_cast<int>(steps.size()) * 4000);
}

TEST_CASE("R19 a zero grid step is a typed error that names the value") {
  try {
    (void)TokenGrid::make(0);
    FAIL("TokenGrid::make(0) must throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("step") != std::string::npos);
    CHECK(std::string(e.what()).find("0") != std::string::npos);
  }
}
