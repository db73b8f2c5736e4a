// kvfuse/host/cache_keeper.hpp — CacheKeeper: an engine loop's side of the CacheLedger
// (docs/reference.md#cache-keeper).
//
// The ledger (engine/cache_ledger.hpp) decides what a byte budget keeps; an engine loop
// still has to say what it is about to save in the ledger's terms, send only what was
// kept, tell it what a load read, and erase what it evicts. Every engine loop (kvfuse-replay,
// kvfuse::llama::Server, kvfuse-llama-server's SlotCache) does the same four things; they
// live here once:
//   - A request's KV chunks are a prefix chain: chunk i is useless without chunk i - 1. A
//     save offers its chunks in order and is cut at the first one the ledger does not keep
//     (keep_chunks returns where): what the Coordinator sends is the kept prefix. The chunks
//     above the cut are still shown to the ledger, because a sighting counts (a dense chunk
//     refused on first sight comes in on the second, and so must the chunks above it); one
//     it admits above the cut, new, is not sent, so it is forgotten again.
//   - A checkpoint stands on the chunk covering its boundary: one whose chunk was cut is not
//     offered, nor any when a chunk is larger than the whole budget (no KV would be kept
//     for it to stand on).
//   - What a load read is a use (note_uses): recency, and for a checkpoint a hit.
//   - A victim goes to the engine's tiers (`Tiers::erase`), which remove it from every tier
//     (and a checkpoint from the index), so the index never serves what the tiers dropped.
//   - Saves land asynchronously, so a victim's own save may still be in flight when it is
//     evicted. Two things can then go wrong: the erase runs before the put, the put lands,
//     and the tiers hold what the ledger does not count (a state save's landing indexes its
//     hash again); or the same checkpoint is offered again at once and kept, but the
//     Coordinator skips the save as a duplicate of the one in flight, which the erase then
//     removes after it landed. So each victim is remembered, and sweep(), which the engine
//     calls when no save is in flight (IndexStats::saves_outstanding == 0, O(1)), settles
//     each one against the tiers (`Tiers::holds`): one the ledger does not keep is erased
//     again; one it keeps again but the tiers lack is forgotten by the ledger and the index.
//     The list is bounded: past `sweep_capacity` victims the oldest is settled at once.
//
// A keeper made without a policy is off: every offer is kept, nothing is counted, so one
// engine loop serves both ways without a branch at each call.
//
// Threading: not thread-safe. The engine's scheduler thread calls every member.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/cache_ledger.hpp>
#include <kvfuse/engine/cache_policy.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// What a CacheKeeper is built from. Plain data. Sizes are in the budget's unit (one rank's
/// slice when every rank holds the same entries).
struct CacheKeeperOptions {
  std::optional<CacheLedgerOptions> ledger;  ///< the policy and the budget; empty: the keeper is off
  std::uint32_t chunk_tokens = 256;          ///< tokens per KV chunk: the keys' grid
  std::uint64_t kv_chunk_bytes = 0;          ///< what one chunk's KV costs the budget (> 0 when on)
  std::uint64_t state_bytes = 0;             ///< what one checkpoint costs the budget (> 0 for a stateful model)
  bool stateful = false;                     ///< the model carries state: its KV alone spares little
  std::size_t sweep_capacity = std::size_t{1} << 16;  ///< victims remembered for sweep() (> 0 when on)
};

/// What a CacheKeeper did besides the ledger's own counters. Plain data.
struct CacheKeeperStats {
  std::uint64_t erased = 0;          ///< victims handed to Tiers::erase
  std::uint64_t swept = 0;           ///< second erases of victims the ledger had not kept again (sweep() or overflow)
  std::uint64_t healed = 0;          ///< victims kept again that the tiers lacked: forgotten and erased (sweep() or overflow)
  std::uint64_t chunks_cut = 0;      ///< chunks keep_chunks left unsent above a refused one
  std::uint64_t checkpoints_cut = 0; ///< checkpoints not offered: their chunk was cut, or a chunk exceeds the budget
  std::size_t unswept = 0;           ///< victims remembered now
};

/// What a CacheKeeper tells the engine's tiers: `erase(key)` removes an entry from every
/// tier the engine writes and, for a checkpoint, forgets its hash in the index (idempotent:
/// a second erase of a missing entry is harmless); `holds(key)` says whether the tiers hold
/// it (every live rank's, for a tensor-parallel engine).
template <class T>
concept CacheTiers = requires(T& t, const T& c, const CacheKey& k) {
  t.erase(k);
  { c.holds(k) } -> std::convertible_to<bool>;
};

/// An engine loop's side of a CacheLedger (see the header comment) over the engine's
/// `Tiers`: erase() is called once per victim, from inside the store that evicts it.
/// Single-threaded.
template <CacheTiers Tiers>
class CacheKeeper {
 public:
  static constexpr std::size_t all_chunks = std::numeric_limits<std::size_t>::max();

  /// Throws Error(invalid_argument) naming the value: chunk_tokens 0; kv_chunk_bytes 0,
  /// state_bytes 0 for a stateful model, or sweep_capacity 0, when on; and what
  /// CacheLedger's constructor throws.
  CacheKeeper(const CacheKeeperOptions& o, Tiers tiers) : o_(checked(o)), tiers_(std::move(tiers)) {
    if (o_.ledger) ledger_.emplace(*o_.ledger);
  }
  CacheKeeper(const CacheKeeper&) = delete;
  CacheKeeper& operator=(const CacheKeeper&) = delete;

  /// Whether a ledger owns the budget. O(1).
  [[nodiscard]] bool on() const noexcept { return ledger_.has_value(); }
  /// The ledger, when on (its counters and facts). O(1).
  [[nodiscard]] const CacheLedger* ledger() const noexcept { return ledger_ ? &*ledger_ : nullptr; }

  /// Chunk `c` of the prefix chain `keys` as the ledger weighs it: one chunk's KV, needing
  /// chunk c - 1.
  [[nodiscard]] CacheEntry kv_entry(std::span<const PrefixHash> keys, std::size_t c) const noexcept {
    return CacheEntry{CacheKey{keys[c], EntryKind::kv_chunk},
                      c == 0 ? std::nullopt : std::optional<CacheKey>(CacheKey{keys[c - 1], EntryKind::kv_chunk}),
                      o_.kv_chunk_bytes, cache_saved_tokens(EntryKind::kv_chunk, o_.stateful, o_.chunk_tokens, 0)};
  }

  /// The checkpoint `hash` at `boundary` of a prompt of `prompt_tokens` whose chunk keys are
  /// `keys`: one state entry, needing the chunk that covers the boundary (a joint load reads
  /// it whole), which with the chunks below it is what its saving stands on.
  [[nodiscard]] CacheEntry state_entry(std::span<const PrefixHash> keys, TokenCount boundary, PrefixHash hash,
                                       TokenCount prompt_tokens) const noexcept {
    const std::size_t covering = covering_chunk(boundary);
    const TokenCount last = prompt_tokens == 0 ? 0 : prompt_tokens - 1;
    return CacheEntry{CacheKey{hash, EntryKind::state},
                      covering < keys.size() ? std::optional<CacheKey>(CacheKey{keys[covering], EntryKind::kv_chunk})
                                             : std::nullopt,
                      o_.state_bytes, cache_saved_tokens(EntryKind::state, true, o_.chunk_tokens, boundary),
                      std::uint64_t{covering + 1} * o_.kv_chunk_bytes, boundary == last - last % o_.chunk_tokens};
  }

  /// Offers chunks [from, to) of `keys` for a save, in order; returns the end of the prefix
  /// kept: the chunks from there up are not to be sent (`to` when every chunk was kept, and
  /// always when off). Victims go to `erase` before it returns. Allocates (the ledger's
  /// nodes): the save path.
  std::size_t keep_chunks(std::span<const PrefixHash> keys, std::size_t from, std::size_t to) {
    if (!ledger_) return to;
    std::size_t kept_end = to;
    for (std::size_t c = from; c < to && c < keys.size(); ++c) {
      const CacheKey k{keys[c], EntryKind::kv_chunk};
      const bool known = ledger_->contains(k);
      const bool kept = store(kv_entry(keys, c));
      if (!kept && kept_end == to) kept_end = c;
      else if (kept && c > kept_end && !known) (void)ledger_->forget(k);
    }
    stats_.chunks_cut += std::min(to, keys.size()) - std::min(kept_end, std::min(to, keys.size()));
    return kept_end;
  }

  /// Offers a checkpoint (state_entry's arguments); `kept_chunks`: where keep_chunks cut the
  /// same chain, if it ran (a checkpoint over a cut chunk stands on nothing and is not
  /// offered). Returns whether it may be sent (always when off). Also false, without asking
  /// the ledger, when one chunk is larger than the whole budget.
  bool keep_checkpoint(std::span<const PrefixHash> keys, TokenCount boundary, PrefixHash hash, TokenCount prompt_tokens,
                       std::size_t kept_chunks = all_chunks) {
    if (!ledger_) return true;
    if (o_.kv_chunk_bytes > ledger_->stats().budget_bytes || covering_chunk(boundary) >= kept_chunks) {
      ++stats_.checkpoints_cut;
      return false;
    }
    return store(state_entry(keys, boundary, hash, prompt_tokens));
  }

  /// What became of a checkpoint offered with offer_checkpoint().
  enum class Offer : std::uint8_t {
    refused,   ///< the keeper did not keep it (the ledger refused it, or it stands on nothing): not sent
    sent,      ///< kept, and `send` says the tiers will hold it
    not_sent,  ///< kept, but `send` could not send it: forgotten again unless it was kept before
  };

  /// keep_checkpoint(), then, if kept, `send()`: the engine's mid-prefill save of it (a
  /// snapshot slot, Coordinator::checkpoint), returning whether the tiers will hold it (sent,
  /// or already served or being saved by the index). A checkpoint this offer kept that is
  /// then not sent is forgotten, so the ledger counts nothing no tier holds. Always calls
  /// `send` when off.
  template <class Send>
  Offer offer_checkpoint(std::span<const PrefixHash> keys, TokenCount boundary, PrefixHash hash, TokenCount prompt_tokens,
                         Send&& send) {
    const CacheKey key{hash, EntryKind::state};
    const bool known = contains(key);
    if (!keep_checkpoint(keys, boundary, hash, prompt_tokens)) return Offer::refused;
    if (send()) return Offer::sent;
    if (!known) (void)forget(key);
    return Offer::not_sent;
  }

  /// A load resumed a request at `resume` tokens, reading from the tier the chunks from
  /// `from` up (its HBM floor) and, for a stateful model, the checkpoint `state`: each one
  /// kept is used. Noexcept, no allocation.
  void note_uses(std::span<const PrefixHash> keys, TokenCount from, TokenCount resume,
                 std::optional<PrefixHash> state) noexcept {
    if (!ledger_ || resume == 0) return;
    for (std::size_t c = static_cast<std::size_t>(from / o_.chunk_tokens);
         c < keys.size() && static_cast<TokenCount>(c) * o_.chunk_tokens < resume; ++c)
      (void)ledger_->use(CacheKey{keys[c], EntryKind::kv_chunk});
    if (state) (void)ledger_->use(CacheKey{*state, EntryKind::state});
  }

  /// Whether the ledger keeps `k` (false when off). Noexcept.
  [[nodiscard]] bool contains(const CacheKey& k) const noexcept { return ledger_ && ledger_->contains(k); }

  /// `k` is not in the tiers after all (an offer kept but never sent, or a tier that dropped
  /// it on its own): the ledger drops it without erasing anything. Returns whether it was
  /// kept. Noexcept, no allocation.
  bool forget(const CacheKey& k) noexcept { return ledger_ && ledger_->forget(k); }

  /// Settles every victim remembered since the last sweep against the tiers, then forgets
  /// the list: one the ledger does not keep is erased again (its save landed after the
  /// eviction); one it keeps again but the tiers lack is forgotten by the ledger and erased
  /// (its new save was skipped as a duplicate of the one the eviction undid). Call it when
  /// no save is in flight. Returns how many it erased. O(victims).
  std::size_t sweep() {
    std::size_t n = 0;
    for (const CacheKey& k : victims_) n += settle(k) ? 1 : 0;
    victims_.clear();
    return n;
  }

  /// The keeper's counters, read now. O(1).
  [[nodiscard]] CacheKeeperStats stats() const noexcept {
    CacheKeeperStats s = stats_;
    s.unswept = victims_.size();
    return s;
  }

 private:
  static CacheKeeperOptions checked(const CacheKeeperOptions& o) {
    auto bad = [](const std::string& what) { return Error(ErrorCode::invalid_argument, "CacheKeeperOptions " + what); };
    if (o.chunk_tokens == 0) throw bad("chunk_tokens must be > 0, got 0");
    if (o.ledger && o.kv_chunk_bytes == 0) throw bad("kv_chunk_bytes must be > 0 with a ledger, got 0");
    if (o.ledger && o.stateful && o.state_bytes == 0)
      throw bad("state_bytes must be > 0 for a stateful model with a ledger, got 0");
    if (o.ledger && o.sweep_capacity == 0) throw bad("sweep_capacity must be > 0 with a ledger, got 0");
    return o;
  }

  [[nodiscard]] std::size_t covering_chunk(TokenCount boundary) const noexcept {
    return boundary == 0 ? 0 : static_cast<std::size_t>((boundary + o_.chunk_tokens - 1) / o_.chunk_tokens - 1);
  }

  bool store(const CacheEntry& e) {
    const CacheVerdict v = ledger_->store(e, [this](const CacheKey& k) { evicted(k); });
    return v == CacheVerdict::admitted || v == CacheVerdict::already_kept;
  }

  void evicted(const CacheKey& k) {
    tiers_.erase(k);
    ++stats_.erased;
    if (victims_.size() == o_.sweep_capacity) {
      (void)settle(victims_.front());
      victims_.pop_front();
    }
    victims_.push_back(k);
  }

  bool settle(const CacheKey& k) {
    if (!ledger_->contains(k)) {
      tiers_.erase(k);
      ++stats_.swept;
      return true;
    }
    if (tiers_.holds(k)) return false;  // stored again since, and there: the ledger counts it
    (void)ledger_->forget(k);
    tiers_.erase(k);
    ++stats_.healed;
    return true;
  }

  CacheKeeperOptions o_;
  Tiers tiers_;
  std::optional<CacheLedger> ledger_;
  std::deque<CacheKey> victims_;  // evicted since the last sweep(), oldest first
  CacheKeeperStats stats_{};
};

}  // namespace kvfuse
