// kvfuse/llama/server.hpp — a llama.cpp engine that offloads its KV and its recurrent state
// through kvfuse, as a serving engine would, one request at a time in a fresh context.
//
// Engine side: kvfuse's Coordinator over an OffloadIndex, a SingleRank group (llama.cpp's
// CPU backend runs a whole model in one context, so the engine is one rank: world size 1 in
// every tier key) and its pump, and the host kit: the prefix-caching block pool (the
// engine's "HBM"), the request and snapshot slot pools, and the admission book that routes
// the Coordinator's events onto them. Rank side: one Connector with the stock PagedKv and
// the model's stock state leg over any kvfuse Tier; the codec (blob_codec.hpp) makes the
// llama.cpp sequence's KV a set of paged blocks and its state a slot.
//
// serve() runs one request: match the prompt's leading blocks in the prefix cache, admit it,
// wait for the load, rebuild the sequence at the claimed boundary, prefill the rest on the
// runner's ubatch grid (stopping where the checkpoint policy asks, to hand the state to
// Coordinator::checkpoint), decode, and finish. What it saves is what a prefill from token 0
// computes, bit for bit: finish recomputes the generated tokens as a prefill would before
// it writes their blocks or their checkpoint, because llama.cpp sums one-token decode steps
// in another order (docs/llama.md).
//
// Threading: a Server belongs to one thread (the scheduler thread of kvfuse's contract);
// the connector's lanes are its only other threads.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include <kvfuse/host/admission_book.hpp>
#include <kvfuse/host/audit.hpp>
#include <kvfuse/host/block_pool.hpp>
#include <kvfuse/host/slot_pool.hpp>
#include <kvfuse/kvfuse.hpp>
#include <kvfuse/llama/detail/in_process.hpp>
#include <kvfuse/llama/detail/in_process_engine.hpp>
#include <kvfuse/llama/detail/server_setup.hpp>
#include <kvfuse/llama/prefix_hashes.hpp>
#include <kvfuse/llama/sequence_runner.hpp>
#include <kvfuse/llama/serving.hpp>

namespace kvfuse::llama {

/// One llama.cpp engine over kvfuse: `T` is the tier every leg reads and writes, `StateLeg`
/// the model's state leg (NoState, RecurrentState<T>, SlotState<T>). One thread.
template <Tier T, class StateLeg>
class Server {
 public:
  using Conn = Connector<PagedKv<T>, StateLeg, SingleRank, HostRuntime>;
  static constexpr bool stateful = Conn::has_state;
  static constexpr StateLayout layout = Conn::layout;

  /// Called with each LoadRequest just before it goes to the rank (the program's controls
  /// use it to tamper with the entry the load is about to read).
  using LoadHook = std::function<void(const LoadRequest&)>;

  /// A server for `runner`'s model over `tier` (both must outlive it). Throws
  /// Error(invalid_argument) naming the value when the state leg does not fit the model's
  /// blob family, the grids disagree, or the pool cannot hold the longest request.
  Server(const SequenceRunner& runner, T& tier, ServeOptions options)
      : runner_(runner),
        tier_(tier),
        options_(detail::checked_options(runner, options, layout)),
        e_(tier, detail::geometry_for(runner, options_, stateful),
           detail::InProcessEngineOptions{.checkpoints = options_.checkpoints,
                                          .request_slots = 1,
                                          .rank_timeout = options_.rank_timeout,
                                          .on_load = &load_hook_,
                                          .cache_policy = options_.cache_policy,
                                          .cache_budget = options_.cache_budget}) {}
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Indexes every state checkpoint the tier already holds for this model (a tier that
  /// outlived the engine that filled it: a disk directory, a Redis server), as a restarted
  /// engine does (R18). Returns how many. Only where the tier lists its keys.
  std::size_t reseed_from_tier()
    requires requires(T& t) { t.keys(EntryKind::state); }
  {
    if constexpr (!stateful) return 0;
    const std::vector<std::vector<TierKey>> keys{tier_.keys(EntryKind::state)};
    return reseed_state_hashes(e_.index, keys, e_.geometry.model, e_.geometry.world_size);
  }

  /// Serves one request: `prompt` (at least one token), then `output_tokens` greedy tokens
  /// (at least one). Returns what it produced and how. Blocks while the ranks load and
  /// save; throws Error for a request the server cannot hold and what llama.cpp's runner
  /// throws (a restored sequence llama.cpp refuses is not thrown: it is recomputed from
  /// token 0, its checkpoint is forgotten by the index, and Served::resume_refused says so).
  Served serve(std::span<const llama_token> prompt, std::size_t output_tokens) {
    const auto started = Clock::now();
    const TokenCount P = prompt.size(), total = P + output_tokens;
    if (P == 0 || output_tokens == 0 || total > options_.max_request_tokens)
      throw Error(ErrorCode::invalid_argument, "a request needs a prompt, an output and at most " +
                                                   std::to_string(options_.max_request_tokens) + " tokens, got " +
                                                   std::to_string(P) + " + " + std::to_string(output_tokens));
    const std::uint32_t block = e_.geometry.block_tokens, chunk = e_.geometry.chunk_tokens;
    current_prompt_ = prompt;
    const std::uint64_t checkpoints_before = e_.coordinator.stats().checkpoints_saved;
    Served s;
    s.prompt_tokens = P;

    // The block table: the prompt's leading cached blocks (never the one holding token P - 1,
    // which the request must compute), then fresh ones for the rest of the request.
    const PrefixHashes prompt_hashes(prompt, block);
    std::vector<std::uint64_t> identities(prompt_hashes.blocks());
    for (std::size_t b = 0; b < identities.size(); ++b) identities[b] = prompt_hashes.block_identity((b + 1) * block);
    const RequestId id{next_request_++};
    std::vector<BlockId> table;
    const std::size_t shared = e_.blocks.match(identities, (P - 1) / block, table);
    const std::size_t needed = TokenGrid{block}.cells_covering(total);
    if (!e_.blocks.allocate(needed - shared, table)) {
      for (const BlockId b : table) e_.blocks.release(b);
      throw Error(ErrorCode::invalid_argument, "the pool of " + std::to_string(e_.geometry.num_blocks) +
                                                   " blocks cannot hold a request of " + std::to_string(total) + " tokens");
    }
    s.hbm = TokenCount{shared} * block;
    std::optional<SlotId> slot;
    if constexpr (stateful) {
      slot = e_.request_slots.take();
      if (!slot) {  // the previous request's admission never came back (a stranded one)
        for (const BlockId b : table) e_.blocks.release(b);
        throw Error(ErrorCode::io_failure, "the request slot is still held by an earlier request whose ranks never answered");
      }
    }

    std::vector<PrefixHash> prompt_keys;
    for (TokenCount end = chunk; end <= P; end += chunk) prompt_keys.push_back(prompt_hashes.chunk_key(end));
    std::vector<Checkpoint> candidates;
    if constexpr (stateful)
      for (TokenCount b = block; b + 1 <= P; b += block) candidates.push_back(Checkpoint{b, prompt_hashes.state_hash(b)});

    const auto admitted_at = Clock::now();
    const AdmitDecision d = e_.coordinator.admit(AdmitRequest{id, P, s.hbm, prompt_keys, table, candidates, slot});
    Entry* entry = e_.book.open(id, d, std::move(table), slot);
    if (entry == nullptr) throw Error(ErrorCode::io_failure, "request " + std::to_string(id.value) + " is parked already");
    const std::vector<BlockId>& blocks = entry->blocks;  // on the book until its Freed
    TokenCount resume = stateful ? 0 : s.hbm;  // a dense model resumes from its cached KV alone
    if (d.parked) {
      s.load = load_kind_of(d.plan);
      const std::optional<Unpark> u = e_.wait_for_unpark(id);
      s.load_seconds = seconds_since(admitted_at);
      if (!u) {
        s.stranded = true;
        ++stranded_;
        e_.coordinator.teardown(id);
        (void)e_.book.end(id);
      } else {
        s.outcome = u->kind;
        s.state_missed = u->state_missed;
        if (u->tokens > 0) {
          resume = stateful ? u->tokens : std::max(u->tokens, s.hbm);
          s.bytes_loaded = u->salvaged ? bytes_salvaged(d.plan, u->tokens) : bytes_of(d.plan);
          e_.cache.note_uses(prompt_keys, s.hbm, u->tokens,
                             stateful ? std::optional<PrefixHash>(prompt_hashes.state_hash(u->tokens)) : std::nullopt);
        }
      }
    }

    // The sequence at `resume`, rebuilt from the blocks and the request's slot.
    std::optional<Sequence> sequence;
    const auto rebuilding_at = Clock::now();
    if (resume > 0) {
      try {
        sequence.emplace(runner_.resume(resume, e_.pools.blocks, std::span(blocks).first(resume / block), slot_bytes(slot)));
      } catch (const Error& e) {
        if (e.code() != ErrorCode::corrupt_data) throw;
        s.resume_refused = true;
        s.refusal = e.what();
        // The checkpoint it came from is not served again: the next prompt that shares it
        // computes its own.
        if (const std::optional<TokenCount> b = state_boundary(d.plan); b && *b == resume)
          (void)e_.index.forget(prompt_hashes.state_hash(*b));
        resume = 0;
      }
    }
    if (!sequence) sequence.emplace(runner_.start());
    s.rebuild_seconds = seconds_since(rebuilding_at);
    s.resumed_at = resume;
    s.from_hbm = std::min(resume, s.hbm);
    s.from_tier = resume - s.from_hbm;

    // Where the prefill stops: the policy's checkpoints; the generation-end checkpoint when
    // it lies in the prompt's whole blocks; and, when finish must recompute generated
    // tokens, the prompt's last block boundary, whose state that recompute starts from.
    const TokenCount frontier = total - 1;  // the last sampled token is never fed forward
    const TokenCount prompt_floor = TokenGrid{block}.floor(P);
    const TokenCount frontier_floor = TokenGrid{block}.floor(frontier);
    const bool extend = frontier_floor > prompt_floor;
    std::optional<TokenCount> generation_end;
    if constexpr (stateful) {
      generation_end = generation_end_checkpoint(total, PlanGrids{block, chunk}, options_.checkpoints);
      if (generation_end && *generation_end <= resume) generation_end.reset();  // restored, so stored already
    }
    std::vector<std::byte> tail_state;
    if (stateful && extend && prompt_floor == resume && resume > 0) {
      const std::span<const std::byte> restored = slot_bytes(slot);
      tail_state.assign(restored.begin(), restored.end());
    }
    // A snapshot at P itself (a prompt that ends on the grid) is taken after the last
    // prefill: the prefill must end on the prompt's last token to keep its logits.
    auto snapshot_at = [&](TokenCount at, const Sequence& seq) {
      if (generation_end && at == *generation_end) seq.store_state(slot_span(*slot));
      if (stateful && extend && at == prompt_floor) {
        tail_state.resize(runner_.codec().slot_bytes());
        seq.store_state(tail_state);
      }
    };
    std::vector<TokenCount> stops;
    for (const TokenCount b : d.checkpoints)
      if (b > resume && b < P) stops.push_back(b);
    if (generation_end && *generation_end < P) stops.push_back(*generation_end);
    if (stateful && extend && prompt_floor > resume && prompt_floor < P) stops.push_back(prompt_floor);
    std::sort(stops.begin(), stops.end());
    stops.erase(std::unique(stops.begin(), stops.end()), stops.end());
    for (const TokenCount stop : stops) {
      sequence->prefill(prompt.subspan(sequence->position(), stop - sequence->position()), false);
      if (std::find(d.checkpoints.begin(), d.checkpoints.end(), stop) != d.checkpoints.end())
        checkpoint_at(*sequence, Checkpoint{stop, prompt_hashes.state_hash(stop)}, prompt_keys, P);
      snapshot_at(stop, *sequence);
    }
    sequence->prefill(prompt.subspan(sequence->position()), true);
    if (P > resume) snapshot_at(P, *sequence);
    s.ttft_seconds = seconds_since(started);
    s.decoded = sequence->decode(output_tokens);

    // Finish: the blocks this request owns get the KV a prefill computes, then the saves.
    std::vector<llama_token> tokens(prompt.begin(), prompt.end());
    tokens.insert(tokens.end(), s.decoded.tokens.begin(), s.decoded.tokens.end());
    const PrefixHashes hashes(tokens, block);
    const TokenCount own = TokenCount{shared} * block;
    if (prompt_floor > own)
      runner_.codec().store_kv(sequence->full_blob(), own, prompt_floor, e_.pools.blocks, std::span(blocks).subspan(shared));
    sequence.reset();
    if (extend) {
      Sequence tail = prompt_floor == 0 ? runner_.start()
                                        : runner_.resume(prompt_floor, e_.pools.blocks,
                                                         std::span(blocks).first(prompt_floor / block), tail_state);
      if (generation_end && *generation_end > prompt_floor) {
        tail.prefill(std::span(tokens).subspan(prompt_floor, *generation_end - prompt_floor), false);
        tail.store_state(slot_span(*slot));
      }
      tail.prefill(std::span(tokens).subspan(tail.position(), frontier_floor - tail.position()), false);
      const TokenCount from = std::max(prompt_floor, own);
      runner_.codec().store_kv(tail.full_blob(), from, frontier_floor, e_.pools.blocks,
                               std::span(blocks).subspan(from / block));
    }
    e_.connector.begin_step(e_.compute);  // the saves read what the lines above wrote (R13)
    std::vector<PrefixHash> keys;
    for (TokenCount end = chunk; end <= frontier; end += chunk) keys.push_back(hashes.chunk_key(end));
    for (TokenCount b = 0; b < frontier_floor / block; ++b) e_.blocks.publish(blocks[b], hashes.block_identity((b + 1) * block));
    if (!s.stranded) {
      // A cache ledger sees the KV first, from the save watermark up, and the save is cut
      // at the first chunk it does not keep; the checkpoint must stand on a kept chunk.
      const std::size_t kept = e_.cache.keep_chunks(
          keys, static_cast<std::size_t>(e_.coordinator.save_watermark(id) / chunk), keys.size());
      const TokenCount computed = kept == keys.size() ? frontier : static_cast<TokenCount>(kept) * chunk;
      std::optional<Checkpoint> last;
      if (generation_end &&
          e_.cache.keep_checkpoint(keys, *generation_end, hashes.state_hash(*generation_end), P, kept))
        last = Checkpoint{*generation_end, hashes.state_hash(*generation_end)};
      (void)e_.coordinator.finish(FinishRequest{id, computed, keys, blocks, last, slot});
      (void)e_.book.end(id);  // `blocks` goes with the Freed: not used below
    }
    s.checkpoints_sent = e_.coordinator.stats().checkpoints_saved - checkpoints_before;
    if (!settle(options_.wait_for_stores)) s.stranded = true;
    e_.sweep_if_quiet();
    current_prompt_ = {};
    return s;
  }

  /// Waits until every load and save settled, every slot came back and every admission was
  /// freed (or rank_timeout passed); then drains the connector. Call before audit().
  void drain() {
    (void)settle(true);
    e_.connector.drain();
    (void)e_.step_once();
  }

  /// The numbers that must be zero: the host kit's audit of the index, the coordinator,
  /// the book and the pools, and the server's own counts. O(everything) (walks the index);
  /// call after drain().
  [[nodiscard]] ServerAudit audit() const {
    const HostAudit h = e_.audit();
    ServerAudit a;
    a.invariant_violations = h.invariant_violations + server_violations_;
    a.stranded_parked = h.stranded_parked + stranded_;
    a.leaked_blocks = h.leaked_blocks;
    a.leaked_slots = h.leaked_slots + h.held_admissions;
    return a;
  }

  /// Forgets the prefix cache, so the next request finds nothing in "HBM".
  void drop_prefix_cache() { e_.blocks.forget_cached(); }

  /// Sets the hook called before each LoadRequest goes to the rank (empty: none).
  void set_load_hook(LoadHook hook) { load_hook_ = std::move(hook); }

  /// The prompt of the request being served (empty between requests), for a load hook.
  [[nodiscard]] std::span<const llama_token> current_prompt() const noexcept { return current_prompt_; }

  /// The rank's geometry: grids, pools, the model id in every tier key.
  [[nodiscard]] const RankGeometry& geometry() const noexcept { return e_.geometry; }
  /// The runner every sequence of this server runs on.
  [[nodiscard]] const SequenceRunner& runner() const noexcept { return runner_; }
  /// The tier the connector's legs read and write (thread-safe, as every kvfuse Tier).
  [[nodiscard]] T& tier() noexcept { return tier_; }
  /// The index's, coordinator's, pump's and connector's counters, read now (O(1)).
  [[nodiscard]] IndexStats index_stats() const { return e_.index.stats(); }
  [[nodiscard]] CoordinatorStats coordinator_stats() const { return e_.coordinator.stats(); }
  [[nodiscard]] PumpStats pump_stats() const { return e_.pump.stats(); }
  [[nodiscard]] ConnectorStats connector_stats() const { return e_.connector.stats(); }
  /// The cache ledger's counters, when a policy owns the budget (O(1)).
  [[nodiscard]] std::optional<CacheLedgerStats> cache_stats() const {
    if (const CacheLedger* l = e_.cache.ledger()) return l->stats();
    return std::nullopt;
  }
  /// What the cache keeper did (victims erased, swept, healed), O(1).
  [[nodiscard]] CacheKeeperStats cache_keeper_stats() const noexcept { return e_.cache.stats(); }
  /// Bytes of one state entry in the tier (0 for a dense model).
  [[nodiscard]] std::size_t state_entry_bytes() const noexcept {
    if constexpr (stateful) return StateLeg::entry_bytes(e_.geometry);
    else return 0;
  }
  /// The tier key of a KV chunk or a state entry of this server's model and rank.
  [[nodiscard]] TierKey tier_key(PrefixHash hash, EntryKind kind) const noexcept {
    return detail::tier_key_of(e_.geometry, hash, kind);
  }

 private:
  using Clock = std::chrono::steady_clock;
  using Engine = detail::InProcessEngine<T, StateLeg>;
  using Entry = typename Engine::Entry;

  // What a completed load read from the tier: whole chunks (PagedKv gets every chunk that
  // overlaps [hbm, end)) and the state entry.
  std::size_t bytes_of(const LoadPlan& plan) const noexcept {
    const IndexRange chunks = chunk_range(plan, PlanGrids{e_.geometry.block_tokens, e_.geometry.chunk_tokens});
    return chunks.size() * e_.geometry.chunk_bytes() + (state_boundary(plan) ? state_entry_bytes() : 0);
  }

  // A salvaged load kept the plan's chunks below `tokens` (a dense prefix) or a state that
  // a second load brought, not what the plan claimed; count what landed and is used.
  std::size_t bytes_salvaged(const LoadPlan& plan, TokenCount tokens) const noexcept {
    const IndexRange chunks = chunk_range(plan, PlanGrids{e_.geometry.block_tokens, e_.geometry.chunk_tokens});
    const std::uint64_t kept_end = std::min<std::uint64_t>(chunks.last, tokens / e_.geometry.chunk_tokens);
    const std::uint64_t kept = kept_end > chunks.first ? kept_end - chunks.first : 0;
    return kept * e_.geometry.chunk_bytes() + (stateful ? state_entry_bytes() : 0);
  }

  static double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

  std::span<std::byte> slot_span(SlotId s) const noexcept {
    return {e_.pools.slots + std::size_t{s.value} * e_.geometry.slot_bytes, e_.geometry.slot_bytes};
  }
  std::span<const std::byte> slot_bytes(std::optional<SlotId> s) const noexcept {
    if (!s) return {};
    return slot_span(*s);
  }

  // A mid-prefill checkpoint of a prompt of `prompt_tokens` whose chunk keys are `keys`: the
  // state at the sequence's position into a snapshot slot, handed to the coordinator if a
  // cache ledger keeps it.
  void checkpoint_at(const Sequence& sequence, const Checkpoint& c, std::span<const PrefixHash> keys, TokenCount prompt_tokens) {
    (void)e_.cache.offer_checkpoint(keys, c.boundary, c.hash, prompt_tokens, [&] {
      if (e_.snapshots.empty()) (void)e_.pump_until([&] { return !e_.snapshots.empty(); });
      const std::optional<SlotId> snapshot = e_.snapshots.take();
      if (!snapshot) {
        ++server_violations_;  // a snapshot slot never came back within the timeout
        return false;
      }
      sequence.store_state(slot_span(*snapshot));
      e_.connector.begin_step(e_.compute);
      const CheckpointResult r = e_.coordinator.checkpoint(c, *snapshot);
      if (r != CheckpointResult::saved) (void)e_.snapshots.give(*snapshot);
      return r == CheckpointResult::saved || r == CheckpointResult::already_indexed;
    });
  }

  // Every admission on the book was freed; with `stores`, every save stored and every
  // snapshot slot back too.
  bool settle(bool stores) {
    return e_.pump_until([&] {
      if (e_.book.size() > 0) return false;
      if (!stores) return true;
      const IndexStats st = e_.index.stats();
      return st.saves_outstanding == 0 && st.outstanding == 0 && e_.snapshots.taken() == 0;
    });
  }

  const SequenceRunner& runner_;
  T& tier_;
  ServeOptions options_;
  LoadHook load_hook_;
  Engine e_;  // the Coordinator, the host kit and the rank
  std::span<const llama_token> current_prompt_;
  std::uint64_t next_request_ = 1;
  std::uint64_t stranded_ = 0;
  std::uint64_t server_violations_ = 0;
};

/// The server for each of the three models over tier `T`.
template <Tier T>
using DenseServer = Server<T, NoState>;
template <Tier T>
using KimiK3Server = Server<T, RecurrentState<T>>;
template <Tier T>
using DeepSeek4Server = Server<T, SlotState<T>>;

}  // namespace kvfuse::llama
