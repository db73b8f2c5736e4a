// HostRuntime: streams run in order, events order streams against each other, host waits
// block, copies are byte-exact, the ring backs off when full, and FaultyRuntime fails
// what a test arms.
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/testing/alloc_counter.hpp>
#include <kvfuse/testing/faulty_runtime.hpp>
#include <kvfuse/device/host_runtime.hpp>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;
using namespace kvfuse::testing;
using namespace std::chrono_literals;

namespace {

static_assert(Runtime<HostRuntime>);
static_assert(Runtime<FaultyRuntime<HostRuntime>>);



/// Scheduler state of thread `tid` ('R' running, 'S' sleeping, ...), from /proc.
char thread_state(long tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  std::getline(in, line);
  const auto close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() ? '?' : line[close + 2];
}

/// True once thread `tid` is seen asleep on 20 consecutive samples: a thread that spins
/// (even with yields) is runnable ('R') and never passes.
bool seen_asleep(long tid) {
  return eventually([&] {
    for (int i = 0; i < 20; ++i) {
      if (thread_state(tid) != 'S') return false;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  });
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed * 7 + (i >> 8)) & 0xff);
  return v;
}

}  // namespace

TEST_CASE("host runtime: bad options throw invalid_argument naming the value") {
  try {
    HostRuntime rt(HostRuntimeOptions{.stream_ring_ops = 0});
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("stream_ring_ops") != std::string::npos);
  }
  try {
    HostRuntime rt(HostRuntimeOptions{.alignment = 48});
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("48") != std::string::npos);
  }
  try {
    HostRuntime rt(HostRuntimeOptions{.stream_spin = std::chrono::nanoseconds{-7}});
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    const std::string what = e.what();
    CHECK(what.find("stream_spin") != std::string::npos);
    CHECK(what.find("-7") != std::string::npos);
  }
  try {
    HostRuntime rt(HostRuntimeOptions{.default_mode = static_cast<HostStreamMode>(3)});
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("default_mode=3") != std::string::npos);
  }
  CHECK(HostRuntime().options().stream_spin == std::chrono::nanoseconds{0});  // off by default
}

TEST_CASE("host runtime: a stream mode outside the enum is an Error naming the value") {
  HostRuntime rt;
  try {
    HostRuntime::Stream s = rt.make_stream(static_cast<HostStreamMode>(4));
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    CHECK(std::string(e.what()).find("mode 4") != std::string::npos);
  }
  for (const HostStreamMode mode : {HostStreamMode::threaded, HostStreamMode::inline_calls})
    CHECK(rt.make_stream(mode).mode() == mode);
}

TEST_CASE("host runtime: with stream_spin on a threaded stream runs every op in order and stops promptly") {
  using namespace std::chrono_literals;
  constexpr std::size_t n = 64 * 1024;
  const auto src = pattern(n, 3);
  std::vector<std::byte> mid(n), dst(n);  // outlive the streams: a copy is still queued when they go
  const auto t0 = std::chrono::steady_clock::now();
  {
    HostRuntime rt(HostRuntimeOptions{.stream_spin = 30s});  // far longer than the test may take
    auto a = rt.make_stream();
    auto b = rt.make_stream();
    HostRuntime::Event e;
    REQUIRE(rt.create_event(e));
    for (int round = 0; round < 50; ++round) {
      std::fill(mid.begin(), mid.end(), std::byte{0});
      std::fill(dst.begin(), dst.end(), std::byte{0});
      // a: src -> mid in 16 pieces, then the event; b waits on it and copies mid -> dst.
      for (std::size_t off = 0; off < n; off += n / 16) REQUIRE(rt.copy_async(mid.data() + off, src.data() + off, n / 16, a));
      REQUIRE(rt.record(e, a));
      REQUIRE(rt.wait(b, e));
      REQUIRE(rt.copy_async(dst.data(), mid.data(), n, b));
      REQUIRE(rt.synchronize(b));
      CHECK(dst == src);
      if (round % 10 == 9) std::this_thread::sleep_for(1ms);
    }
    REQUIRE(rt.copy_async(dst.data(), src.data(), n, a));  // queued when the streams go away
  }  // destroying the streams finishes their work and ends the spin at once
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  CHECK(dst == src);  // the copy queued last ran before the stream went away
}

TEST_CASE("host runtime: allocations are aligned and counted and freed") {
  HostRuntime rt(HostRuntimeOptions{.alignment = 4096});
  void* a = rt.allocate_pinned(10000);
  void* b = rt.allocate_device(123);
  void* z = rt.allocate_pinned(0);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 4096 == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(b) % 4096 == 0);
  CHECK(z != nullptr);
  CHECK(rt.pinned_bytes() == 10000);
  CHECK(rt.device_bytes() == 123);
  std::memset(a, 0xab, 10000);
  rt.free_pinned(a);
  rt.free_pinned(z);
  rt.free_device(b);
  rt.free_pinned(nullptr);
  CHECK(rt.pinned_bytes() == 0);
  CHECK(rt.device_bytes() == 0);
}

TEST_CASE("host runtime: chunked copies through a stream are byte-exact in both modes") {
  for (const HostStreamMode mode : {HostStreamMode::threaded, HostStreamMode::inline_calls}) {
    HostRuntime rt(HostRuntimeOptions{.stream_ring_ops = 8});
    constexpr std::size_t n = (1 << 20) + 77;
    auto* src = static_cast<std::byte*>(rt.allocate_pinned(n));
    auto* dst = static_cast<std::byte*>(rt.allocate_device(n));
    const auto expect = pattern(n, 3);
    std::memcpy(src, expect.data(), n);
    std::memset(dst, 0, n);
    auto stream = rt.make_stream(mode);
    CHECK(stream.mode() == mode);
    constexpr std::size_t chunk = 4093;  // odd size: the tail chunk is short
    for (std::size_t off = 0; off < n; off += chunk) {
      REQUIRE(rt.copy_async(dst + off, src + off, std::min(chunk, n - off), stream));
    }
    REQUIRE(rt.synchronize(stream));
    CHECK(std::memcmp(dst, expect.data(), n) == 0);
    rt.free_pinned(src);
    rt.free_device(dst);
  }
}

TEST_CASE("host runtime: one stream runs its operations in FIFO order") {
  HostRuntime rt(HostRuntimeOptions{.stream_ring_ops = 16});
  auto stream = rt.make_stream();
  // A chain of dependent copies a -> b -> c -> a ...: any reordering leaves stale bytes.
  constexpr std::size_t n = 4096;
  std::vector<std::byte> a = pattern(n, 1), b(n), c(n);
  for (int round = 0; round < 200; ++round) {
    REQUIRE(rt.copy_async(b.data(), a.data(), n, stream));
    REQUIRE(rt.copy_async(c.data(), b.data(), n, stream));
    REQUIRE(rt.copy_async(a.data(), c.data(), n, stream));
  }
  // Host functions record the order the stream thread reaches them.
  std::vector<int> order;
  struct Mark {
    std::vector<int>* order;
    int index;
    static void run(void* p) noexcept {
      auto* m = static_cast<Mark*>(p);
      m->order->push_back(m->index);
    }
  };
  std::vector<Mark> marks;
  for (int i = 0; i < 100; ++i) marks.push_back(Mark{&order, i});
  order.reserve(marks.size());
  for (auto& m : marks) REQUIRE(rt.launch_host_func(stream, &Mark::run, &m));
  REQUIRE(rt.synchronize(stream));
  CHECK(c == pattern(n, 1));
  REQUIRE(order.size() == 100);
  CHECK(std::is_sorted(order.begin(), order.end()));
}

TEST_CASE("host runtime: a stream waiting on an event runs later work only after the recording stream got there") {
  HostRuntime rt;
  auto producer_stream = rt.make_stream();
  auto consumer_stream = rt.make_stream();
  constexpr std::size_t n = 64 * 1024;
  std::vector<std::byte> src(n, std::byte{0x11}), dst(n, std::byte{0});
  Gate gate;
  struct Fill {
    std::vector<std::byte>* v;
    static void run(void* p) noexcept {
      auto* f = static_cast<Fill*>(p);
      std::fill(f->v->begin(), f->v->end(), std::byte{0x5a});
    }
  } fill{&src};
  HostRuntime::Event ready, copied;
  REQUIRE(rt.create_event(ready));
  REQUIRE(rt.create_event(copied));
  REQUIRE(rt.launch_host_func(producer_stream, &Gate::host_func, &gate));
  REQUIRE(rt.launch_host_func(producer_stream, &Fill::run, &fill));
  REQUIRE(rt.record(ready, producer_stream));
  REQUIRE(rt.wait(consumer_stream, ready));  // returns at once: a device-side wait
  REQUIRE(rt.copy_async(dst.data(), src.data(), n, consumer_stream));
  REQUIRE(rt.record(copied, consumer_stream));
  REQUIRE(eventually([&] { return gate.entered.load(); }));
  // The producer is held at the gate, so the consumer cannot have copied yet.
  CHECK_FALSE(rt.query(ready));
  CHECK_FALSE(rt.query(copied));
  gate.open();
  REQUIRE(rt.synchronize(copied));
  CHECK(rt.query(ready));
  CHECK(std::all_of(dst.begin(), dst.end(), [](std::byte x) { return x == std::byte{0x5a}; }));
}

TEST_CASE("R12 copies / records / waits / synchronizes never allocate (the load path's device calls)") {
  REQUIRE(detail::AllocationScope::hook_installed());
  HostRuntime rt(HostRuntimeOptions{.stream_ring_ops = 16});
  auto a = rt.make_stream();
  auto b = rt.make_stream();
  HostRuntime::Event filled, drained;
  REQUIRE(rt.create_event(filled));  // set-up: the one allocation an event costs
  REQUIRE(rt.create_event(drained));
  std::vector<std::byte> src = pattern(64 * 1024, 5), mid(src.size()), dst(src.size());
  REQUIRE(rt.copy_async(mid.data(), src.data(), src.size(), a));  // warm the threads
  REQUIRE(rt.synchronize(a));
  detail::AllocationScope scope;
  for (int i = 0; i < 500; ++i) {  // enough to wrap each ring many times
    REQUIRE(rt.wait(a, drained));  // a may refill `mid` only after b read it
    REQUIRE(rt.copy_async(mid.data(), src.data(), src.size(), a));
    REQUIRE(rt.record(filled, a));
    REQUIRE(rt.wait(b, filled));
    REQUIRE(rt.copy_async(dst.data(), mid.data(), mid.size(), b));
    REQUIRE(rt.record(drained, b));
  }
  HostRuntime::Event& e = filled;
  REQUIRE(rt.synchronize(b));
  REQUIRE(rt.synchronize(e));
  REQUIRE(rt.device_synchronize());
  CHECK(scope.all_threads() == 0);
  CHECK(dst == src);
}

TEST_CASE("host runtime: events that were never recorded plus empty events and empty streams") {
  HostRuntime rt;
  auto stream = rt.make_stream();
  HostRuntime::Event never;
  HostRuntime::Event empty;
  REQUIRE(rt.create_event(never));
  CHECK(never.valid());
  CHECK_FALSE(empty.valid());
  CHECK(rt.wait(stream, never));   // nothing recorded: no wait
  CHECK(rt.synchronize(never));    // complete already
  CHECK(rt.query(never));
  CHECK_FALSE(rt.wait(stream, empty));
  CHECK_FALSE(rt.record(empty, stream));
  CHECK_FALSE(rt.synchronize(empty));
  HostRuntime::Stream none;
  std::byte x{1}, y{0};
  CHECK_FALSE(rt.copy_async(&y, &x, 1, none));
  CHECK_FALSE(rt.synchronize(none));
  CHECK_FALSE(rt.record(never, none));
  CHECK_FALSE(rt.copy_async(nullptr, &x, 1, stream));
  CHECK(rt.copy_async(nullptr, nullptr, 0, stream));
  CHECK(rt.synchronize(stream));
}

TEST_CASE("R13 host waits block: synchronize(event) / synchronize(stream) / device_synchronize sleep and never spin") {
  HostRuntime rt;
  auto stream = rt.make_stream();
  HostRuntime::Event done;
  REQUIRE(rt.create_event(done));

  enum class Wait { event, stream, device };
  for (const Wait kind : {Wait::event, Wait::stream, Wait::device}) {
    Gate gate;
    REQUIRE(rt.launch_host_func(stream, &Gate::host_func, &gate));
    REQUIRE(rt.record(done, stream));
    std::atomic<long> tid{0};
    std::atomic<bool> returned{false};
    std::thread waiter([&] {
      tid.store(static_cast<long>(syscall(SYS_gettid)));
      bool ok = false;
      switch (kind) {
        case Wait::event: ok = rt.synchronize(done); break;
        case Wait::stream: ok = rt.synchronize(stream); break;
        case Wait::device: ok = rt.device_synchronize(); break;
      }
      CHECK(ok);
      returned.store(true);
    });
    REQUIRE(eventually([&] { return tid.load() != 0; }));
    // The stream is held at the gate, so the waiter must still be waiting — asleep.
    CHECK(seen_asleep(tid.load()));
    CHECK_FALSE(returned.load());
    gate.open();
    waiter.join();
    CHECK(returned.load());
    CHECK(rt.query(done));
  }
}

TEST_CASE("host runtime: device_synchronize waits for every stream") {
  HostRuntime rt;
  auto s1 = rt.make_stream();
  auto s2 = rt.make_stream();
  auto s3 = rt.make_stream(HostStreamMode::inline_calls);
  Gate g1, g2;
  REQUIRE(rt.launch_host_func(s1, &Gate::host_func, &g1));
  REQUIRE(rt.launch_host_func(s2, &Gate::host_func, &g2));
  std::vector<std::byte> a(1024, std::byte{7}), b1(1024), b2(1024);
  REQUIRE(rt.copy_async(b1.data(), a.data(), a.size(), s1));
  REQUIRE(rt.copy_async(b2.data(), a.data(), a.size(), s2));
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    CHECK(rt.device_synchronize());
    returned.store(true);
  });
  REQUIRE(eventually([&] { return g1.entered.load() && g2.entered.load(); }));
  g1.open();
  // s2 still held: device_synchronize must not have returned. (A wrong one that returned
  // early would be caught here or by the byte check below.)
  std::this_thread::sleep_for(20ms);
  CHECK_FALSE(returned.load());
  g2.open();
  waiter.join();
  CHECK(b1 == a);
  CHECK(b2 == a);
}

TEST_CASE("host runtime: a full ring makes the caller back off and nothing is dropped") {
  HostRuntime rt(HostRuntimeOptions{.stream_ring_ops = 4});
  auto stream = rt.make_stream();
  Gate gate;
  REQUIRE(rt.launch_host_func(stream, &Gate::host_func, &gate));
  REQUIRE(eventually([&] { return gate.entered.load(); }));
  constexpr int copies = 40;
  std::vector<std::vector<std::byte>> src, dst;
  for (int i = 0; i < copies; ++i) {
    src.push_back(pattern(512, static_cast<unsigned>(i)));
    dst.emplace_back(512);
  }
  std::atomic<int> enqueued{0};
  std::thread producer([&] {
    for (int i = 0; i < copies; ++i) {
      CHECK(rt.copy_async(dst[i].data(), src[i].data(), 512, stream));
      enqueued.fetch_add(1);
    }
  });
  REQUIRE(eventually([&] { return stream.full_waits() > 0; }));
  CHECK(enqueued.load() < copies);  // it is blocked, not dropping
  gate.open();
  producer.join();
  REQUIRE(rt.synchronize(stream));
  CHECK(enqueued.load() == copies);
  for (int i = 0; i < copies; ++i) CHECK(dst[i] == src[i]);
}

TEST_CASE("host runtime: destroying a stream finishes its work - destroying an event with queued records is safe") {
  HostRuntime rt;
  std::vector<std::byte> a = pattern(100000, 9), b(100000);
  {
    auto stream = rt.make_stream();
    {
      HostRuntime::Event e;
      REQUIRE(rt.create_event(e));
      for (int i = 0; i < 50; ++i) {
        REQUIRE(rt.copy_async(b.data(), a.data(), a.size(), stream));
        REQUIRE(rt.record(e, stream));
        REQUIRE(rt.wait(stream, e));
      }
    }  // event handle gone while its records and waits are still queued
  }    // stream gone: drains first
  CHECK(b == a);
}

TEST_CASE("host runtime: an inline stream runs work on the caller and waits block the caller") {
  HostRuntime rt;
  auto threaded = rt.make_stream();
  auto inl = rt.make_stream(HostStreamMode::inline_calls);
  Gate gate;
  std::vector<std::byte> src(4096, std::byte{0x11}), dst(4096);
  struct Fill {
    std::vector<std::byte>* v;
    static void run(void* p) noexcept {
      auto* f = static_cast<Fill*>(p);
      std::fill(f->v->begin(), f->v->end(), std::byte{0x77});
    }
  } fill{&src};
  HostRuntime::Event ready;
  REQUIRE(rt.create_event(ready));
  REQUIRE(rt.launch_host_func(threaded, &Gate::host_func, &gate));
  REQUIRE(rt.launch_host_func(threaded, &Fill::run, &fill));
  REQUIRE(rt.record(ready, threaded));
  std::thread opener([&] {
    CHECK(eventually([&] { return gate.entered.load(); }));
    gate.open();
  });
  REQUIRE(rt.wait(inl, ready));  // blocks this thread until the fill ran
  REQUIRE(rt.copy_async(dst.data(), src.data(), src.size(), inl));
  opener.join();
  CHECK(std::all_of(dst.begin(), dst.end(), [](std::byte x) { return x == std::byte{0x77}; }));
}

TEST_CASE("host runtime: query answers without waiting whether a stream ran everything queued on it") {
  HostRuntime rt;
  auto threaded = rt.make_stream();
  auto inl = rt.make_stream(HostStreamMode::inline_calls);
  HostRuntime::Stream empty;
  CHECK_FALSE(rt.query(empty));
  CHECK(rt.query(threaded));  // nothing queued yet
  std::vector<std::byte> src(4096, std::byte{0x5a}), dst(4096);
  REQUIRE(rt.copy_async(dst.data(), src.data(), src.size(), inl));
  CHECK(rt.query(inl));  // an inline copy ran before copy_async returned
  Gate gate;
  REQUIRE(rt.launch_host_func(threaded, &Gate::host_func, &gate));
  REQUIRE(rt.copy_async(dst.data(), src.data(), src.size(), threaded));
  CHECK(eventually([&] { return gate.entered.load(); }));
  CHECK_FALSE(rt.query(threaded));  // held at the gate: the copy has not run
  gate.open();
  CHECK(eventually([&] { return rt.query(threaded); }));  // turns true by itself, no synchronize
  CHECK(rt.synchronize(threaded));
  FaultyRuntime<HostRuntime> faulty;
  auto fs = faulty.make_stream();
  CHECK(faulty.query(fs));
}

TEST_CASE("faulty runtime: armed calls fail (counted) - heal restores - construction-time calls throw") {
  FaultyRuntime<> rt;
  auto stream = rt.make_stream();
  HostRuntime::Event e;
  rt.fail(RuntimeCall::create_event, 1);
  CHECK_FALSE(rt.create_event(e));
  CHECK_FALSE(e.valid());
  CHECK(rt.create_event(e));
  CHECK(rt.calls(RuntimeCall::create_event) == 2);
  CHECK(rt.failures(RuntimeCall::create_event) == 1);

  rt.fail(RuntimeCall::record);
  for (int i = 0; i < 3; ++i) CHECK_FALSE(rt.record(e, stream));
  rt.heal(RuntimeCall::record);
  CHECK(rt.record(e, stream));
  CHECK(rt.failures(RuntimeCall::record) == 3);

  std::byte x{5}, y{0};
  rt.fail(RuntimeCall::copy_async, 1, 1);  // the first passes, the second fails
  CHECK(rt.copy_async(&y, &x, 1, stream));
  CHECK_FALSE(rt.copy_async(&y, &x, 1, stream));
  CHECK(rt.copy_async(&y, &x, 1, stream));
  CHECK(rt.synchronize(stream));
  CHECK(y == x);

  rt.fail(RuntimeCall::allocate_pinned, 1);
  try {
    (void)rt.allocate_pinned(64);
    FAIL("expected an Error");
  } catch (const Error& err) {
    CHECK(err.code() == ErrorCode::device_failure);
    CHECK(std::string(err.what()).find("allocate_pinned") != std::string::npos);
  }
  void* p = rt.allocate_pinned(64);
  CHECK(rt.inner().pinned_bytes() == 64);
  rt.free_pinned(p);

  rt.fail(RuntimeCall::device_synchronize, 1);
  CHECK_FALSE(rt.device_synchronize());
  CHECK(rt.device_synchronize());
}

TEST_CASE("host runtime: many threads copying through shared streams") {
  HostRuntime rt(HostRuntimeOptions{.stream_ring_ops = 8});
  auto s1 = rt.make_stream();
  auto s2 = rt.make_stream();
  constexpr int threads = 4;
  constexpr std::size_t n = 2048;
  std::vector<std::vector<std::byte>> src, dst;
  for (int t = 0; t < threads; ++t) {
    src.push_back(pattern(n, static_cast<unsigned>(t + 40)));
    dst.emplace_back(n);
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      HostRuntime::Event e;
      CHECK(rt.create_event(e));
      auto& mine = (t % 2 == 0) ? s1 : s2;
      auto& other = (t % 2 == 0) ? s2 : s1;
      for (int i = 0; i < 50; ++i) {
        CHECK(rt.copy_async(dst[t].data(), src[t].data(), n, mine));
        CHECK(rt.record(e, mine));
        CHECK(rt.wait(other, e));
        CHECK(rt.synchronize(e));
      }
    });
  }
  for (auto& th : pool) th.join();
  CHECK(rt.device_synchronize());
  for (int t = 0; t < threads; ++t) CHECK(dst[t] == src[t]);
}
