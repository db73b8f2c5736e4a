// HipRuntime: compiled, linked and run in every build that finds the HIP runtime. On a
// machine without a device it must refuse to build with a clear no_device error; with a
// device it moves real bytes through pinned and device memory, ordered by an event.
#if defined(KVFUSE_HAVE_HIP)

#include <doctest/doctest.h>

#include <kvfuse/device/hip_runtime.hpp>
#include <kvfuse/device/save_fence.hpp>

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

using namespace kvfuse;

static_assert(Runtime<HipRuntime>, "HipRuntime must model kvfuse::Runtime");

namespace {
int hip_devices() {
  int count = 0;
  if (hipGetDeviceCount(&count) != hipSuccess) return 0;
  return count;
}
}  // namespace

TEST_CASE("hip runtime: without a device construction throws no_device saying no HIP device was found") {
  if (hip_devices() > 0) return;  // covered by the round trip below
  try {
    HipRuntime rt;
    FAIL("expected kvfuse::Error(no_device)");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::no_device);
    const std::string what = e.what();
    CHECK(what.find("no HIP device was found") != std::string::npos);
    CHECK(what.find("hipError") != std::string::npos);  // the HIP error, by name
  }
}

TEST_CASE("hip runtime: a pinned -> device -> pinned round trip is byte-exact and event-ordered") {
  if (hip_devices() == 0) return;  // covered by the no_device test above
  HipRuntime rt;
  constexpr std::size_t n = (8u << 20) + 13;
  auto* a = static_cast<std::byte*>(rt.allocate_pinned(n));
  auto* b = static_cast<std::byte*>(rt.allocate_pinned(n));
  void* d = rt.allocate_device(n);
  for (std::size_t i = 0; i < n; ++i) a[i] = static_cast<std::byte>((i * 131 + 7) & 0xff);
  std::memset(b, 0, n);
  auto up = rt.make_stream();
  auto down = rt.make_stream();
  HipRuntime::Event uploaded;
  REQUIRE(rt.create_event(uploaded));
  REQUIRE(rt.copy_async(d, a, n, up));
  REQUIRE(rt.record(uploaded, up));
  REQUIRE(rt.wait(down, uploaded));
  REQUIRE(rt.copy_async(b, d, n, down));
  REQUIRE(rt.synchronize(down));
  CHECK(std::memcmp(a, b, n) == 0);

  // One fenced save through SaveFence<HipRuntime>.
  SaveFence<HipRuntime> fence(rt);
  std::memset(b, 0, n);
  REQUIRE(rt.copy_async(d, a, n, up));
  CHECK(fence.begin_step(up) == FenceMode::event);
  CHECK(fence.fence(down));
  REQUIRE(rt.copy_async(b, d, n, down));
  REQUIRE(rt.synchronize(down));
  CHECK(std::memcmp(a, b, n) == 0);
  CHECK(rt.device_synchronize());

  rt.free_device(d);
  rt.free_pinned(a);
  rt.free_pinned(b);
}

#endif  // KVFUSE_HAVE_HIP
