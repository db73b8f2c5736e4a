// kvfuse/engine/load_cost.hpp — LoadCostMeter: what a load from the tier costs, measured.
//
// The planner's break-even (planner.hpp, BreakEven) weighs a load as the tier's latency
// plus its bytes times the tier's time per byte. Those two numbers are rarely known up front:
// a memory tier's bandwidth depends on the copy engine, a disk's on its page cache, Redis's
// on the network and the server's load, and all of them on what else the machine does. The
// meter learns them from the loads themselves: each completed load is one sample (the bytes
// its longer leg read on one rank, the time from its dispatch to the step that settled it),
// and a least-squares line through the samples, older ones weighing less, gives the latency
// (its intercept) and the time per byte (its slope). The time is what the request waited,
// lanes and quorum included, which is the time a load must beat.
//
// Degenerate fits fall back rather than mislead: loads all of one size give no slope, so
// the whole time is charged per byte (a larger load then costs more, never less); a negative
// slope (noise) becomes a flat latency; a negative intercept becomes a line through zero.
//
// Plain data and arithmetic: no allocation, noexcept. Not thread-safe: one owner (the
// Coordinator, on the scheduler thread) adds and reads.
#pragma once

#include <cstdint>
#include <limits>

#include <kvfuse/engine/planner.hpp>

namespace kvfuse {

/// What the meter has learnt. Plain data.
struct LoadCostEstimate {
  double ns_per_byte = 0;    ///< the fitted time per byte read (>= 0)
  double latency_ns = 0;     ///< the fitted time of a load of no bytes (>= 0)
  std::uint64_t samples = 0; ///< loads it learnt from
  friend constexpr bool operator==(const LoadCostEstimate&, const LoadCostEstimate&) = default;
};

/// A decaying least-squares fit of load time against bytes (see the header comment).
class LoadCostMeter {
 public:
  /// `decay` in (0, 1]: the weight a sample keeps per later sample (1: all weigh the same).
  /// Out of range or not finite is read as 1.
  explicit constexpr LoadCostMeter(double decay = 0.98) noexcept
      : decay_(decay > 0 && decay <= 1 ? decay : 1.0) {}

  /// One completed load: `bytes` read by its longer leg on one rank, `ns` from dispatch to
  /// settlement. A sample with a negative or non-finite time is ignored. O(1), noexcept.
  constexpr void add(std::uint64_t bytes, double ns) noexcept {
    if (!(ns >= 0 && ns <= std::numeric_limits<double>::max())) return;  // negative, NaN or infinite
    const double x = static_cast<double>(bytes);
    w_ = w_ * decay_ + 1;
    sx_ = sx_ * decay_ + x;
    sy_ = sy_ * decay_ + ns;
    sxx_ = sxx_ * decay_ + x * x;
    sxy_ = sxy_ * decay_ + x * ns;
    ++samples_;
  }

  /// The fit so far (zeros before any sample). O(1), noexcept.
  [[nodiscard]] constexpr LoadCostEstimate estimate() const noexcept {
    LoadCostEstimate e;
    e.samples = samples_;
    if (samples_ == 0) return e;
    const double mx = sx_ / w_, my = sy_ / w_;
    const double var = sxx_ / w_ - mx * mx;
    if (!(var > 1e-9 * (mx * mx + 1))) {  // one size only: no slope to fit
      e.ns_per_byte = mx > 0 ? my / mx : 0;
      e.latency_ns = mx > 0 ? 0 : my;
      return e;
    }
    double slope = (sxy_ / w_ - mx * my) / var;
    double intercept = my - slope * mx;
    if (slope < 0) {  // noise: time does not grow with bytes here
      slope = 0;
      intercept = my;
    } else if (intercept < 0) {  // a line through zero instead
      slope = sxx_ > 0 ? sxy_ / sxx_ : 0;
      intercept = 0;
    }
    e.ns_per_byte = slope;
    e.latency_ns = intercept;
    return e;
  }

  /// `configured` with the tier's two times replaced by the fit's, once at least
  /// `min_samples` loads were learnt from; `configured` itself before. O(1), noexcept.
  [[nodiscard]] constexpr BreakEven applied_to(BreakEven configured, std::uint64_t min_samples) const noexcept {
    if (samples_ == 0 || samples_ < min_samples) return configured;
    const LoadCostEstimate e = estimate();
    configured.tier_ns_per_byte = e.ns_per_byte;
    configured.tier_latency_ns = e.latency_ns;
    return configured;
  }

 private:
  double decay_;
  double w_ = 0, sx_ = 0, sy_ = 0, sxx_ = 0, sxy_ = 0;
  std::uint64_t samples_ = 0;
};

}  // namespace kvfuse
