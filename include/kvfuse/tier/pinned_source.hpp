// kvfuse/tier/pinned_source.hpp — where a MemoryTier gets its bytes.
//
// A memory-tier hit is meant to be one copy into the device blocks, so the tier's entries
// live in page-locked host memory the device can DMA from. The tier does not care who
// pins it: anything with allocate_pinned / free_pinned will do. HostRuntime and HipRuntime
// model this concept (every Runtime does), and HeapPinnedSource serves tests and engines
// without a device.
#pragma once

#include <concepts>
#include <cstddef>
#include <new>
#include <string>

#include <kvfuse/error.hpp>

namespace kvfuse {

/// A source of pinned host memory.
///   a.allocate_pinned(n) -> void*: n bytes, suitably aligned for any copy engine; may throw
///     kvfuse::Error when it cannot (never returns null).
///   a.free_pinned(p) noexcept: gives back a pointer allocate_pinned returned. Any thread.
/// A MemoryTier calls allocate_pinned on its put path (outside its lock) and free_pinned on
/// whichever thread drops an entry's last reference, so both must be callable from any thread.
template <class A>
concept PinnedMemorySource = requires(A& source, std::size_t bytes, void* pointer) {
  { source.allocate_pinned(bytes) } -> std::same_as<void*>;
  { source.free_pinned(pointer) } noexcept;
};

/// Plain heap memory, 64-byte aligned (cache line, enough for any vector copy). Not
/// page-locked: for tests and for engines that have no device. Stateless and thread-safe.
struct HeapPinnedSource {
  static constexpr std::size_t alignment = 64;

  /// `bytes` bytes (at least one, so a zero-byte entry still has a unique address).
  /// Throws Error(device_failure) naming the size when the heap is exhausted.
  void* allocate_pinned(std::size_t bytes) {
    void* p = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t{alignment}, std::nothrow);
    if (p == nullptr)
      throw Error(ErrorCode::device_failure,
                  "HeapPinnedSource could not allocate " + std::to_string(bytes) + " bytes");
    return p;
  }
  /// Frees what allocate_pinned returned. Any thread, noexcept.
  void free_pinned(void* pointer) noexcept { ::operator delete(pointer, std::align_val_t{alignment}); }
};

static_assert(PinnedMemorySource<HeapPinnedSource>);

}  // namespace kvfuse
