// The rings of ranks as processes (ipc/shm_ring.hpp), alone on one thread: an empty frame
// is a frame like any other (its span may carry a null pointer, which memcpy must never
// see), frames wrap around the end of the data area intact, and a ring that is full says so.
#include <doctest/doctest.h>

#include <kvfuse/ipc/shm_ring.hpp>

#include <array>
#include <cstddef>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::detail;

namespace {

struct Ring {
  static constexpr std::size_t capacity = 64;
  RingControl control;
  alignas(8) std::array<std::byte, capacity> data{};
  FrameRing view{&control, data.data(), capacity};
};

std::vector<std::byte> bytes(std::size_t n, unsigned seed) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>(seed + 7 * i);
  return out;
}

}  // namespace

TEST_CASE("frame ring: an empty frame goes through with a null span on both sides") {
  Ring ring;
  REQUIRE(ring.view.try_push(std::span<const std::byte>{}));  // data() is nullptr
  CHECK(ring.view.free_bytes() == Ring::capacity - FrameRing::footprint(0));
  std::size_t length = 99;
  CHECK(ring.view.pop(std::span<std::byte>{}, length) == RingRead::item);
  CHECK(length == 0);
  CHECK(ring.view.pop(std::span<std::byte>{}, length) == RingRead::empty);
}

TEST_CASE("frame ring: frames that wrap around the end of the data area come back intact") {
  Ring ring;
  std::vector<std::byte> out(Ring::capacity);
  for (unsigned round = 0; round < 40; ++round) {
    const std::vector<std::byte> frame = bytes(round % 3 == 0 ? 0 : 5 + round % 19, round);
    REQUIRE(ring.view.try_push(frame));
    std::size_t length = 0;
    REQUIRE(ring.view.pop(out, length) == RingRead::item);
    REQUIRE(length == frame.size());
    CHECK(std::equal(frame.begin(), frame.end(), out.begin()));
  }
}

TEST_CASE("frame ring: a frame that does not fit is refused and nothing of it is written") {
  Ring ring;
  const std::vector<std::byte> big = bytes(Ring::capacity - 8 + 1, 3);  // one byte over
  CHECK_FALSE(ring.view.try_push(big));
  CHECK(ring.view.free_bytes() == Ring::capacity);
  const std::vector<std::byte> fits = bytes(Ring::capacity - 8, 4);
  CHECK(ring.view.try_push(fits));
  CHECK_FALSE(ring.view.try_push(std::span<const std::byte>{}));  // full: not even a header fits
}
