// kvfuse/ipc/shm_ring.hpp — the two single-producer single-consumer rings that cross a
// process boundary inside a shared memory segment (ipc/shm_segment.hpp): a frame ring
// (variable-length frames, engine -> rank: LoadRequest, KvSave, StateSave) and a record
// ring (fixed 32-byte records, one rank lane -> engine).
//
// Why rings of atomics and not Boost.Lockfree's spsc_queue: a queue in a segment that two
// processes map at different addresses must hold no pointer, and its indices must be
// atomics that work across processes. spsc_queue's runtime-sized form keeps a pointer to
// its buffer; its compile-time form fixes the capacity in the type. Here the control block
// is two 64-bit counters (lock-free and address-free: plain memory, no pointer, no lock) and
// two process-shared futex event counts; the data area sits beside it, and each process
// builds a view (control pointer, data pointer, capacity) over its own mapping.
//
// The counters only grow (position = counter % capacity), so full and empty never look
// alike, and each side writes one counter only: the producer `tail`, the consumer `head`.
// A consumer never trusts what the other process wrote: a producer's tail that is behind
// the head or more than a capacity ahead, or a frame length that overruns what was
// published, is corruption, reported, never read past.
//
// Waiting is a futex on a word in the segment (process-shared): the producer notifies
// `data` after it publishes, the consumer notifies `space` after it frees room; either side
// sleeps with a timeout, so a process whose peer died notices. Internal to ipc/.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <utility>

#include <kvfuse/bridge/records.hpp>
#include <kvfuse/detail/event_count.hpp>
#include <kvfuse/detail/little_endian.hpp>

namespace kvfuse::detail {

static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "the rings need lock-free 64-bit atomics: they are shared by processes that hold no common lock");

/// The shared half of a ring: its counters and its two event counts. Placement-new'd into
/// the segment by the process that creates it; never copied. Each field on its own cache
/// line: the producer writes `tail`, the consumer `head`.
struct RingControl {
  alignas(64) std::atomic<std::uint64_t> head{0};  ///< bytes or records the consumer took
  alignas(64) std::atomic<std::uint64_t> tail{0};  ///< bytes or records the producer published
  alignas(64) SharedEventCount data;                ///< notified after the producer publishes
  alignas(64) SharedEventCount space;               ///< notified after the consumer frees room

  /// Empties the ring. Only while neither side uses it (the engine retiring a dead rank).
  void reset() noexcept {
    head.store(0, std::memory_order_relaxed);
    tail.store(0, std::memory_order_release);
  }
};

/// What a pop found.
enum class RingRead : std::uint8_t {
  item,     ///< an item was copied out
  empty,    ///< nothing published
  corrupt,  ///< the producer's counters or lengths are impossible: stop reading this ring
};

/// Variable-length frames (engine -> rank). On the ring a frame is an 8-byte header (its
/// length, little-endian u32, then 4 zero bytes) and its bytes, padded to 8. One producer
/// thread, one consumer thread, in any two processes.
class FrameRing {
 public:
  /// Bytes a frame of `length` takes on the ring.
  static constexpr std::size_t footprint(std::size_t length) noexcept { return 8 + ((length + 7) & ~std::size_t{7}); }

  FrameRing() noexcept = default;
  /// A view over `control` and `capacity` bytes at `data` (capacity a multiple of 8).
  FrameRing(RingControl* control, std::byte* data, std::size_t capacity) noexcept
      : control_(control), data_(data), capacity_(capacity) {}

  /// Producer: publishes `frame` if it fits now; false when the ring lacks room (the frame
  /// is not written). Never blocks; noexcept.
  bool try_push(std::span<const std::byte> frame) noexcept {
    const std::uint64_t tail = control_->tail.load(std::memory_order_relaxed);
    const std::uint64_t head = control_->head.load(std::memory_order_acquire);
    const std::size_t need = footprint(frame.size());
    if (need > capacity_ - static_cast<std::size_t>(tail - head)) return false;
    std::byte header[8]{};
    put_le(header, frame.size(), 4);
    write(tail, header, sizeof header);
    write(tail + 8, frame.data(), frame.size());
    control_->tail.store(tail + need, std::memory_order_release);
    control_->data.notify_one();
    return true;
  }

  /// Producer: bytes free now (only grows until the next push). noexcept.
  [[nodiscard]] std::size_t free_bytes() const noexcept {
    return capacity_ - static_cast<std::size_t>(control_->tail.load(std::memory_order_relaxed) -
                                                control_->head.load(std::memory_order_acquire));
  }

  /// Consumer: copies the next frame into `out` and sets `length`. A frame longer than
  /// `out`, or a length or counter the producer could not have written, is `corrupt`.
  /// noexcept.
  RingRead pop(std::span<std::byte> out, std::size_t& length) noexcept {
    const std::uint64_t head = control_->head.load(std::memory_order_relaxed);
    const std::uint64_t tail = control_->tail.load(std::memory_order_acquire);
    if (tail == head) return RingRead::empty;
    const std::uint64_t published = tail - head;
    if (published > capacity_ || published < 8) return RingRead::corrupt;
    std::byte header[8];
    read(head, header, sizeof header);
    length = static_cast<std::size_t>(get_le(header, 4));
    if (length > out.size() || footprint(length) > published) return RingRead::corrupt;
    read(head + 8, out.data(), length);
    control_->head.store(head + footprint(length), std::memory_order_release);
    control_->space.notify_one();
    return RingRead::item;
  }

  [[nodiscard]] RingControl& control() const noexcept { return *control_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

 private:
  // n == 0 returns at once: an empty frame's span may have a null data pointer, and memcpy
  // of a null pointer is undefined even for zero bytes.
  void write(std::uint64_t at, const void* src, std::size_t n) noexcept {
    if (n == 0) return;
    const std::size_t pos = static_cast<std::size_t>(at % capacity_);
    const std::size_t first = n < capacity_ - pos ? n : capacity_ - pos;
    std::memcpy(data_ + pos, src, first);
    std::memcpy(data_, static_cast<const std::byte*>(src) + first, n - first);
  }
  void read(std::uint64_t at, void* dst, std::size_t n) const noexcept {
    if (n == 0) return;
    const std::size_t pos = static_cast<std::size_t>(at % capacity_);
    const std::size_t first = n < capacity_ - pos ? n : capacity_ - pos;
    std::memcpy(dst, data_ + pos, first);
    std::memcpy(static_cast<std::byte*>(dst) + first, data_, n - first);
  }

  RingControl* control_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t capacity_ = 0;
};

/// Fixed 32-byte records (a rank lane -> the engine), in the records' wire format
/// (bridge/records.hpp). One producer thread, one consumer thread, in any two processes.
class RecordRing {
 public:
  RecordRing() noexcept = default;
  /// A view over `control` and `capacity` record slots at `slots`.
  RecordRing(RingControl* control, RecordBytes* slots, std::size_t capacity) noexcept
      : control_(control), slots_(slots), capacity_(capacity) {}

  /// Producer: publishes `record` if there is room; false when full. noexcept.
  bool try_push(const RecordBytes& record) noexcept {
    const std::uint64_t tail = control_->tail.load(std::memory_order_relaxed);
    if (tail - control_->head.load(std::memory_order_acquire) >= capacity_) return false;
    slots_[tail % capacity_] = record;
    control_->tail.store(tail + 1, std::memory_order_release);
    control_->data.notify_one();
    return true;
  }

  /// Consumer: the next record, if any. `corrupt` when the producer's counter is behind the
  /// head or more than a ring ahead. noexcept.
  RingRead pop(RecordBytes& out) noexcept {
    const std::uint64_t head = control_->head.load(std::memory_order_relaxed);
    const std::uint64_t tail = control_->tail.load(std::memory_order_acquire);
    if (tail == head) return RingRead::empty;
    if (tail - head > capacity_) return RingRead::corrupt;
    out = slots_[head % capacity_];
    control_->head.store(head + 1, std::memory_order_release);
    control_->space.notify_one();
    return RingRead::item;
  }

  /// Consumer: hands every record published now to `take(const RecordBytes&)`, in order,
  /// each copied out of the ring first (the producer's process cannot change what the
  /// consumer decodes); `take` returns false to stop after that record. The head moves and
  /// the producer is notified once for the whole batch, not once per record. Returns the
  /// records taken, or `corrupt` as pop() does (nothing taken). noexcept if `take` is.
  template <class Take>
  RingRead take_published(Take&& take, std::size_t& taken) noexcept(noexcept(take(std::declval<const RecordBytes&>()))) {
    taken = 0;
    const std::uint64_t head = control_->head.load(std::memory_order_relaxed);
    const std::uint64_t tail = control_->tail.load(std::memory_order_acquire);
    if (tail == head) return RingRead::empty;
    if (tail - head > capacity_) return RingRead::corrupt;
    const std::size_t published = static_cast<std::size_t>(tail - head);
    std::size_t at = static_cast<std::size_t>(head % capacity_);
    bool more = true;
    while (more && taken < published) {
      const RecordBytes record = slots_[at];
      at = at + 1 == capacity_ ? 0 : at + 1;
      ++taken;
      more = take(record);
    }
    control_->head.store(head + taken, std::memory_order_release);
    control_->space.notify_one();
    return RingRead::item;
  }

  [[nodiscard]] RingControl& control() const noexcept { return *control_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

 private:
  RingControl* control_ = nullptr;
  RecordBytes* slots_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace kvfuse::detail
