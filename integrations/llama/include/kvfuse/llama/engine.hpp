// kvfuse/llama/engine.hpp — a llama.cpp engine that offloads its KV and its recurrent state
// through kvfuse, as a serving engine would.
//
// Engine side: kvfuse's Coordinator (planner, checkpoint policy, OffloadIndex, a SingleRank
// completion group and its SettlementPump), a paged block pool with prefix caching (the
// engine's "HBM": blocks of finished requests stay cached, least recently used first) and a
// state slot pool. Rank side: one kvfuse Connector whose legs are the stock PagedKv and the
// model's stock state leg (RecurrentState for kimi-k3, SlotState for deepseek4, none for a
// dense llama) over any kvfuse Tier. The sequence itself runs in llama.cpp
// (SequenceRunner); the codec (blob_codec.hpp) is what makes its KV a set of paged blocks
// and its state a slot, so the connector moves them like any other engine's.
//
// One rank: llama.cpp's CPU backend runs a whole model in one context of one process, so a
// token's KV is never split across ranks. SingleRank is kvfuse's group for that (a record
// settles when it is drained, with no quorum table); world size 1 goes into every tier key.
//
// serve() runs one request: match the prompt's leading blocks in the prefix cache, admit it
// (the planner picks a KV-only, joint or state-only load, or none), wait for the load, rebuild
// the llama.cpp sequence at the claimed boundary from the blocks and the slot, prefill the rest
// in ubatches on the runner's grid — stopping at the boundaries the checkpoint policy asks for
// to snapshot the state into a snapshot slot and hand it to Coordinator::checkpoint — decode,
// and finish: the KV of whole chunks and the generation-end checkpoint are saved. Everything
// it saves is what a prefill from token 0 computes, bit for bit: decode steps run one token at
// a time, which llama.cpp's CPU backend sums in another order than a batched prefill, so
// finish recomputes the generated tokens as a prefill would (from the prompt's last block
// boundary) before it writes their blocks or their checkpoint. A later request that resumes
// from them therefore continues exactly as one computed from token 0 (docs/llama.md).
//
// Threading: an Engine belongs to one thread (the scheduler thread of kvfuse's contract);
// the connector's lanes are its only other threads.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <kvfuse/kvfuse.hpp>
#include <kvfuse/llama/sequence_runner.hpp>
#include <kvfuse/testing/index_consistency.hpp>

namespace kvfuse::llama {

/// How an engine is built. Plain data; the Engine constructor checks it.
struct ServeOptions {
  /// Goes into every tier key: engines that share a tier share entries only under the same
  /// id, so it must name everything that changes the bytes (model_id_for() does).
  std::uint64_t model_id = 0;
  std::uint32_t chunk_tokens = 256;      ///< tokens per tier chunk; a multiple of the runner's block_tokens
  std::uint32_t num_blocks = 64;         ///< the block pool ("HBM"), prefix cache included
  std::uint32_t snapshot_slots = 4;      ///< slots that hold mid-prefill checkpoints while the ranks save them
  TokenCount max_request_tokens = 4096;  ///< the longest prompt + output served (sizes a load's chunk bound)
  CheckpointPolicy checkpoints{};        ///< where stateful requests capture state checkpoints
  /// serve() returns only once every save of the request has stored (or failed): the next
  /// request then sees all of them, so a run's loads do not depend on thread timing.
  bool wait_for_stores = true;
  /// How long serve() waits for the ranks (a load, a release, a store) before it counts the
  /// request as stranded and goes on without it.
  std::chrono::milliseconds rank_timeout{30000};
};

/// The id for ServeOptions::model_id: a hash of what decides a saved byte — the model's
/// architecture and vocabulary, the grids and the runner's ubatch and threads. Any thread.
inline std::uint64_t model_id_for(const SequenceRunner& runner, std::uint32_t chunk_tokens) {
  std::uint64_t h = 0x6b7666757365ULL;
  for (const char c : runner.model().architecture()) h = kvfuse::detail::mix64(h ^ static_cast<unsigned char>(c));
  for (const std::uint64_t v : {std::uint64_t(runner.model().vocab_size()), std::uint64_t(runner.options().block_tokens),
                                std::uint64_t(chunk_tokens), std::uint64_t(runner.options().ubatch_tokens),
                                std::uint64_t(runner.options().threads)})
    h = kvfuse::detail::mix64(h ^ v);
  return h;
}

/// Which load a request parked on, if any.
enum class LoadKind : std::uint8_t { none, kv_only, joint, state_only };

/// Short, stable name of a LoadKind. Any thread.
constexpr std::string_view to_string(LoadKind k) noexcept {
  switch (k) {
    case LoadKind::none: return "none";
    case LoadKind::kv_only: return "kv-only";
    case LoadKind::joint: return "joint";
    case LoadKind::state_only: return "state-only";
  }
  return "unknown";
}

/// What serving one request did and produced.
struct Served {
  Decoded decoded;                 ///< the greedy tokens and the first decode step's logits
  TokenCount prompt_tokens = 0;
  TokenCount hbm = 0;              ///< prompt tokens the prefix cache held at admission
  TokenCount resumed_at = 0;       ///< where the sequence started: 0 = computed from token 0
  TokenCount from_hbm = 0;         ///< of resumed_at: tokens whose KV came from the prefix cache
  TokenCount from_tier = 0;        ///< ... and from the tier
  LoadKind load = LoadKind::none;  ///< the load the request parked on
  std::optional<Resolution> outcome;  ///< how that load ended
  bool state_missed = false;
  std::size_t bytes_loaded = 0;    ///< bytes the load read from the tier (whole chunks, state entry)
  bool resume_refused = false;     ///< llama.cpp (or the runner) refused the restored sequence: recomputed
  std::string refusal;             ///< why, when refused
  std::size_t checkpoints_sent = 0;  ///< mid-prefill and finish checkpoints that went to the ranks
  bool stranded = false;           ///< the ranks did not answer within rank_timeout
  double ttft_seconds = 0;         ///< from serve() to the first token's logits
  double load_seconds = 0;         ///< admission to unpark (0 without a load)
  double rebuild_seconds = 0;      ///< the sequence's context made and, when resumed, its blob rebuilt and set
};

/// What must be zero at the end of a run, read by audit().
struct EngineAudit {
  std::uint64_t invariant_violations = 0;  ///< index and coordinator audits, the full index walk, the engine's own
  std::uint64_t stranded_parked = 0;       ///< requests still parked, or given up waiting for their load
  std::uint64_t leaked_blocks = 0;         ///< blocks still pinned
  std::uint64_t leaked_slots = 0;          ///< request and snapshot slots not back, admissions still held
};

/// The engine's block pool with prefix caching: a block that holds whole tokens of a known
/// prefix stays cached after its request, least recently used first, until a new block is
/// needed. Block ids are the connector's. One thread.
class PrefixCache {
 public:
  explicit PrefixCache(std::uint32_t blocks) : entries_(blocks) {
    for (std::uint32_t b = blocks; b-- > 0;) free_.push_back(b);
  }
  /// Pins the leading cached blocks named by `identities` (at most `limit`), appends them to
  /// `table` and returns how many.
  std::size_t match(std::span<const std::uint64_t> identities, std::size_t limit, std::vector<BlockId>& table) {
    std::size_t n = 0;
    for (; n < std::min(limit, identities.size()); ++n) {
      const auto it = cached_.find(identities[n]);
      if (it == cached_.end()) break;
      Entry& e = entries_[it->second];
      if (e.pins++ == 0) lru_.erase(e.position);
      table.push_back(BlockId{it->second});
    }
    return n;
  }
  /// Appends `n` fresh pinned blocks to `table`, evicting cached ones; false (nothing
  /// taken) when too few are unpinned.
  bool allocate(std::size_t n, std::vector<BlockId>& table) {
    if (free_.size() + lru_.size() < n) return false;
    for (std::size_t i = 0; i < n; ++i) {
      if (free_.empty()) {
        const std::uint32_t victim = lru_.front();
        lru_.pop_front();
        cached_.erase(entries_[victim].identity);
        entries_[victim].cached = false;
        free_.push_back(victim);
      }
      const std::uint32_t b = free_.back();
      free_.pop_back();
      entries_[b].pins = 1;
      table.push_back(BlockId{b});
    }
    return true;
  }
  /// `b` (pinned) now holds the whole tokens `identity` names: later requests may share it.
  void publish(BlockId b, std::uint64_t identity) {
    Entry& e = entries_[b.value];
    if (e.cached || cached_.contains(identity)) return;
    e.cached = true;
    e.identity = identity;
    cached_.emplace(identity, b.value);
  }
  /// Unpins `b`; a published block stays cached once nobody pins it.
  void release(BlockId b) {
    Entry& e = entries_[b.value];
    if (--e.pins > 0) return;
    if (e.cached) e.position = lru_.insert(lru_.end(), b.value);
    else free_.push_back(b.value);
  }
  /// Forgets every unpinned cached block (they become free).
  void drop_cached() {
    for (const std::uint32_t b : lru_) {
      cached_.erase(entries_[b].identity);
      entries_[b].cached = false;
      free_.push_back(b);
    }
    lru_.clear();
  }
  /// Blocks some request pins now.
  [[nodiscard]] std::size_t pinned() const {
    return static_cast<std::size_t>(std::count_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.pins > 0; }));
  }
  /// Blocks in the pool.
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }

 private:
  struct Entry {
    std::uint32_t pins = 0;
    bool cached = false;
    std::uint64_t identity = 0;
    std::list<std::uint32_t>::iterator position;
  };
  std::vector<Entry> entries_;
  std::vector<std::uint32_t> free_;
  std::list<std::uint32_t> lru_;
  std::unordered_map<std::uint64_t, std::uint32_t> cached_;
};

/// Content hashes of a token sequence's prefixes at every block boundary: equal hashes mean
/// equal tokens, which is what lets the tier and the prefix cache share across requests.
/// The tier's chunk keys, the state checkpoints' hashes and the cached blocks' identities
/// are three salts of the same prefix hash.
class PrefixHashes {
 public:
  PrefixHashes(std::span<const llama_token> tokens, std::uint32_t block_tokens) : block_tokens_(block_tokens) {
    std::uint64_t h = 0x7072656669780aULL;
    at_.push_back(h);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      h = kvfuse::detail::mix64(h ^ (static_cast<std::uint64_t>(static_cast<std::uint32_t>(tokens[i])) + 0x9e3779b97f4a7c15ULL));
      if ((i + 1) % block_tokens == 0) at_.push_back(h);
    }
  }
  /// The hash of tokens [0, boundary), boundary on the block grid and within the tokens.
  [[nodiscard]] std::uint64_t at(TokenCount boundary) const { return at_.at(boundary / block_tokens_); }
  /// The tier key of the chunk that ends at `end`.
  [[nodiscard]] PrefixHash chunk_key(TokenCount end) const { return PrefixHash{kvfuse::detail::mix64(at(end) ^ 0x6b76ULL)}; }
  /// The hash a state checkpoint at `boundary` is indexed and stored under.
  [[nodiscard]] PrefixHash state_hash(TokenCount boundary) const { return PrefixHash{kvfuse::detail::mix64(at(boundary) ^ 0x7374ULL)}; }
  /// The prefix-cache identity of the block that ends at `end`.
  [[nodiscard]] std::uint64_t block_identity(TokenCount end) const { return kvfuse::detail::mix64(at(end) ^ 0x626cULL); }
  /// Whole blocks covered.
  [[nodiscard]] std::size_t blocks() const noexcept { return at_.size() - 1; }

 private:
  std::uint32_t block_tokens_;
  std::vector<std::uint64_t> at_;
};

/// Computes `prompt` from token 0 in a fresh context and decodes `output_tokens`: what a
/// request gets with offload off. Any thread (the runner's start() is); throws what the
/// runner throws.
inline Served compute_from_scratch(const SequenceRunner& runner, std::span<const llama_token> prompt, std::size_t output_tokens) {
  const auto started = std::chrono::steady_clock::now();
  Served s;
  s.prompt_tokens = prompt.size();
  Sequence sequence = runner.start();
  sequence.prefill(prompt, true);
  s.ttft_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  s.decoded = sequence.decode(output_tokens);
  return s;
}

/// One llama.cpp engine over kvfuse: `T` is the tier every leg reads and writes, `StateLeg`
/// the model's state leg (NoState, RecurrentState<T>, SlotState<T>). One thread.
template <Tier T, class StateLeg>
class Engine {
 public:
  using Conn = Connector<PagedKv<T>, StateLeg, SingleRank, HostRuntime>;
  static constexpr bool stateful = Conn::has_state;
  static constexpr StateLayout layout = Conn::layout;

  /// Called with each LoadRequest just before it goes to the rank (the program's controls
  /// use it to tamper with the entry the load is about to read).
  using LoadHook = std::function<void(const LoadRequest&)>;

  /// An engine for `runner`'s model over `tier` (both must outlive it). Throws
  /// Error(invalid_argument) naming the value when the state leg does not fit the model's
  /// blob family, the grids disagree, or the pool cannot hold the longest request.
  Engine(const SequenceRunner& runner, T& tier, ServeOptions options)
      : runner_(runner),
        tier_(tier),
        options_(checked(runner, options)),
        geometry_(make_geometry(runner, options_)),
        pools_(runtime_, geometry_),
        group_(SingleRankOptions{Conn::lane_count, 4096, {}}),
        index_(OffloadIndexOptions{.hash_capacity = std::size_t{1} << 16, .slot_count = geometry_.num_slots}),
        pump_(group_, index_),
        transport_{this},
        lookup_{this},
        coordinator_(CoordinatorOptions{layout, PlanGrids{geometry_.block_tokens, geometry_.chunk_tokens}, 0, 64,
                                        options_.checkpoints},
                     index_, pump_, transport_, lookup_),
        connector_(geometry_, runtime_, DeviceMemory{pools_.blocks, pools_.slots}, PagedKv<T>(tier), make_state_leg(tier),
                   group_),
        cache_(geometry_.num_blocks),
        compute_(runtime_.make_stream(HostStreamMode::inline_calls)) {
    if constexpr (stateful)
      for (std::uint32_t s = geometry_.num_slots; s-- > 1;) free_snapshots_.push_back(SlotId{s});
  }
  ~Engine() { connector_.drain(); }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Indexes every state checkpoint the tier already holds for this model (a tier that
  /// outlived the engine that filled it: a disk directory, a Redis server), as a restarted
  /// engine does (R18). Returns how many. Only where the tier lists its keys.
  std::size_t reseed_from_tier()
    requires requires(T& t) { t.keys(EntryKind::state); }
  {
    if constexpr (!stateful) return 0;
    const std::vector<std::vector<TierKey>> keys{tier_.keys(EntryKind::state)};
    return reseed_state_hashes(index_, keys, geometry_.model, geometry_.world_size);
  }

  /// Serves one request: `prompt` (at least one token), then `output_tokens` greedy tokens
  /// (at least one). Returns what it produced and how. Blocks while the ranks load and
  /// save; throws Error for a request the engine cannot hold and what llama.cpp's runner
  /// throws (a restored sequence llama.cpp refuses is not thrown: it is recomputed from
  /// token 0, its checkpoint is forgotten by the index, and Served::resume_refused says so).
  Served serve(std::span<const llama_token> prompt, std::size_t output_tokens) {
    const auto started = Clock::now();
    const TokenCount P = prompt.size(), total = P + output_tokens;
    if (P == 0 || output_tokens == 0 || total > options_.max_request_tokens)
      throw Error(ErrorCode::invalid_argument, "a request needs a prompt, an output and at most " +
                                                   std::to_string(options_.max_request_tokens) + " tokens, got " +
                                                   std::to_string(P) + " + " + std::to_string(output_tokens));
    const std::uint32_t block = geometry_.block_tokens, chunk = geometry_.chunk_tokens;
    current_prompt_ = prompt;
    const std::uint64_t checkpoints_before = coordinator_.stats().checkpoints_saved;
    Served s;
    s.prompt_tokens = P;

    // The block table: the prompt's leading cached blocks (never the one holding token P - 1,
    // which the request must compute), then fresh ones for the rest of the request.
    const PrefixHashes prompt_hashes(prompt, block);
    std::vector<std::uint64_t> identities(prompt_hashes.blocks());
    for (std::size_t b = 0; b < identities.size(); ++b) identities[b] = prompt_hashes.block_identity((b + 1) * block);
    Admission a;
    a.id = RequestId{next_request_++};
    const std::size_t shared = cache_.match(identities, (P - 1) / block, a.table);
    const std::size_t needed = TokenGrid{block}.cells_covering(total);
    if (!cache_.allocate(needed - shared, a.table)) {
      for (const BlockId b : a.table) cache_.release(b);
      throw Error(ErrorCode::invalid_argument, "the pool of " + std::to_string(geometry_.num_blocks) +
                                                   " blocks cannot hold a request of " + std::to_string(total) + " tokens");
    }
    a.shared = shared;
    s.hbm = TokenCount{shared} * block;

    std::vector<PrefixHash> prompt_keys;
    for (TokenCount end = chunk; end <= P; end += chunk) prompt_keys.push_back(prompt_hashes.chunk_key(end));
    std::vector<Checkpoint> candidates;
    if constexpr (stateful)
      for (TokenCount b = block; b + 1 <= P; b += block) candidates.push_back(Checkpoint{b, prompt_hashes.state_hash(b)});
    const std::optional<SlotId> slot = stateful ? std::optional<SlotId>(request_slot) : std::nullopt;

    const auto admitted_at = Clock::now();
    const AdmitDecision d = coordinator_.admit(AdmitRequest{a.id, P, s.hbm, prompt_keys, a.table, candidates, slot});
    a.admission = d.admission;
    TokenCount resume = stateful ? 0 : s.hbm;  // a dense model resumes from its cached KV alone
    if (d.parked) {
      s.load = kind_of(d.plan);
      const std::optional<Unpark> u = wait_for_unpark(a.id);
      s.load_seconds = seconds_since(admitted_at);
      if (!u) {
        s.stranded = true;
        ++stranded_;
        coordinator_.teardown(a.id);
      } else {
        s.outcome = u->kind;
        s.state_missed = u->state_missed;
        if (u->tokens > 0) {
          resume = stateful ? u->tokens : std::max(u->tokens, s.hbm);
          s.bytes_loaded = bytes_of(d.plan);
        }
      }
    }

    // The sequence at `resume`, rebuilt from the blocks and the request's slot.
    std::optional<Sequence> sequence;
    const auto rebuilding_at = Clock::now();
    if (resume > 0) {
      try {
        sequence.emplace(runner_.resume(resume, pools_.blocks, std::span(a.table).first(resume / block), slot_bytes(slot)));
      } catch (const Error& e) {
        if (e.code() != ErrorCode::corrupt_data) throw;
        s.resume_refused = true;
        s.refusal = e.what();
        // The checkpoint it came from is not served again: the next prompt that shares it
        // computes its own.
        if (const std::optional<TokenCount> b = state_boundary(d.plan); b && *b == resume)
          (void)index_.forget(prompt_hashes.state_hash(*b));
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
      if (generation_end && at == *generation_end) seq.store_state(slot_span(request_slot));
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
        checkpoint_at(a.id, *sequence, Checkpoint{stop, prompt_hashes.state_hash(stop)});
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
      runner_.codec().store_kv(sequence->full_blob(), own, prompt_floor, pools_.blocks, std::span(a.table).subspan(shared));
    sequence.reset();
    if (extend) {
      Sequence tail = prompt_floor == 0 ? runner_.start()
                                        : runner_.resume(prompt_floor, pools_.blocks,
                                                         std::span(a.table).first(prompt_floor / block), tail_state);
      if (generation_end && *generation_end > prompt_floor) {
        tail.prefill(std::span(tokens).subspan(prompt_floor, *generation_end - prompt_floor), false);
        tail.store_state(slot_span(request_slot));
      }
      tail.prefill(std::span(tokens).subspan(tail.position(), frontier_floor - tail.position()), false);
      const TokenCount from = std::max(prompt_floor, own);
      runner_.codec().store_kv(tail.full_blob(), from, frontier_floor, pools_.blocks,
                               std::span(a.table).subspan(from / block));
    }
    connector_.begin_step(compute_);  // the saves read what the lines above wrote (R13)
    std::vector<PrefixHash> keys;
    for (TokenCount end = chunk; end <= frontier; end += chunk) keys.push_back(hashes.chunk_key(end));
    std::optional<Checkpoint> last;
    if (generation_end) last = Checkpoint{*generation_end, hashes.state_hash(*generation_end)};
    if (!s.stranded) (void)coordinator_.finish(FinishRequest{a.id, frontier, keys, a.table, last, slot});
    s.checkpoints_sent = coordinator_.stats().checkpoints_saved - checkpoints_before;
    for (TokenCount b = 0; b < frontier_floor / block; ++b) cache_.publish(a.table[b], hashes.block_identity((b + 1) * block));
    waiting_.push_back(std::move(a));
    if (!settle(options_.wait_for_stores)) s.stranded = true;
    current_prompt_ = {};
    return s;
  }

  /// Waits until every load and save settled, every slot came back and every admission was
  /// freed (or rank_timeout passed); then drains the connector. Call before audit().
  void drain() {
    (void)settle(true);
    connector_.drain();
    (void)step_once();
  }

  /// The numbers that must be zero. O(everything) (walks the index); call after drain().
  [[nodiscard]] EngineAudit audit() const {
    EngineAudit a;
    const IndexStats is = index_.stats();
    const CoordinatorStats cs = coordinator_.stats();
    const auto walk = kvfuse::testing::check_consistency(index_);
    a.invariant_violations = is.invariant_violations + cs.invariant_violations + engine_violations_ + (walk.ok ? 0 : 1);
    a.stranded_parked = cs.waiting_now + stranded_;
    a.leaked_blocks = cache_.pinned();
    const std::uint64_t snapshots = stateful ? geometry_.num_slots - 1 : 0;
    a.leaked_slots = (snapshots - free_snapshots_.size()) + waiting_.size() + cs.holding_now;
    return a;
  }

  /// Forgets the prefix cache's unpinned blocks, so the next request finds nothing in "HBM".
  void drop_prefix_cache() { cache_.drop_cached(); }

  /// Sets the hook called before each LoadRequest goes to the rank (empty: none).
  void set_load_hook(LoadHook hook) { load_hook_ = std::move(hook); }

  /// The prompt of the request being served (empty between requests), for a load hook.
  [[nodiscard]] std::span<const llama_token> current_prompt() const noexcept { return current_prompt_; }

  /// The rank's geometry: grids, pools, the model id in every tier key.
  [[nodiscard]] const RankGeometry& geometry() const noexcept { return geometry_; }
  /// The runner every sequence of this engine runs on.
  [[nodiscard]] const SequenceRunner& runner() const noexcept { return runner_; }
  /// The tier the connector's legs read and write (thread-safe, as every kvfuse Tier).
  [[nodiscard]] T& tier() noexcept { return tier_; }
  /// The index's, coordinator's, pump's and connector's counters, read now (O(1)).
  [[nodiscard]] IndexStats index_stats() const { return index_.stats(); }
  [[nodiscard]] CoordinatorStats coordinator_stats() const { return coordinator_.stats(); }
  [[nodiscard]] PumpStats pump_stats() const { return pump_.stats(); }
  [[nodiscard]] ConnectorStats connector_stats() const { return connector_.stats(); }
  /// Bytes of one state entry in the tier (0 for a dense model).
  [[nodiscard]] std::size_t state_entry_bytes() const noexcept {
    if constexpr (stateful) return StateLeg::entry_bytes(geometry_);
    else return 0;
  }
  /// The tier key of a KV chunk or a state entry of this engine's model and rank.
  [[nodiscard]] TierKey tier_key(PrefixHash hash, EntryKind kind) const noexcept {
    return TierKey{geometry_.model, hash, geometry_.world_size, geometry_.rank, kind};
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr SlotId request_slot{0};  // requests run one at a time: one slot, then the snapshots

  struct Admission {
    RequestId id;
    AdmissionId admission;
    std::vector<BlockId> table;
    std::size_t shared = 0;
  };

  // The device pools: host memory from the runtime, freed after the connector is gone.
  struct Pools {
    HostRuntime& runtime;
    std::byte* blocks;
    std::byte* slots;
    Pools(HostRuntime& rt, const RankGeometry& g)
        : runtime(rt),
          blocks(static_cast<std::byte*>(rt.allocate_device(std::size_t{g.num_blocks} * g.block_bytes()))),
          slots(static_cast<std::byte*>(rt.allocate_device(std::max<std::size_t>(1, std::size_t{g.num_slots} * g.slot_bytes)))) {}
    ~Pools() {
      runtime.free_device(blocks);
      runtime.free_device(slots);
    }
    Pools(const Pools&) = delete;
    Pools& operator=(const Pools&) = delete;
  };

  struct Transport {
    Engine* e;
    bool send(const LoadRequest& r) {
      if (e->load_hook_) e->load_hook_(r);
      e->connector_.load(r);
      return true;
    }
    bool send(const KvSave& s) {
      e->connector_.save_kv(s);
      return true;
    }
    bool send(const StateSave& s) {
      if constexpr (stateful) e->connector_.save_state(s);
      return stateful;
    }
  };
  // The tier's answer: how many leading chunks it holds (asked of the one rank's tier).
  struct Lookup {
    Engine* e;
    std::size_t operator()(std::span<const PrefixHash> keys) {
      std::size_t n = 0;
      while (n < keys.size() && e->tier_.contains(e->tier_key(keys[n], EntryKind::kv_chunk))) ++n;
      return n;
    }
  };

  static ServeOptions checked(const SequenceRunner& runner, const ServeOptions& o) {
    const BlobFamily family = runner.codec().layout().family;
    const StateLayout wanted = family == BlobFamily::attention ? StateLayout::none
                               : family == BlobFamily::hybrid  ? StateLayout::k3_recurrent
                                                               : StateLayout::dsv4_slot;
    if (wanted != layout)
      throw Error(ErrorCode::invalid_argument, "the model '" + runner.model().architecture() + "' needs the state layout " +
                                                   std::string(to_string(wanted)) + ", this engine's state leg plans " +
                                                   std::string(to_string(layout)));
    if (o.chunk_tokens == 0 || o.chunk_tokens % runner.options().block_tokens != 0)
      throw Error(ErrorCode::invalid_argument, "chunk_tokens must be a positive multiple of the runner's block_tokens (" +
                                                   std::to_string(runner.options().block_tokens) + "), got " +
                                                   std::to_string(o.chunk_tokens));
    if (o.max_request_tokens > runner.options().context_tokens)
      throw Error(ErrorCode::invalid_argument, "max_request_tokens must fit the runner's context of " +
                                                   std::to_string(runner.options().context_tokens) + " tokens, got " +
                                                   std::to_string(o.max_request_tokens));
    const TokenCount longest = TokenGrid{runner.options().block_tokens}.cells_covering(o.max_request_tokens);
    if (o.num_blocks < longest)
      throw Error(ErrorCode::invalid_argument, "num_blocks must hold the longest request (" + std::to_string(longest) +
                                                   " blocks), got " + std::to_string(o.num_blocks));
    if (stateful && o.snapshot_slots == 0) throw Error(ErrorCode::invalid_argument, "snapshot_slots must be > 0, got 0");
    return o;
  }

  static RankGeometry make_geometry(const SequenceRunner& runner, const ServeOptions& o) {
    RankGeometry g;
    g.model = o.model_id;
    g.rank = 0;
    g.world_size = 1;
    g.block_tokens = runner.options().block_tokens;
    g.chunk_tokens = o.chunk_tokens;
    g.kv_bytes_per_token = runner.codec().kv_bytes_per_token();
    g.num_blocks = o.num_blocks;
    g.num_slots = stateful ? 1 + o.snapshot_slots : 0;
    g.slot_bytes = stateful ? runner.codec().slot_bytes() : 0;
    g.max_chunks_per_load = static_cast<std::uint32_t>(TokenGrid{o.chunk_tokens}.cells_covering(o.max_request_tokens) + 1);
    return g;
  }

  static StateLeg make_state_leg(T& tier) {
    if constexpr (stateful) return StateLeg(tier);
    else return StateLeg{};
  }

  static LoadKind kind_of(const LoadPlan& plan) noexcept {
    if (std::holds_alternative<KvOnlyLoad>(plan)) return LoadKind::kv_only;
    if (std::holds_alternative<JointLoad>(plan)) return LoadKind::joint;
    if (std::holds_alternative<StateOnlyLoad>(plan)) return LoadKind::state_only;
    return LoadKind::none;
  }

  // What a completed load read from the tier: whole chunks (PagedKv gets every chunk that
  // overlaps [hbm, end)) and the state entry.
  std::size_t bytes_of(const LoadPlan& plan) const noexcept {
    const IndexRange chunks = chunk_range(plan, PlanGrids{geometry_.block_tokens, geometry_.chunk_tokens});
    return chunks.size() * geometry_.chunk_bytes() + (state_boundary(plan) ? state_entry_bytes() : 0);
  }

  static double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

  std::span<std::byte> slot_span(SlotId s) const noexcept {
    return {pools_.slots + std::size_t{s.value} * geometry_.slot_bytes, geometry_.slot_bytes};
  }
  std::span<const std::byte> slot_bytes(std::optional<SlotId> s) const noexcept {
    if (!s) return {};
    return slot_span(*s);
  }

  // A mid-prefill checkpoint: the state at the sequence's position into a snapshot slot,
  // handed to the coordinator.
  void checkpoint_at(RequestId id, const Sequence& sequence, const Checkpoint& c) {
    if (free_snapshots_.empty()) (void)pump_until([&] { return !free_snapshots_.empty(); });
    if (free_snapshots_.empty()) {
      ++engine_violations_;  // a snapshot slot never came back within the timeout
      return;
    }
    const SlotId snapshot = free_snapshots_.back();
    free_snapshots_.pop_back();
    sequence.store_state(slot_span(snapshot));
    connector_.begin_step(compute_);
    const CheckpointResult r = coordinator_.checkpoint(id, c, snapshot);
    if (r != CheckpointResult::saved) free_snapshots_.push_back(snapshot);
  }

  std::optional<Unpark> wait_for_unpark(RequestId id) {
    std::optional<Unpark> got;
    unpark_watch_ = id;
    unparked_.reset();
    (void)pump_until([&] { return unparked_.has_value(); });
    got = unparked_;
    unparked_.reset();
    unpark_watch_.reset();
    return got;
  }

  // Every admission waiting for its Freed is freed; with `stores`, every save stored too.
  bool settle(bool stores) {
    return pump_until([&] {
      if (!waiting_.empty()) return false;
      if (!stores) return true;
      const IndexStats st = index_.stats();
      const std::size_t snapshots = stateful ? geometry_.num_slots - 1 : 0;
      return st.saves_outstanding == 0 && st.outstanding == 0 && free_snapshots_.size() == snapshots;
    });
  }

  template <class Done>
  bool pump_until(Done done) {
    const auto deadline = Clock::now() + options_.rank_timeout;
    while (!done()) {
      if (Clock::now() > deadline) return false;
      if (!step_once()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
  }

  // One coordinator step; true when it brought anything.
  bool step_once() {
    const auto r = coordinator_.step();
    for (const Unpark& u : r.unparked) {
      if (unpark_watch_ && u.request == *unpark_watch_ && !unparked_) unparked_ = u;
      else ++engine_violations_;  // an unpark nobody waits for
    }
    for (const Freed& f : r.freed) {
      const auto it = std::find_if(waiting_.begin(), waiting_.end(),
                                   [&](const Admission& a) { return a.id == f.request && a.admission == f.admission; });
      if (it == waiting_.end()) {
        ++engine_violations_;  // a Freed for an admission that is not done, or twice
        continue;
      }
      for (const BlockId b : it->table) cache_.release(b);
      waiting_.erase(it);
    }
    for (const SlotId snapshot : r.snapshots) free_snapshots_.push_back(snapshot);
    return r.records > 0 || !r.unparked.empty() || !r.freed.empty() || !r.snapshots.empty();
  }

  const SequenceRunner& runner_;
  T& tier_;
  ServeOptions options_;
  HostRuntime runtime_;
  RankGeometry geometry_;
  Pools pools_;
  SingleRank group_;
  OffloadIndex<> index_;
  SettlementPump<SingleRank, OffloadIndex<>> pump_;
  Transport transport_;
  Lookup lookup_;
  Coordinator<SingleRank, Transport, Lookup> coordinator_;
  Conn connector_;
  PrefixCache cache_;
  HostRuntime::Stream compute_;
  std::vector<SlotId> free_snapshots_;
  std::vector<Admission> waiting_;  // finished or torn down, waiting for their Freed
  std::optional<RequestId> unpark_watch_;
  std::optional<Unpark> unparked_;
  LoadHook load_hook_;
  std::span<const llama_token> current_prompt_;
  std::uint64_t next_request_ = 1;
  std::uint64_t stranded_ = 0;
  std::uint64_t engine_violations_ = 0;
};

/// The engine for each of the three models over tier `T`.
template <Tier T>
using DenseEngine = Engine<T, NoState>;
template <Tier T>
using KimiK3Engine = Engine<T, RecurrentState<T>>;
template <Tier T>
using DeepSeek4Engine = Engine<T, SlotState<T>>;

}  // namespace kvfuse::llama
