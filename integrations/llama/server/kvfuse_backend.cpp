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
// stock serves it, and saved only up to where it was clean. Once a task's reply is sent,
// settle() recomputes it as a prefill would, so the next turn finds it clean and in the tiers.
#include "server-prompt-cache-backend.h"

#include "common.h"
#include "llama.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <span>
#include <string>
#include <vector>

#include "backend_flags.hpp"
#include "backend_metrics.hpp"
#include "cache_engine.hpp"
#include "llama_calls.hpp"
#include "slot_cache.hpp"
#include "slot_progress.hpp"
#include "stream_blob.hpp"
#include "tier_stack.hpp"

namespace kvfuse::llama_server {
namespace {

using llama::BlobFamily;


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
    if (flags_.cache_policy) {  // twice the ledger's budget: room for a save landing after its entry's eviction
      cache_budget_ = tier_options_.memory_bytes;
      tier_options_.memory_bytes = 2 * cache_budget_;
    }
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
      codec_ = learn_codec(family_, params, model, chunk_, ubatch_);
    } catch (const Error& e) {
      say(std::string("the model's state blob is not what kvfuse reads: ") + e.what());
      return false;
    }
    const std::uint32_t slots = llama_n_seq_max(ctx);
    unified_ = params.kv_unified || slots == 1;
    if (slots > 1 && unified_ && family_ == BlobFamily::deepseek4) {
      // One unified cache of several sequences: its compressor states hold rows the
      // one-sequence layout does not have. A stream per slot (no --kv-unified) is cut to it.
      say("deepseek4 with --kv-unified and --parallel " + std::to_string(slots) +
          ": kvfuse reads its state blob with a stream per slot only; serving without kvfuse");
      return true;
    }
    SlotCacheOptions o;
    o.chunk_tokens = chunk_;
    o.slots = slots;
    o.max_prompt_tokens = llama_n_ctx_seq(ctx);
    o.checkpoints = policy_;
    o.model_id = model_identity(params, model, chunk_, ubatch_);
    o.cache_policy = flags_.cache_policy;  // the ledger owns the memory tier's budget
    o.cache_budget = cache_budget_;
    if (family_ == BlobFamily::deepseek4) {
      // Measured, not derived: on the tiny deepseek4 at -ub 64 a resume is bit for bit at
      // 128, 384 and 640 tokens and not at 256 or 512 (in a fresh context and in a slot
      // alike), so its state boundaries are the odd multiples of 128. The likely cause is
      // where llama.cpp puts the restored sliding-window cells (from cell 0) against where a
      // prefill from token 0 put them (docs/llama-server.md#deepseek4).
      o.state_period = 256;
      o.state_phase = 128;
    }
    cache_options_ = o;
    try {
      if (family_ == BlobFamily::attention) engine_ = std::make_unique<CacheEngineOf<NoState>>(*codec_, *tiers_, o);
      else if (family_ == BlobFamily::hybrid) engine_ = std::make_unique<CacheEngineOf<RecurrentState<TierStack>>>(*codec_, *tiers_, o);
      else engine_ = std::make_unique<CacheEngineOf<SlotState<TierStack>>>(*codec_, *tiers_, o);
      reseeded_ = engine_->reseed();
    } catch (const Error& e) {
      say(e.what());
      return false;
    }
    slots_.assign(slots, SlotProgress{});
    std::ostringstream line;
    line << "kvfuse prompt cache: "
         << (flags_.cache_policy ? std::to_string(cache_budget_ >> 20) + " MiB memory, owned by the cache ledger (" +
                                       std::string(to_string(*flags_.cache_policy)) + ")"
                                 : std::to_string(tier_options_.memory_bytes >> 20) + " MiB memory")
         << (tier_options_.disk ? ", disk " + tier_options_.disk->string() : std::string())
         << (tier_options_.redis ? ", redis " + *tier_options_.redis : std::string()) << "; chunks of " << chunk_
         << " tokens; " << reseeded_ << " state checkpoints found in the tiers";
    say(line.str());
    return true;
  }

  int32_t load(int32_t id_slot, const std::vector<llama_token>& tokens, int32_t n_past, int32_t n_tail) override {
    if (!engine_ || id_slot < 0 || static_cast<std::size_t>(id_slot) >= slots_.size()) return n_past;
    return start(static_cast<std::uint32_t>(id_slot), tokens, n_past, n_tail, true);
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
    if (!slots_[slot].open) return;
    if (advance(slot, tokens, static_cast<TokenCount>(n))) {
      end_prompt(slot, tokens);
      slots_[slot].settle = true;
    }
  }

  // A decode step computes a reply's cells one token at a time, which sums in another order
  // than a prefill, so they are never saved and a later prompt holding the reply would
  // recompute it. Here, once the reply is sent and before the slot's next prompt starts,
  // the reply (and the prompt's tail below the grid) is recomputed on the slot's sequence
  // as a prefill from token 0 computes it, in whole ubatches from a clean boundary, and its
  // whole chunks are saved: the next turn, in this slot or any other (or another server),
  // reuses it bit for bit. It costs the decode of those tokens, once per ended task.
  int32_t settle(int32_t id_slot, const std::vector<llama_token>& tokens) override {
    if (!engine_ || id_slot < 0 || static_cast<std::size_t>(id_slot) >= slots_.size()) return -1;
    const auto slot = static_cast<std::uint32_t>(id_slot);
    SlotProgress& s = slots_[slot];
    if (!s.settle || s.open) return -1;
    s.settle = false;
    // The last token was sampled and never decoded: the chunks end below it (and a stateful
    // model's target is a boundary it may resume at).
    const TokenCount end = tokens.size() < 2 ? 0 : tokens.size() - 1;
    const TokenCount target = family_ == BlobFamily::attention ? TokenGrid{chunk_}.floor(end) : cache_options_.state_floor(end, chunk_);
    // Nothing the prompt has not saved already: its KV chunks, and for a stateful model the
    // state (its prompt's checkpoints sit below the server's tail split, so often well below).
    if (target <= (family_ == BlobFamily::attention ? TokenGrid{chunk_}.floor(s.clean) : s.state_at)) return -1;
    llama_memory_t mem = llama_get_memory(ctx_);
    const llama_pos last = llama_memory_seq_pos_max(mem, id_slot);
    const TokenCount cells = std::min<TokenCount>(last < 0 ? 0 : static_cast<TokenCount>(last) + 1, tokens.size());
    // One token past the target, so the target is a state boundary the planner may choose.
    const std::vector<llama_token> prefix(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(target) + 1);
    const TokenCount from = static_cast<TokenCount>(start(slot, prefix, static_cast<int32_t>(cells), 0, false));
    if (from == 0 && family_ != BlobFamily::attention) {
      // No state to resume from: a stateful sequence would be recomputed from token 0.
      engine_->finish(slot, prefix, 0, {});
      s.open = false;
      return 0;
    }
    (void)advance(slot, prefix, from);
    const TokenCount at0 = from;
    TokenCount at = !s.grid ? from : decode_run(ctx_, id_slot, from, target, ubatch_, [&](TokenCount i) { return prefix[i]; },
                                                [&](TokenCount done) { (void)advance(slot, prefix, done); });
    counters_.settled_tokens += at - at0;
    if (s.grid && at < target) {
      // A decode failed: a dense sequence keeps its clean cells, a stateful one nothing.
      llama_memory_seq_rm(mem, id_slot, family_ == BlobFamily::attention ? static_cast<llama_pos>(at) : -1, -1);
      if (family_ != BlobFamily::attention) s.clean = at = 0;
    } else if (s.grid) {
      ++counters_.settles;
      if (family_ != BlobFamily::attention) s.state_end = at;  // the next prompt may continue these cells
      // The generation-end checkpoint (CheckpointPolicy::at_generation_end), when the policy's
      // prefill checkpoints did not already put one at the target.
      const std::vector<TokenCount> stops = family_ == BlobFamily::attention ? std::vector<TokenCount>{} : engine_->stops(slot);
      if (family_ != BlobFamily::attention && policy_.at_generation_end && at > at0 &&
          std::find(stops.begin(), stops.end(), at) == stops.end()) {
        try {
          engine_->checkpoint(slot, prefix, at,
                              one_stream(codec_->layout(), sequence_blob(ctx_, id_slot, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), place(slot), true));
        } catch (const Error&) {
          ++counters_.blob_refusals;
        }
      }
    }
    s.prompt = at;
    end_prompt(slot, prefix);
    return static_cast<int32_t>(at);
  }

  int32_t n_loaded(int32_t id_slot) const override {
    if (id_slot < 0 || static_cast<std::size_t>(id_slot) >= slots_.size()) return 0;
    return static_cast<int32_t>(slots_[static_cast<std::size_t>(id_slot)].restored);
  }

  std::string metrics() override { return prometheus_text(counters_, engine_.get(), tiers_->stats(), !control_.empty()); }

 private:
  // A slot starts a prompt: `served` for a request's (counted as its reuse), not for settle().
  // Returns n: the sequence holds the cells of tokens[0, n) (the slot's own, cut back, or
  // restored) when n != n_past, else it is as it was.
  int32_t start(std::uint32_t slot, const std::vector<llama_token>& tokens, int32_t n_past, int32_t n_tail, bool served) {
    const auto id_slot = static_cast<int32_t>(slot);
    SlotProgress& s = slots_[slot];
    if (s.open) engine_->finish(slot, tokens, 0, {});  // the previous prompt never finished
    s.open = true;
    s.restored = 0;
    s.state_at = 0;
    s.start.reset();
    s.grid = false;
    s.prompt = tokens.size();
    s.tail = static_cast<TokenCount>(std::max(0, n_tail));
    s.clean = std::min<TokenCount>(s.clean, static_cast<TokenCount>(std::max(0, n_past)));
    if (served) counters_.prompt_tokens += tokens.size();
    const TokenCount P = tokens.size();
    const TokenCount limit = P > 1 + s.tail ? P - 1 - s.tail : 0;
    // What of the slot's own cells a prompt may start from and still compute what a prefill
    // from token 0 computes: clean cells, cut to the ubatch grid (a prefill that starts off
    // it runs other ubatches). Beyond that the slot holds a reply's KV, computed one token at
    // a time, which stock reuses and kvfuse does not: with the tiny dense model stock's own
    // reuse of a continuation changes its first-step probabilities (docs/llama-server.md).
    // A stateful model's cells cannot be cut back (its state is at their end): it keeps them
    // only when they are clean to their end and the prompt continues them there (a settled
    // reply, on the grid, below the tail split), else it starts from kvfuse's boundary or
    // from token 0.
    const TokenCount own = static_cast<TokenCount>(std::max(0, n_past));
    TokenCount keep = 0;
    if (family_ == BlobFamily::attention) {
      keep = TokenGrid{ubatch_}.floor(std::min(own, s.clean));
    } else {
      const llama_pos last = llama_memory_seq_pos_max(llama_get_memory(ctx_), id_slot);
      const bool whole = own > 0 && last >= 0 && static_cast<TokenCount>(last) + 1 == own;
      if (whole && own == s.clean && own % ubatch_ == 0 && own <= limit && own == s.state_end) keep = own;
    }
    s.state_end = 0;  // this prompt moves the state on
    // No gain is possible below that: admit without a load (the admission still carries
    // this prompt's saves).
    // A dense prompt also asks the tier's catalogue first: a load that cannot pass the
    // slot's own cells is not worth its bytes. (A stateful one keeps nothing of its own.)
    const bool worth = TokenGrid{chunk_}.floor(limit) > keep &&
                       (keep == 0 || engine_->held_tokens(tokens, limit + 1) > keep);
    if (!control_.empty() && worth && keep == 0 && counters_.tampered == 0 && engine_->tamper(std::span(tokens).first(limit + 1), control_ == "wrong-state"))
      ++counters_.tampered;
    Restore r = engine_->begin(slot, tokens, worth ? limit : 0);
    if (r.load != LoadKind::none) ++counters_.loads[static_cast<std::size_t>(r.load)];
    if (r.outcome) ++(*r.outcome == Resolution::completed ? counters_.loads_completed : counters_.loads_failed);
    if (r.stranded) ++counters_.loads_failed;
    llama_memory_t mem = llama_get_memory(ctx_);
    if (r.boundary <= keep) {
      if (served) counters_.reused_slot += keep;
      if (keep == own) return n_past;
      llama_memory_seq_rm(mem, id_slot, keep == 0 ? -1 : static_cast<llama_pos>(keep), -1);
      s.clean = std::min(s.clean, keep);
      return static_cast<int32_t>(keep);
    }
    std::vector<std::uint8_t> blob;
    try {
      blob = into_stream(codec_->layout(), std::move(r.blob), place(slot));
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
      ++counters_.restores_refused;
      engine_->refused(slot);
      llama_memory_seq_rm(mem, id_slot, -1, -1);
      s.clean = 0;
      return 0;
    }
    s.restored = r.boundary;
    s.state_at = r.boundary;
    s.clean = r.boundary;
    if (served) counters_.reused_kvfuse += r.boundary;
    return static_cast<int32_t>(r.boundary);
  }

  // The slot's sequence holds the cells of tokens[0, at) as its prefill computed them.
  // Tracks where they are clean and takes the state checkpoints the admission planned.
  // Returns whether the prompt is done.
  bool advance(std::uint32_t slot, const std::vector<llama_token>& tokens, TokenCount at) {
    SlotProgress& s = slots_[slot];
    if (!s.start) {
      // The first batch of this prompt starts here: on the grid from clean cells, or not.
      s.start = at;
      s.grid = (s.restored > 0 && at == s.restored) || (at % ubatch_ == 0 && at <= s.clean);
      s.clean = std::min(s.clean, at);
    }
    if (s.grid) s.clean = std::max(s.clean, at);
    if (at >= s.prompt) return true;
    if (family_ != BlobFamily::attention && s.grid && at > *s.start) {
      const std::vector<TokenCount> stops = engine_->stops(slot);
      if (std::find(stops.begin(), stops.end(), at) != stops.end()) {
        std::vector<std::uint8_t> partial = sequence_blob(ctx_, static_cast<int32_t>(slot), LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
        try {
          engine_->checkpoint(slot, tokens, at, one_stream(codec_->layout(), partial, place(slot), true));
          s.state_at = at;
        } catch (const Error&) {
          ++counters_.blob_refusals;
        }
      }
    }
    return false;
  }

  // The prompt is done: save what is clean, in whole chunks, beyond what kvfuse restored.
  void end_prompt(std::uint32_t slot, const std::vector<llama_token>& tokens) {
    SlotProgress& s = slots_[slot];
    s.open = false;
    const TokenCount clean = std::min(s.clean, s.prompt);
    if (TokenGrid{chunk_}.floor(clean) > s.restored) {
      try {
        const std::vector<std::uint8_t> full = one_stream(codec_->layout(), sequence_blob(ctx_, static_cast<int32_t>(slot), 0), place(slot));
        engine_->finish(slot, tokens, clean, full);
        return;
      } catch (const Error&) {
        ++counters_.blob_refusals;
      }
    }
    engine_->finish(slot, tokens, 0, {});
  }

  StreamPlace place(std::uint32_t slot) const noexcept {
    return unified_ ? StreamPlace{1, 0} : StreamPlace{static_cast<std::uint32_t>(slots_.size()), slot};
  }

  BackendFlags flags_;
  TierStackOptions tier_options_;
  std::size_t cache_budget_ = 0;  // --kvfuse-cache-policy: the ledger's budget (the memory flag's bytes)
  bool memory_given_ = false;
  bool known_ = false;  // configure() found a model kvfuse serves
  CheckpointPolicy policy_{};
  std::unique_ptr<TierStack> tiers_;
  BlobFamily family_ = BlobFamily::attention;
  std::uint32_t chunk_ = 256, ubatch_ = 512;
  SlotCacheOptions cache_options_;  // what the SlotCache was built with (its state boundary rule)
  llama_context* ctx_ = nullptr;
  bool unified_ = true;
  std::unique_ptr<llama::SequenceCodec> codec_;
  std::unique_ptr<CacheEngine> engine_;
  std::vector<SlotProgress> slots_;
  std::size_t reseeded_ = 0;
  std::string control_;
  BackendCounters counters_;
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
