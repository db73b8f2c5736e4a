// kvfuse/worker/staging.hpp — StagingPool<R>: the rank's bounded staging (R12).
//
// Legs that need an intermediate buffer (a disk read, a state gather, a KV save's gather)
// use the staging buffer of the lane they run on. All buffers are allocated when the pool
// is built, one per lane, from the runtime's pinned allocator, and reused for every load
// and save; nothing is allocated afterwards. So the standing staging memory is exactly the
// sum of the lanes' buffer sizes, whatever the thread counts — the seed's per-thread
// buffers grew to five (+165 MiB per rank) when the lanes were merged. Lanes may differ in
// size: a Connector gives its save lane room for a whole multi-chunk save
// (ConnectorOptions::save_staging_chunks) and its other lanes one chunk or state entry.
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
  /// Allocates `lanes` buffers of `bytes_per_lane` bytes each with rt.allocate_pinned.
  /// Throws Error(invalid_argument) naming a zero lane count or size, or a total that
  /// overflows size_t; or whatever the runtime's allocator throws (Error(device_failure));
  /// on a throw nothing is leaked.
  StagingPool(R& runtime, std::size_t lanes, std::size_t bytes_per_lane) : rt_(&runtime) {
    if (lanes == 0) throw Error(ErrorCode::invalid_argument, "StagingPool: lanes must be > 0, got 0");
    if (bytes_per_lane == 0) {
      throw Error(ErrorCode::invalid_argument, "StagingPool: bytes_per_lane must be > 0, got 0 (lanes = " +
                                                   std::to_string(lanes) + ")");
    }
    if (bytes_per_lane > SIZE_MAX / lanes) {
      throw Error(ErrorCode::invalid_argument, "StagingPool: " + std::to_string(lanes) + " lanes x " +
                                                   std::to_string(bytes_per_lane) + " bytes overflows size_t");
    }
    allocate(lanes, [&](std::size_t) { return bytes_per_lane; });
  }

  /// Allocates one buffer per entry of `lane_bytes`: lane i gets lane_bytes[i] bytes.
  /// Throws Error(invalid_argument) for no lanes, a zero size (naming the lane) or a
  /// total that overflows size_t; or whatever the runtime's allocator throws; on a throw
  /// nothing is leaked.
  StagingPool(R& runtime, std::span<const std::size_t> lane_bytes) : rt_(&runtime) {
    if (lane_bytes.empty()) throw Error(ErrorCode::invalid_argument, "StagingPool: lanes must be > 0, got 0");
    std::size_t total = 0;
    for (std::size_t i = 0; i < lane_bytes.size(); ++i) {
      if (lane_bytes[i] == 0)
        throw Error(ErrorCode::invalid_argument, "StagingPool: lane " + std::to_string(i) + "'s buffer must be > 0 bytes, got 0");
      if (lane_bytes[i] > SIZE_MAX - total)
        throw Error(ErrorCode::invalid_argument, "StagingPool: lane " + std::to_string(i) + "'s " +
                                                     std::to_string(lane_bytes[i]) + " bytes overflow size_t with the lanes before it");
      total += lane_bytes[i];
    }
    allocate(lane_bytes.size(), [&](std::size_t i) { return lane_bytes[i]; });
  }

  StagingPool(StagingPool&& other) noexcept
      : rt_(other.rt_), lanes_(std::exchange(other.lanes_, 0)), standing_(std::exchange(other.standing_, 0)),
        buffers_(std::move(other.buffers_)) {}
  StagingPool& operator=(StagingPool&& other) noexcept {
    if (this != &other) {
      release();
      rt_ = other.rt_;
      lanes_ = std::exchange(other.lanes_, 0);
      standing_ = std::exchange(other.standing_, 0);
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
    return buffers_[lane];
  }

  /// Number of buffers (one per lane).
  [[nodiscard]] std::size_t lanes() const noexcept { return lanes_; }
  /// Size of lane `lane`'s buffer in bytes; 0 if `lane` is out of range.
  [[nodiscard]] std::size_t buffer_bytes(std::size_t lane) const noexcept { return buffer(lane).size(); }
  /// Pinned bytes this pool holds: exactly the sum of the buffer sizes (R12).
  [[nodiscard]] std::size_t standing_bytes() const noexcept { return standing_; }

 private:
  // Allocates lane i's buffer of size_of(i) bytes, for i in [0, lanes); sizes are checked.
  template <class SizeOf>
  void allocate(std::size_t lanes, SizeOf&& size_of) {
    buffers_ = std::make_unique<std::span<std::byte>[]>(lanes);  // value-initialised: all empty
    lanes_ = lanes;
    try {
      for (std::size_t i = 0; i < lanes; ++i) {
        const std::size_t bytes = size_of(i);
        buffers_[i] = {static_cast<std::byte*>(rt_->allocate_pinned(bytes)), bytes};
        standing_ += bytes;
      }
    } catch (...) {
      release();
      throw;
    }
  }

  void release() noexcept {
    if (!buffers_) return;
    for (std::size_t i = 0; i < lanes_; ++i) {
      if (buffers_[i].data() != nullptr) rt_->free_pinned(buffers_[i].data());
    }
    buffers_.reset();
    lanes_ = 0;
    standing_ = 0;
  }

  R* rt_;
  std::size_t lanes_ = 0;
  std::size_t standing_ = 0;
  std::unique_ptr<std::span<std::byte>[]> buffers_;
};

}  // namespace kvfuse
