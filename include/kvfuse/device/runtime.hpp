// kvfuse/device/runtime.hpp — the Runtime policy: streams, events, pinned memory, copies.
//
// kvfuse launches no kernels; a runtime only has to move bytes and order streams. Two
// models ship: HostRuntime (the default: host memory, streams emulated by threads) and
// HipRuntime. A third (CUDA) is one small file that models this concept.
//
// Error discipline (R19): the construction-time calls (allocate_*, make_stream) throw
// kvfuse::Error; every call a load or save path makes is noexcept and returns false on
// failure, so a failed copy becomes a failed leg, never an exception across a lane.
#pragma once

#include <concepts>
#include <cstddef>

namespace kvfuse {

/// Requirements on a device runtime. `R::Stream` and `R::Event` are move-only RAII
/// handles; a default-constructed Event is empty (creation failed or not attempted).
template <class R>
concept Runtime = requires(R& rt, typename R::Stream& stream, typename R::Event& event, void* dst,
                           const void* src, std::size_t bytes) {
  typename R::Stream;
  typename R::Event;
  // Construction time: may throw kvfuse::Error.
  { rt.allocate_pinned(bytes) } -> std::same_as<void*>;  // page-locked host memory
  { rt.allocate_device(bytes) } -> std::same_as<void*>;  // device memory (host memory for HostRuntime)
  { rt.make_stream() } -> std::same_as<typename R::Stream>;
  // Any thread, never throws.
  { rt.free_pinned(dst) } noexcept;
  { rt.free_device(dst) } noexcept;
  { rt.copy_async(dst, src, bytes, stream) } noexcept -> std::same_as<bool>;  // any direction, ordered on `stream`
  { rt.synchronize(stream) } noexcept -> std::same_as<bool>;                  // host blocks until `stream` drained
  { rt.create_event(event) } noexcept -> std::same_as<bool>;                  // blocking-sync event into `event`
  { rt.record(event, stream) } noexcept -> std::same_as<bool>;                // mark the current end of `stream`
  { rt.wait(stream, event) } noexcept -> std::same_as<bool>;                  // `stream` waits on the device, no host sync
  { rt.synchronize(event) } noexcept -> std::same_as<bool>;                   // host blocks (does not spin) until recorded work ran
  { rt.device_synchronize() } noexcept -> std::same_as<bool>;                 // the full-device fallback (R13)
};

/// Optional, on top of Runtime: ask whether a stream has run everything queued on it,
/// without waiting (hipStreamQuery / cudaStreamQuery). True only when it has; false when it
/// has not or cannot say. Never blocks, never throws; call it from the thread that
/// enqueues on `stream`. PagedKv uses it to hand a tier's buffers back while a load is
/// still arriving: a view whose copy provably ran is released at once, so the tier can
/// reuse its memory (hot in cache) for the next chunk instead of holding every chunk of
/// the load until the final synchronize.
template <class R>
concept QueryableRuntime = Runtime<R> && requires(R& rt, typename R::Stream& stream) {
  { rt.query(stream) } noexcept -> std::same_as<bool>;
};

}  // namespace kvfuse
