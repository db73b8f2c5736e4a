// kvfuse/worker/lane.hpp — Lane: a single-thread executor with a bounded ring of inline
// tasks; LegLatch: the join between a load task and its state leg (R9).
//
// A rank runs its work on a few named lanes (load, state, save). Each lane is one
// std::thread and a fixed ring of task slots allocated when the lane is built; a task is
// moved into its slot (small-buffer storage, no heap), runs there in FIFO order, and is
// destroyed there. So submitting a task never allocates (R12), and a full ring makes the
// submitter wait (counted) instead of dropping the task (R20's rule for records, applied
// to work).
//
// Exceptions: a task is noexcept to the lane. If one throws anyway, the lane catches it,
// counts it in exceptions(), destroys the task and runs the next one; the lane never
// dies and never calls std::terminate. Whatever the task owed (a completion record) is
// the task's own guard's business: kvfuse's connector tasks report through a guard
// object and never let an exception escape it.
//
// Sleeping. An idle lane sleeps on a futex (detail::EventCount), not on a condition
// variable: a glibc condition variable wakes its waiter into a mutex marked contended, and
// the lane's next unlock then costs a second system call before the task even starts
// (bench/README.md#fixed-cost). So a hand-off costs the submitter one futex wake, and the
// lane one futex wait.
//
// Spin before sleeping (opt-in; off by default). A sleeping lane
// costs a futex wake per hand-off, and on a VM whose other vCPU is halted that wake-up is
// slow (bench/README.md#fixed-cost). A lane built with spin > 0 polls for new
// work for up to that long after it ran a task, before it goes back to sleep: a task
// submitted meanwhile starts within about a microsecond and the submitter's notify finds
// no sleeper (no syscall). The price is CPU: the lane's thread runs flat out for up to
// `spin` after every burst of tasks, whether or not more work comes. No lock is held while
// spinning (the submitters never wait for the spinner), and the loop yields its CPU
// regularly. With spin 0 the lane behaves exactly as it did without the option.
//
// Placement (opt-in; off by default). A lane may be given the CPUs its thread may run on.
// Left to the OS, a lane woken by the scheduler thread lands wherever the kernel's wake-up
// heuristics put it: on a small VM that is sometimes the CPU the scheduler is about to
// leave and sometimes a halted vCPU that is slow to wake, and the choice sticks for the
// life of the thread (bench/README.md#placement). Pinning the lanes to CPUs of
// their own makes every hand-off the same kind: an engine that keeps its scheduler thread
// on other CPUs gets the same cost on every load.
#pragma once

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include <kvfuse/detail/event_count.hpp>
#include <kvfuse/detail/spin.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// Default inline capacity of a lane task, in bytes. Connector::load's task owns its
/// LoadRequest by value (moved into the lambda, then into the slot: the specs' vectors
/// change hands, nothing is copied or allocated) plus the connector's `this`; that fits
/// with room to spare.
inline constexpr std::size_t lane_task_bytes = 256;

namespace detail {

/// One ring slot: storage for a callable of at most `Bytes` bytes, plus how to run and
/// destroy it. Not movable: a task lives in its slot from submit to completion.
template <std::size_t Bytes>
class TaskSlot {
 public:
  TaskSlot() noexcept = default;
  TaskSlot(const TaskSlot&) = delete;
  TaskSlot& operator=(const TaskSlot&) = delete;
  ~TaskSlot() { reset(); }

  template <class F>
  void emplace(F&& f) noexcept {
    using T = std::decay_t<F>;
    ::new (static_cast<void*>(storage_)) T(std::forward<F>(f));
    run_ = [](void* p) noexcept -> bool {
      try {
        (*static_cast<T*>(p))();
        return true;
      } catch (...) {
        return false;
      }
    };
    destroy_ = [](void* p) noexcept { static_cast<T*>(p)->~T(); };
  }

  /// Runs the task; false if it threw (the exception is swallowed here).
  bool run() noexcept { return run_(storage_); }

  void reset() noexcept {
    if (destroy_ != nullptr) {
      destroy_(storage_);
      destroy_ = nullptr;
      run_ = nullptr;
    }
  }

 private:
  alignas(std::max_align_t) std::byte storage_[Bytes];
  bool (*run_)(void*) noexcept = nullptr;
  void (*destroy_)(void*) noexcept = nullptr;
};

/// Checks a CPU list for a lane's placement: every CPU below CPU_SETSIZE and below the
/// number of CPUs this machine has configured. `what` names the option in the message.
/// Throws Error(invalid_argument) naming the first bad CPU. Construction time; any thread.
inline void check_cpus(std::span<const unsigned> cpus, std::string_view what) {
  const long configured = ::sysconf(_SC_NPROCESSORS_CONF);
  for (const unsigned cpu : cpus) {
    if (cpu >= CPU_SETSIZE || (configured > 0 && cpu >= static_cast<unsigned long>(configured)))
      throw Error(ErrorCode::invalid_argument, std::string(what) + " holds CPU " + std::to_string(cpu) +
                                                   ", but this machine has " + std::to_string(configured) + " CPUs (0.." +
                                                   std::to_string(configured - 1) + ")");
  }
}

}  // namespace detail

/// A single-thread executor with a bounded FIFO of inline tasks (see the file comment).
/// `TaskBytes` is the inline capacity of one task. Not copyable or movable (tasks and the
/// thread point into it). Thread-safety: submit, try_submit, wait_idle and the counters
/// may be called from any thread concurrently; the destructor from one thread, after
/// every other thread stopped submitting.
template <std::size_t TaskBytes = lane_task_bytes>
class BasicLane {
 public:
  /// Inline capacity of one task, in bytes.
  static constexpr std::size_t task_bytes = TaskBytes;

  /// Starts the lane's thread. `name` is for debugging (it also names the OS thread,
  /// truncated to 15 characters); `capacity` is the number of task slots, allocated now;
  /// the running task keeps its slot until it returns, so at most `capacity` tasks are
  /// queued or running at once. `spin`: how long the lane polls for new work after it ran
  /// a task before it sleeps (see the file comment: it trades up
  /// to `spin` of one CPU after every burst of tasks for a wake-up without a futex); 0, the
  /// default, never spins. `cpus`: the CPUs the lane's thread may run on (see the file
  /// comment); empty, the default, leaves placement to the OS.
  /// Throws Error(invalid_argument) for capacity 0, a negative spin, a CPU this machine
  /// does not have or a set the thread may not run on (both named), Error(device_failure)
  /// if the thread cannot start.
  BasicLane(std::string_view name, std::size_t capacity, std::chrono::nanoseconds spin = std::chrono::nanoseconds{0},
            std::span<const unsigned> cpus = {})
      : name_(name), capacity_(capacity), spin_(spin) {
    if (capacity == 0) {
      throw Error(ErrorCode::invalid_argument, "Lane '" + name_ + "': capacity must be > 0, got 0");
    }
    if (spin < std::chrono::nanoseconds{0}) {
      throw Error(ErrorCode::invalid_argument,
                  "Lane '" + name_ + "': spin must be >= 0 ns, got " + std::to_string(spin.count()) + " ns");
    }
    detail::check_cpus(cpus, "Lane '" + name_ + "': cpus");
    slots_ = std::make_unique<detail::TaskSlot<TaskBytes>[]>(capacity);
    try {
      worker_ = std::thread([this] { run(); });
    } catch (const std::exception& e) {
      throw Error(ErrorCode::device_failure, "Lane '" + name_ + "': cannot start its thread: " + e.what());
    }
    const std::string os_name = name_.substr(0, 15);
    (void)pthread_setname_np(worker_.native_handle(), os_name.c_str());
    if (!cpus.empty()) place(cpus);
  }
  BasicLane(const BasicLane&) = delete;
  BasicLane& operator=(const BasicLane&) = delete;

  /// Runs every task already queued (and any those tasks queue on this lane), then joins
  /// the thread. Must not run concurrently with submits from other threads.
  ~BasicLane() { stop(); }

  /// Queues `task` (a callable taking no arguments; its result is ignored). Never drops
  /// and never allocates: if the ring is full the caller blocks until a slot frees and
  /// the wait is counted in full_waits(). A task must not blocking-submit to its own lane
  /// (it could wait for itself): use try_submit there. Any thread.
  template <class F>
  void submit(F&& task) noexcept {
    check_task<F>();
    {
      std::unique_lock lock(mutex_);
      if (tail_ - head_ == capacity_) {
        full_waits_.fetch_add(1, std::memory_order_relaxed);
        ++space_waiters_;
        has_space_.wait(lock, [&] { return tail_ - head_ < capacity_; });
        --space_waiters_;
      }
      push(std::forward<F>(task));
    }
    has_work_.notify_one();
  }

  /// Queues `task` if a slot is free; false (task not taken, `task` untouched) if the ring
  /// is full. Never blocks on space, never allocates. Any thread.
  template <class F>
  [[nodiscard]] bool try_submit(F&& task) noexcept {
    check_task<F>();
    {
      std::lock_guard lock(mutex_);
      if (tail_ - head_ == capacity_) return false;
      push(std::forward<F>(task));
    }
    has_work_.notify_one();
    return true;
  }

  /// Blocks (condition variable) until every task submitted before the call has run.
  /// Called from a task on this lane it returns at once (it cannot wait for itself).
  void wait_idle() noexcept {
    if (on_lane()) return;
    std::unique_lock lock(mutex_);
    const std::uint64_t target = tail_;
    idle_.wait(lock, [&] { return completed_.load(std::memory_order_relaxed) >= target; });
  }

  /// True on this lane's own thread. Any thread; wait-free.
  [[nodiscard]] bool on_lane() const noexcept { return std::this_thread::get_id() == worker_.get_id(); }

  /// The lane's name. Immutable after construction: any thread.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// Number of task slots.
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// How long the lane polls for work after a task before it sleeps (0: never).
  /// Immutable after construction: any thread.
  [[nodiscard]] std::chrono::nanoseconds spin() const noexcept { return spin_; }
  /// Tasks queued so far. Any thread; lock-free.
  [[nodiscard]] std::uint64_t submitted() const noexcept { return submitted_.load(std::memory_order_relaxed); }
  /// Tasks finished so far (a task that threw counts as finished). Any thread; lock-free.
  [[nodiscard]] std::uint64_t completed() const noexcept { return completed_.load(std::memory_order_relaxed); }
  /// Times submit() found the ring full and waited. Any thread; lock-free.
  [[nodiscard]] std::uint64_t full_waits() const noexcept { return full_waits_.load(std::memory_order_relaxed); }
  /// Tasks that threw (caught by the lane). Any thread; lock-free.
  [[nodiscard]] std::uint64_t exceptions() const noexcept { return exceptions_.load(std::memory_order_relaxed); }

 private:
  template <class F>
  static constexpr void check_task() noexcept {
    using T = std::decay_t<F>;
    static_assert(std::is_invocable_v<T&>, "kvfuse::Lane: a task must be callable with no arguments");
    static_assert(sizeof(T) <= TaskBytes,
                  "kvfuse::Lane: the task does not fit the lane's inline storage (TaskBytes); capture less: "
                  "move large objects in, or point to data that outlives the task");
    static_assert(alignof(T) <= alignof(std::max_align_t), "kvfuse::Lane: the task is over-aligned for a lane slot");
    static_assert(std::is_nothrow_move_constructible_v<T>, "kvfuse::Lane: a task must be nothrow-move-constructible");
    static_assert(std::is_nothrow_constructible_v<T, F&&>,
                  "kvfuse::Lane: building the task from the argument must not throw (pass it by move)");
  }

  // Caller holds mutex_ and has checked there is space.
  template <class F>
  void push(F&& task) noexcept {
    slots_[tail_ % capacity_].emplace(std::forward<F>(task));
    ++tail_;
    submitted_.fetch_add(1, std::memory_order_relaxed);
  }

  void stop() noexcept {
    {
      std::lock_guard lock(mutex_);
      stopping_.store(true, std::memory_order_relaxed);
    }
    has_work_.notify_one();
    worker_.join();
  }

  // Restricts the (idle, just started) thread to `cpus`; on failure stops it and throws.
  void place(std::span<const unsigned> cpus) {
    cpu_set_t set;
    CPU_ZERO(&set);
    std::string list;
    for (const unsigned cpu : cpus) {
      CPU_SET(cpu, &set);
      if (!list.empty()) list.push_back(',');
      list.append(std::to_string(cpu));
    }
    const int rc = pthread_setaffinity_np(worker_.native_handle(), sizeof set, &set);
    if (rc == 0) return;
    stop();
    throw Error(ErrorCode::invalid_argument, "Lane '" + name_ + "': cannot run on CPUs {" + list + "}: error " +
                                                 std::to_string(rc) + " (none of them is allowed to this process?)");
  }

  void run() noexcept {
    std::unique_lock lock(mutex_);
    bool ran = false;  // a task ran since the lane last slept: worth spinning for the next
    for (;;) {
      if (ran && spin_.count() > 0 && head_ == tail_ && !stopping_.load(std::memory_order_relaxed)) {
        const std::uint64_t seen = tail_;
        lock.unlock();
        spin_for_work(seen);
        lock.lock();
      }
      ran = false;
      has_work_.wait_until(lock, [&] { return head_ != tail_ || stopping_.load(std::memory_order_relaxed); });
      if (head_ == tail_) return;  // stopping, and nothing left to run
      // The slot at head_ stays ours until head_ moves: submitters never write it.
      detail::TaskSlot<TaskBytes>& slot = slots_[head_ % capacity_];
      lock.unlock();
      const bool ok = slot.run();
      slot.reset();
      lock.lock();
      ++head_;
      if (!ok) exceptions_.fetch_add(1, std::memory_order_relaxed);
      completed_.fetch_add(1, std::memory_order_relaxed);
      if (space_waiters_ > 0) has_space_.notify_one();
      idle_.notify_all();
      ran = true;
    }
  }

  // Lane thread, no lock held: polls until a task beyond `seen` was submitted, the lane is
  // stopping, or spin_ has passed. The counters are only a hint; the caller relocks and
  // reads the ring under the mutex as usual, so nothing is ordered by these loads.
  void spin_for_work(std::uint64_t seen) const noexcept {
    (void)detail::poll_for(spin_, [&]() noexcept {
      return submitted_.load(std::memory_order_relaxed) != seen || stopping_.load(std::memory_order_relaxed);
    });
  }

  const std::string name_;
  const std::size_t capacity_;
  std::unique_ptr<detail::TaskSlot<TaskBytes>[]> slots_;
  std::mutex mutex_;
  detail::EventCount has_work_;  // the lane sleeps here; not a condition variable (see event_count.hpp)
  std::condition_variable has_space_;
  std::condition_variable idle_;
  std::uint64_t head_ = 0;  // next task to run (guarded by mutex_)
  std::uint64_t tail_ = 0;  // next free slot (guarded by mutex_)
  const std::chrono::nanoseconds spin_;
  std::uint32_t space_waiters_ = 0;
  std::atomic<bool> stopping_{false};  // written under mutex_; atomic so a spinning lane sees it without the lock
  std::atomic<std::uint64_t> submitted_{0};
  std::atomic<std::uint64_t> completed_{0};
  std::atomic<std::uint64_t> full_waits_{0};
  std::atomic<std::uint64_t> exceptions_{0};
  std::thread worker_;  // last: the thread starts once everything above exists
};

/// The lane with the default inline task capacity (lane_task_bytes).
using Lane = BasicLane<>;

/// A one-shot join between a task and a leg it handed to another lane (R9): the task
/// puts a LegLatch on its stack, gives the leg an Arrival token, and waits before it
/// reports. No allocation; the waiter blocks on a futex (C++20 atomic wait) after at
/// most a few spin iterations.
///
/// Lifetime: the waiter may destroy the latch as soon as wait() returns, even while
/// arrive() is still inside its notify: the notify only passes the latch's address to
/// the futex syscall and never reads or writes the latch after the store that releases
/// the waiter (libstdc++'s atomic notify is the same mechanism std::latch relies on).
class LegLatch {
 public:
  /// Arrives at the latch when destroyed, unless it already arrived or was moved from.
  /// Give one to the leg (captured by move), so every path out of the leg — return,
  /// early exit, exception unwinding — arrives exactly once.
  class Arrival {
   public:
    Arrival() noexcept = default;
    explicit Arrival(LegLatch& latch) noexcept : latch_(&latch) {}
    Arrival(Arrival&& other) noexcept : latch_(std::exchange(other.latch_, nullptr)) {}
    Arrival& operator=(Arrival&& other) noexcept {
      if (this != &other) {
        arrive();
        latch_ = std::exchange(other.latch_, nullptr);
      }
      return *this;
    }
    Arrival(const Arrival&) = delete;
    Arrival& operator=(const Arrival&) = delete;
    ~Arrival() { arrive(); }
    /// Arrives now (idempotent).
    void arrive() noexcept {
      if (latch_ != nullptr) std::exchange(latch_, nullptr)->arrive();
    }

   private:
    LegLatch* latch_ = nullptr;
  };

  LegLatch() noexcept = default;
  LegLatch(const LegLatch&) = delete;
  LegLatch& operator=(const LegLatch&) = delete;

  /// A token that arrives when it goes away. Take at most one per latch.
  [[nodiscard]] Arrival arrival() noexcept { return Arrival(*this); }

  /// Marks the leg done and wakes the waiter. Idempotent; any thread; never blocks.
  void arrive() noexcept {
    state_.store(1, std::memory_order_release);
    state_.notify_all();
  }

  /// Blocks until arrive(); everything the leg wrote before arriving is visible after.
  /// Any thread.
  void wait() const noexcept {
    while (state_.load(std::memory_order_acquire) == 0) state_.wait(0, std::memory_order_acquire);
  }

  /// True once arrive() ran. Any thread; wait-free.
  [[nodiscard]] bool ready() const noexcept { return state_.load(std::memory_order_acquire) != 0; }

 private:
  std::atomic<std::uint32_t> state_{0};  // futex-sized: the waiter sleeps on this word
};

}  // namespace kvfuse
