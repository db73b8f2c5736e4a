// kvfuse/worker/staging.hpp — StagingPool<R>: the rank's bounded staging (R12).
//
// Legs that need an intermediate buffer (a disk read, a state gather) use the staging
// buffer of the lane they run on. All buffers are allocated when the pool is built, one
// per lane, from the runtime's pinned allocator, and reused for every load and save;
// nothing is allocated afterwards. So the standing staging memory is exactly
// lanes x buffer size, whatever the thread counts — the seed's per-thread buffers grew
// to five (+165 MiB per rank) when the lanes were merged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include <kvfuse/device/runtime.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// One pinned staging buffer per lane, owned for the pool's lifetime. Movable, not
/// copyable; the runtime must outlive the pool. Thread-safety: the accessors are const
/// and wait-free from any thread; buffer(i) is meant to be written only by lane i
/// (the pool does no locking around the bytes).
template <Runtime R>
class StagingPool {
 public:
  /// Allocates `lanes` buffers of `bytes_per_lane` bytes with rt.allocate_pinned.
  /// Throws Error(invalid_argument) naming a zero lane count or size, or whatever the
  /// runtime's allocator throws (Error(device_failure)); on a throw nothing is leaked.
  StagingPool(R& runtime, std::size_t lanes, std::size_t bytes_per_lane)
      : rt_(&runtime), lanes_(lanes), bytes_(bytes_per_lane) {
    if (lanes == 0) throw Error(ErrorCode::invalid_argument, "StagingPool: lanes must be > 0, got 0");
    if (bytes_per_lane == 0) {
      throw Error(ErrorCode::invalid_argument, "StagingPool: bytes_per_lane must be > 0, got 0 (lanes = " +
                                                   std::to_string(lanes) + ")");
    }
    if (bytes_per_lane > SIZE_MAX / lanes) {
      throw Error(ErrorCode::invalid_argument, "StagingPool: " + std::to_string(lanes) + " lanes x " +
                                                   std::to_string(bytes_per_lane) + " bytes overflows size_t");
    }
    buffers_ = std::make_unique<std::byte*[]>(lanes);  // value-initialised: all null
    try {
      for (std::size_t i = 0; i < lanes; ++i) buffers_[i] = static_cast<std::byte*>(rt_->allocate_pinned(bytes_));
    } catch (...) {
      release();
      throw;
    }
  }
  StagingPool(StagingPool&& other) noexcept
      : rt_(other.rt_), lanes_(std::exchange(other.lanes_, 0)), bytes_(std::exchange(other.bytes_, 0)),
        buffers_(std::move(other.buffers_)) {}
  StagingPool& operator=(StagingPool&& other) noexcept {
    if (this != &other) {
      release();
      rt_ = other.rt_;
      lanes_ = std::exchange(other.lanes_, 0);
      bytes_ = std::exchange(other.bytes_, 0);
      buffers_ = std::move(other.buffers_);
    }
    return *this;
  }
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;
  ~StagingPool() { release(); }

  /// Lane `lane`'s buffer: the same bytes on every call. An empty span if `lane` is out
  /// of range (never an out-of-bounds pointer). Any thread; wait-free; never allocates.
  [[nodiscard]] std::span<std::byte> buffer(std::size_t lane) const noexcept {
    if (lane >= lanes_) return {};
    return {buffers_[lane], bytes_};
  }

  /// Number of buffers (one per lane).
  [[nodiscard]] std::size_t lanes() const noexcept { return lanes_; }
  /// Size of each buffer in bytes.
  [[nodiscard]] std::size_t buffer_bytes() const noexcept { return bytes_; }
  /// Pinned bytes this pool holds: exactly lanes() x buffer_bytes() (R12).
  [[nodiscard]] std::size_t standing_bytes() const noexcept { return lanes_ * bytes_; }

 private:
  void release() noexcept {
    if (!buffers_) return;
    for (std::size_t i = 0; i < lanes_; ++i) {
      if (buffers_[i] != nullptr) rt_->free_pinned(buffers_[i]);
    }
    buffers_.reset();
  }

  R* rt_;
  std::size_t lanes_;
  std::size_t bytes_;
  std::unique_ptr<std::byte*[]> buffers_;
};

}  // namespace kvfuse
