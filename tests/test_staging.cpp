// StagingPool (R12): one pinned buffer per lane, allocated when built, reused, and
// exactly the sum of the buffers standing (lanes x buffer size when they are equal) —
// counted by the runtime, not just reported.
#include <doctest/doctest.h>

#include <kvfuse/testing/alloc_counter.hpp>
#include <kvfuse/testing/faulty_runtime.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/worker/staging.hpp>

#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;

TEST_CASE("R12 standing staging bytes equal lanes x buffer size for any lane count") {
  HostRuntime rt;
  for (const std::size_t lanes : {1u, 2u, 3u, 8u}) {
    for (const std::size_t bytes : {std::size_t{1}, std::size_t{4096}, std::size_t{1} << 20}) {
      {
        StagingPool<HostRuntime> pool(rt, lanes, bytes);
        CHECK(pool.lanes() == lanes);
        for (std::size_t i = 0; i < lanes; ++i) CHECK(pool.buffer_bytes(i) == bytes);
        CHECK(pool.standing_bytes() == lanes * bytes);
        CHECK(rt.pinned_bytes() == lanes * bytes);  // what the runtime really handed out
        for (std::size_t i = 0; i < lanes; ++i) CHECK(pool.buffer(i).size() == bytes);
      }
      CHECK(rt.pinned_bytes() == 0);  // freed on destruction
    }
  }
}

TEST_CASE("R12 standing staging bytes equal the sum of the lanes' buffers when their sizes differ") {
  HostRuntime rt;
  {
    const std::size_t sizes[] = {2048, 8 * 2048, 4096};  // load, save (a whole save), state
    StagingPool<HostRuntime> pool(rt, sizes);
    CHECK(pool.lanes() == 3);
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(pool.buffer_bytes(i) == sizes[i]);
      CHECK(pool.buffer(i).size() == sizes[i]);
    }
    CHECK(pool.buffer_bytes(3) == 0);
    CHECK(pool.standing_bytes() == 2048 + 8 * 2048 + 4096);
    CHECK(rt.pinned_bytes() == pool.standing_bytes());  // what the runtime really handed out
    // Lanes never share bytes.
    for (std::size_t i = 0; i < 3; ++i)
      for (std::size_t j = i + 1; j < 3; ++j) {
        const auto a = pool.buffer(i), b = pool.buffer(j);
        CHECK((a.data() + a.size() <= b.data() || b.data() + b.size() <= a.data()));
      }
  }
  CHECK(rt.pinned_bytes() == 0);
  try {
    const std::size_t sizes[] = {64, 0, 64};
    StagingPool<HostRuntime> pool(rt, sizes);
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("lane 1's buffer must be > 0 bytes, got 0") != std::string::npos);
  }
  const std::size_t overflowing[] = {SIZE_MAX / 2, SIZE_MAX / 2 + 2};
  CHECK_THROWS_AS(StagingPool<HostRuntime>(rt, overflowing), Error);
  CHECK_THROWS_AS(StagingPool<HostRuntime>(rt, std::span<const std::size_t>{}), Error);
  CHECK(rt.pinned_bytes() == 0);
}

TEST_CASE("R12 buffers are reused: the same bytes on every call and no allocation after construction") {
  REQUIRE(detail::AllocationScope::hook_installed());
  HostRuntime rt;
  constexpr std::size_t lanes = 3;
  constexpr std::size_t bytes = 64 * 1024;
  StagingPool<HostRuntime> pool(rt, lanes, bytes);
  std::vector<std::byte*> first;
  for (std::size_t i = 0; i < lanes; ++i) first.push_back(pool.buffer(i).data());
  // Lanes never share bytes.
  for (std::size_t i = 0; i < lanes; ++i) {
    for (std::size_t j = i + 1; j < lanes; ++j) {
      const bool disjoint = first[i] + bytes <= first[j] || first[j] + bytes <= first[i];
      CHECK(disjoint);
    }
  }
  detail::AllocationScope scope;
  for (int load = 0; load < 1000; ++load) {
    for (std::size_t i = 0; i < lanes; ++i) {
      const auto buf = pool.buffer(i);
      CHECK(buf.data() == first[i]);
      std::memset(buf.data(), load & 0xff, buf.size());
    }
  }
  CHECK(scope.all_threads() == 0);
  CHECK(rt.pinned_bytes() == lanes * bytes);
}

TEST_CASE("staging: zero lanes or zero bytes is an Error naming the value") {
  HostRuntime rt;
  try {
    StagingPool<HostRuntime> pool(rt, 0, 4096);
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("lanes must be > 0, got 0") != std::string::npos);
  }
  try {
    StagingPool<HostRuntime> pool(rt, 2, 0);
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("bytes_per_lane must be > 0, got 0") != std::string::npos);
  }
  CHECK_THROWS_AS(StagingPool<HostRuntime>(rt, 4, SIZE_MAX / 2), Error);
  CHECK(rt.pinned_bytes() == 0);
}

TEST_CASE("staging: an out-of-range lane gets an empty span and never a wild pointer") {
  HostRuntime rt;
  StagingPool<HostRuntime> pool(rt, 2, 128);
  CHECK(pool.buffer(2).empty());
  CHECK(pool.buffer(SIZE_MAX).empty());
}

TEST_CASE("staging: an allocation failure part-way through leaks nothing") {
  FaultyRuntime<HostRuntime> rt;
  rt.fail(RuntimeCall::allocate_pinned, 1, 2);  // the third buffer fails
  try {
    StagingPool<FaultyRuntime<HostRuntime>> pool(rt, 4, 4096);
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::device_failure);
  }
  CHECK(rt.inner().pinned_bytes() == 0);
}

TEST_CASE("staging: moving a pool moves its buffers - the moved-from pool owns nothing") {
  HostRuntime rt;
  StagingPool<HostRuntime> a(rt, 2, 256);
  std::byte* p0 = a.buffer(0).data();
  StagingPool<HostRuntime> b(std::move(a));
  CHECK(b.buffer(0).data() == p0);
  CHECK(b.standing_bytes() == 512);
  CHECK(a.standing_bytes() == 0);  // NOLINT(bugprone-use-after-move): documented state
  CHECK(a.buffer(0).empty());
  StagingPool<HostRuntime> c(rt, 1, 64);
  c = std::move(b);
  CHECK(c.buffer(1).size() == 256);
  CHECK(rt.pinned_bytes() == 512);
}
