// kvfuse-llama: one model's runs. A workload is served twice — pass 1 with offload off
// (every request computed from token 0 in a fresh context), pass 2 through a kvfuse Server
// over a tier — and every request's greedy tokens and first decode step's logits are
// compared bit for bit. The controls tamper with the entry the first load of pass 2 is about
// to read, to show that the comparison catches it. The time-to-first-token measurement
// serves one prompt from the tier and recomputes it.
#pragma once

#include "workload.hpp"

#include <kvfuse/llama/server.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace llama_app {

using namespace kvfuse;
using namespace kvfuse::llama;

/// What pass 2 does to the tier before its first load, to prove the check can fail.
enum class Control {
  none,
  flip_kv,         ///< one byte of the first KV chunk a load reads, flipped in the tier
  wrong_boundary,  ///< the first state entry a load reads, replaced by the state of another boundary
};

/// How every run of a model is built.
struct RunSettings {
  std::uint32_t chunk_tokens = 256;
  std::uint32_t num_blocks = 0;  ///< 0: one and a half times the longest request's blocks
  std::uint32_t snapshot_slots = 4;
  CheckpointPolicy checkpoints{};
  bool two_passes = true;  ///< false: pass 2 only (its outputs checked against a file, or not at all)
  Control control = Control::none;
  /// --cache-policy: a cache ledger owns `cache_budget` bytes (--tier-capacity) of pass 2's
  /// tier; empty: the memory tier's LRU decides, the disk behind it keeps everything.
  std::optional<CachePolicy> cache_policy;
  std::uint64_t cache_budget = 0;
};

/// One request's output: what is compared bit for bit.
struct Output {
  std::vector<llama_token> tokens;
  std::vector<float> logits;
  friend bool operator==(const Output& a, const Output& b) {
    return a.tokens == b.tokens && a.logits.size() == b.logits.size() &&
           std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * sizeof(float)) == 0;
  }
};

/// One model's run of one workload: what pass 2 did, and the comparison.
struct WorkloadRun {
  std::string workload;
  std::size_t requests = 0;
  std::size_t computed_without_load = 0, loads_kv_only = 0, loads_joint = 0, loads_state_only = 0;
  std::size_t outcome_completed = 0, outcome_failed = 0, outcome_other = 0, state_missed = 0;
  TokenCount prompt_tokens = 0, reused_hbm = 0, reused_tier = 0, reuse_bound = 0;
  bool has_reuse_bound = false;
  std::uint64_t checkpoints_planned = 0, checkpoints_saved = 0, checkpoints_deduplicated = 0;
  std::uint64_t saves_stored = 0, saves_failed = 0, hashes_reseeded = 0;
  std::optional<CacheLedgerStats> cache_ledger;  ///< with --cache-policy
  CacheKeeperStats cache_keeper;                 ///< with --cache-policy: victims erased, swept, healed
  /// A memory+disk tier at the end of the run: what each level holds (with a cache ledger,
  /// the disk holds exactly what the ledger counts).
  std::optional<MemoryTierStats> memory_tier;
  std::optional<DiskTierStats> disk_tier;
  std::uint64_t bytes_loaded = 0;
  std::size_t resumes_refused = 0;
  std::string first_refusal;
  double seconds_off = 0, seconds_on = 0;
  ServerAudit audit;
  std::uint64_t corrupted_loads = 0;  ///< loads whose restored sequence was refused, or gave other bits
  std::uint64_t compared = 0, two_pass_delta = 0;
  std::string first_difference;
  std::vector<Output> outputs;  ///< pass 2's, in workload order
  std::string control;          ///< what the control did; empty when it did nothing
  std::uint64_t must_be_zero() const {
    return audit.invariant_violations + corrupted_loads + audit.stranded_parked + audit.leaked_blocks + audit.leaked_slots +
           two_pass_delta;
  }
};

/// One prompt length of the time-to-first-token measurement.
struct TtftRow {
  TokenCount prompt = 0, reused = 0;
  LoadKind load = LoadKind::none;
  double recompute_ms = 0, memory_ms = 0, memory_load_ms = 0, memory_rebuild_ms = 0, disk_ms = 0;
  std::size_t bytes_loaded = 0;
  bool same_bits = true;  ///< every hit gave the recompute's tokens and logits
};

/// A bounded memory tier in front of a disk tier in `dir`: the embedded default.
struct MemoryDiskTier {
  MemoryTier<> front;
  DiskTier back;
  TieredTier<MemoryTier<>, DiskTier> tier;
  MemoryDiskTier(std::size_t memory_bytes, const std::filesystem::path& dir) : front(memory_bytes), back(dir), tier(front, back) {}
};

namespace detail {

inline double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// The run of the blob layout whose rows reach furthest back (deepseek4's HCA rows; a K row
/// otherwise): a flipped byte there is read by every later token.
inline std::size_t furthest_run(const SequenceCodec& codec) {
  std::size_t run = 0;
  for (std::size_t i = 0; i < codec.layout().runs.size(); ++i)
    if (codec.layout().runs[i].tokens_per_row > codec.layout().runs[run].tokens_per_row) run = i;
  return run;
}

/// Installs the control's hook on `server`: it acts on the first load that has the leg it
/// tampers with, and writes what it did into `done`.
template <class E>
void arm_control(E& server, Control control, std::string& done) {
  if (control == Control::none) return;
  server.set_load_hook([&server, control, &done](const LoadRequest& r) {
    if (!done.empty()) return;
    const RankGeometry& g = server.geometry();
    const SequenceCodec& codec = server.runner().codec();
    if (control == Control::flip_kv && r.kv && !r.kv->chunk_keys.empty()) {
      // Token hbm starts a granule (hbm is on the block grid): flip the exponent of the first
      // element of its furthest-reaching row, in the chunk the load reads first.
      const TierKey key = server.tier_key(r.kv->chunk_keys.front(), EntryKind::kv_chunk);
      std::vector<std::byte> staging(g.chunk_bytes()), bytes;
      {
        TierView view = server.tier().get(key, staging);
        if (!view.hit()) return;
        bytes.assign(view.bytes().begin(), view.bytes().end());
      }
      const std::size_t run = furthest_run(codec);
      const std::size_t offset = (r.kv->hbm % g.chunk_tokens) * g.kv_bytes_per_token + codec.run_offset(run) + 1;
      bytes.at(offset) ^= std::byte{0x04};
      if (!server.tier().put(key, bytes)) return;
      done = "flipped byte " + std::to_string(offset) + " of the KV chunk holding token " + std::to_string(r.kv->hbm) +
             " (a row of token " + std::to_string(r.kv->hbm) + ") before the first load that reads it";
    }
    if (control == Control::wrong_boundary && r.state) {
      // The state at another boundary of the same prompt, stored under this boundary's key
      // (with a sidecar that names this boundary): what a snapshot taken at the wrong place
      // would have saved.
      const TokenCount boundary = r.state->boundary_tokens;
      const std::span<const llama_token> prompt = server.current_prompt();
      // A later boundary where the prompt has one: llama.cpp takes a kimi-k3 state of a
      // later boundary without a word (only the logits tell), while one of an earlier
      // boundary makes the restored sequence end early, which the runner refuses.
      const TokenCount other = boundary + g.block_tokens <= prompt.size() ? boundary + g.block_tokens
                               : boundary >= 2 * g.block_tokens           ? boundary - g.block_tokens
                                                                          : 0;
      if (other == 0) return;
      Sequence sequence = server.runner().start();
      sequence.prefill(prompt.first(other), false);
      std::vector<std::byte> slot(codec.slot_bytes()), entry;
      sequence.store_state(slot);
      if constexpr (E::layout == StateLayout::dsv4_slot) {
        const SlotSidecar sidecar{r.state->boundary_hash.value, boundary, g.slot_bytes};
        entry.resize(sizeof sidecar);
        std::memcpy(entry.data(), &sidecar, sizeof sidecar);
      }
      entry.insert(entry.end(), slot.begin(), slot.end());
      if (!server.tier().put(server.tier_key(r.state->boundary_hash, EntryKind::state), entry)) return;
      done = "replaced the state entry of boundary " + std::to_string(boundary) + " with the state at token " +
             std::to_string(other) + " before the first load that reads it";
    }
  });
}

}  // namespace detail

/// Serves `w` twice through `runner` (pass 1 from scratch, pass 2 through a server of type
/// `E` over `tier`) and compares. `expected`, when given, holds outputs pass 2 must equal
/// (another process's); mismatches there count in the caller's comparison, not here.
template <class E, class T>
WorkloadRun run_workload(const SequenceRunner& runner, const Workload& w, const RunSettings& settings, T& tier) {
  WorkloadRun run;
  run.workload = w.name;
  run.requests = w.turns.size();
  run.has_reuse_bound = w.has_reuse_bound;
  auto serve_all = [&](auto&& serve) {
    std::vector<std::vector<llama_token>> history(w.conversations);
    std::vector<Output> outputs;
    for (const Turn& turn : w.turns) {
      std::vector<llama_token> prompt;
      if (turn.conversation) prompt = history[*turn.conversation];
      prompt.insert(prompt.end(), turn.tokens.begin(), turn.tokens.end());
      const Served s = serve(prompt, turn);
      if (turn.conversation) {
        prompt.insert(prompt.end(), s.decoded.tokens.begin(), s.decoded.tokens.end());
        history[*turn.conversation] = std::move(prompt);
      }
      outputs.push_back(Output{s.decoded.tokens, s.decoded.first_logits});
    }
    return outputs;
  };

  std::vector<Output> reference;
  if (settings.two_passes) {
    const auto started = std::chrono::steady_clock::now();
    reference = serve_all([&](const std::vector<llama_token>& prompt, const Turn& turn) {
      return compute_from_scratch(runner, prompt, turn.output_tokens);
    });
    run.seconds_off = detail::seconds_between(started, std::chrono::steady_clock::now());
  }

  ServeOptions o;
  o.chunk_tokens = settings.chunk_tokens;
  o.model_id = model_id_for(runner, settings.chunk_tokens);
  const TokenCount longest_blocks = TokenGrid{runner.options().block_tokens}.cells_covering(w.longest);
  // Small enough that the prefix cache drops what the tier then serves.
  o.num_blocks = settings.num_blocks != 0 ? settings.num_blocks : static_cast<std::uint32_t>(longest_blocks + (longest_blocks + 1) / 2);
  o.snapshot_slots = settings.snapshot_slots;
  o.max_request_tokens = w.longest;
  o.checkpoints = settings.checkpoints;
  o.cache_policy = settings.cache_policy;
  o.cache_budget = settings.cache_budget;
  E server(runner, tier, o);
  run.hashes_reseeded = server.reseed_from_tier();
  detail::arm_control(server, settings.control, run.control);
  std::vector<Served> served;
  const auto started = std::chrono::steady_clock::now();
  run.outputs = serve_all([&](const std::vector<llama_token>& prompt, const Turn& turn) {
    served.push_back(server.serve(prompt, turn.output_tokens));
    return served.back();
  });
  server.drain();
  run.seconds_on = detail::seconds_between(started, std::chrono::steady_clock::now());

  for (std::size_t i = 0; i < served.size(); ++i) {
    const Served& s = served[i];
    run.prompt_tokens += s.prompt_tokens;
    run.reused_hbm += s.from_hbm;
    run.reused_tier += s.from_tier;
    run.reuse_bound += w.turns[i].reuse_bound;
    run.bytes_loaded += s.bytes_loaded;
    switch (s.load) {
      case LoadKind::none: ++run.computed_without_load; break;
      case LoadKind::kv_only: ++run.loads_kv_only; break;
      case LoadKind::joint: ++run.loads_joint; break;
      case LoadKind::state_only: ++run.loads_state_only; break;
    }
    if (s.outcome) {
      if (*s.outcome == Resolution::completed) ++run.outcome_completed;
      else if (*s.outcome == Resolution::failed) ++run.outcome_failed;
      else ++run.outcome_other;
    }
    run.state_missed += s.state_missed;
    if (s.resume_refused) {
      ++run.resumes_refused;
      ++run.corrupted_loads;
      if (run.first_refusal.empty()) run.first_refusal = w.turns[i].label + ": " + s.refusal;
    }
    if (settings.two_passes) {
      ++run.compared;
      if (!(run.outputs[i] == reference[i])) {
        ++run.two_pass_delta;
        if (s.resumed_at > 0) ++run.corrupted_loads;
        if (run.first_difference.empty())
          run.first_difference = w.turns[i].label + (s.resumed_at > 0 ? " (resumed at token " + std::to_string(s.resumed_at) + ")"
                                                                      : std::string(" (computed from token 0)"));
      }
    }
  }
  const CoordinatorStats cs = server.coordinator_stats();
  const IndexStats is = server.index_stats();
  run.checkpoints_planned = cs.checkpoints_planned;
  run.checkpoints_saved = cs.checkpoints_saved;
  run.checkpoints_deduplicated = cs.checkpoints_deduplicated;
  run.saves_stored = is.saves_stored;
  run.saves_failed = is.saves_failed;
  run.cache_ledger = server.cache_stats();
  run.cache_keeper = server.cache_keeper_stats();
  run.audit = server.audit();
  return run;
}

/// Time to first token for a prompt of `length + 16` tokens served from the tier (its first
/// `length` tokens restored: KV and, for a hybrid model, the state) against the same prompt
/// recomputed, median of `reps` each; the hits come from the memory tier, then from the disk
/// tier alone (a fresh memory tier over the same directory, as after a restart). Every hit
/// must give the recompute's bits.
template <class E>
TtftRow measure_ttft(const SequenceRunner& runner, TokenCount length, std::size_t reps, const RunSettings& settings,
                     const std::filesystem::path& dir) {
  TtftRow row;
  const std::vector<llama_token> prompt = seeded_prompt(length + 16, 0x7474667400ULL + length, runner.model().vocab_size());
  row.prompt = prompt.size();
  std::vector<double> recompute, memory, memory_load, memory_rebuild, disk;
  Output reference;
  for (std::size_t i = 0; i < reps; ++i) {
    const Served s = compute_from_scratch(runner, prompt, 1);
    recompute.push_back(s.ttft_seconds);
    reference = Output{s.decoded.tokens, s.decoded.first_logits};
  }
  ServeOptions o;
  o.chunk_tokens = settings.chunk_tokens;
  o.model_id = model_id_for(runner, settings.chunk_tokens);
  o.max_request_tokens = prompt.size() + 1;
  o.num_blocks = static_cast<std::uint32_t>(TokenGrid{runner.options().block_tokens}.cells_covering(o.max_request_tokens) + 1);
  o.checkpoints = settings.checkpoints;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto check = [&](const Served& s) {
    row.same_bits = row.same_bits && Output{s.decoded.tokens, s.decoded.first_logits} == reference && !s.resume_refused;
    row.reused = s.from_tier;
    row.load = s.load;
    row.bytes_loaded = s.bytes_loaded;
  };
  {
    MemoryDiskTier tiers(std::size_t{1} << 30, dir);
    E server(runner, tiers.tier, o);
    (void)server.serve(prompt, 1);  // computes and saves
    for (std::size_t i = 0; i < reps; ++i) {
      server.drop_prefix_cache();
      const Served s = server.serve(prompt, 1);
      check(s);
      memory.push_back(s.ttft_seconds);
      memory_load.push_back(s.load_seconds);
      memory_rebuild.push_back(s.rebuild_seconds);
    }
    server.drain();
  }
  for (std::size_t i = 0; i < reps; ++i) {
    MemoryDiskTier tiers(std::size_t{1} << 30, dir);
    E server(runner, tiers.tier, o);
    (void)server.reseed_from_tier();
    const Served s = server.serve(prompt, 1);
    check(s);
    disk.push_back(s.ttft_seconds);
    server.drain();
  }
  std::filesystem::remove_all(dir);
  row.recompute_ms = 1e3 * detail::median(recompute);
  row.memory_ms = 1e3 * detail::median(memory);
  row.memory_load_ms = 1e3 * detail::median(memory_load);
  row.memory_rebuild_ms = 1e3 * detail::median(memory_rebuild);
  row.disk_ms = 1e3 * detail::median(disk);
  return row;
}

}  // namespace llama_app
