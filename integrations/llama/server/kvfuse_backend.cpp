// kvfuse_backend.cpp — kvfuse as llama-server's prompt cache backend: the implementation of
// server-prompt-cache-backend.h (the interface prompt_cache_backend.patch adds to
// llama-server) over a SlotCache (slot_cache.hpp) and the tiers the flags ask for
// (tier_stack.hpp). The patched server calls it on its main loop; docs/llama-server.md says
// what it does for the user, and the patch's header why each call sits where it does.
//
// What a slot's cells are worth is tracked here: a slot's leading cells are "clean" when
// they hold what a prefill from token 0 on the ubatch grid computes (a restore from kvfuse,
// or a prefill that started on the grid from clean cells). Only clean cells are saved, and
// only those of whole chunks; a prompt that reuses the slot's own cells beyond that (stock's
// token-granular reuse, which may include a reply computed one token at a time) is served as
// stock serves it, and saved only up to where it was clean.
#include "server-prompt-cache-backend.h"

#include "common.h"
#include "gguf.h"
#include "llama.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "backend_flags.hpp"
#include "slot_cache.hpp"
#include "stream_blob.hpp"
#include "tier_stack.hpp"

namespace kvfuse::llama_server {
namespace {

using llama::BlobFamily;

/// One SlotCache of the model's family, behind one interface.
struct Engine {
  virtual ~Engine() = default;
  virtual Restore begin(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount limit) = 0;
  virtual void refused(std::uint32_t slot) = 0;
  virtual TokenCount held_tokens(std::span<const llama_token> prompt, TokenCount limit) const = 0;
  virtual std::vector<TokenCount> stops(std::uint32_t slot) = 0;
  virtual void checkpoint(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount at,
                          std::span<const std::uint8_t> partial) = 0;
  virtual void finish(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount clean,
                      std::span<const std::uint8_t> full) = 0;
  virtual std::size_t reseed() = 0;
  virtual bool tamper(std::span<const llama_token> prompt, bool state) = 0;
  virtual SlotCacheCounters counters() const = 0;
  virtual IndexStats index_stats() const = 0;
  virtual CoordinatorStats coordinator_stats() const = 0;
  virtual HostAudit audit() const = 0;
};

template <class Leg>
struct EngineOf final : Engine {
  SlotCache<TierStack, Leg> cache;
  EngineOf(const llama::SequenceCodec& codec, TierStack& tier, const SlotCacheOptions& o) : cache(codec, tier, o) {}
  Restore begin(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount limit) override {
    return cache.begin(slot, prompt, limit);
  }
  void refused(std::uint32_t slot) override { cache.refused(slot); }
  TokenCount held_tokens(std::span<const llama_token> prompt, TokenCount limit) const override {
    return cache.held_tokens(prompt, limit);
  }
  std::vector<TokenCount> stops(std::uint32_t slot) override {
    const auto s = cache.stops(slot);
    return {s.begin(), s.end()};
  }
  void checkpoint(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount at,
                  std::span<const std::uint8_t> partial) override {
    cache.checkpoint(slot, prompt, at, partial);
  }
  void finish(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount clean,
              std::span<const std::uint8_t> full) override {
    cache.finish(slot, prompt, clean, full);
  }
  std::size_t reseed() override { return cache.reseed_from_tier(); }
  bool tamper(std::span<const llama_token> prompt, bool state) override {
    return state ? cache.tamper_state(prompt) : cache.tamper_kv(prompt);
  }
  SlotCacheCounters counters() const override { return cache.counters(); }
  IndexStats index_stats() const override { return cache.index_stats(); }
  CoordinatorStats coordinator_stats() const override { return cache.coordinator_stats(); }
  HostAudit audit() const override { return cache.audit(); }
};

/// What the backend knows about one slot.
struct SlotProgress {
  TokenCount clean = 0;        ///< leading cells that are what a prefill from token 0 computes
  TokenCount restored = 0;     ///< this task: tokens restored from kvfuse (0: none)
  TokenCount prompt = 0;       ///< this task's prompt length
  TokenCount tail = 0;         ///< the server's own split of the prompt's last tokens
  std::optional<TokenCount> start;  ///< where this task's prefill started (its first computed())
  bool grid = false;           ///< the prefill started on the grid from clean cells
  bool open = false;           ///< a task between load() and its prompt's end
};

std::uint64_t mix_in(std::uint64_t h, std::uint64_t v) { return mix64(h ^ (v + 0x9e3779b97f4a7c15ULL)); }

std::string architecture_of(const std::string& path) {
  gguf_init_params p{};
  p.no_alloc = true;
  p.ctx = nullptr;
  gguf_context* g = gguf_init_from_file(path.c_str(), p);
  if (g == nullptr) return {};
  std::string arch;
  const int64_t k = gguf_find_key(g, "general.architecture");
  if (k >= 0) arch = gguf_get_val_str(g, k);
  gguf_free(g);
  return arch;
}

void say(const std::string& message) { std::fprintf(stderr, "kvfuse-llama-server: %s\n", message.c_str()); }

class KvfuseBackend final : public server_prompt_cache_backend {
 public:
  explicit KvfuseBackend(BackendFlags flags) : flags_(std::move(flags)) {
    // The tests' controls (check_llama_server.py): tamper with the tier before one load.
    if (const char* c = std::getenv("KVFUSE_LLAMA_SERVER_CONTROL")) control_ = c;
    if (!control_.empty() && control_ != "flip-kv" && control_ != "wrong-state")
      throw Error(ErrorCode::invalid_argument, "KVFUSE_LLAMA_SERVER_CONTROL=" + control_ + ": not flip-kv or wrong-state");
    if (flags_.checkpoints) policy_ = checkpoint_policy_named(*flags_.checkpoints);
    TierStackOptions o;
    if (flags_.memory_bytes) o.memory_bytes = *flags_.memory_bytes;
    o.disk = flags_.disk;
    o.disk_bytes = flags_.disk_bytes;
    o.redis = flags_.redis;
    memory_given_ = flags_.memory_bytes.has_value();
    tier_options_ = o;
  }

  bool configure(common_params& params) override {
    // The memory tier takes stock's --cache-ram budget when --kvfuse-memory is not given.
    if (!memory_given_ && params.cache_ram_mib > 0) tier_options_.memory_bytes = std::size_t(params.cache_ram_mib) << 20;
    try {
      tiers_ = std::make_unique<TierStack>(tier_options_);  // a bad directory or a Redis that does not answer: exit 1 now
    } catch (const Error& e) {
      say(e.what());
      return false;
    }
    const std::string arch = architecture_of(params.model.path);
    if (arch.empty()) {
      say("the model '" + params.model.path + "' has no readable general.architecture; serving without kvfuse");
      return true;
    }
    try {
      family_ = llama::family_of_architecture(arch);
    } catch (const Error& e) {
      say(std::string("--kvfuse-*: ") + e.what());
      return false;
    }
    known_ = true;
    params.cache_ram_mib = 0;  // kvfuse is the prompt cache: stock's own is off
    if (params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_AUTO) params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    else if (params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_ENABLED)
      say("warning: -fa on: restores are not bit for bit the same as a prefill from token 0 (docs/llama-server.md)");
    const std::uint32_t ubatch = static_cast<std::uint32_t>(std::max(1, std::min(params.n_ubatch, params.n_batch)));
    if (params.n_batch % static_cast<std::int32_t>(ubatch) != 0) {
      say("-b " + std::to_string(params.n_batch) + ": kvfuse needs the batch to be a multiple of the ubatch (-ub " +
          std::to_string(ubatch) + "), or a prompt's second batch runs other ubatches than a prefill from token 0");
      return false;
    }
    const std::uint32_t granule = family_ == BlobFamily::deepseek4 ? 128 : 1;
    const std::uint32_t grid = std::lcm(ubatch, granule);
    if (flags_.chunk_tokens) {
      if (*flags_.chunk_tokens % grid != 0) {
        say("--kvfuse-chunk-tokens " + std::to_string(*flags_.chunk_tokens) + ": must be a multiple of " +
            std::to_string(grid) + " (the ubatch, -ub " + std::to_string(ubatch) + (granule > 1 ? ", and " + arch + "'s granule of 128" : std::string()) +
            ") so that a restored prompt runs the same ubatches as one prefilled from token 0");
        return false;
      }
      chunk_ = *flags_.chunk_tokens;
    } else {
      // The grid itself (at least 64 tokens): the finer the chunks, the closer a restore
      // gets to the prompt's end (with -ub 64, 64-token chunks reuse a fifth more than
      // 256-token ones on the checks' conversations), at one tier entry per chunk.
      chunk_ = grid * std::max<std::uint32_t>(1, (64 + grid - 1) / grid);
    }
    ubatch_ = ubatch;
    return true;
  }

  bool attach(llama_context* ctx, const common_params& params) override {
    ctx_ = ctx;
    if (!known_) return true;
    const llama_model* model = llama_get_model(ctx);
    try {
      learn(params, model);
    } catch (const Error& e) {
      say(std::string("the model's state blob is not what kvfuse reads: ") + e.what());
      return false;
    }
    const std::uint32_t slots = llama_n_seq_max(ctx);
    unified_ = params.kv_unified || slots == 1;
    if (slots > 1 && family_ == BlobFamily::deepseek4) {
      // With several sequences its blob carries every stream (or, unified, state rows the
      // one-sequence layout does not have); the codec reads the one-sequence form only.
      say("deepseek4 with --parallel " + std::to_string(slots) + ": kvfuse reads its state blob for one slot only; serving without kvfuse");
      return true;
    }
    SlotCacheOptions o;
    o.chunk_tokens = chunk_;
    o.slots = slots;
    o.max_prompt_tokens = llama_n_ctx_seq(ctx);
    o.checkpoints = policy_;
    o.model_id = model_id(params, model);
    if (family_ == BlobFamily::deepseek4) {
      // Measured, not derived: on the tiny deepseek4 at -ub 64 a resume is bit for bit at
      // 128, 384 and 640 tokens and not at 256 or 512 (in a fresh context and in a slot
      // alike), so its state boundaries are the odd multiples of 128. The likely cause is
      // where llama.cpp puts the restored sliding-window cells (from cell 0) against where a
      // prefill from token 0 put them (docs/llama-server.md#deepseek4).
      o.state_period = 256;
      o.state_phase = 128;
    }
    try {
      if (family_ == BlobFamily::attention) engine_ = std::make_unique<EngineOf<NoState>>(*codec_, *tiers_, o);
      else if (family_ == BlobFamily::hybrid) engine_ = std::make_unique<EngineOf<RecurrentState<TierStack>>>(*codec_, *tiers_, o);
      else engine_ = std::make_unique<EngineOf<SlotState<TierStack>>>(*codec_, *tiers_, o);
      reseeded_ = engine_->reseed();
    } catch (const Error& e) {
      say(e.what());
      return false;
    }
    slots_.assign(slots, SlotProgress{});
    std::ostringstream line;
    line << "kvfuse prompt cache: " << (tier_options_.memory_bytes >> 20) << " MiB memory"
         << (tier_options_.disk ? ", disk " + tier_options_.disk->string() : std::string())
         << (tier_options_.redis ? ", redis " + *tier_options_.redis : std::string()) << "; chunks of " << chunk_
         << " tokens; " << reseeded_ << " state checkpoints found in the tiers";
    say(line.str());
    return true;
  }

  int32_t load(int32_t id_slot, const std::vector<llama_token>& tokens, int32_t n_past, int32_t n_tail) override {
    if (!engine_ || id_slot < 0 || static_cast<std::size_t>(id_slot) >= slots_.size()) return n_past;
    const auto slot = static_cast<std::uint32_t>(id_slot);
    SlotProgress& s = slots_[slot];
    if (s.open) engine_->finish(slot, tokens, 0, {});  // the previous prompt never finished
    s.open = true;
    s.restored = 0;
    s.start.reset();
    s.grid = false;
    s.prompt = tokens.size();
    s.tail = static_cast<TokenCount>(std::max(0, n_tail));
    s.clean = std::min<TokenCount>(s.clean, static_cast<TokenCount>(std::max(0, n_past)));
    prompt_tokens_ += tokens.size();
    const TokenCount P = tokens.size();
    const TokenCount limit = P > 1 + s.tail ? P - 1 - s.tail : 0;
    // What of the slot's own cells a prompt may start from and still compute what a prefill
    // from token 0 computes: clean cells, cut to the ubatch grid (a prefill that starts off
    // it runs other ubatches). Beyond that the slot holds a reply's KV, computed one token at
    // a time, which stock reuses and kvfuse does not: with the tiny dense model stock's own
    // reuse of a continuation changes its first-step probabilities (docs/llama-server.md).
    // A stateful model's cells cannot be cut back (its state is at their end), so it starts
    // from kvfuse's boundary or from token 0.
    const TokenCount own = static_cast<TokenCount>(std::max(0, n_past));
    const TokenCount keep = family_ == BlobFamily::attention ? TokenGrid{ubatch_}.floor(std::min(own, s.clean)) : 0;
    // No gain is possible below that: admit without a load (the admission still carries
    // this prompt's saves).
    // A dense prompt also asks the tier's catalogue first: a load that cannot pass the
    // slot's own cells is not worth its bytes. (A stateful one keeps nothing of its own.)
    const bool worth = TokenGrid{chunk_}.floor(limit) > keep &&
                       (keep == 0 || engine_->held_tokens(tokens, limit + 1) > keep);
    if (!control_.empty() && worth && keep == 0 && tampered_ == 0 && engine_->tamper(std::span(tokens).first(limit + 1), control_ == "wrong-state"))
      ++tampered_;
    Restore r = engine_->begin(slot, tokens, worth ? limit : 0);
    if (r.load != LoadKind::none) ++loads_[static_cast<std::size_t>(r.load)];
    if (r.outcome) ++(*r.outcome == Resolution::completed ? loads_completed_ : loads_failed_);
    if (r.stranded) ++loads_failed_;
    llama_memory_t mem = llama_get_memory(ctx_);
    if (r.boundary <= keep) {
      reused_slot_ += keep;
      if (keep == own) return n_past;
      llama_memory_seq_rm(mem, id_slot, keep == 0 ? -1 : static_cast<llama_pos>(keep), -1);
      s.clean = std::min(s.clean, keep);
      return static_cast<int32_t>(keep);
    }
    std::vector<std::uint8_t> blob;
    try {
      blob = into_stream(codec_->layout(), r.blob, place(slot));
    } catch (const Error&) {
      blob.clear();
    }
    llama_memory_seq_rm(mem, id_slot, -1, -1);
    std::size_t read = blob.empty() ? 0 : llama_state_seq_set_data(ctx_, blob.data(), blob.size(), id_slot);
    // llama.cpp reads a state of another boundary without complaint (the recurrent section
    // is not checked against the KV), and the server's next partial removal would then
    // abort: the sequence must end exactly at the boundary.
    const llama_pos last = static_cast<llama_pos>(r.boundary) - 1;
    if (read != 0 && (llama_memory_seq_pos_max(mem, id_slot) != last || llama_memory_seq_pos_min(mem, id_slot) < 0 ||
                      llama_memory_seq_pos_min(mem, id_slot) > last))
      read = 0;
    if (read == 0) {
      // llama.cpp refused it: the slot's cells are gone; the prompt is computed from token 0.
      ++restores_refused_;
      engine_->refused(slot);
      llama_memory_seq_rm(mem, id_slot, -1, -1);
      s.clean = 0;
      return 0;
    }
    s.restored = r.boundary;
    s.clean = r.boundary;
    reused_kvfuse_ += r.boundary;
    return static_cast<int32_t>(r.boundary);
  }

  int32_t next_stop(int32_t id_slot, int32_t n_cur) override {
    if (!engine_ || id_slot < 0 || static_cast<std::size_t>(id_slot) >= slots_.size()) return -1;
    const SlotProgress& s = slots_[static_cast<std::size_t>(id_slot)];
    if (!s.open || !s.grid) return -1;
    for (const TokenCount b : engine_->stops(static_cast<std::uint32_t>(id_slot)))
      if (b > static_cast<TokenCount>(n_cur) && b + s.tail < s.prompt) return static_cast<int32_t>(b);
    return -1;
  }

  void computed(int32_t id_slot, const std::vector<llama_token>& tokens, int32_t n) override {
    if (!engine_ || id_slot < 0 || static_cast<std::size_t>(id_slot) >= slots_.size() || n < 0) return;
    const auto slot = static_cast<std::uint32_t>(id_slot);
    SlotProgress& s = slots_[slot];
    if (!s.open) return;
    const auto at = static_cast<TokenCount>(n);
    if (!s.start) {
      // The first batch of this prompt starts here: on the grid from clean cells, or not.
      s.start = at;
      s.grid = (s.restored > 0 && at == s.restored) || (at % ubatch_ == 0 && at <= s.clean);
      s.clean = std::min(s.clean, at);
    }
    if (s.grid) s.clean = std::max(s.clean, at);
    if (at < s.prompt) {
      if (family_ != BlobFamily::attention && s.grid && at > *s.start) {
        const std::vector<TokenCount> stops = engine_->stops(slot);
        if (std::find(stops.begin(), stops.end(), at) != stops.end()) {
          std::vector<std::uint8_t> partial = take_blob(id_slot, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
          try {
            engine_->checkpoint(slot, tokens, at, one_stream(codec_->layout(), partial, place(slot), true));
          } catch (const Error&) {
            ++blob_refusals_;
          }
        }
      }
      return;
    }
    // The prompt is done: save what is clean, in whole chunks, beyond what kvfuse restored.
    s.open = false;
    const TokenCount clean = std::min(s.clean, s.prompt);
    if (TokenGrid{chunk_}.floor(clean) > s.restored) {
      try {
        const std::vector<std::uint8_t> full = one_stream(codec_->layout(), take_blob(id_slot, 0), place(slot));
        engine_->finish(slot, tokens, clean, full);
        return;
      } catch (const Error&) {
        ++blob_refusals_;
      }
    }
    engine_->finish(slot, tokens, 0, {});
  }

  int32_t n_loaded(int32_t id_slot) const override {
    if (id_slot < 0 || static_cast<std::size_t>(id_slot) >= slots_.size()) return 0;
    return static_cast<int32_t>(slots_[static_cast<std::size_t>(id_slot)].restored);
  }

  std::string metrics() override {
    std::ostringstream m;
    auto metric = [&](const char* name, const char* type, const char* help) {
      m << "# HELP kvfuse:" << name << " " << help << "\n# TYPE kvfuse:" << name << " " << type << "\n";
    };
    metric("prompt_tokens_total", "counter", "Prompt tokens of the completions kvfuse was asked about");
    m << "kvfuse:prompt_tokens_total " << prompt_tokens_ << "\n";
    metric("reused_tokens_total", "counter", "Prompt tokens not computed, by where their cells came from");
    m << "kvfuse:reused_tokens_total{source=\"slot\"} " << reused_slot_ << "\n";
    m << "kvfuse:reused_tokens_total{source=\"kvfuse\"} " << reused_kvfuse_ << "\n";
    metric("loads_total", "counter", "Loads from the tiers, by kind");
    static constexpr const char* kinds[] = {"none", "kv-only", "joint", "state-only"};
    for (std::size_t k = 1; k < 4; ++k) m << "kvfuse:loads_total{kind=\"" << kinds[k] << "\"} " << loads_[k] << "\n";
    metric("load_outcomes_total", "counter", "How loads ended");
    m << "kvfuse:load_outcomes_total{outcome=\"completed\"} " << loads_completed_ << "\n";
    m << "kvfuse:load_outcomes_total{outcome=\"failed\"} " << loads_failed_ << "\n";
    metric("restores_refused_total", "counter", "Restored sequences llama.cpp refused: recomputed from token 0");
    m << "kvfuse:restores_refused_total " << restores_refused_ << "\n";
    metric("blob_refusals_total", "counter", "Slot blobs kvfuse could not read or cut (cells out of order, a state that does not fit): not saved");
    m << "kvfuse:blob_refusals_total " << blob_refusals_ + (engine_ ? engine_->counters().codec_refusals : 0) << "\n";
    if (!control_.empty()) {
      metric("control_tampered_total", "counter", "Tier entries the test control tampered with");
      m << "kvfuse:control_tampered_total " << tampered_ << "\n";
    }
    if (engine_) {
      const CoordinatorStats c = engine_->coordinator_stats();
      const IndexStats i = engine_->index_stats();
      const SlotCacheCounters k = engine_->counters();
      metric("checkpoints_total", "counter", "State checkpoints, by event");
      m << "kvfuse:checkpoints_total{event=\"planned\"} " << c.checkpoints_planned << "\n";
      m << "kvfuse:checkpoints_total{event=\"saved\"} " << c.checkpoints_saved << "\n";
      m << "kvfuse:checkpoints_total{event=\"deduplicated\"} " << c.checkpoints_deduplicated << "\n";
      metric("saves_total", "counter", "Saves to the tiers, by result");
      m << "kvfuse:saves_total{result=\"stored\"} " << i.saves_stored << "\n";
      m << "kvfuse:saves_total{result=\"failed\"} " << i.saves_failed << "\n";
      metric("saved_tokens_total", "counter", "Prompt tokens whose KV was saved");
      m << "kvfuse:saved_tokens_total " << k.kv_rows_saved << "\n";
      const HostAudit a = engine_->audit();
      metric("must_be_zero", "gauge", "The numbers that must be zero between requests");
      m << "kvfuse:must_be_zero{what=\"invariant_violations\"} " << a.invariant_violations << "\n";
      m << "kvfuse:must_be_zero{what=\"stranded_parked\"} " << a.stranded_parked + k.stranded << "\n";
      m << "kvfuse:must_be_zero{what=\"leaked_blocks\"} " << a.leaked_blocks << "\n";
      m << "kvfuse:must_be_zero{what=\"leaked_slots\"} " << a.leaked_slots << "\n";
      m << "kvfuse:must_be_zero{what=\"held_admissions\"} " << a.held_admissions << "\n";
    }
    const TierStackStats t = tiers_->stats();
    metric("tier_gets_total", "counter", "Tier gets, by tier and result");
    m << "kvfuse:tier_gets_total{tier=\"memory\",result=\"hit\"} " << t.memory.hits << "\n";
    m << "kvfuse:tier_gets_total{tier=\"memory\",result=\"miss\"} " << t.memory.misses << "\n";
    if (t.has_redis) {
      m << "kvfuse:tier_gets_total{tier=\"redis\",result=\"hit\"} " << t.redis_hits << "\n";
      m << "kvfuse:tier_gets_total{tier=\"redis\",result=\"miss\"} " << t.redis_misses << "\n";
      m << "kvfuse:tier_gets_total{tier=\"redis\",result=\"failed\"} " << t.redis_failures + t.redis_timeouts << "\n";
    }
    metric("tier_bytes", "gauge", "Bytes held, by tier");
    m << "kvfuse:tier_bytes{tier=\"memory\"} " << t.memory.bytes << "\n";
    if (t.has_disk) m << "kvfuse:tier_bytes{tier=\"disk\"} " << t.disk_bytes << "\n";
    metric("tier_evictions_total", "counter", "Entries the memory tier dropped to make room");
    m << "kvfuse:tier_evictions_total " << t.memory.evictions << "\n";
    return m.str();
  }

 private:
  StreamPlace place(std::uint32_t slot) const noexcept {
    return unified_ ? StreamPlace{1, 0} : StreamPlace{static_cast<std::uint32_t>(slots_.size()), slot};
  }

  std::vector<std::uint8_t> take_blob(int32_t seq, llama_state_seq_flags flags) const {
    std::vector<std::uint8_t> blob(llama_state_seq_get_size_ext(ctx_, seq, flags));
    blob.resize(llama_state_seq_get_data_ext(ctx_, blob.data(), blob.size(), seq, flags));
    return blob;
  }

  // Learns the blob layout in a small context of the server's own settings holding one
  // sequence (the codec's grammar), and checks that the codec rebuilds llama.cpp's blob.
  void learn(const common_params& params, const llama_model* model) {
    llama_context_params cp = common_context_params_to_llama(params);
    cp.n_ctx = chunk_ + 256;
    cp.n_seq_max = 1;
    cp.n_batch = cp.n_ubatch = ubatch_;
    cp.kv_unified = true;
    llama_context* c = llama_init_from_model(const_cast<llama_model*>(model), cp);
    if (c == nullptr) throw Error(ErrorCode::io_failure, "llama.cpp could not make a context to learn the blob layout");
    struct Free {
      llama_context* c;
      ~Free() { llama_free(c); }
    } free_it{c};
    const std::int32_t vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_batch batch = llama_batch_init(static_cast<std::int32_t>(ubatch_), 0, 1);
    for (TokenCount done = 0; done < chunk_;) {
      const TokenCount take = std::min<TokenCount>(ubatch_, chunk_ - done);
      batch.n_tokens = static_cast<std::int32_t>(take);
      for (TokenCount k = 0; k < take; ++k) {
        batch.token[k] = static_cast<llama_token>(3 + ((done + k) * 37) % static_cast<TokenCount>(vocab - 3));
        batch.pos[k] = static_cast<llama_pos>(done + k);
        batch.n_seq_id[k] = 1;
        batch.seq_id[k][0] = 0;
        batch.logits[k] = 0;
      }
      if (llama_decode(c, batch) != 0) {
        llama_batch_free(batch);
        throw Error(ErrorCode::io_failure, "llama_decode failed while learning the blob layout");
      }
      done += take;
    }
    llama_batch_free(batch);
    auto blob_of = [&](llama_state_seq_flags flags) {
      std::vector<std::uint8_t> b(llama_state_seq_get_size_ext(c, 0, flags));
      b.resize(llama_state_seq_get_data_ext(c, b.data(), b.size(), 0, flags));
      return b;
    };
    const std::vector<std::uint8_t> full = blob_of(0), partial = blob_of(LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    codec_ = std::make_unique<llama::SequenceCodec>(llama::learn_layout(family_, full, partial), chunk_);
    std::vector<std::byte> pool(codec_->block_bytes());
    const BlockId b0{0};
    codec_->store_kv(full, 0, chunk_, pool.data(), std::span(&b0, 1));
    std::vector<std::byte> slot(codec_->slot_bytes());
    if (!slot.empty()) codec_->store_state(partial, slot);
    std::vector<std::uint8_t> rebuilt;
    codec_->rebuild(chunk_, pool.data(), std::span(&b0, 1), slot, rebuilt);
    if (rebuilt != full)
      throw Error(ErrorCode::corrupt_data, "the rebuilt blob of " + std::to_string(rebuilt.size()) +
                                               " bytes differs from llama.cpp's of " + std::to_string(full.size()));
  }

  // Everything besides the tokens that decides a saved byte: servers that share a tier share
  // an entry only when they would have computed the same bytes.
  std::uint64_t model_id(const common_params& params, const llama_model* model) const {
    char desc[256] = {};
    (void)llama_model_desc(model, desc, sizeof desc);
    std::uint64_t h = 0x6b7666757365ULL;
    for (const char ch : std::string(desc)) h = mix_in(h, static_cast<unsigned char>(ch));
    for (const std::uint64_t v :
         {std::uint64_t(llama_model_n_params(model)), std::uint64_t(llama_model_size(model)),
          std::uint64_t(llama_vocab_n_tokens(llama_model_get_vocab(model))), std::uint64_t(chunk_), std::uint64_t(ubatch_),
          std::uint64_t(params.cache_type_k), std::uint64_t(params.cache_type_v), std::uint64_t(params.swa_full),
          std::uint64_t(static_cast<std::int64_t>(params.flash_attn_type)), std::uint64_t(params.cpuparams_batch.n_threads)})
      h = mix_in(h, v);
    return h;
  }

  BackendFlags flags_;
  TierStackOptions tier_options_;
  bool memory_given_ = false;
  bool known_ = false;  // configure() found a model kvfuse serves
  CheckpointPolicy policy_{};
  std::unique_ptr<TierStack> tiers_;
  BlobFamily family_ = BlobFamily::attention;
  std::uint32_t chunk_ = 256, ubatch_ = 512;
  llama_context* ctx_ = nullptr;
  bool unified_ = true;
  std::unique_ptr<llama::SequenceCodec> codec_;
  std::unique_ptr<Engine> engine_;
  std::vector<SlotProgress> slots_;
  std::size_t reseeded_ = 0;
  std::string control_;
  std::uint64_t tampered_ = 0;
  std::uint64_t prompt_tokens_ = 0, reused_slot_ = 0, reused_kvfuse_ = 0;
  std::uint64_t loads_[4] = {};
  std::uint64_t loads_completed_ = 0, loads_failed_ = 0, restores_refused_ = 0, blob_refusals_ = 0;
};

std::unique_ptr<KvfuseBackend>& the_backend() {
  static std::unique_ptr<KvfuseBackend> backend;
  return backend;
}

}  // namespace
}  // namespace kvfuse::llama_server

server_prompt_cache_backend* server_prompt_cache_backend_init(int& argc, char** argv) {
  using namespace kvfuse::llama_server;
  try {
    BackendFlags flags = take_backend_flags(argc, argv);
    if (!flags.any()) return nullptr;
    the_backend() = std::make_unique<KvfuseBackend>(std::move(flags));
  } catch (const kvfuse::Error& e) {
    say(e.what());
    std::exit(1);
  }
  return the_backend().get();
}

server_prompt_cache_backend* server_prompt_cache_backend_get() { return kvfuse::llama_server::the_backend().get(); }
