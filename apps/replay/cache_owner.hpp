// kvfuse-replay: the engine's cache ledger (--cache-policy) and what the pass tells it. Every
// store goes through the ledger first; what it evicts is erased from every live rank's tier,
// and a checkpoint from the index too, so the index never serves what the tiers dropped and
// the tiers keep nothing the ledger does not count. Scheduler thread only.
#pragma once

#include "content.hpp"
#include "models.hpp"
#include "ranks.hpp"
#include "transport.hpp"
#include "workload.hpp"

#include <kvfuse/kvfuse.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace replay {

/// The ledger of one pass, or none (without --cache-policy every store may be sent).
class CacheOwner {
 public:
  static constexpr std::uint64_t kv_chunk_bytes = std::uint64_t{chunk_tokens} * kv_bytes_per_token;  // one rank's

  /// `policy` empty: no ledger. A state of up to two chunks' KV is let in on first sight.
  CacheOwner(std::optional<kvfuse::CachePolicy> policy, std::uint64_t budget, const Model& model, std::uint32_t state_scale,
             Ranks& ranks, const Transport& transport, TierKeys keys, kvfuse::OffloadIndex<>& index)
      : model_(model), state_scale_(state_scale), ranks_(ranks), transport_(transport), keys_(keys), index_(index) {
    if (policy) ledger_.emplace(kvfuse::CacheLedgerOptions{*policy, budget, std::size_t{1} << 16, 2 * kv_chunk_bytes, !model.stateful});
  }

  [[nodiscard]] bool on() const noexcept { return ledger_.has_value(); }
  [[nodiscard]] const std::optional<kvfuse::CacheLedger>& ledger() const noexcept { return ledger_; }

  /// Hands `e` to the ledger; true when it may be saved (admitted, or kept already).
  bool keep(const kvfuse::CacheEntry& e) {
    if (!ledger_) return true;
    const kvfuse::CacheVerdict v = ledger_->store(e, [this](const kvfuse::CacheKey& k) { drop_everywhere(k); });
    return v == kvfuse::CacheVerdict::admitted || v == kvfuse::CacheVerdict::already_kept;
  }
  [[nodiscard]] bool contains(const kvfuse::CacheKey& k) const noexcept { return ledger_ && ledger_->contains(k); }
  void forget(const kvfuse::CacheKey& k) noexcept {
    if (ledger_) (void)ledger_->forget(k);
  }

  /// Chunk c of `q` as the ledger weighs it: one rank's KV of a chunk, needing chunk c - 1.
  kvfuse::CacheEntry kv_entry(const Request& q, std::size_t c) const {
    using kvfuse::CacheKey, kvfuse::EntryKind;
    return kvfuse::CacheEntry{CacheKey{q.chunk_keys[c], EntryKind::kv_chunk},
                              c == 0 ? std::nullopt : std::optional<CacheKey>(CacheKey{q.chunk_keys[c - 1], EntryKind::kv_chunk}),
                              kv_chunk_bytes, kvfuse::cache_saved_tokens(EntryKind::kv_chunk, model_.stateful, chunk_tokens, 0)};
  }

  /// The checkpoint of `q` at `boundary`: one rank's state slot, needing the chunk that
  /// covers the boundary (a joint load reads it whole), which with the chunks below it is
  /// what its saving stands on.
  kvfuse::CacheEntry state_entry(const Request& q, kvfuse::TokenCount boundary, kvfuse::PrefixHash hash) const {
    using kvfuse::CacheKey, kvfuse::EntryKind;
    const std::size_t covering = static_cast<std::size_t>((boundary + chunk_tokens - 1) / chunk_tokens - 1);
    const kvfuse::TokenCount last = q.prompt_tokens - 1;
    return kvfuse::CacheEntry{CacheKey{hash, EntryKind::state}, CacheKey{q.chunk_keys[covering], EntryKind::kv_chunk},
                              std::uint64_t{state_scale_} * default_slot_bytes,
                              kvfuse::cache_saved_tokens(EntryKind::state, true, chunk_tokens, boundary),
                              std::uint64_t{covering + 1} * kv_chunk_bytes, boundary == last - last % chunk_tokens};
  }

  /// A load resumed `q` at `resume` over `hbm` tokens of HBM: the chunks it read from the
  /// tier and the checkpoint it restored are uses.
  void note_uses(const Request& q, kvfuse::TokenCount hbm, kvfuse::TokenCount resume) {
    if (!ledger_ || resume == 0) return;
    for (kvfuse::TokenCount c = hbm / chunk_tokens; c * chunk_tokens < resume && c < q.chunk_keys.size(); ++c)
      (void)ledger_->use(kvfuse::CacheKey{q.chunk_keys[c], kvfuse::EntryKind::kv_chunk});
    if (model_.stateful)
      (void)ledger_->use(kvfuse::CacheKey{StateChain::of(model_.id, q, resume), kvfuse::EntryKind::state});
  }

 private:
  void drop_everywhere(const kvfuse::CacheKey& k) {
    for (std::uint32_t r = 0; r < ranks_.world(); ++r)
      if (transport_.alive(r))
        (void)ranks_.tier(r).erase(k.kind == kvfuse::EntryKind::state ? keys_.state(k.hash, r) : keys_.kv(k.hash, r));
    if (k.kind == kvfuse::EntryKind::state) (void)index_.forget(k.hash);
  }

  const Model& model_;
  std::uint32_t state_scale_;
  Ranks& ranks_;
  const Transport& transport_;
  TierKeys keys_;
  kvfuse::OffloadIndex<>& index_;
  std::optional<kvfuse::CacheLedger> ledger_;
};

}  // namespace replay
