// kvfuse/device/host_runtime.hpp — HostRuntime, the default Runtime: host memory for
// "device" and pinned memory, streams and events emulated with threads.
//
// The point of the emulation is that stream ordering is real, not assumed: a threaded
// stream is one thread running a bounded FIFO of plain operations (copy, record event,
// wait event, host function) in order, so "the copy stream waits on an event recorded
// on the compute stream" (R13) behaves, and fails, as it does on a GPU. A copy stream
// that forgot its wait really does read the producer's bytes too early.
//
// Semantics follow CUDA/HIP where they overlap:
//   * record(event, stream) captures the current end of `stream`; the event completes
//     when the stream's thread reaches that point. Re-recording moves the capture point.
//   * wait(stream, event) and synchronize(event) refer to the latest record issued at
//     the time of the call; an event never recorded is already complete.
//   * host waits (synchronize, device_synchronize) sleep on a futex (detail::EventCount);
//     no host wait in this runtime spins (R13). Only a threaded stream's own thread may poll for
//     its next operation, and only if HostRuntimeOptions::stream_spin asks it to (it
//     stands in for a GPU's copy engine, which needs no wake-up).
// An event's completion is tracked as "the highest record that has run". Record one event
// on one stream at a time, as GPU code does: if it is re-recorded on a second stream while
// an earlier record is pending on the first, a wait on the earlier record can be released
// by the newer one.
//
// Memory: allocate_pinned / allocate_device return host memory aligned to
// HostRuntimeOptions::alignment; the runtime counts the bytes outstanding so tests can
// assert budgets (R12) against what was really allocated.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <kvfuse/detail/event_count.hpp>
#include <kvfuse/detail/spin.hpp>
#include <kvfuse/device/runtime.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// How a HostRuntime stream executes its operations.
enum class HostStreamMode : std::uint8_t {
  /// One thread per stream runs a bounded FIFO in order; enqueueing never waits for the
  /// work (only for ring space). Ordering between streams is real. The default.
  threaded = 0,
  /// Every operation runs on the calling thread before the call returns: a copy is a
  /// plain memcpy, wait(stream, event) blocks the caller until the event completes.
  /// Cheapest for a single caller doing synchronous copies (a memory-tier hit); it gives
  /// up overlap, not ordering. One caller thread per inline stream at a time.
  inline_calls = 1,
};

/// Construction options of a HostRuntime. Plain aggregate; validated by the constructor.
struct HostRuntimeOptions {
  /// Operations a threaded stream holds before copy_async and friends back off (block
  /// until the stream's thread frees a slot). Must be > 0.
  std::size_t stream_ring_ops = 1024;
  /// Mode of streams made by make_stream().
  HostStreamMode default_mode = HostStreamMode::threaded;
  /// Alignment of pinned and device allocations, a power of two >= 16. 256 matches
  /// what cudaMalloc/hipMalloc guarantee.
  std::size_t alignment = 256;
  /// How long a threaded stream's thread polls for its next operation after running one,
  /// before it sleeps (a futex). 0, the default, never spins. Must be >= 0.
  /// A copy enqueued while the stream's thread still spins starts without a futex wake-up
  /// (costly when the stream thread's CPU has gone idle; bench/README.md says how much).
  /// The cost: every threaded stream keeps a CPU busy for up to this long after each burst
  /// of operations. Host waits (synchronize, device_synchronize) never spin, whatever this
  /// says (R13). Inline streams have no thread and ignore it.
  std::chrono::nanoseconds stream_spin{0};
};

/// A host function enqueued on a stream (HostRuntime::launch_host_func): the emulator's
/// stand-in for a kernel. Runs on the stream's thread, in stream order.
using HostFunc = void (*)(void* arg) noexcept;

namespace detail {

/// Shared state of one event. Reference counted because operations still queued on a
/// stream may outlive the Event handle (as on a GPU, destroying an event with pending
/// records is allowed).
struct HostEventState {
  std::mutex mutex;
  std::condition_variable completed_cv;
  std::uint64_t issued = 0;     // records issued so far (guarded by mutex)
  std::uint64_t completed = 0;  // highest record that ran (guarded by mutex)
  std::atomic<std::uint32_t> refs{1};

  std::uint64_t issue() noexcept {
    std::lock_guard lock(mutex);
    return ++issued;
  }
  std::uint64_t last_issued() noexcept {
    std::lock_guard lock(mutex);
    return issued;
  }
  void complete(std::uint64_t seq) noexcept {
    {
      std::lock_guard lock(mutex);
      completed = std::max(completed, seq);
    }
    completed_cv.notify_all();
  }
  void wait_for(std::uint64_t target) noexcept {
    std::unique_lock lock(mutex);
    completed_cv.wait(lock, [&] { return completed >= target; });
  }
  bool reached(std::uint64_t target) noexcept {
    std::lock_guard lock(mutex);
    return completed >= target;
  }
  void retain() noexcept { refs.fetch_add(1, std::memory_order_relaxed); }
  void release() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
};

/// One stream operation. Plain data so the ring never allocates and a slot is reusable.
struct HostOp {
  enum class Kind : std::uint8_t { copy, record, wait, host_func };
  Kind kind = Kind::copy;
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  HostEventState* event = nullptr;  // holds one reference while queued (record, wait)
  std::uint64_t target = 0;         // record: its sequence number; wait: the one to reach
  HostFunc fn = nullptr;
  void* arg = nullptr;
};

inline void execute(const HostOp& op) noexcept {
  switch (op.kind) {
    case HostOp::Kind::copy: std::memcpy(op.dst, op.src, op.bytes); break;
    case HostOp::Kind::record: op.event->complete(op.target); break;
    case HostOp::Kind::wait: op.event->wait_for(op.target); break;
    case HostOp::Kind::host_func: op.fn(op.arg); break;
  }
  if (op.event != nullptr) op.event->release();
}

class HostStreamState;

/// What a HostRuntime shares with its streams; heap-held so the runtime may move.
struct HostRuntimeShared {
  HostRuntimeOptions options;
  std::mutex streams_mutex;
  std::vector<HostStreamState*> streams;  // live streams, for device_synchronize
  std::atomic<std::size_t> pinned_bytes{0};
  std::atomic<std::size_t> device_bytes{0};
};

/// One emulated stream. Threaded: a worker thread pops the ring in order. Inline: the
/// caller executes each operation immediately.
class HostStreamState {
 public:
  HostStreamState(HostRuntimeShared& shared, HostStreamMode mode)
      : shared_(shared), mode_(mode), capacity_(shared.options.stream_ring_ops) {
    if (mode_ == HostStreamMode::threaded) {
      ring_ = std::make_unique<HostOp[]>(capacity_);
      worker_ = std::thread([this] { run(); });
    }
    std::lock_guard lock(shared_.streams_mutex);
    try {
      shared_.streams.push_back(this);
    } catch (...) {
      stop_and_join();
      throw;
    }
  }
  HostStreamState(const HostStreamState&) = delete;
  HostStreamState& operator=(const HostStreamState&) = delete;

  // Finishes every queued operation, then joins; queued records still complete, so no
  // waiter on another stream is left hanging by a stream going away.
  ~HostStreamState() {
    {
      std::lock_guard lock(shared_.streams_mutex);
      auto& v = shared_.streams;
      v.erase(std::remove(v.begin(), v.end(), this), v.end());
    }
    stop_and_join();
  }

  [[nodiscard]] HostStreamMode mode() const noexcept { return mode_; }
  [[nodiscard]] std::uint64_t full_waits() const noexcept { return full_waits_.load(std::memory_order_relaxed); }

  /// Appends `op` (threaded) or runs it now (inline). Blocks while the ring is full.
  void enqueue(const HostOp& op) noexcept {
    if (mode_ == HostStreamMode::inline_calls) {
      execute(op);
      return;
    }
    {
      std::unique_lock lock(mutex_);
      if (tail_ - head_ == capacity_) {
        full_waits_.fetch_add(1, std::memory_order_relaxed);
        ++space_waiters_;
        has_space_.wait(lock, [&] { return tail_ - head_ < capacity_; });
        --space_waiters_;
      }
      ring_[tail_ % capacity_] = op;
      ++tail_;
      enqueued_.store(tail_, std::memory_order_relaxed);
    }
    has_work_.notify_one();
  }

  /// Whether everything enqueued so far has run, without waiting. Exact when called by
  /// the enqueuing thread (one enqueuer per stream, as streams are used).
  [[nodiscard]] bool idle() const noexcept {
    if (mode_ == HostStreamMode::inline_calls) return true;
    return finished_.load(std::memory_order_acquire) == enqueued_.load(std::memory_order_relaxed);
  }

  /// Host blocks until everything enqueued before the call has run. Takes no lock: an
  /// enqueue that happened before the call is in enqueued_, and finished_ is stored (release)
  /// after the operation ran, so the bytes a copy wrote are visible on return.
  void drain() noexcept {
    if (mode_ == HostStreamMode::inline_calls) return;
    const std::uint64_t target = enqueued_.load(std::memory_order_relaxed);
    drained_.wait_until([&] { return finished_.load(std::memory_order_acquire) >= target; });
  }

 private:
  void run() noexcept {
    std::unique_lock lock(mutex_);
    const std::chrono::nanoseconds spin = shared_.options.stream_spin;
    bool ran = false;  // an op ran since the thread last slept: worth polling for the next
    for (;;) {
      if (ran && spin.count() > 0 && head_ == tail_ && !stopping_.load(std::memory_order_relaxed)) {
        // No lock held while polling; enqueued_ is only a hint, the ring is read under the lock.
        const std::uint64_t seen = tail_;
        lock.unlock();
        (void)poll_for(spin, [&]() noexcept {
          return enqueued_.load(std::memory_order_relaxed) != seen || stopping_.load(std::memory_order_relaxed);
        });
        lock.lock();
      }
      ran = false;
      has_work_.wait_until(lock, [&] { return head_ != tail_ || stopping_.load(std::memory_order_relaxed); });
      if (head_ == tail_) return;  // stopping and drained
      const HostOp op = ring_[head_ % capacity_];
      ++head_;
      if (space_waiters_ > 0) has_space_.notify_one();
      lock.unlock();
      execute(op);
      lock.lock();
      ++done_;
      finished_.store(done_, std::memory_order_release);
      drained_.notify_all();  // drain() takes no lock, so waking it under ours costs it nothing
      ran = true;
    }
  }

  void stop_and_join() noexcept {
    if (!worker_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stopping_.store(true, std::memory_order_relaxed);
    }
    has_work_.notify_one();
    worker_.join();
  }

  HostRuntimeShared& shared_;
  const HostStreamMode mode_;
  const std::size_t capacity_;
  std::mutex mutex_;
  detail::EventCount has_work_;  // the stream's thread sleeps here (see event_count.hpp)
  std::condition_variable has_space_;
  detail::EventCount drained_;   // drain() sleeps here
  std::unique_ptr<HostOp[]> ring_;
  std::uint64_t head_ = 0;  // next op to run
  std::uint64_t tail_ = 0;  // next free slot; ops enqueued so far
  std::uint64_t done_ = 0;  // ops finished
  std::uint32_t space_waiters_ = 0;
  std::atomic<bool> stopping_{false};       // written under mutex_; atomic for the spinning thread
  std::atomic<std::uint64_t> enqueued_{0};  // = tail_ (stored under mutex_), for the spinning thread
  std::atomic<std::uint64_t> finished_{0};  // = done_ (stored under mutex_ after the op ran), for idle()
  std::atomic<std::uint64_t> full_waits_{0};
  std::thread worker_;  // last: starts after every member it reads is initialised
};

}  // namespace detail

/// The default Runtime: host memory, streams emulated by threads (see the file comment).
/// Models kvfuse::Runtime. Movable, not copyable; it must outlive the streams it made.
/// Thread-safety: every member is safe to call from any thread concurrently, except that
/// a Stream must not be destroyed (or moved) while another thread enqueues on it, and an
/// inline_calls stream serves one caller thread at a time.
class HostRuntime {
 public:
  /// A move-only stream handle. Default-constructed: empty, every operation on it fails.
  /// Destroying a stream finishes its queued operations first.
  class Stream {
   public:
    Stream() noexcept = default;
    Stream(Stream&&) noexcept = default;
    Stream& operator=(Stream&&) noexcept = default;
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    ~Stream() = default;
    /// True if the handle owns a stream. Any thread; wait-free.
    [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
    /// Times an enqueue found this stream's ring full and backed off. Any thread; wait-free.
    [[nodiscard]] std::uint64_t full_waits() const noexcept { return state_ ? state_->full_waits() : 0; }
    /// The stream's execution mode (threaded when empty).
    [[nodiscard]] HostStreamMode mode() const noexcept {
      return state_ ? state_->mode() : HostStreamMode::threaded;
    }

   private:
    friend class HostRuntime;
    std::unique_ptr<detail::HostStreamState> state_;
  };

  /// A move-only event handle. Default-constructed: empty (creation failed or not tried).
  /// Destroying an event with records still queued is safe.
  class Event {
   public:
    Event() noexcept = default;
    Event(Event&& other) noexcept : state_(std::exchange(other.state_, nullptr)) {}
    Event& operator=(Event&& other) noexcept {
      if (this != &other) {
        reset();
        state_ = std::exchange(other.state_, nullptr);
      }
      return *this;
    }
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;
    ~Event() { reset(); }
    /// True if the handle owns an event. Any thread; wait-free.
    [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }

   private:
    friend class HostRuntime;
    void reset() noexcept {
      if (state_ != nullptr) std::exchange(state_, nullptr)->release();
    }
    detail::HostEventState* state_ = nullptr;
  };

  /// Builds a runtime. Throws kvfuse::Error(invalid_argument) naming a bad option (a
  /// default_mode outside HostStreamMode included).
  explicit HostRuntime(HostRuntimeOptions options = {}) {
    if (options.stream_ring_ops == 0) {
      throw Error(ErrorCode::invalid_argument, "HostRuntimeOptions::stream_ring_ops must be > 0, got 0");
    }
    if (options.alignment < 16 || (options.alignment & (options.alignment - 1)) != 0) {
      throw Error(ErrorCode::invalid_argument, "HostRuntimeOptions::alignment must be a power of two >= 16, got " +
                                                   std::to_string(options.alignment));
    }
    if (options.stream_spin < std::chrono::nanoseconds{0}) {
      throw Error(ErrorCode::invalid_argument, "HostRuntimeOptions::stream_spin must be >= 0 ns, got " +
                                                   std::to_string(options.stream_spin.count()) + " ns");
    }
    if (!known_mode(options.default_mode)) {
      throw Error(ErrorCode::invalid_argument, "HostRuntimeOptions::default_mode=" +
                                                   std::to_string(static_cast<unsigned>(options.default_mode)) +
                                                   " is not a HostStreamMode (threaded, inline_calls)");
    }
    shared_ = std::make_unique<detail::HostRuntimeShared>();
    shared_->options = options;
  }
  HostRuntime(HostRuntime&&) noexcept = default;
  HostRuntime& operator=(HostRuntime&&) noexcept = default;
  HostRuntime(const HostRuntime&) = delete;
  HostRuntime& operator=(const HostRuntime&) = delete;
  ~HostRuntime() = default;

  // ---- construction time: may throw kvfuse::Error --------------------------------------

  /// `bytes` of host memory standing in for page-locked memory, aligned to
  /// options().alignment; never null (0 bytes gets a unique address too). Throws
  /// Error(device_failure) naming the size if the memory is not available. Any thread.
  [[nodiscard]] void* allocate_pinned(std::size_t bytes) { return allocate(bytes, shared().pinned_bytes, "pinned"); }
  /// `bytes` of "device" memory (host memory here); same contract as allocate_pinned.
  [[nodiscard]] void* allocate_device(std::size_t bytes) { return allocate(bytes, shared().device_bytes, "device"); }
  /// A new stream in the default mode (options().default_mode). Starts a thread for a
  /// threaded stream. Throws Error(device_failure) if the thread cannot start.
  [[nodiscard]] Stream make_stream() { return make_stream(shared().options.default_mode); }
  /// A new stream in `mode`. Throws Error(invalid_argument) naming the value for a mode
  /// that is none of HostStreamMode's, and Error(device_failure) as make_stream() does.
  [[nodiscard]] Stream make_stream(HostStreamMode mode) {
    if (!known_mode(mode))
      throw Error(ErrorCode::invalid_argument, "HostRuntime::make_stream: stream mode " +
                                                   std::to_string(static_cast<unsigned>(mode)) +
                                                   " is not a HostStreamMode (threaded, inline_calls)");
    Stream stream;
    try {
      stream.state_ = std::make_unique<detail::HostStreamState>(shared(), mode);
    } catch (const std::exception& e) {
      throw Error(ErrorCode::device_failure, std::string("HostRuntime::make_stream could not start a stream: ") + e.what());
    }
    return stream;
  }

  // ---- any thread, never throws --------------------------------------------------------

  /// Frees memory from allocate_pinned; nullptr is a no-op.
  void free_pinned(void* p) noexcept { release(p, shared_->pinned_bytes); }
  /// Frees memory from allocate_device; nullptr is a no-op.
  void free_device(void* p) noexcept { release(p, shared_->device_bytes); }

  /// Enqueues a copy of `bytes` from `src` to `dst` on `stream` (ranges must not overlap
  /// and must stay valid until the copy ran). Never allocates; blocks only while the
  /// stream's ring is full. False for an empty stream or a null pointer with bytes > 0.
  bool copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) noexcept {
    if (!stream.valid()) return false;
    if (bytes == 0) return true;
    if (dst == nullptr || src == nullptr) return false;
    detail::HostOp op;
    op.kind = detail::HostOp::Kind::copy;
    op.dst = dst;
    op.src = src;
    op.bytes = bytes;
    stream.state_->enqueue(op);
    return true;
  }

  /// Host blocks (a futex, no spinning) until every operation enqueued on `stream` before
  /// the call has run. False for an empty stream.
  bool synchronize(Stream& stream) noexcept {
    if (!stream.valid()) return false;
    stream.state_->drain();
    return true;
  }

  /// QueryableRuntime: true when every operation enqueued on `stream` has run (always, for
  /// an inline stream); never waits. False for an empty stream. The thread that enqueues
  /// on `stream`; lock-free.
  bool query(Stream& stream) noexcept { return stream.valid() && stream.state_->idle(); }

  /// Creates an event into `event` (replacing what it held). False only if memory for the
  /// event's state is not available. Allocates: call it at set-up or once per step, not
  /// per copy.
  bool create_event(Event& event) noexcept {
    auto* state = new (std::nothrow) detail::HostEventState();
    if (state == nullptr) return false;
    event.reset();
    event.state_ = state;
    return true;
  }

  /// Captures the current end of `stream` in `event`. False for an empty event or stream.
  bool record(Event& event, Stream& stream) noexcept {
    if (!event.valid() || !stream.valid()) return false;
    detail::HostOp op;
    op.kind = detail::HostOp::Kind::record;
    op.event = event.state_;
    op.target = event.state_->issue();
    op.event->retain();
    stream.state_->enqueue(op);
    return true;
  }

  /// Operations enqueued on `stream` after this call run only once the latest record of
  /// `event` has completed. The calling thread does not wait (threaded stream). False for
  /// an empty event or stream; an event never recorded imposes no wait.
  bool wait(Stream& stream, Event& event) noexcept {
    if (!event.valid() || !stream.valid()) return false;
    const std::uint64_t target = event.state_->last_issued();
    if (target == 0) return true;
    detail::HostOp op;
    op.kind = detail::HostOp::Kind::wait;
    op.event = event.state_;
    op.target = target;
    op.event->retain();
    stream.state_->enqueue(op);
    return true;
  }

  /// Host blocks (condition variable, no spinning) until the latest record of `event`
  /// has completed. False for an empty event.
  bool synchronize(Event& event) noexcept {
    if (!event.valid()) return false;
    event.state_->wait_for(event.state_->last_issued());
    return true;
  }

  /// Host blocks until every stream of this runtime has run everything enqueued before
  /// the call (the R13 fallback). Always true for a live runtime.
  bool device_synchronize() noexcept {
    if (!shared_) return false;
    std::lock_guard lock(shared_->streams_mutex);
    for (detail::HostStreamState* s : shared_->streams) s->drain();
    return true;
  }

  // ---- extras (not part of the Runtime concept) ----------------------------------------

  /// Enqueues `fn(arg)` on `stream`, the emulator's kernel launch (like
  /// cudaLaunchHostFunc): tests use it as the "forward" that writes a save's source.
  bool launch_host_func(Stream& stream, HostFunc fn, void* arg) noexcept {
    if (!stream.valid() || fn == nullptr) return false;
    detail::HostOp op;
    op.kind = detail::HostOp::Kind::host_func;
    op.fn = fn;
    op.arg = arg;
    stream.state_->enqueue(op);
    return true;
  }

  /// Non-blocking: has the latest record of `event` completed? (true if never recorded,
  /// false for an empty event). Any thread.
  [[nodiscard]] bool query(Event& event) noexcept {
    if (!event.valid()) return false;
    return event.state_->reached(event.state_->last_issued());
  }

  /// Bytes currently allocated by allocate_pinned / allocate_device. Any thread; wait-free.
  [[nodiscard]] std::size_t pinned_bytes() const noexcept { return shared_ ? shared_->pinned_bytes.load() : 0; }
  [[nodiscard]] std::size_t device_bytes() const noexcept { return shared_ ? shared_->device_bytes.load() : 0; }
  /// The options this runtime was built with.
  [[nodiscard]] const HostRuntimeOptions& options() const noexcept { return shared_->options; }

 private:
  static constexpr bool known_mode(HostStreamMode m) noexcept {
    return m == HostStreamMode::threaded || m == HostStreamMode::inline_calls;
  }
  detail::HostRuntimeShared& shared() {
    if (!shared_) throw Error(ErrorCode::invalid_argument, "HostRuntime used after being moved from");
    return *shared_;
  }

  // Layout: [header of `alignment` bytes, size in its last word][user bytes]. The header
  // keeps the size next to the block so free needs no lookup table.
  void* allocate(std::size_t bytes, std::atomic<std::size_t>& counter, const char* what) {
    const std::size_t align = shared().options.alignment;
    if (bytes > SIZE_MAX - 2 * align) {
      throw Error(ErrorCode::device_failure,
                  std::string("HostRuntime::allocate_") + what + ": cannot allocate " + std::to_string(bytes) + " bytes");
    }
    // A zero-byte request still gets a unique, freeable address (tiers store empty entries).
    const std::size_t usable = bytes == 0 ? 1 : bytes;
    auto* base = static_cast<std::byte*>(::operator new(usable + align, std::align_val_t{align}, std::nothrow));
    if (base == nullptr) {
      throw Error(ErrorCode::device_failure, std::string("HostRuntime::allocate_") + what + ": out of memory for " +
                                                 std::to_string(bytes) + " bytes");
    }
    std::byte* user = base + align;
    std::memcpy(user - sizeof(std::size_t), &bytes, sizeof bytes);
    counter.fetch_add(bytes, std::memory_order_relaxed);
    return user;
  }

  void release(void* p, std::atomic<std::size_t>& counter) noexcept {
    if (p == nullptr || !shared_) return;
    const std::size_t align = shared_->options.alignment;
    auto* user = static_cast<std::byte*>(p);
    std::size_t bytes = 0;
    std::memcpy(&bytes, user - sizeof(std::size_t), sizeof bytes);
    counter.fetch_sub(bytes, std::memory_order_relaxed);
    ::operator delete(user - align, std::align_val_t{align});
  }

  std::unique_ptr<detail::HostRuntimeShared> shared_;
};

static_assert(Runtime<HostRuntime>, "HostRuntime must model kvfuse::Runtime");
static_assert(QueryableRuntime<HostRuntime>);

}  // namespace kvfuse
