// kvfuse/engine/cache_policy.hpp — the cache policy (docs/reference.md#cache-policy): which KV
// chunks and state checkpoints a byte budget keeps, and which it lets in.
//
// A tier's budget binds on what a hybrid model stores most of: state. LRU treats a 64-chunk
// checkpoint like one chunk of KV and a KV chunk nothing can resume from like one a
// checkpoint stands on. The `cost` policy weighs each entry by the prefill it saves per
// byte and how recently it was used (Greedy-Dual-Size: the priority of an entry is
// L + w x saved_tokens / bytes, where the inflation L is the highest priority evicted so
// far, so an entry not used for a while sinks below newer ones without a clock), and it is
// dependency-aware:
//
//   - An entry is *needed* by another kept entry that is useless without it: KV chunk i by
//     chunk i + 1 of the same prefix (a lookup counts leading chunks), the KV chunk covering
//     B by the checkpoint at B (a joint load needs both). Under `cost` only an entry no kept
//     entry needs (a leaf) is evicted, so what stays is always a usable prefix.
//   - What an entry saves (cache_saved_tokens): a dense KV chunk its own tokens; a
//     checkpoint at B the whole prefill of [0, B); a stateful model's KV chunk a quarter of
//     its tokens. Alone it spares nothing (no load resumes a hybrid without state), so as a
//     leaf it goes before the checkpoints; under a kept checkpoint it is pinned anyway; and
//     the quarter keeps it above nothing, since a later checkpoint may come to stand on it.
//   - Uses weigh for checkpoints only (w = 1 + hits; 1 for KV): a KV chunk's uses are its
//     prefix's, already weighed by the checkpoint on it, and for dense KV recency alone
//     did best on the shipped trace (docs/replay.md#cache-policy).
//   - Admission: a heavy checkpoint (one larger than the ledger's light_state_bytes) never
//     seen before is refused when it could only come in by evicting something. A checkpoint
//     placed deep in a request-unique suffix is stored once and never read; the second time
//     a boundary is checkpointed it has proved it is shared. Two are let in on first sight:
//     a light one (as cheap as the KV it spares, worth the gamble) and the prompt-end one
//     (the highest point a later prompt extending this one, the next turn of a chat, can
//     resume from: seen once, by the request that made it, and the likeliest to be read).
//   - A dense model's KV chunk (the ledger's kv_on_second_sight) is admitted on second sight
//     too: one never seen before comes in only when it fits without an eviction. A dense
//     prompt's unique suffix is stored once and never read, and under `cost` it would push
//     out a shared prefix. Not for a stateful model: its checkpoints stand on the KV, and a
//     KV chunk refused once leaves the checkpoint above it nothing to stand on (on the
//     shipped trace hybrids starved, docs/replay.md#cache-policy).
//   - Priority divides by the footprint, not the bytes: a checkpoint's saving needs the KV
//     it stands on kept too, so a deep checkpoint of a small state does not pin a whole
//     prefix of a small budget as if it cost one slot.
//
// `lru` is the baseline: the least recently used entry goes, needed or not, and everything
// that fits the budget comes in, as a tier's own LRU does.
//
// These are pure functions of plain inputs: no state, no allocation, noexcept, constexpr,
// and therefore thread-safe. CacheLedger (cache_ledger.hpp) is the owner that keeps the
// facts and calls them; the tests check its choices against these functions by brute force.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

#include <kvfuse/tier/tier.hpp>

namespace kvfuse {

/// Which entries a byte budget keeps. An out-of-range value is refused by CacheLedger's
/// constructor.
enum class CachePolicy : std::uint8_t {
  lru,   ///< the least recently used entry goes; every entry that fits is admitted
  cost,  ///< prefill saved per byte, uses and recency (GDSF), leaves only, first-seen checkpoints (and dense KV) refused under pressure
};

/// Stable name of a CachePolicy ("lru", "cost"). Thread-safe, noexcept.
constexpr std::string_view to_string(CachePolicy p) noexcept {
  switch (p) {
    case CachePolicy::lru: return "lru";
    case CachePolicy::cost: return "cost";
  }
  return "unknown_cache_policy";
}

/// What the policy weighs of one kept entry. Plain data.
struct CacheFacts {
  EntryKind kind = EntryKind::kv_chunk;
  std::uint64_t bytes = 1;         ///< what it holds in the budget's unit (0 is read as 1)
  std::uint64_t footprint = 1;     ///< what its saving needs kept: its bytes and the KV it stands on (0 is read as 1)
  std::uint64_t saved_tokens = 0;  ///< prefill a use of it spares, beyond what the entries it needs spare
  std::uint32_t hits = 0;          ///< uses since it was stored
  std::uint64_t last_use = 0;      ///< the ledger's logical clock at its store or last use: higher is more recent
  std::uint32_t needed_by = 0;     ///< kept entries that are useless without it
  double priority = 0;             ///< cache_priority() at its store or last use
};

/// The priority of an entry used (or stored) now, with the ledger's inflation value:
/// inflation + w x saved_tokens / footprint, w = 1 + hits for a checkpoint and 1 for a KV
/// chunk. Never below `inflation`. Thread-safe.
constexpr double cache_priority(EntryKind kind, std::uint64_t saved_tokens, std::uint32_t hits, std::uint64_t footprint,
                                double inflation) noexcept {
  const double b = footprint == 0 ? 1.0 : static_cast<double>(footprint);
  const double w = kind == EntryKind::state ? 1.0 + static_cast<double>(hits) : 1.0;
  return inflation + w * static_cast<double>(saved_tokens) / b;
}

/// What an entry saves, for CacheEntry::saved_tokens: a checkpoint at `boundary` the
/// tokens below it; a KV chunk of `chunk_tokens` all of them for a dense model and a
/// quarter for a stateful one (the header comment says why). Thread-safe.
constexpr std::uint64_t cache_saved_tokens(EntryKind kind, bool stateful, std::uint64_t chunk_tokens,
                                           std::uint64_t boundary) noexcept {
  if (kind == EntryKind::state) return boundary;
  return stateful ? chunk_tokens / 4 : chunk_tokens;
}

/// Whether `policy` may evict an entry with these facts: `lru` any, `cost` a leaf only
/// (needed_by == 0). Thread-safe.
constexpr bool cache_evictable(CachePolicy policy, const CacheFacts& f) noexcept {
  return policy == CachePolicy::lru || f.needed_by == 0;
}

/// True when `policy` evicts `a` before `b` (both evictable): `lru` by last_use; `cost` by
/// priority, then last_use. Equal in both: neither (the caller breaks the tie by its own
/// order). Thread-safe.
constexpr bool cache_evicts_first(CachePolicy policy, const CacheFacts& a, const CacheFacts& b) noexcept {
  if (policy == CachePolicy::cost && a.priority != b.priority) return a.priority < b.priority;
  return a.last_use < b.last_use;
}

/// The entry `policy` evicts next among `kept`: the evictable one that cache_evicts_first
/// orders first, the lowest index among equals; `kept.size()` when none is evictable. The
/// reference the ledger is tested against (O(n)). Thread-safe.
constexpr std::size_t cache_victim(CachePolicy policy, std::span<const CacheFacts> kept) noexcept {
  std::size_t best = kept.size();
  for (std::size_t i = 0; i < kept.size(); ++i) {
    if (!cache_evictable(policy, kept[i])) continue;
    if (best == kept.size() || cache_evicts_first(policy, kept[i], kept[best])) best = i;
  }
  return best;
}

/// What an admission is decided on.
struct CacheAdmission {
  EntryKind kind = EntryKind::kv_chunk;
  bool fits = false;         ///< it fits the budget without evicting anything
  bool seen_before = false;  ///< the ledger has seen this key before (stored, refused or evicted)
  bool light = false;        ///< a checkpoint no larger than the ledger's light_state_bytes
  bool prompt_end = false;   ///< the checkpoint at its prompt's last chunk boundary
  bool kv_on_second_sight = false;  ///< a KV chunk comes in under pressure only when seen before (a dense model's)
};

/// Whether `policy` lets an entry in (given that it is not larger than the whole budget):
/// `lru` always; `cost` unless it does not fit without an eviction and is either a heavy
/// checkpoint, never seen before and not at its prompt's end, or (kv_on_second_sight) a KV
/// chunk never seen before. Thread-safe.
constexpr bool cache_admits(CachePolicy policy, const CacheAdmission& a) noexcept {
  if (policy == CachePolicy::lru || a.fits) return true;
  if (a.kind != EntryKind::state) return !a.kv_on_second_sight || a.seen_before;
  return a.seen_before || a.light || a.prompt_end;
}

}  // namespace kvfuse
