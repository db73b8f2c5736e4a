// kvfuse/detail/ring.hpp — a growable FIFO over a power-of-two ring buffer.
//
// Why not std::deque: a deque allocates and frees blocks as its ends move, so a FIFO that
// is pushed and popped millions of times a second keeps touching the allocator. Ring
// allocates only when it grows past its high-water mark and never shrinks.
//
// Internal: not part of the public API. Not thread-safe: one owner thread (the quorum's
// tables belong to the scheduler thread that drains and settles).
#pragma once

#include <bit>
#include <cstddef>
#include <vector>

namespace kvfuse::detail {

/// FIFO of T over a power-of-two ring that doubles when full. T must be default
/// constructible and copy assignable. Single owner thread.
template <class T>
class Ring {
 public:
  /// Room for `capacity` elements (at least 2, rounded up to a power of two) before the
  /// first growth. Allocates; may throw std::bad_alloc.
  explicit Ring(std::size_t capacity = 16) : buf_(std::bit_ceil(capacity < 2 ? std::size_t{2} : capacity)) {}

  /// Appends `v`; allocates only when the ring is full (may throw std::bad_alloc then,
  /// leaving the ring unchanged).
  void push_back(const T& v) {
    if (size_ == buf_.size()) grow();
    buf_[(head_ + size_) & (buf_.size() - 1)] = v;
    ++size_;
  }

  /// Drops the oldest element. Precondition: !empty(). noexcept, O(1).
  void pop_front() noexcept {
    head_ = (head_ + 1) & (buf_.size() - 1);
    --size_;
  }

  /// The oldest element. Precondition: !empty(). noexcept, O(1).
  [[nodiscard]] const T& front() const noexcept { return buf_[head_]; }
  /// Elements held. noexcept, O(1).
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Whether no element is held. noexcept, O(1).
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  /// Keeps, in order, only the elements for which keep(element) is true. O(size), no
  /// allocation; noexcept (so `keep` must not throw).
  template <class Pred>
  void retain(Pred&& keep) noexcept {
    std::size_t kept = 0;
    const std::size_t m = buf_.size() - 1;
    for (std::size_t i = 0; i < size_; ++i) {
      const T& v = buf_[(head_ + i) & m];
      if (keep(v)) buf_[(head_ + kept++) & m] = v;
    }
    size_ = kept;
  }

 private:
  void grow() {
    std::vector<T> bigger(buf_.size() * 2);
    for (std::size_t i = 0; i < size_; ++i) bigger[i] = buf_[(head_ + i) & (buf_.size() - 1)];
    buf_.swap(bigger);
    head_ = 0;
  }

  std::vector<T> buf_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

}  // namespace kvfuse::detail
