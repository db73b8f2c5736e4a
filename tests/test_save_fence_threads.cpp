// SaveFence (R13): a save's copy waits for the forward that wrote its source — on the
// device through one event per step, or, when the event cannot be created or recorded,
// through a full device synchronize. Either way the save happens and reads the final bytes.
#include <doctest/doctest.h>

#include <kvfuse/testing/faulty_runtime.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/device/save_fence.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

using namespace kvfuse;
using namespace std::chrono_literals;

namespace {

using Faulty = FaultyRuntime<HostRuntime>;

/// The "forward" of a step, run on the compute stream: it holds at a gate until the test
/// opens it, then gives a copy that was not fenced a window to run (it waits, with a
/// bound, for a signal the copy stream sends after the save's copy), then writes the
/// step's final bytes. A fenced copy cannot run inside that window, so it reads the final
/// bytes; an unfenced one copies the stale bytes and is seen having run early.
struct Forward {
  Forward(std::vector<std::byte>* src, std::byte value) : source(src), final_value(value) {}
  std::vector<std::byte>* source;
  std::byte final_value;
  std::mutex m;
  std::condition_variable cv;
  bool gate_open = false;
  bool copy_done = false;
  std::atomic<bool> produced{false};
  std::atomic<bool> copy_ran_early{false};

  void open_gate() {
    {
      std::lock_guard lock(m);
      gate_open = true;
    }
    cv.notify_all();
  }
  static void run(void* self) noexcept {
    auto* f = static_cast<Forward*>(self);
    std::unique_lock lock(f->m);
    f->cv.wait(lock, [&] { return f->gate_open; });
    if (f->cv.wait_for(lock, 100ms, [&] { return f->copy_done; })) f->copy_ran_early.store(true);
    std::fill(f->source->begin(), f->source->end(), f->final_value);
    f->produced.store(true);
  }
  /// Enqueued on the copy stream right after the save's copy.
  static void copied(void* self) noexcept {
    auto* f = static_cast<Forward*>(self);
    {
      std::lock_guard lock(f->m);
      f->copy_done = true;
    }
    f->cv.notify_all();
  }
};

bool all_equal(const std::vector<std::byte>& v, std::byte x) {
  return std::all_of(v.begin(), v.end(), [x](std::byte b) { return b == x; });
}

/// One fenced save: forward on `compute`, begin_step, fence, copy, signal. The gate opens
/// before begin_step when `open_before_step` (a falling-back begin_step synchronizes the
/// device, so it would otherwise wait for a gate nobody opens), else after the save was
/// enqueued. Returns the fence mode of the step.
template <class R>
FenceMode fenced_save(R& rt, HostRuntime& host, SaveFence<R>& fence, typename R::Stream& compute,
                      typename R::Stream& copy, Forward& forward, std::vector<std::byte>& dst,
                      bool open_before_step) {
  REQUIRE(host.launch_host_func(compute, &Forward::run, &forward));
  if (open_before_step) forward.open_gate();
  const FenceMode mode = fence.begin_step(compute);
  if (mode == FenceMode::event) CHECK_FALSE(forward.produced.load());  // no host sync on the event path
  CHECK(fence.fence(copy));
  CHECK(rt.copy_async(dst.data(), forward.source->data(), dst.size(), copy));
  REQUIRE(host.launch_host_func(copy, &Forward::copied, &forward));
  if (!open_before_step) forward.open_gate();
  REQUIRE(rt.synchronize(copy));
  REQUIRE(rt.device_synchronize());
  return mode;
}

}  // namespace

TEST_CASE("R13 the event path orders the save's copy after the producer without a host wait") {
  HostRuntime rt;
  auto compute = rt.make_stream();
  auto copy = rt.make_stream();
  SaveFence<HostRuntime> fence(rt);
  constexpr std::size_t n = 256 * 1024;
  std::vector<std::byte> source(n, std::byte{0x11});
  for (int step = 0; step < 2; ++step) {
    std::vector<std::byte> saved(n, std::byte{0});
    Forward forward{&source, static_cast<std::byte>(0x40 + step)};
    CHECK(fenced_save(rt, rt, fence, compute, copy, forward, saved, /*open_before_step=*/false) == FenceMode::event);
    CHECK_FALSE(forward.copy_ran_early.load());
    CHECK(all_equal(saved, forward.final_value));
  }
  const SaveFenceStats s = fence.stats();
  CHECK(s.steps == 2);
  CHECK(s.event_steps == 2);
  CHECK(s.fallback_steps == 0);
  CHECK(s.fences == 2);
}

namespace {
/// Two steps whose event path is broken: each must fall back to device_synchronize, and
/// its save must still happen, reading the producer's final bytes.
void save_two_fallback_steps(Faulty& rt, SaveFence<Faulty>& fence, int first_value) {
  auto compute = rt.make_stream();
  auto copy = rt.make_stream();
  constexpr std::size_t n = 256 * 1024;
  std::vector<std::byte> source(n, std::byte{0x11});
  for (int step = 0; step < 2; ++step) {
    std::vector<std::byte> saved(n, std::byte{0});
    Forward forward{&source, static_cast<std::byte>(first_value + step)};
    CHECK(fenced_save(rt, rt.inner(), fence, compute, copy, forward, saved, /*open_before_step=*/true) ==
          FenceMode::device_synchronized);
    CHECK_FALSE(forward.copy_ran_early.load());
    CHECK(all_equal(saved, forward.final_value));  // the save happened, with the producer's bytes
  }
}
}  // namespace

TEST_CASE("R13 event creation fails: the step falls back to device_synchronize and the saves read the final bytes") {
  Faulty rt;
  rt.fail(RuntimeCall::create_event);
  SaveFence<Faulty> fence(rt);
  save_two_fallback_steps(rt, fence, 0x60);
  const SaveFenceStats s = fence.stats();
  CHECK(s.steps == 2);
  CHECK(s.fallback_steps == 2);
  CHECK(s.create_failures == 2);  // creation is retried every step
  CHECK(s.event_steps == 0);
  CHECK(rt.calls(RuntimeCall::device_synchronize) >= 2);
}

TEST_CASE("R13 event record fails: the step falls back to device_synchronize and the saves read the final bytes") {
  Faulty rt;
  rt.fail(RuntimeCall::record);
  SaveFence<Faulty> fence(rt);
  save_two_fallback_steps(rt, fence, 0x70);
  const SaveFenceStats s = fence.stats();
  CHECK(s.fallback_steps == 2);
  CHECK(s.record_failures == 2);
  CHECK(rt.calls(RuntimeCall::create_event) == 1);  // made once, kept
}

TEST_CASE("R13 a failed record after good steps falls back for that step only") {
  Faulty rt;
  auto compute = rt.make_stream();
  auto copy = rt.make_stream();
  SaveFence<Faulty> fence(rt);
  constexpr std::size_t n = 64 * 1024;
  std::vector<std::byte> source(n, std::byte{0x11});
  const FenceMode expected[] = {FenceMode::event, FenceMode::device_synchronized, FenceMode::event};
  for (int step = 0; step < 3; ++step) {
    if (step == 1) rt.fail(RuntimeCall::record, 1);
    std::vector<std::byte> saved(n, std::byte{0});
    Forward forward{&source, static_cast<std::byte>(0x20 + step)};
    const bool fallback = expected[step] == FenceMode::device_synchronized;
    CHECK(fenced_save(rt, rt.inner(), fence, compute, copy, forward, saved, fallback) == expected[step]);
    CHECK_FALSE(forward.copy_ran_early.load());
    CHECK(all_equal(saved, forward.final_value));
  }
  CHECK(fence.stats().event_steps == 2);
  CHECK(fence.stats().fallback_steps == 1);
}

TEST_CASE("R13 a failed device-side wait makes the fencing thread wait on the event instead") {
  Faulty rt;
  auto compute = rt.make_stream();
  auto copy = rt.make_stream();
  SaveFence<Faulty> fence(rt);
  constexpr std::size_t n = 64 * 1024;
  std::vector<std::byte> source(n, std::byte{0x11});
  std::vector<std::byte> saved(n, std::byte{0});
  Forward forward{&source, std::byte{0x33}};
  rt.fail(RuntimeCall::wait);
  REQUIRE(rt.inner().launch_host_func(compute, &Forward::run, &forward));
  CHECK(fence.begin_step(compute) == FenceMode::event);
  forward.open_gate();
  CHECK(fence.fence(copy));  // blocks on the event: the forward has finished when it returns
  CHECK(forward.produced.load());
  CHECK(rt.copy_async(saved.data(), source.data(), n, copy));
  REQUIRE(rt.synchronize(copy));
  REQUIRE(rt.device_synchronize());  // the forward must be gone before `forward` is
  CHECK(all_equal(saved, std::byte{0x33}));
  CHECK(fence.stats().wait_fallbacks == 1);
}

TEST_CASE("R13 when not even the device can be synchronized fence() refuses instead of copying unordered") {
  Faulty rt;
  rt.fail(RuntimeCall::create_event);
  rt.fail(RuntimeCall::device_synchronize, 1);
  auto compute = rt.make_stream();
  auto copy = rt.make_stream();
  SaveFence<Faulty> fence(rt);
  CHECK(fence.begin_step(compute) == FenceMode::device_synchronized);
  CHECK_FALSE(fence.fence(copy));
  CHECK(fence.stats().sync_failures == 1);
  CHECK(fence.stats().failed_fences == 1);
  // The next step synchronizes fine again and fences pass.
  CHECK(fence.begin_step(compute) == FenceMode::device_synchronized);
  CHECK(fence.fence(copy));
}

TEST_CASE("R13 steps and concurrent save lanes: every save reads its own step's bytes") {
  // The step thread runs the forwards and begin_step; two store threads fence and copy.
  // Each step's forward writes its own source buffer, so any copy that is not ordered
  // after its forward is both a wrong byte here and a data race for ThreadSanitizer.
  Faulty rt;
  auto compute = rt.make_stream();
  SaveFence<Faulty> fence(rt);
  constexpr int steps = 60;
  constexpr std::size_t n = 8 * 1024;
  std::vector<std::vector<std::byte>> sources(steps, std::vector<std::byte>(n, std::byte{0}));
  std::vector<std::vector<std::byte>> saved(steps, std::vector<std::byte>(n, std::byte{0}));
  struct Write {
    std::vector<std::byte>* v;
    std::byte value;
    static void run(void* p) noexcept {
      auto* w = static_cast<Write*>(p);
      std::this_thread::sleep_for(1ms);  // a forward takes a while: an unfenced copy overtakes it
      std::fill(w->v->begin(), w->v->end(), w->value);
    }
  };
  std::vector<Write> writes;
  for (int i = 0; i < steps; ++i) writes.push_back(Write{&sources[i], static_cast<std::byte>(i + 1)});

  std::mutex m;
  std::condition_variable cv;
  std::deque<int> pending;
  bool finished = false;
  auto save_lane = [&] {
    auto copy = rt.make_stream();
    for (;;) {
      int step = -1;
      {
        std::unique_lock lock(m);
        cv.wait(lock, [&] { return finished || !pending.empty(); });
        if (pending.empty()) break;
        step = pending.front();
        pending.pop_front();
      }
      CHECK(fence.fence(copy));
      CHECK(rt.copy_async(saved[step].data(), sources[step].data(), n, copy));
      CHECK(rt.synchronize(copy));
    }
  };
  std::thread lane1(save_lane), lane2(save_lane);
  for (int i = 0; i < steps; ++i) {
    if (i % 7 == 3) rt.fail(RuntimeCall::record, 1);  // some steps fall back
    REQUIRE(rt.inner().launch_host_func(compute, &Write::run, &writes[i]));
    fence.begin_step(compute);
    {
      std::lock_guard lock(m);
      pending.push_back(i);
    }
    cv.notify_one();
  }
  {
    std::lock_guard lock(m);
    finished = true;
  }
  cv.notify_all();
  lane1.join();
  lane2.join();
  REQUIRE(rt.device_synchronize());
  for (int i = 0; i < steps; ++i) CHECK(all_equal(saved[i], static_cast<std::byte>(i + 1)));
  const SaveFenceStats s = fence.stats();
  CHECK(s.steps == steps);
  CHECK(s.fallback_steps > 0);
  CHECK(s.event_steps + s.fallback_steps == steps);
  CHECK(s.fences == steps);
}
