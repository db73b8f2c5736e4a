// Lane and LegLatch: FIFO, back-off without drops, inline tasks (no allocation per
// submit), a destructor that drains, exceptions that do not kill the lane, and the join.
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/testing/alloc_counter.hpp>
#include <kvfuse/worker/lane.hpp>

#include <pthread.h>
#include <sched.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;
using namespace kvfuse::testing;
using namespace std::chrono_literals;

namespace {



}  // namespace

TEST_CASE("lane: capacity 0 is refused with an Error naming the lane and the value") {
  try {
    Lane lane("kvfuse-load", 0);
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    const std::string what = e.what();
    CHECK(what.find("kvfuse-load") != std::string::npos);
    CHECK(what.find("got 0") != std::string::npos);
  }
}

TEST_CASE("lane: a negative spin is refused with an Error naming the lane and the value") {
  try {
    Lane lane("kvfuse-load", 8, std::chrono::nanoseconds{-5});
    FAIL("expected an Error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    const std::string what = e.what();
    CHECK(what.find("kvfuse-load") != std::string::npos);
    CHECK(what.find("spin") != std::string::npos);
    CHECK(what.find("-5") != std::string::npos);
  }
  Lane lane("kvfuse-load", 8);  // the default never spins
  CHECK(lane.spin() == std::chrono::nanoseconds{0});
}

TEST_CASE("lane: cpus confine the lane's thread to them - a CPU the machine lacks is refused naming it") {
  const unsigned last = std::thread::hardware_concurrency() > 0 ? std::thread::hardware_concurrency() - 1 : 0;
  const unsigned cpus[] = {last};
  Lane lane("placed", 8, std::chrono::nanoseconds{0}, cpus);
  std::atomic<int> ran_on{-1};
  std::atomic<int> allowed{-1};
  lane.submit([&]() noexcept {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (pthread_getaffinity_np(pthread_self(), sizeof set, &set) == 0)
      allowed = CPU_COUNT(&set) == 1 && CPU_ISSET(last, &set) ? 1 : 0;
    ran_on = sched_getcpu();
  });
  lane.wait_idle();
  CHECK(allowed.load() == 1);
  CHECK(ran_on.load() == static_cast<int>(last));

  const unsigned absent[] = {0, 4000};
  try {
    Lane bad("nowhere", 8, std::chrono::nanoseconds{0}, absent);
    FAIL("a CPU the machine does not have must be refused");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::invalid_argument);
    const std::string what = e.what();
    CHECK(what.find("nowhere") != std::string::npos);
    CHECK(what.find("CPU 4000") != std::string::npos);
  }
}

TEST_CASE("lane: with spin on every task from several submitters runs once and in each submitter's order") {
  // A spin long enough that the lane is often still polling when the next task comes, and
  // gaps now and then longer than it, so the lane also goes to sleep and is woken by the cv.
  Lane lane("kvfuse-load", 8, 200us);
  CHECK(lane.spin() == 200us);
  constexpr int per_thread = 300;
  std::vector<std::vector<int>> seen(3);
  for (auto& v : seen) v.reserve(per_thread);
  std::atomic<bool> wrong_thread{false};
  std::vector<std::thread> submitters;
  for (int t = 0; t < 3; ++t) {
    submitters.emplace_back([&, t] {
      for (int i = 0; i < per_thread; ++i) {
        lane.submit([&seen, &lane, &wrong_thread, t, i]() noexcept {
          if (!lane.on_lane()) wrong_thread.store(true);
          seen[static_cast<std::size_t>(t)].push_back(i);
        });
        if (i % 50 == 49) std::this_thread::sleep_for(1ms);  // past the spin: the lane sleeps
      }
    });
  }
  for (auto& th : submitters) th.join();
  lane.wait_idle();
  CHECK_FALSE(wrong_thread.load());
  for (const auto& v : seen) {
    REQUIRE(v.size() == per_thread);
    for (int i = 0; i < per_thread; ++i) CHECK(v[static_cast<std::size_t>(i)] == i);
  }
  CHECK(lane.submitted() == 3 * per_thread);
  CHECK(lane.completed() == 3 * per_thread);
  // One task at a time with the lane idle in between: each is picked up whether the lane
  // still spins or already sleeps, and wait_idle sees it finished.
  for (int i = 0; i < 20; ++i) {
    std::atomic<int> ran{0};
    lane.submit([&ran]() noexcept { ran.fetch_add(1); });
    lane.wait_idle();
    CHECK(ran.load() == 1);
    if (i % 5 == 4) std::this_thread::sleep_for(1ms);
  }
}

TEST_CASE("lane: a spinning lane's destructor runs every queued task and returns without waiting out the spin") {
  std::atomic<int> ran{0};
  const auto t0 = std::chrono::steady_clock::now();
  {
    Lane lane("kvfuse-load", 4, 30s);  // a spin far longer than the test may take
    lane.submit([&ran]() noexcept { ran.fetch_add(1); });
    REQUIRE(eventually([&] { return lane.completed() == 1; }));  // now it spins
    for (int i = 0; i < 50; ++i) lane.submit([&ran]() noexcept { ran.fetch_add(1); });
    lane.wait_idle();
    CHECK(ran.load() == 51);
    for (int i = 0; i < 3; ++i) lane.submit([&ran]() noexcept { ran.fetch_add(1); });
  }  // stopping ends the spin at once
  CHECK(ran.load() == 54);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
}

TEST_CASE("lane: tasks run in submission order on the lane's one thread") {
  Lane lane("kvfuse-load", 16);
  CHECK(lane.name() == "kvfuse-load");
  constexpr int tasks = 2000;
  std::vector<int> order;
  order.reserve(tasks);
  std::atomic<bool> wrong_thread{false};
  for (int i = 0; i < tasks; ++i) {
    lane.submit([&order, &lane, &wrong_thread, i]() noexcept {
      if (!lane.on_lane()) wrong_thread.store(true);
      order.push_back(i);
    });
  }
  lane.wait_idle();
  CHECK_FALSE(wrong_thread.load());
  CHECK_FALSE(lane.on_lane());
  REQUIRE(order.size() == tasks);
  for (int i = 0; i < tasks; ++i) CHECK(order[static_cast<std::size_t>(i)] == i);
  CHECK(lane.submitted() == tasks);
  CHECK(lane.completed() == tasks);
}

TEST_CASE("lane: a full ring makes submit back off - nothing is dropped and order holds") {
  Lane lane("kvfuse-state", 4);
  Gate gate;
  lane.submit([&gate]() noexcept { (void)gate.pass(); });
  REQUIRE(eventually([&] { return gate.entered.load(); }));
  // The running task keeps its slot; fill the other three, then see try_submit refuse
  // without taking the task.
  std::vector<int> order;
  order.reserve(200);
  for (int i = 0; i < 3; ++i) CHECK(lane.try_submit([&order, i]() noexcept { order.push_back(i); }));
  bool ran_rejected = false;
  auto rejected = [&ran_rejected]() noexcept { ran_rejected = true; };
  CHECK_FALSE(lane.try_submit(rejected));
  // Several submitters block on the full ring; each keeps its own order.
  constexpr int per_thread = 40;
  std::vector<std::vector<int>> seen(3);
  for (auto& v : seen) v.reserve(per_thread);
  std::vector<std::thread> submitters;
  for (int t = 0; t < 3; ++t) {
    submitters.emplace_back([&lane, &seen, t] {
      for (int i = 0; i < per_thread; ++i) lane.submit([&seen, t, i]() noexcept { seen[t].push_back(i); });
    });
  }
  REQUIRE(eventually([&] { return lane.full_waits() >= 3; }));
  CHECK(lane.completed() == 0);  // still held at the gate: nothing ran, nothing was dropped
  gate.open();
  for (auto& th : submitters) th.join();
  lane.wait_idle();
  CHECK_FALSE(ran_rejected);
  CHECK(order == std::vector<int>{0, 1, 2});
  for (const auto& v : seen) {
    REQUIRE(v.size() == per_thread);
    for (int i = 0; i < per_thread; ++i) CHECK(v[static_cast<std::size_t>(i)] == i);
  }
  CHECK(lane.completed() == 1 + 3 + 3 * per_thread);
}

TEST_CASE("R12 a lane submit never allocates: tasks live inline in the ring") {
  REQUIRE(detail::AllocationScope::hook_installed());
  Lane lane("kvfuse-load", 64);
  std::atomic<std::uint64_t> sum{0};
  // A task as large as a connector's: a request-sized payload captured by value.
  std::array<std::uint64_t, 24> payload{};
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = i;
  static_assert(sizeof(payload) + sizeof(void*) <= Lane::task_bytes);
  lane.submit([]() noexcept {});  // the thread is warm
  lane.wait_idle();
  detail::AllocationScope scope;
  for (int i = 0; i < 5000; ++i) {
    lane.submit([payload, &sum]() noexcept { sum.fetch_add(payload[23], std::memory_order_relaxed); });
  }
  lane.wait_idle();
  CHECK(scope.all_threads() == 0);
  CHECK(sum.load() == 5000u * 23u);
}

TEST_CASE("lane: the destructor runs every queued task including ones queued by tasks") {
  std::atomic<int> ran{0};
  {
    Lane lane("kvfuse-save", 8);
    Gate gate;
    lane.submit([&gate]() noexcept { (void)gate.pass(); });
    std::thread opener([&] {
      CHECK(eventually([&] { return gate.entered.load(); }));
      gate.open();
    });
    for (int i = 0; i < 100; ++i) {
      lane.submit([&ran, &lane]() noexcept {
        ran.fetch_add(1);
        // A task may queue follow-up work on its own lane without blocking.
        (void)lane.try_submit([&ran]() noexcept { ran.fetch_add(1000); });
      });
    }
    opener.join();
  }  // destructor: drains, then joins
  CHECK(ran.load() % 1000 == 100);
  CHECK(ran.load() >= 1000 + 100);  // at least one follow-up found a slot and ran
}

TEST_CASE("lane: a task that throws is counted and the lane keeps running") {
  Lane lane("kvfuse-load", 8);
  std::atomic<int> after{0};
  lane.submit([] { throw std::runtime_error("leg blew up"); });
  lane.submit([&after]() noexcept { after.fetch_add(1); });
  lane.wait_idle();
  CHECK(lane.exceptions() == 1);
  CHECK(after.load() == 1);
  CHECK(lane.completed() == 2);
}

TEST_CASE("lane: wait_idle from the lane's own thread returns instead of waiting for itself") {
  Lane lane("kvfuse-load", 4);
  std::atomic<bool> returned{false};
  lane.submit([&]() noexcept {
    lane.wait_idle();
    returned.store(true);
  });
  lane.wait_idle();
  CHECK(returned.load());
}

TEST_CASE("leg latch: a load task joins its state leg - the leg's writes are visible after the wait") {
  Lane load("kvfuse-load", 8);
  Lane state("kvfuse-state", 8);
  constexpr int loads = 500;
  std::atomic<int> ok{0};
  for (int i = 0; i < loads; ++i) {
    load.submit([&state, &ok, i]() noexcept {
      LegLatch join;  // on the task's stack; destroyed right after wait()
      int verdict = -1;
      state.submit([&verdict, i, done = join.arrival()]() mutable noexcept {
        verdict = i * 3;
        done.arrive();
      });
      join.wait();
      if (verdict == i * 3) ok.fetch_add(1);
    });
  }
  load.wait_idle();
  CHECK(ok.load() == loads);
}

TEST_CASE("leg latch: the arrival token arrives on every path (an exception included)") {
  Lane state("kvfuse-state", 4);
  LegLatch join;
  state.submit([done = join.arrival()]() mutable {
    (void)done;
    throw std::runtime_error("state tier exploded");
  });
  join.wait();  // would hang if the unwinding task did not arrive
  CHECK(join.ready());
  state.wait_idle();
  CHECK(state.exceptions() == 1);

  LegLatch never_run;
  {
    auto token = never_run.arrival();
    auto moved = std::move(token);
    CHECK_FALSE(never_run.ready());
  }  // the moved-to token arrives once, the moved-from one does nothing
  CHECK(never_run.ready());
}
