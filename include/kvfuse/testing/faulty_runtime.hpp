// kvfuse/testing/faulty_runtime.hpp — FaultyRuntime<R>: a Runtime wrapper that fails
// chosen calls on demand and counts every call. A test hook, shipped as a header so
// engine developers can drive their own fallback paths the same way kvfuse's tests do
// (R13: "a runtime whose event creation fails").
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/device/runtime.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// The Runtime calls a FaultyRuntime can fail and counts.
enum class RuntimeCall : std::uint8_t {
  allocate_pinned,
  allocate_device,
  make_stream,
  copy_async,
  synchronize_stream,
  create_event,
  record,
  wait,
  synchronize_event,
  device_synchronize,
  count_,  ///< number of calls, not a call
};

/// Wraps a Runtime `R` (stored by value) and fails the calls a test arms. A failing
/// noexcept call returns false without reaching `R`; a failing construction-time call
/// throws Error(device_failure) naming the call. Models kvfuse::Runtime with R's Stream
/// and Event types. Arming, healing and counters are atomics: any thread, lock-free.
template <Runtime R = HostRuntime>
class FaultyRuntime {
 public:
  using Stream = typename R::Stream;
  using Event = typename R::Event;
  /// Pass to fail() to fail every call until heal().
  static constexpr std::uint32_t always = std::numeric_limits<std::uint32_t>::max();

  /// Builds the wrapped runtime from `args`.
  template <class... Args>
  explicit FaultyRuntime(Args&&... args) : inner_(std::forward<Args>(args)...) {}

  /// The wrapped runtime (for its extras, e.g. HostRuntime::launch_host_func).
  [[nodiscard]] R& inner() noexcept { return inner_; }
  [[nodiscard]] const R& inner() const noexcept { return inner_; }

  /// Lets the next `after` calls of `call` through, then fails `times` calls (`always`:
  /// every call until heal()). Re-arming replaces the previous plan for `call`.
  void fail(RuntimeCall call, std::uint32_t times = always, std::uint32_t after = 0) noexcept {
    slot(call).skip.store(after, std::memory_order_relaxed);
    slot(call).remaining.store(times, std::memory_order_relaxed);
  }
  /// Stops failing `call`.
  void heal(RuntimeCall call) noexcept {
    slot(call).remaining.store(0, std::memory_order_relaxed);
    slot(call).skip.store(0, std::memory_order_relaxed);
  }
  /// Calls of `call` made so far, failed or not.
  [[nodiscard]] std::uint64_t calls(RuntimeCall call) const noexcept {
    return slot(call).calls.load(std::memory_order_relaxed);
  }
  /// Calls of `call` that were failed on purpose.
  [[nodiscard]] std::uint64_t failures(RuntimeCall call) const noexcept {
    return slot(call).failures.load(std::memory_order_relaxed);
  }

  [[nodiscard]] void* allocate_pinned(std::size_t bytes) {
    if (trip(RuntimeCall::allocate_pinned)) throw injected("allocate_pinned");
    return inner_.allocate_pinned(bytes);
  }
  [[nodiscard]] void* allocate_device(std::size_t bytes) {
    if (trip(RuntimeCall::allocate_device)) throw injected("allocate_device");
    return inner_.allocate_device(bytes);
  }
  [[nodiscard]] Stream make_stream() {
    if (trip(RuntimeCall::make_stream)) throw injected("make_stream");
    return inner_.make_stream();
  }
  void free_pinned(void* p) noexcept { inner_.free_pinned(p); }
  void free_device(void* p) noexcept { inner_.free_device(p); }
  bool copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) noexcept {
    return !trip(RuntimeCall::copy_async) && inner_.copy_async(dst, src, bytes, stream);
  }
  bool synchronize(Stream& stream) noexcept {
    return !trip(RuntimeCall::synchronize_stream) && inner_.synchronize(stream);
  }
  /// Forwards QueryableRuntime when `R` models it (no fault is armed on it: a query that
  /// answers false only keeps views longer).
  bool query(Stream& stream) noexcept
    requires QueryableRuntime<R>
  {
    return inner_.query(stream);
  }
  bool create_event(Event& event) noexcept {
    return !trip(RuntimeCall::create_event) && inner_.create_event(event);
  }
  bool record(Event& event, Stream& stream) noexcept {
    return !trip(RuntimeCall::record) && inner_.record(event, stream);
  }
  bool wait(Stream& stream, Event& event) noexcept { return !trip(RuntimeCall::wait) && inner_.wait(stream, event); }
  bool synchronize(Event& event) noexcept {
    return !trip(RuntimeCall::synchronize_event) && inner_.synchronize(event);
  }
  bool device_synchronize() noexcept {
    return !trip(RuntimeCall::device_synchronize) && inner_.device_synchronize();
  }

 private:
  struct Slot {
    std::atomic<std::uint32_t> skip{0};
    std::atomic<std::uint32_t> remaining{0};
    std::atomic<std::uint64_t> calls{0};
    std::atomic<std::uint64_t> failures{0};
  };

  Slot& slot(RuntimeCall call) noexcept { return slots_[static_cast<std::size_t>(call)]; }
  const Slot& slot(RuntimeCall call) const noexcept { return slots_[static_cast<std::size_t>(call)]; }

  // Counts the call and decides whether it fails, consuming one armed failure.
  bool trip(RuntimeCall call) noexcept {
    Slot& s = slot(call);
    s.calls.fetch_add(1, std::memory_order_relaxed);
    std::uint32_t pass = s.skip.load(std::memory_order_relaxed);
    while (pass != 0) {
      if (s.skip.compare_exchange_weak(pass, pass - 1, std::memory_order_relaxed)) return false;
    }
    std::uint32_t left = s.remaining.load(std::memory_order_relaxed);
    while (left != 0) {
      if (left == always || s.remaining.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
        s.failures.fetch_add(1, std::memory_order_relaxed);
        return true;
      }
    }
    return false;
  }

  static Error injected(const char* call) {
    return Error(ErrorCode::device_failure, std::string("FaultyRuntime: injected failure of ") + call);
  }

  R inner_;
  std::array<Slot, static_cast<std::size_t>(RuntimeCall::count_)> slots_{};
};

static_assert(Runtime<FaultyRuntime<HostRuntime>>, "FaultyRuntime<HostRuntime> must model kvfuse::Runtime");
static_assert(QueryableRuntime<FaultyRuntime<HostRuntime>>);

}  // namespace kvfuse
