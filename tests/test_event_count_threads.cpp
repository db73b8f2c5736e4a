// detail::EventCount, the futex the lanes and the emulated streams sleep on: a wait whose key
// predates a notify returns, no wake-up is lost between a waiter's check and its sleep, and
// notify_all wakes every sleeper. A lost wake-up shows as a waiter still asleep at a
// deadline (the test then fails and wakes it, rather than hang).
#include <doctest/doctest.h>

#include <kvfuse/detail/event_count.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

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
