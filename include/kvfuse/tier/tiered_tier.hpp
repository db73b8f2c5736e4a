// kvfuse/tier/tiered_tier.hpp — TieredTier: a bounded fast tier in front of a durable one.
//
// The way LMCache stacks its local CPU backend on its local disk backend: every put is
// written through to the back (the durable copy, the one that counts) and then to the
// front; a get asks the front, and on a front miss reads the back and promotes a copy into
// the front. A TieredTier is itself a Tier, so any preset can use it as its KV or state
// tier (docs/reference.md#tier).
//
// Consistency without locks. The Tier concept forbids holding a lock across I/O, yet a get
// that promotes what it read from the back can race a put or an erase of the same key: the
// promotion could land after the write and leave the front holding bytes the back no
// longer has (a stale copy, or an erased entry brought back). Each key hashes to one of a
// fixed set of stripes, each with two counters: writes started and writes finished. A
// write (put or erase) bumps `started`, touches the back and then the front, and bumps
// `finished`. A promotion happens only if no write of its stripe was in flight when the
// get began, and is withdrawn (erased from the front) if a write started since. Two
// overlapping writes of one stripe both erase the front copy when they end. So once the
// racing calls have returned, whatever the front holds equals what the back holds; a get
// that overlaps a write of its key may see either value, as with any tier.
#pragma once

#include <array>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <kvfuse/tier/tier.hpp>

namespace kvfuse {

/// Counters of a TieredTier since construction. Each counts one kind of event; a snapshot
/// of relaxed atomics, not a consistent cut across them.
struct TieredTierStats {
  std::uint64_t front_hits = 0;          ///< gets the front served
  std::uint64_t back_hits = 0;           ///< gets the back served after the front missed (or failed)
  std::uint64_t misses = 0;              ///< gets that returned miss (neither tier has the entry)
  std::uint64_t failures = 0;            ///< gets that returned failed or timed_out (the back did, or the front
                                         ///< failed and the back missed)
  std::uint64_t promotions = 0;          ///< back hits copied into the front
  std::uint64_t promote_failures = 0;    ///< back hits whose copy the front refused (the get still hit)
  std::uint64_t put_failures = 0;        ///< puts the back refused: put returned false
  std::uint64_t front_put_failures = 0;  ///< puts the back stored and the front refused (put returned true)
};

/// A Tier that is not a BatchedTier: what TieredTier accepts as its back. A wrapper must not
/// silently lose what it wraps: a batched back (RedisTier) answers a whole load in one
/// round trip, and TieredTier asks its back one chunk at a time, so a batched back is
/// refused at compile time, naming this concept; use the batched tier directly.
template <class T>
concept UnbatchedTier = Tier<T> && !BatchedTier<T>;

/// A bounded fast tier (`Front`, e.g. MemoryTier) in front of a durable one (`Back`, e.g.
/// DiskTier). Non-owning: both tiers outlive it, and nothing else should write to them
/// while it is in use (the front must never hold what the back does not).
///
///   put:      write-through, back first, then front. True iff the back stored it. If the
///             back refused, the front's copy of the key is erased; if the front refused,
///             that is counted, not an error (and its copy erased, so it serves nothing stale).
///   get:      the front; on a front miss (or failure) the back, read into the caller's
///             staging; a back hit is promoted (copied) into the front. A back `failed` is
///             `failed`, never reported as a miss.
///   contains: front or back.  erase: both; true if either had the key.
/// Not a BatchedTier, and a batched Back is refused at compile time (UnbatchedTier).
///
/// Thread-safe: every member may be called from any thread at once, as far as Front and
/// Back are (every Tier is). Holds no lock of its own. Not copyable or movable.
template <Tier Front, UnbatchedTier Back>
class TieredTier {
 public:
  using front_type = Front;
  using back_type = Back;

  /// Serves from `front` and `back`, which must outlive this object. Any thread; noexcept.
  TieredTier(Front& front, Back& back) noexcept : front_(&front), back_(&back) {}

  TieredTier(const TieredTier&) = delete;
  TieredTier& operator=(const TieredTier&) = delete;

  /// The entry for `key`: the front's view on a front hit; otherwise the back's, read into
  /// `staging` if the back needs a buffer, and then copied into the front (a promotion,
  /// counted; a front that refuses the copy is counted in promote_failures and the get
  /// still hits). `miss` only if the front missed and the back missed; `failed` if the back
  /// failed, or the front failed and the back missed (the front may hold it). Any thread;
  /// noexcept; blocks as long as the two tiers' gets and the promotion's put do; allocates
  /// nothing itself (a promotion allocates whatever the front's put allocates).
  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept {
    TierView front_view = front_->get(key, staging);
    if (front_view.hit()) {
      bump(front_hits_);
      return front_view;
    }
    // A front that failed or timed out may still hold the entry: a back miss is then no miss.
    const bool front_failed = front_view.status() == GetStatus::failed || front_view.status() == GetStatus::timed_out;
    front_view = TierView{};  // a failed front view pins nothing, but let it go before the back reads

    Stripe& stripe = stripe_of(key);
    // `finished` before `started`: if they agree, no write of this stripe was in flight.
    const std::uint64_t finished = stripe.finished.load(std::memory_order_seq_cst);
    const std::uint64_t started = stripe.started.load(std::memory_order_seq_cst);

    TierView view = back_->get(key, staging);
    switch (view.status()) {
      case GetStatus::hit: break;
      case GetStatus::miss:
        if (front_failed) {
          bump(failures_);
          return TierView(GetStatus::failed);
        }
        bump(misses_);
        return view;
      case GetStatus::failed:
      case GetStatus::timed_out:  // a remote back that did not answer in time: not a miss either
        bump(failures_);
        return view;
    }
    bump(back_hits_);
    if (started == finished) {  // no write was in flight: the copy may go to the front
      if (front_->put(key, view.bytes())) {
        bump(promotions_);
        // A write that started since may have changed the back before our copy landed.
        if (stripe.started.load(std::memory_order_seq_cst) != started) (void)front_->erase(key);
      } else {
        bump(promote_failures_);
      }
    }
    return view;
  }

  /// Stores a copy of `bytes` in the back, then in the front. True iff the back stored it:
  /// the durable copy is what counts. A back refusal is counted in put_failures and erases
  /// the front's copy of `key`; a front refusal is counted in front_put_failures (and the
  /// front's older copy, if any, erased). Any thread; noexcept; blocks on both tiers' puts;
  /// allocates what they allocate.
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept {
    WriteScope write(stripe_of(key));
    if (!back_->put(key, bytes)) {
      bump(put_failures_);
      (void)front_->erase(key);  // the back may no longer match what the front holds
      write.finish(*front_, key, false);
      return false;
    }
    const bool in_front = front_->put(key, bytes);
    if (!in_front) {
      bump(front_put_failures_);
      (void)front_->erase(key);  // a refused put may leave the front's older copy in place
    }
    write.finish(*front_, key, in_front);
    return true;
  }

  /// Whether the front or the back has `key` now. Any thread; noexcept; costs what the
  /// tiers' contains cost (the back is asked only if the front does not have it).
  bool contains(const TierKey& key) const noexcept { return front_->contains(key) || back_->contains(key); }

  /// Removes `key` from the back, then the front. True if either had it. Any thread;
  /// noexcept; costs what the tiers' erases cost.
  bool erase(const TierKey& key) noexcept {
    WriteScope write(stripe_of(key));
    const bool in_back = back_->erase(key);
    const bool in_front = front_->erase(key);
    write.finish(*front_, key, false);
    return in_back || in_front;
  }

  /// The back's keys of `kind` (with write-through, the back holds every entry): how an
  /// engine re-seeds its index after a restart (R18). Present only when Back has
  /// `keys(kind)`. Any thread; allocates; throws what Back::keys throws (std::bad_alloc).
  std::vector<TierKey> keys(EntryKind kind) const
    requires requires(const Back& b) {
      { b.keys(kind) } -> std::same_as<std::vector<TierKey>>;
    }
  {
    return back_->keys(kind);
  }

  /// A snapshot of the counters. Any thread; noexcept; wait-free, O(1).
  [[nodiscard]] TieredTierStats stats() const noexcept {
    return TieredTierStats{load(front_hits_), load(back_hits_),        load(misses_),       load(failures_),
                           load(promotions_), load(promote_failures_), load(put_failures_), load(front_put_failures_)};
  }

  /// The front tier (for its own stats). Any thread; noexcept.
  [[nodiscard]] Front& front() noexcept { return *front_; }
  [[nodiscard]] const Front& front() const noexcept { return *front_; }
  /// The back tier (for its own stats, or its keys). Any thread; noexcept.
  [[nodiscard]] Back& back() noexcept { return *back_; }
  [[nodiscard]] const Back& back() const noexcept { return *back_; }

 private:
  static constexpr std::size_t stripe_count = 64;  // a power of two

  // One cache line each, so writes of unrelated keys do not share a line.
  struct alignas(64) Stripe {
    std::atomic<std::uint64_t> started{0};
    std::atomic<std::uint64_t> finished{0};
  };

  // One put or erase, from before it touches the back until after it touched the front.
  class WriteScope {
   public:
    explicit WriteScope(Stripe& stripe) noexcept
        : stripe_(stripe),
          finished_(stripe.finished.load(std::memory_order_seq_cst)),
          ticket_(stripe.started.fetch_add(1, std::memory_order_seq_cst)) {}
    WriteScope(const WriteScope&) = delete;
    WriteScope& operator=(const WriteScope&) = delete;

    // Called after the front was written. If another write of this stripe was in flight
    // when this one began, or began since, the order in which the two reached the back
    // and the front is unknown: drop the front's copy (`front_written`) so the front
    // cannot keep the loser's bytes. Only then does this write count as finished.
    void finish(Front& front, const TierKey& key, bool front_written) noexcept {
      const bool overlapped =
          ticket_ != finished_ || stripe_.started.load(std::memory_order_seq_cst) != ticket_ + 1;
      if (overlapped && front_written) (void)front.erase(key);
      stripe_.finished.fetch_add(1, std::memory_order_seq_cst);
    }

   private:
    Stripe& stripe_;
    std::uint64_t finished_;  // writes finished before this one began
    std::uint64_t ticket_;    // writes started before this one
  };

  Stripe& stripe_of(const TierKey& key) noexcept { return stripes_[std::hash<TierKey>{}(key) & (stripe_count - 1)]; }

  static void bump(std::atomic<std::uint64_t>& counter) noexcept { counter.fetch_add(1, std::memory_order_relaxed); }
  static std::uint64_t load(const std::atomic<std::uint64_t>& counter) noexcept {
    return counter.load(std::memory_order_relaxed);
  }

  Front* front_;
  Back* back_;
  std::array<Stripe, stripe_count> stripes_{};
  std::atomic<std::uint64_t> front_hits_{0}, back_hits_{0}, misses_{0}, failures_{0}, promotions_{0},
      promote_failures_{0}, put_failures_{0}, front_put_failures_{0};
};

}  // namespace kvfuse
