// slot_cache.hpp — kvfuse's engine loop inside llama-server: the prompt cache behind its
// slots, built on the Coordinator and the host kit as kvfuse::llama::Server is.
//
// kvfuse::llama::Server runs a whole request in a fresh context of its own. Here llama-server
// owns the context, the slots and the prefill; kvfuse is asked at two points of a slot's
// task, and each task is one admission of the Coordinator:
//   begin(): when a slot starts a prompt. The prompt's chunk keys (every chunk at or below
//     the last boundary the restore may reach) and, for a stateful model, its block
//     boundaries as checkpoint candidates go to admit(); the planner picks the load (KV
//     chunks, and the state at the boundary it chose) against everything the tier holds;
//     the rank reads it into the admission's blocks and slot; the codec rebuilds the FULL
//     blob of the sequence at that boundary, which the caller restores into the slot.
//   checkpoint(): the prefill stopped at a boundary the admission planned (stops()); the
//     state there goes to a snapshot slot and Coordinator::checkpoint.
//   finish(): the prompt is done; the KV rows the prefill computed, up to the last chunk
//     boundary below which every cell is what a prefill from token 0 computes, go from the
//     slot's blob into the admission's blocks, and Coordinator::finish saves the new chunks.
// KV of generated tokens is never saved (llama-server computes it one token at a time, in
// another order than a prefill: docs/llama.md), so a later prompt that contains a reply
// reuses the reply's KV only from the slot's own cells, as stock does.
//
// The block pool holds only the blocks of admissions in flight (its prefix cache is not
// used: every reuse comes from the tier, whose size is the budget the user gave), so every
// begin() reads from the tier; blocks [0, boundary) then hold the restored KV and finish()
// writes the rest after them.
//
// Threading: one thread, llama-server's main loop (kvfuse's scheduler thread); the
// connector's lanes are its only other threads.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <llama.h>

#include <kvfuse/host/admission_book.hpp>
#include <kvfuse/host/audit.hpp>
#include <kvfuse/host/block_pool.hpp>
#include <kvfuse/host/slot_pool.hpp>
#include <kvfuse/kvfuse.hpp>
#include <kvfuse/llama/blob_codec.hpp>
#include <kvfuse/llama/detail/in_process.hpp>
#include <kvfuse/llama/detail/in_process_engine.hpp>
#include <kvfuse/llama/detail/server_setup.hpp>
#include <kvfuse/llama/prefix_hashes.hpp>
#include <kvfuse/llama/serving.hpp>

#include "slot_cache_options.hpp"

namespace kvfuse::llama_server {


/// The prompt cache of one llama-server: `T` the tier, `StateLeg` the model's state leg (NoState,
/// RecurrentState<T>, SlotState<T>). One thread.
template <Tier T, class StateLeg>
class SlotCache {
 public:
  using Conn = Connector<PagedKv<T>, StateLeg, SingleRank, HostRuntime>;
  static constexpr bool stateful = Conn::has_state;
  static constexpr StateLayout layout = Conn::layout;

  /// A cache for `codec`'s model over `tier` (both outlive it). Throws Error(invalid_argument)
  /// naming the value for a chunk size off the codec's grid or no slots.
  SlotCache(const llama::SequenceCodec& codec, T& tier, SlotCacheOptions options)
      : codec_(codec),
        tier_(tier),
        options_(checked_options(codec, options)),
        // The lanes' copies run on the lanes themselves: a stream thread per lane would add
        // a hand-off (two futex wake-ups) to every chunk of a load (bench_restore_cost.cpp).
        e_(tier, geometry_for(codec, options_, stateful),
           kvfuse::llama::detail::InProcessEngineOptions{
               .checkpoints = options_.checkpoints,
               .request_slots = options_.slots,
               .rank_timeout = options_.rank_timeout,
               .runtime = HostRuntimeOptions{.default_mode = HostStreamMode::inline_calls},
               .cache_policy = options_.cache_policy,
               .cache_budget = options_.cache_budget}),
        tasks_(options_.slots) {}
  SlotCache(const SlotCache&) = delete;
  SlotCache& operator=(const SlotCache&) = delete;

  /// Indexes the state checkpoints the tier already holds for this model (a disk directory
  /// or a Redis server that outlived the process that filled it). Returns how many. Throws
  /// what the tier's keys() throws (a Redis that does not answer).
  std::size_t reseed_from_tier() {
    if constexpr (!stateful) return 0;
    const std::vector<std::vector<TierKey>> keys{tier_.keys(EntryKind::state)};
    return reseed_state_hashes(e_.index, keys, e_.geometry.model, e_.geometry.world_size);
  }

  /// Slot `slot` starts a prompt; a restore may reach at most `limit` tokens (below the
  /// prompt's last token and the server's own tail split). Ends the slot's previous
  /// admission if it is still open. Returns the load's outcome and, when it brought tokens
  /// back, the rebuilt blob. Blocks while the rank loads (at most rank_timeout). Throws
  /// Error(invalid_argument) for a slot out of range.
  Restore begin(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount limit) {
    Task& t = task(slot);
    if (t.open) finish(slot, prompt, 0);
    ++counters_.tasks;
    Restore out;
    const std::uint32_t block = e_.geometry.block_tokens;
    const TokenCount P = std::min<TokenCount>(prompt.size(), std::max<TokenCount>(limit + 1, 1));
    const llama::PrefixHashes hashes(prompt.first(P), block);
    t.id = RequestId{next_request_++};
    t.table.clear();
    if (!e_.blocks.allocate(TokenGrid{block}.cells_covering(prompt.size()), t.table)) {
      for (const BlockId b : t.table) e_.blocks.release(b);
      t.table.clear();
      return out;  // cannot happen with the pool sized for every slot's context; served without kvfuse
    }
    t.slot.reset();
    if constexpr (stateful) {
      t.slot = e_.request_slots.take();
      if (!t.slot) {
        for (const BlockId b : t.table) e_.blocks.release(b);
        t.table.clear();
        return out;
      }
    }
    std::vector<PrefixHash> keys;
    for (TokenCount end = block; end <= P; end += block) keys.push_back(hashes.chunk_key(end));
    std::vector<Checkpoint> candidates;
    if constexpr (stateful)
      for (TokenCount b = block; b + 1 <= P; b += block)
        if (options_.state_allowed(b))
          candidates.push_back(Checkpoint{b, hashes.state_hash(b)});
    const AdmitDecision d = e_.coordinator.admit(AdmitRequest{t.id, P, 0, keys, t.table, candidates, t.slot});
    Entry* entry = e_.book.open(t.id, d, t.table, t.slot);
    if (entry == nullptr) {  // the coordinator says it is parked already: a protocol error, counted by the book
      for (const BlockId b : t.table) e_.blocks.release(b);
      if (t.slot) (void)e_.request_slots.give(*t.slot);
      t.table.clear();
      return out;
    }
    t.open = true;
    t.stops.clear();
    for (const TokenCount b : d.checkpoints)
      if (options_.state_allowed(b)) t.stops.push_back(b);
    if (options_.state_period != 0 && !candidates.empty() &&
        std::find(t.stops.begin(), t.stops.end(), candidates.back().boundary) == t.stops.end()) {
      // The policy's prompt-end checkpoint may fall off the allowed boundaries: the last
      // allowed one below the prompt's end is taken instead.
      t.stops.push_back(candidates.back().boundary);
      std::sort(t.stops.begin(), t.stops.end());
    }
    t.state_hash.reset();
    if (const std::optional<TokenCount> b = state_boundary(d.plan)) t.state_hash = hashes.state_hash(*b);
    t.loaded = 0;
    if (d.parked) {
      out.load = llama::load_kind_of(d.plan);
      const std::optional<Unpark> u = e_.wait_for_unpark(t.id);
      if (!u) {
        out.stranded = true;
        ++counters_.stranded;
        e_.coordinator.teardown(t.id);
        (void)e_.book.end(t.id);
        t.open = false;
        return out;
      }
      out.outcome = u->kind;
      t.loaded = u->tokens;
    }
    if (t.loaded > 0) {
      e_.cache.note_uses(keys, 0, t.loaded, t.state_hash);
      try {
        codec_.rebuild(t.loaded, e_.pools.blocks, std::span(t.table).first(t.loaded / block), slot_bytes(t.slot), out.blob);
        out.boundary = t.loaded;
        ++counters_.restores;
        counters_.restored_tokens += t.loaded;
      } catch (const Error&) {
        ++counters_.codec_refusals;
        refused(slot);
      }
    }
    return out;
  }

  /// How many of `prompt`'s leading tokens the tier holds in whole chunks, up to `limit`
  /// (a catalogue lookup per chunk: no bytes move). Lets a caller skip a load that could
  /// not beat what the slot holds.
  [[nodiscard]] TokenCount held_tokens(std::span<const llama_token> prompt, TokenCount limit) const {
    const std::uint32_t chunk = e_.geometry.chunk_tokens;
    const TokenCount P = std::min<TokenCount>(prompt.size(), limit);
    const llama::PrefixHashes hashes(prompt.first(P), e_.geometry.block_tokens);
    TokenCount held = 0;
    while (held + chunk <= P && tier_.contains(tier_key(hashes.chunk_key(held + chunk), EntryKind::kv_chunk))) held += chunk;
    return held;
  }

  /// llama.cpp refused the blob begin() rebuilt (or the caller could not use it): the state
  /// checkpoint it came from is forgotten by the index, so the next prompt that shares it
  /// computes its own, and the blocks are not trusted for finish().
  void refused(std::uint32_t slot) {
    Task& t = task(slot);
    if (t.state_hash) (void)e_.index.forget(*t.state_hash);
    t.loaded = 0;
    t.untrusted = true;
  }

  /// The boundaries at which the slot's prefill should stop for a state checkpoint
  /// (ascending; empty for a dense model).
  [[nodiscard]] std::span<const TokenCount> stops(std::uint32_t slot) { return task(slot).stops; }

  /// The prefill of the slot's prompt is at `boundary`, one of stops(); `partial` is the
  /// one-stream PARTIAL_ONLY blob of the sequence there. Hands the state to the coordinator
  /// (nothing when a snapshot slot does not come back within rank_timeout).
  void checkpoint(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount boundary,
                  std::span<const std::uint8_t> partial) {
    if constexpr (!stateful) return;
    Task& t = task(slot);
    if (!t.open) return;
    // A cache ledger is asked first: it stands on the chunk ending at the boundary.
    const std::uint32_t block = e_.geometry.block_tokens;
    const llama::PrefixHashes hashes(prompt.first(boundary), block);
    std::vector<PrefixHash> keys;
    for (TokenCount end = block; end <= boundary; end += block) keys.push_back(hashes.chunk_key(end));
    const Checkpoint c{boundary, hashes.state_hash(boundary)};
    (void)e_.cache.offer_checkpoint(keys, boundary, c.hash, prompt.size(), [&] {
      if (e_.snapshots.empty()) (void)e_.pump_until([&] { return !e_.snapshots.empty(); });
      const std::optional<SlotId> snapshot = e_.snapshots.take();
      if (!snapshot) {
        ++counters_.stranded;
        return false;
      }
      try {
        codec_.store_state(partial, slot_span(*snapshot));
      } catch (const Error&) {
        ++counters_.codec_refusals;
        (void)e_.snapshots.give(*snapshot);
        return false;
      }
      e_.connector.begin_step(e_.compute);
      const CheckpointResult r = e_.coordinator.checkpoint(c, *snapshot);
      if (r != CheckpointResult::saved) (void)e_.snapshots.give(*snapshot);
      else if (saved_states_.size() < 64) saved_states_.push_back(c.hash);
      return r == CheckpointResult::saved || r == CheckpointResult::already_indexed;
    });
  }

  /// The slot's prompt is done (or abandoned: `clean` 0). `clean` is the length of the
  /// prefix whose cells are what a prefill from token 0 computes; `full` the one-stream FULL
  /// blob of the slot's sequence (empty when clean is 0). The KV of whole chunks in
  /// [tokens loaded, clean) goes to the admission's blocks, and finish() saves every chunk
  /// below the clean floor that the tier does not hold yet. Waits for the saves to store
  /// (at most rank_timeout), so a later begin() sees them.
  void finish(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount clean,
              std::span<const std::uint8_t> full = {}) {
    Task& t = task(slot);
    if (!t.open) return;
    t.open = false;
    const std::uint32_t block = e_.geometry.block_tokens;
    TokenCount floor = TokenGrid{block}.floor(std::min<TokenCount>(clean, prompt.size()));
    const TokenCount own = t.untrusted ? 0 : t.loaded;
    if (t.untrusted && floor > 0) floor = 0;  // blocks [0, loaded) hold what llama.cpp refused
    if (floor > own && !full.empty()) {
      try {
        codec_.store_kv(full, own, floor, e_.pools.blocks, std::span(t.table).subspan(own / block));
        counters_.kv_rows_saved += floor - own;
      } catch (const Error&) {
        ++counters_.codec_refusals;
        floor = own;
      }
    } else if (floor > own) {
      floor = own;
    }
    e_.connector.begin_step(e_.compute);  // the saves read what the lines above wrote (R13)
    const llama::PrefixHashes hashes(prompt.first(floor), block);
    std::vector<PrefixHash> keys;
    for (TokenCount end = block; end <= floor; end += block) keys.push_back(hashes.chunk_key(end));
    // A cache ledger sees the chunks from the save watermark up; the save is cut at the
    // first one it does not keep.
    const std::size_t kept =
        e_.cache.keep_chunks(keys, static_cast<std::size_t>(e_.coordinator.save_watermark(t.id) / block), keys.size());
    const TokenCount computed = kept == keys.size() ? floor : static_cast<TokenCount>(kept) * block;
    (void)e_.coordinator.finish(FinishRequest{t.id, computed, keys, t.table, std::nullopt, t.slot});
    (void)e_.book.end(t.id);
    t.untrusted = false;
    if (!settle()) ++counters_.stranded;
    e_.sweep_if_quiet();
  }

  /// A control for the tests, never on in service: flips one byte in the middle of the first
  /// KV chunk of `prompt` the tier holds, rewriting the entry so its checksum still holds.
  /// Returns whether it found one.
  bool tamper_kv(std::span<const llama_token> prompt) {
    const llama::PrefixHashes hashes(prompt, e_.geometry.block_tokens);
    for (TokenCount end = e_.geometry.chunk_tokens; end <= prompt.size(); end += e_.geometry.chunk_tokens)
      if (rewrite(tier_key(hashes.chunk_key(end), EntryKind::kv_chunk), e_.geometry.chunk_bytes(), [](std::vector<std::byte>& b) {
            b[b.size() / 2] ^= std::byte{0x40};
          }))
        return true;
    return false;
  }

  /// A control for the tests: the deepest state entry of `prompt` the tier holds is
  /// overwritten with another state this cache saved (the state of a wrong boundary).
  /// Returns whether it found both.
  bool tamper_state(std::span<const llama_token> prompt) {
    if constexpr (!stateful) return false;
    else {
      const llama::PrefixHashes hashes(prompt, e_.geometry.block_tokens);
      const std::size_t bytes = StateLeg::entry_bytes(e_.geometry);
      for (TokenCount b = TokenGrid{e_.geometry.block_tokens}.floor(prompt.size() - 1); b > 0; b -= e_.geometry.block_tokens) {
        const TierKey target = tier_key(hashes.state_hash(b), EntryKind::state);
        if (!tier_.contains(target)) continue;
        for (const PrefixHash other : saved_states_) {
          const TierKey source = tier_key(other, EntryKind::state);
          if (source == target) continue;
          std::vector<std::byte> staging(bytes);
          TierView v = tier_.get(source, staging);
          if (!v.hit()) continue;
          const std::vector<std::byte> copy(v.bytes().begin(), v.bytes().end());
          v = TierView{};
          if (tier_.put(target, copy)) return true;
        }
        return false;
      }
      return false;
    }
  }

  /// The cache's own counters (O(1)).
  [[nodiscard]] SlotCacheCounters counters() const noexcept { return counters_; }
  /// The index's, coordinator's and connector's counters, read now (O(1)).
  [[nodiscard]] IndexStats index_stats() const { return e_.index.stats(); }
  [[nodiscard]] CoordinatorStats coordinator_stats() const { return e_.coordinator.stats(); }
  [[nodiscard]] ConnectorStats connector_stats() const { return e_.connector.stats(); }
  /// The cache ledger's counters, when a policy owns the budget (O(1)).
  [[nodiscard]] std::optional<CacheLedgerStats> cache_stats() const {
    if (const CacheLedger* l = e_.cache.ledger()) return l->stats();
    return std::nullopt;
  }
  /// The numbers that must be zero (the host kit's audit); walks the index: not per request.
  [[nodiscard]] HostAudit audit() const {
    return e_.audit();
  }
  /// The rank's geometry (grids, pools, the model id in every tier key).
  [[nodiscard]] const RankGeometry& geometry() const noexcept { return e_.geometry; }
  /// The tier key of a KV chunk or state entry of this cache's model.
  [[nodiscard]] TierKey tier_key(PrefixHash hash, EntryKind kind) const noexcept {
    return kvfuse::llama::detail::tier_key_of(e_.geometry, hash, kind);
  }

 private:
  using Engine = kvfuse::llama::detail::InProcessEngine<T, StateLeg>;
  using Entry = typename Engine::Entry;

  struct Task {
    bool open = false;
    bool untrusted = false;
    RequestId id{};
    std::vector<BlockId> table;
    std::optional<SlotId> slot;
    std::vector<TokenCount> stops;
    std::optional<PrefixHash> state_hash;  // of the state the load brought back, if any
    TokenCount loaded = 0;
  };

  template <class Change>
  bool rewrite(const TierKey& key, std::size_t bytes, Change change) {
    std::vector<std::byte> staging(bytes);
    TierView v = tier_.get(key, staging);
    if (!v.hit() || v.bytes().empty()) return false;
    std::vector<std::byte> copy(v.bytes().begin(), v.bytes().end());
    v = TierView{};
    change(copy);
    return tier_.put(key, copy);
  }

  Task& task(std::uint32_t slot) {
    if (slot >= tasks_.size())
      throw Error(ErrorCode::invalid_argument, "slot " + std::to_string(slot) + " of " + std::to_string(tasks_.size()));
    return tasks_[slot];
  }

  std::span<std::byte> slot_span(SlotId s) const noexcept {
    return {e_.pools.slots + std::size_t{s.value} * e_.geometry.slot_bytes, e_.geometry.slot_bytes};
  }
  std::span<const std::byte> slot_bytes(std::optional<SlotId> s) const noexcept {
    if (!s) return {};
    return slot_span(*s);
  }

  // Every ended admission was freed and every save stored (or rank_timeout passed); the
  // open admissions of other slots stay on the book.
  bool settle() {
    return e_.pump_until([&] {
      const IndexStats st = e_.index.stats();
      return st.saves_outstanding == 0 && e_.book.stats().ended_now == 0;
    });
  }

  const llama::SequenceCodec& codec_;
  T& tier_;
  SlotCacheOptions options_;
  Engine e_;  // the Coordinator, the host kit and the rank
  std::vector<Task> tasks_;
  std::vector<PrefixHash> saved_states_;  // for tamper_state
  std::uint64_t next_request_ = 1;
  SlotCacheCounters counters_;
};

}  // namespace kvfuse::llama_server
