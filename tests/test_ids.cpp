// Identifiers, the chunk grid and the error type.
#include <doctest/doctest.h>

#include <kvfuse/kvfuse.hpp>

#include <unordered_set>

using namespace kvfuse;

TEST_CASE("ids: generations are unique and nonzero and resume after a checkpoint") {
  GenerationSource source;
  std::unordered_set<Generation> seen;
  for (int i = 0; i < 1000; ++i) CHECK(seen.insert(source.next()).second);
  CHECK_FALSE(seen.contains(Generation{0}));
  GenerationSource resumed(Generation{41});
  CHECK(resumed.next() == Generation{42});
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
