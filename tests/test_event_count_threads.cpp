// detail::EventCount, the futex the lanes and the emulated streams sleep on: a wait whose key
// predates a notify returns, no wake-up is lost between a waiter's check and its sleep, and
// notify_all wakes every sleeper. A lost wake-up shows as a waiter still asleep at a
// deadline (the test then fails and wakes it, rather than hang).
#include <doctest/doctest.h>

#include <kvfuse/detail/event_count.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

using kvfuse::detail::EventCount;
using namespace std::chrono_literals;

namespace {

/// Polls `done` until it is true or `limit` passes; true if it became true.
template <class Done>
bool within(std::chrono::milliseconds limit, Done&& done) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

}  // namespace

TEST_CASE("event count: a wait whose key predates a notify returns at once - a fresh key sleeps until the next") {
  EventCount ec;
  const EventCount::Key before = ec.prepare_wait();
  ec.notify_one();
  ec.wait(before);  // would sleep forever if the notify were not seen

  std::atomic<bool> woke{false};
  const EventCount::Key now = ec.prepare_wait();
  std::thread waiter([&] {
    ec.wait(now);
    woke.store(true);
  });
  std::this_thread::sleep_for(20ms);
  // A futex may wake spuriously, but not 20 ms in a row on an idle key.
  CHECK_FALSE(woke.load());
  ec.notify_one();
  const bool returned = within(10s, [&] { return woke.load(); });
  CHECK(returned);
  while (!woke.load()) ec.notify_one();
  waiter.join();
}

TEST_CASE("event count: two threads hand a token back and forth 100000 times - no wake-up is lost") {
  // Each side waits the way a lane does: key, check, sleep; the other side publishes, then
  // notifies. A wake-up lost between a check and a sleep stalls the exchange.
  constexpr std::uint64_t rounds = 100000;
  EventCount to_b, to_a;
  std::atomic<std::uint64_t> sent{0}, acked{0};
  std::atomic<bool> stop{false};
  auto await = [&](EventCount& ec, std::atomic<std::uint64_t>& word, std::uint64_t want) {
    ec.wait_until([&] { return word.load(std::memory_order_acquire) >= want || stop.load(); });
  };
  std::thread b([&] {
    for (std::uint64_t i = 1; i <= rounds && !stop.load(); ++i) {
      await(to_b, sent, i);
      acked.store(i, std::memory_order_release);
      to_a.notify_one();
    }
  });
  std::thread a([&] {
    for (std::uint64_t i = 1; i <= rounds && !stop.load(); ++i) {
      sent.store(i, std::memory_order_release);
      to_b.notify_one();
      await(to_a, acked, i);
    }
  });
  const bool finished = within(120s, [&] { return acked.load() == rounds; });
  CHECK(finished);
  stop.store(true);
  to_a.notify_all();
  to_b.notify_all();
  a.join();
  b.join();
  CHECK(acked.load() == rounds);
}

TEST_CASE("event count: notify_all wakes every sleeper, notify_one at least one") {
  EventCount ec;
  std::atomic<int> awake{0};
  std::atomic<bool> released{false};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 4; ++i)
    waiters.emplace_back([&] {
      ec.wait_until([&] { return released.load(); });
      awake.fetch_add(1);
    });
  std::this_thread::sleep_for(20ms);
  CHECK(awake.load() == 0);
  released.store(true);
  ec.notify_one();
  const bool one = within(10s, [&] { return awake.load() >= 1; });
  CHECK(one);
  ec.notify_all();
  const bool all = within(10s, [&] { return awake.load() == 4; });
  CHECK(all);
  while (awake.load() < 4) ec.notify_all();
  for (std::thread& t : waiters) t.join();
}

#if defined(__linux__)
namespace {

/// Whether thread `tid` of this process is blocked in a futex system call right now
/// (/proc/self/task/<tid>/syscall names the call a blocked thread is in, "running" otherwise).
bool blocked_in_futex(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/syscall");
  long number = -1;
  return static_cast<bool>(in >> number) && number == SYS_futex;
}

/// A notify hook that holds the notifier between its two steps until the test's waiter has
/// either returned from its wait or is asleep in the futex (or 10 s pass). Armed by the
/// test through `waiter`; a notify while it is null passes straight through.
struct HoldNotifier {
  struct Waiter {
    std::atomic<pid_t> tid{0};
    std::atomic<bool> entering_wait{false};  // the next thing the waiter does is wait(key)
    std::atomic<bool> returned{false};
    std::atomic<bool> notifier_held{false};
    std::atomic<bool> saw_it_parked{false};
  };
  static inline std::atomic<Waiter*> waiter{nullptr};

  static void between_steps() noexcept {
    Waiter* w = waiter.load();
    if (w == nullptr) return;
    w->notifier_held.store(true);
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < until) {
      if (w->returned.load()) return;
      if (w->entering_wait.load() && blocked_in_futex(w->tid.load())) {
        w->saw_it_parked.store(true);
        return;
      }
      std::this_thread::sleep_for(100us);
    }
  }
};

}  // namespace

TEST_CASE("event count: a waiter that parks while a notify is between its two steps is still woken by it") {
  // The waiter takes its key before the notify and calls wait(key) while the notifier is
  // held between its two steps (bump the epoch, look for sleepers), then must return within
  // a deadline. With the epoch bumped first the wait sees the new epoch and returns at
  // once; were the steps swapped it would find no bump yet, park in the futex, and the
  // notifier, having already looked for sleepers and found none, would never wake it.
  kvfuse::detail::BasicEventCount<HoldNotifier> ec;
  HoldNotifier::Waiter w;
  HoldNotifier::waiter.store(&w);
  std::atomic<bool> key_taken{false};
  std::thread waiter([&] {
    w.tid.store(static_cast<pid_t>(::syscall(SYS_gettid)));
    const auto key = ec.prepare_wait();
    key_taken.store(true);  // ... and the condition it guards is seen false
    while (!w.notifier_held.load()) std::this_thread::sleep_for(100us);
    w.entering_wait.store(true);
    ec.wait(key);
    w.returned.store(true);
  });
  REQUIRE(within(10s, [&] { return key_taken.load(); }));
  std::thread notifier([&] { ec.notify_one(); });  // the work is published; held inside
  notifier.join();
  const bool woken = within(5s, [&] { return w.returned.load(); });
  const bool parked = w.saw_it_parked.load();  // true only if the waiter slept through the window
  CAPTURE(parked);
  CHECK(woken);
  HoldNotifier::waiter.store(nullptr);
  while (!w.returned.load()) {  // a lost wake-up: wake the waiter so the test can end
    ec.notify_all();
    std::this_thread::sleep_for(1ms);
  }
  waiter.join();
}
#endif
