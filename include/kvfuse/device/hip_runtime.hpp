// kvfuse/device/hip_runtime.hpp — HipRuntime: the Runtime policy over HIP.
//
// kvfuse launches no kernels, so this is host code: compile it with
// __HIP_PLATFORM_AMD__ defined and link amdhip64 (the CMake target kvfuse::hip does
// both); hipcc is not needed.
//
// Choices that matter:
//   * streams are non-blocking (hipStreamNonBlocking): they never serialise against the
//     legacy null stream the engine's other libraries may use;
//   * every event is hipEventBlockingSync | hipEventDisableTiming, so a host wait sleeps
//     instead of spinning a core for the length of a forward (R13; the seed's default
//     event spun the save worker). synchronize(stream) goes through a per-stream event
//     of the same kind for the same reason;
//   * copies are hipMemcpyAsync(hipMemcpyDefault): direction from the pointers (unified
//     addressing), so one call serves device->staging, staging->device and pinned->device;
//   * the device's schedule is set to hipDeviceScheduleBlockingSync where the process
//     still allows it (device_synchronize, the R13 fallback, then blocks too).
//
// With no device, the constructor throws Error(no_device) naming the HIP error; the
// default runtime stays HostRuntime.
#pragma once

#include <hip/hip_runtime_api.h>

#include <cstddef>
#include <string>
#include <utility>

#include <kvfuse/device/runtime.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

namespace detail {
/// "hipErrorNoDevice (code 100)" for messages, plus HIP's description when it has one
/// that says more than the name.
inline std::string hip_error_text(hipError_t err) {
  const char* name_c = hipGetErrorName(err);
  const char* text_c = hipGetErrorString(err);
  const std::string name = name_c != nullptr ? name_c : "hipError?";
  std::string out = name + " (code " + std::to_string(static_cast<int>(err));
  if (text_c != nullptr && name != text_c) out += std::string(": ") + text_c;
  return out + ")";
}
}  // namespace detail

/// Runtime over one HIP device. Models kvfuse::Runtime. Not copyable or movable (streams
/// and events are tied to its device); it must outlive the streams and events it made.
/// Thread-safety: every member may be called from any thread (the HIP runtime is
/// thread-safe); the calls that create objects first make this device current on the
/// calling thread, so lanes need no set-up of their own.
class HipRuntime {
 public:
  /// A move-only non-blocking stream; empty when default-constructed or moved from.
  class Stream {
   public:
    Stream() noexcept = default;
    Stream(Stream&& other) noexcept
        : stream_(std::exchange(other.stream_, nullptr)), drained_(std::exchange(other.drained_, nullptr)) {}
    Stream& operator=(Stream&& other) noexcept {
      if (this != &other) {
        reset();
        stream_ = std::exchange(other.stream_, nullptr);
        drained_ = std::exchange(other.drained_, nullptr);
      }
      return *this;
    }
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    /// Destroys the stream; work already queued still completes (HIP semantics).
    ~Stream() { reset(); }
    [[nodiscard]] bool valid() const noexcept { return stream_ != nullptr; }
    /// The raw handle, for engines that enqueue their own work on it.
    [[nodiscard]] hipStream_t native() const noexcept { return stream_; }

   private:
    friend class HipRuntime;
    void reset() noexcept {
      if (drained_ != nullptr) (void)hipEventDestroy(std::exchange(drained_, nullptr));
      if (stream_ != nullptr) (void)hipStreamDestroy(std::exchange(stream_, nullptr));
    }
    hipStream_t stream_ = nullptr;
    hipEvent_t drained_ = nullptr;  // blocking-sync event behind synchronize(stream)
  };

  /// A move-only blocking-sync event; empty when default-constructed or moved from.
  class Event {
   public:
    Event() noexcept = default;
    Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
    Event& operator=(Event&& other) noexcept {
      if (this != &other) {
        reset();
        event_ = std::exchange(other.event_, nullptr);
      }
      return *this;
    }
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;
    ~Event() { reset(); }
    [[nodiscard]] bool valid() const noexcept { return event_ != nullptr; }
    [[nodiscard]] hipEvent_t native() const noexcept { return event_; }

   private:
    friend class HipRuntime;
    void reset() noexcept {
      if (event_ != nullptr) (void)hipEventDestroy(std::exchange(event_, nullptr));
    }
    hipEvent_t event_ = nullptr;
  };

  /// Binds to HIP device `device`. Throws Error(no_device) if HIP finds no device (the
  /// message says so and carries the HIP error), Error(invalid_argument) if `device` is
  /// not an index below the device count, Error(device_failure) if it cannot be selected.
  explicit HipRuntime(int device = 0) : device_(device) {
    int count = 0;
    const hipError_t err = hipGetDeviceCount(&count);
    if (err != hipSuccess || count <= 0) {
      throw Error(ErrorCode::no_device, "no HIP device was found: hipGetDeviceCount returned " +
                                            detail::hip_error_text(err) + ", " + std::to_string(count) + " devices");
    }
    if (device < 0 || device >= count) {
      throw Error(ErrorCode::invalid_argument, "HIP device index " + std::to_string(device) + " is out of range: " +
                                                   std::to_string(count) + " device(s) found");
    }
    select("HipRuntime");
    // Applies to the current device, hence after select(). Only possible before the
    // device's context is active; afterwards the engine's choice stands, and the
    // blocking-sync events still keep kvfuse's own waits asleep.
    const hipError_t flags = hipSetDeviceFlags(hipDeviceScheduleBlockingSync);
    (void)flags;
  }
  HipRuntime(const HipRuntime&) = delete;
  HipRuntime& operator=(const HipRuntime&) = delete;

  /// The HIP device index this runtime uses.
  [[nodiscard]] int device() const noexcept { return device_; }

  // ---- construction time: may throw kvfuse::Error --------------------------------------

  /// hipHostMalloc'd page-locked memory; never null (0 bytes gets one byte, so empty
  /// entries still have an address). Throws Error(device_failure) naming the size and
  /// the HIP error.
  [[nodiscard]] void* allocate_pinned(std::size_t bytes) {
    select("allocate_pinned");
    void* p = nullptr;
    const hipError_t err = hipHostMalloc(&p, bytes == 0 ? 1 : bytes, hipHostMallocDefault);
    if (err != hipSuccess) throw failure("hipHostMalloc of " + std::to_string(bytes) + " bytes", err);
    return p;
  }
  /// hipMalloc'd device memory; same contract as allocate_pinned.
  [[nodiscard]] void* allocate_device(std::size_t bytes) {
    select("allocate_device");
    void* p = nullptr;
    const hipError_t err = hipMalloc(&p, bytes == 0 ? 1 : bytes);
    if (err != hipSuccess) throw failure("hipMalloc of " + std::to_string(bytes) + " bytes", err);
    return p;
  }
  /// A non-blocking stream on this device (plus its blocking-sync drain event).
  [[nodiscard]] Stream make_stream() {
    select("make_stream");
    Stream s;
    hipError_t err = hipStreamCreateWithFlags(&s.stream_, hipStreamNonBlocking);
    if (err != hipSuccess) throw failure("hipStreamCreateWithFlags", err);
    err = hipEventCreateWithFlags(&s.drained_, hipEventBlockingSync | hipEventDisableTiming);
    if (err != hipSuccess) throw failure("hipEventCreateWithFlags", err);  // ~Stream frees the stream
    return s;
  }

  // ---- any thread, never throws --------------------------------------------------------

  void free_pinned(void* p) noexcept {
    if (p != nullptr) (void)hipHostFree(p);
  }
  void free_device(void* p) noexcept {
    if (p != nullptr) (void)hipFree(p);
  }
  /// hipMemcpyAsync(hipMemcpyDefault) on `stream`. False for an empty stream or a HIP error.
  bool copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) noexcept {
    if (!stream.valid()) return false;
    if (bytes == 0) return true;
    return hipMemcpyAsync(dst, src, bytes, hipMemcpyDefault, stream.stream_) == hipSuccess;
  }
  /// Host sleeps until `stream` has run everything queued before the call.
  bool synchronize(Stream& stream) noexcept {
    if (!stream.valid()) return false;
    return hipEventRecord(stream.drained_, stream.stream_) == hipSuccess &&
           hipEventSynchronize(stream.drained_) == hipSuccess;
  }
  /// QueryableRuntime: hipStreamQuery; true when `stream` has run everything queued on it.
  /// Never waits. False for an empty stream, work still queued, or a HIP error.
  bool query(Stream& stream) noexcept { return stream.valid() && hipStreamQuery(stream.stream_) == hipSuccess; }
  /// A blocking-sync, timing-disabled event on this device, into `event`.
  bool create_event(Event& event) noexcept {
    if (hipSetDevice(device_) != hipSuccess) return false;
    hipEvent_t e = nullptr;
    if (hipEventCreateWithFlags(&e, hipEventBlockingSync | hipEventDisableTiming) != hipSuccess) return false;
    event.reset();
    event.event_ = e;
    return true;
  }
  bool record(Event& event, Stream& stream) noexcept {
    if (!event.valid() || !stream.valid()) return false;
    return hipEventRecord(event.event_, stream.stream_) == hipSuccess;
  }
  /// hipStreamWaitEvent: a device-side wait; the caller does not block.
  bool wait(Stream& stream, Event& event) noexcept {
    if (!event.valid() || !stream.valid()) return false;
    return hipStreamWaitEvent(stream.stream_, event.event_, 0) == hipSuccess;
  }
  /// hipEventSynchronize on a blocking-sync event: the host sleeps.
  bool synchronize(Event& event) noexcept {
    if (!event.valid()) return false;
    return hipEventSynchronize(event.event_) == hipSuccess;
  }
  /// hipDeviceSynchronize on this device (the R13 fallback).
  bool device_synchronize() noexcept {
    return hipSetDevice(device_) == hipSuccess && hipDeviceSynchronize() == hipSuccess;
  }

 private:
  void select(const char* what) const {
    const hipError_t err = hipSetDevice(device_);
    if (err != hipSuccess) throw failure(std::string(what) + ": hipSetDevice(" + std::to_string(device_) + ")", err);
  }
  Error failure(const std::string& what, hipError_t err) const {
    return Error(ErrorCode::device_failure,
                 "HIP device " + std::to_string(device_) + ": " + what + " failed: " + detail::hip_error_text(err));
  }

  int device_;
};

static_assert(Runtime<HipRuntime>, "HipRuntime must model kvfuse::Runtime");
static_assert(QueryableRuntime<HipRuntime>);

}  // namespace kvfuse
