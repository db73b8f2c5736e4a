// kvfuse/detail/event_count.hpp — EventCount: lets a worker thread sleep until it is told
// there is new work, without the mutex a condition variable needs.
//
// Why not std::condition_variable: glibc's condition variable wakes its waiter into a
// mutex it marks contended whether or not anyone else wants it, so the woken thread pays
// a futex wake on its next unlock: a second system call on every hand-off, on the woken
// thread, before it runs what it was woken for (seen in a `perf record` trace of the lane of a
// one-chunk load: FUTEX_WAKE_PRIVATE on the lane's mutex 1.4 us after every wake-up).
// Why not std::atomic<T>::wait: libstdc++ spins and calls sched_yield before it sleeps,
// and its notify makes the system call whenever any thread waits on any address that
// shares its slot in a 16-entry table.
//
// The protocol is the classic event count. The waiter takes a key, checks its condition
// (under whatever lock guards it), and if there is nothing to do calls wait(key): that
// returns at once if notify() ran since the key was taken. The notifier publishes the
// work, then calls notify(), which makes a system call only if a waiter is asleep or on
// its way to sleep. Both sides' counter updates are sequentially consistent, so either the
// waiter sees the new count and does not sleep, or the notifier sees the waiter and wakes
// it: no wake-up is lost. wait() may return without a notify (the futex can wake
// spuriously); callers check their condition in a loop.
//
// Internal: not part of the public API. Never throws, never allocates. Any thread may
// notify; any thread may wait.
#pragma once

#include <atomic>
#include <climits>
#include <cstdint>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvfuse::detail {

/// A futex-backed event count (see the file comment). Not copyable or movable: waiters
/// sleep on its address.
class EventCount {
 public:
  /// What the caller saw before it checked its condition. Any thread; wait-free.
  using Key = std::uint32_t;

  EventCount() noexcept = default;
  EventCount(const EventCount&) = delete;
  EventCount& operator=(const EventCount&) = delete;

  /// Takes a key: call before checking the condition the wait is for. Any thread; wait-free.
  [[nodiscard]] Key prepare_wait() const noexcept { return epoch_.load(std::memory_order_seq_cst); }

  /// Sleeps until notify() ran after `key` was taken; returns at once if it already has.
  /// May return spuriously. Hold no lock the notifier needs. Any thread; blocks.
  void wait(Key key) noexcept {
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if (epoch_.load(std::memory_order_seq_cst) == key) sleep(key);
    sleepers_.fetch_sub(1, std::memory_order_release);
  }

  /// Wakes the waiters whose keys predate this call (all of them: `one` wakes at most one,
  /// for a single consumer). Makes a system call only if a thread waits. Call after the work
  /// is published. Any thread; never blocks.
  void notify(bool one = true) noexcept {
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) != 0) wake(one);
  }

 private:
#if defined(__linux__)
  void sleep(Key key) noexcept {
    // EAGAIN (the epoch moved on) and EINTR both return to the caller's loop.
    (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&epoch_), FUTEX_WAIT_PRIVATE, key, nullptr, nullptr, 0);
  }
  void wake(bool one) noexcept {
    (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&epoch_), FUTEX_WAKE_PRIVATE, one ? 1 : INT_MAX,
                    nullptr, nullptr, 0);
  }
#else
  void sleep(Key key) noexcept { epoch_.wait(key, std::memory_order_seq_cst); }
  void wake(bool one) noexcept {
    if (one) epoch_.notify_one();
    else epoch_.notify_all();
  }
#endif
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) && std::atomic<std::uint32_t>::is_always_lock_free,
                "the futex word must be a plain 32-bit word");

  std::atomic<std::uint32_t> epoch_{0};
  std::atomic<std::uint32_t> sleepers_{0};
};

}  // namespace kvfuse::detail
