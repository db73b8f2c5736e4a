// kvfuse/detail/event_count.hpp — EventCount: lets a worker thread sleep until it is told
// there is new work, without the mutex a condition variable needs.
//
// Why not std::condition_variable: glibc's condition variable wakes its waiter into a
// mutex it marks contended whether or not anyone else wants it, so the woken thread pays
// a futex wake on its next unlock: a second system call on every hand-off, on the woken
// thread, before it runs what it was woken for (a `perf record` trace of a lane shows the
// FUTEX_WAKE_PRIVATE after every wake-up; bench/README.md#fixed-cost has the numbers).
// Why not std::atomic<T>::wait: libstdc++ spins and calls sched_yield before it sleeps,
// and its notify makes the system call whenever any thread waits on any address that
// shares its slot in a 16-entry table.
//
// The protocol is the classic event count. The waiter takes a key, checks its condition
// (under whatever lock guards it), and if there is nothing to do calls wait(key): that
// returns at once if a notify ran since the key was taken (wait_until is that loop). The
// notifier publishes the work, then calls notify_one or notify_all, which makes a system
// call only if a waiter is asleep or on its way to sleep. Both sides' counter updates are sequentially consistent, so either the
// waiter sees the new count and does not sleep, or the notifier sees the waiter and wakes
// it: no wake-up is lost. wait() may return without a notify (the futex can wake
// spuriously); callers check their condition in a loop.
//
// The order inside notify is the whole guarantee: bump the epoch first, then look for
// sleepers. Swapped, a waiter that registers and enters its futex wait between the two
// steps sleeps on the old epoch and no wake comes. That window is a few instructions wide,
// so a test cannot hit it by chance; BasicEventCount's NotifyHook lets a test hold the
// notifier inside it (tests/test_event_count_threads.cpp). EventCount uses NoNotifyHook,
// an empty inline function: it compiles to nothing.
//
// Internal: not part of the public API. Never throws, never allocates. Any thread may
// notify; any thread may wait.
#pragma once

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvfuse::detail {

/// What notify does between bumping the epoch and looking for sleepers: nothing.
struct NoNotifyHook {
  static void between_steps() noexcept {}
};

/// A futex-backed event count (see the file comment). Not copyable or movable: waiters
/// sleep on its address. `NotifyHook::between_steps()` (static, noexcept) runs inside
/// every notify, after the epoch is bumped and before sleepers are looked for: a test
/// holds the notifier there; everything else uses EventCount (NoNotifyHook).
/// `ProcessShared`: the futex is keyed by the physical page, not the process, so the event
/// count works across processes that map it from one shared memory segment (it holds two
/// plain 32-bit atomics and no pointer: address-free); otherwise a cheaper private futex.
template <class NotifyHook = NoNotifyHook, bool ProcessShared = false>
class BasicEventCount {
 public:
  /// What the caller saw before it checked its condition. Any thread; wait-free.
  using Key = std::uint32_t;

  BasicEventCount() noexcept = default;
  BasicEventCount(const BasicEventCount&) = delete;
  BasicEventCount& operator=(const BasicEventCount&) = delete;

  /// Takes a key: call before checking the condition the wait is for. Any thread; wait-free.
  [[nodiscard]] Key prepare_wait() const noexcept { return epoch_.load(std::memory_order_seq_cst); }

  /// Sleeps until a notify ran after `key` was taken; returns at once if it already has.
  /// May return spuriously. Hold no lock the notifier needs. Any thread; blocks.
  void wait(Key key) noexcept {
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if (epoch_.load(std::memory_order_seq_cst) == key) sleep(key);
    sleepers_.fetch_sub(1, std::memory_order_release);
  }

  /// As wait(), but gives up after `timeout`: returns false when it timed out (the caller
  /// checks its condition either way). Any thread; blocks at most about `timeout`.
  bool wait_for(Key key, std::chrono::nanoseconds timeout) noexcept {
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    bool woken = true;
    if (epoch_.load(std::memory_order_seq_cst) == key) woken = sleep_for(key, timeout);
    sleepers_.fetch_sub(1, std::memory_order_release);
    return woken;
  }

  /// Blocks until `ready()` is true: takes a key, checks, sleeps, again. `ready` is read
  /// with no lock held, so what it reads must be atomic (acquire, to see what the notifier
  /// published). Any thread; blocks.
  template <class Ready>
  void wait_until(Ready&& ready) noexcept {
    for (;;) {
      const Key key = prepare_wait();
      if (ready()) return;
      wait(key);
    }
  }

  /// The same for a condition guarded by a mutex: `lock` (held on entry and on return) is
  /// held while `ready()` is checked and released while asleep, as with
  /// std::condition_variable::wait. The key is taken under the lock, before the condition
  /// is seen false, so work published (under the lock) after that check is notified after
  /// the key was taken and the wait returns at once. Any thread; blocks.
  template <class Lock, class Ready>
  void wait_until(Lock& lock, Ready&& ready) noexcept {
    for (;;) {
      const Key key = prepare_wait();
      if (ready()) return;
      lock.unlock();
      wait(key);
      lock.lock();
    }
  }

  /// Wakes at most one waiter whose key predates this call (for a single consumer). Makes a
  /// system call only if a thread waits. Call after the work is published. Any thread;
  /// never blocks.
  void notify_one() noexcept { notify(1); }

  /// Wakes every waiter whose key predates this call. Makes a system call only if a thread
  /// waits. Call after the work is published. Any thread; never blocks.
  void notify_all() noexcept { notify(INT_MAX); }

 private:
  void notify(int waiters) noexcept {
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    NotifyHook::between_steps();
    if (sleepers_.load(std::memory_order_seq_cst) != 0) wake(waiters);
  }

#if defined(__linux__)
  static constexpr int wait_op = ProcessShared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE;
  static constexpr int wake_op = ProcessShared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE;
  void sleep(Key key) noexcept {
    // EAGAIN (the epoch moved on) and EINTR both return to the caller's loop.
    (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&epoch_), wait_op, key, nullptr, nullptr, 0);
  }
  // False when the timeout ran out.
  bool sleep_for(Key key, std::chrono::nanoseconds timeout) noexcept {
    const auto s = std::chrono::duration_cast<std::chrono::seconds>(timeout);
    timespec ts{static_cast<time_t>(s.count()), static_cast<long>((timeout - s).count())};
    const long r = ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&epoch_), wait_op, key, &ts, nullptr, 0);
    return !(r == -1 && errno == ETIMEDOUT);
  }
  void wake(int waiters) noexcept {
    (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&epoch_), wake_op, waiters, nullptr, nullptr, 0);
  }
#else
  static_assert(!ProcessShared, "a process-shared event count needs Linux futexes");
  void sleep(Key key) noexcept { epoch_.wait(key, std::memory_order_seq_cst); }
  bool sleep_for(Key key, std::chrono::nanoseconds timeout) noexcept {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (epoch_.load(std::memory_order_seq_cst) == key)
      if (std::chrono::steady_clock::now() >= deadline) return false;
    return true;
  }
  void wake(int waiters) noexcept {
    if (waiters == 1) epoch_.notify_one();
    else epoch_.notify_all();
  }
#endif
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) && std::atomic<std::uint32_t>::is_always_lock_free,
                "the futex word must be a plain 32-bit word");

  std::atomic<std::uint32_t> epoch_{0};
  std::atomic<std::uint32_t> sleepers_{0};
};

/// The event count the library uses: no hook.
using EventCount = BasicEventCount<>;
/// The same across processes: lives in a shared memory segment (ipc/).
using SharedEventCount = BasicEventCount<NoNotifyHook, true>;

}  // namespace kvfuse::detail
