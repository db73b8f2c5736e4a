// kvfuse/testing/delay_tier.hpp — DelayTier: a tier whose gets take a fixed extra time.
//
// Stands in for a disk or remote fetch in benchmarks and tests: a joint load whose legs are
// dominated by tier latency should cost max(kv, state), not the sum (R9), and a fixed sleep
// per get makes that visible on any machine without a slow device.
#pragma once

#include <chrono>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include <kvfuse/error.hpp>
#include <kvfuse/tier/tier.hpp>

namespace kvfuse {

/// Wraps a Tier and sleeps `delay` before every get (hit, miss or failure alike), the way a
/// fetch pays its round trip before it knows the answer. put, contains and erase pass
/// straight through. A wrapper must not lose a capability of what it wraps: over a
/// BatchedTier it is one too, and a batch pays the delay once, as one round trip does. The wrapped tier is built in place, so non-movable tiers fit.
/// Thread-safe exactly as far as Inner is (the delay itself holds no lock: concurrent gets
/// sleep concurrently).
template <Tier Inner>
class DelayTier {
 public:
  /// Builds Inner from `args`. Throws Error(invalid_argument) naming the value when
  /// `delay` is negative, or whatever Inner's constructor throws.
  template <class... Args>
  explicit DelayTier(std::chrono::nanoseconds delay, Args&&... args)
      : delay_(checked(delay)), inner_(std::forward<Args>(args)...) {}

  /// Sleeps for the delay, then asks the wrapped tier. Any thread; noexcept; blocks.
  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept {
    if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
    return inner_.get(key, staging);
  }
  /// Sleeps for the delay once, then hands the whole batch to the wrapped tier (exists
  /// only when Inner is a BatchedTier). Any thread; noexcept; blocks.
  void get_batch(const TierKey& first, std::span<const PrefixHash> hashes, std::span<TierView> out,
                 BatchSink sink = {}) noexcept
    requires BatchedTier<Inner>
  {
    if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
    inner_.get_batch(first, hashes, out, sink);
  }
  /// The wrapped tier's put, undelayed.
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept { return inner_.put(key, bytes); }
  /// The wrapped tier's contains, undelayed.
  bool contains(const TierKey& key) const noexcept { return inner_.contains(key); }
  /// The wrapped tier's erase, undelayed.
  bool erase(const TierKey& key) noexcept { return inner_.erase(key); }

  /// The wrapped tier (for its stats, or to fill it without a delay).
  Inner& inner() noexcept { return inner_; }
  const Inner& inner() const noexcept { return inner_; }
  /// The delay every get pays.
  [[nodiscard]] std::chrono::nanoseconds delay() const noexcept { return delay_; }

 private:
  static std::chrono::nanoseconds checked(std::chrono::nanoseconds delay) {
    if (delay.count() < 0)
      throw Error(ErrorCode::invalid_argument,
                  "DelayTier delay must be >= 0 ns, got " + std::to_string(delay.count()) + " ns");
    return delay;
  }

  std::chrono::nanoseconds delay_;
  Inner inner_;
};

}  // namespace kvfuse
