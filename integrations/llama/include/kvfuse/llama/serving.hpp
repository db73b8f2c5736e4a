// kvfuse/llama/serving.hpp — the plain data of serving one llama.cpp request through kvfuse:
// how a Server is built (ServeOptions), what serving a request did (Served), and what must be
// zero at the end of a run (ServerAudit); and the reference every served request is compared
// with, the same request computed from token 0 (compute_from_scratch).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/resolution.hpp>
#include <kvfuse/engine/cache_policy.hpp>
#include <kvfuse/engine/checkpoint_policy.hpp>
#include <kvfuse/engine/planner.hpp>
#include <kvfuse/llama/sequence_runner.hpp>

namespace kvfuse::llama {

/// How a Server is built. Plain data; the Server constructor checks it.
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
  /// A cache ledger owns `cache_budget` bytes of the tier and decides what it keeps by this
  /// policy (host/cache_keeper.hpp); empty: the tier's own capacity decides.
  std::optional<CachePolicy> cache_policy;
  std::uint64_t cache_budget = 0;  ///< bytes; > 0 with a policy
};

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

/// The kind of load a plan makes. Any thread.
constexpr LoadKind load_kind_of(const LoadPlan& plan) noexcept {
  if (std::holds_alternative<KvOnlyLoad>(plan)) return LoadKind::kv_only;
  if (std::holds_alternative<JointLoad>(plan)) return LoadKind::joint;
  if (std::holds_alternative<StateOnlyLoad>(plan)) return LoadKind::state_only;
  return LoadKind::none;
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

/// What must be zero at the end of a run, read by Server::audit().
struct ServerAudit {
  std::uint64_t invariant_violations = 0;  ///< the host kit's audit (index, coordinator, book, the index walk) and the server's own
  std::uint64_t stranded_parked = 0;       ///< requests still parked, or given up waiting for their load
  std::uint64_t leaked_blocks = 0;         ///< blocks still pinned
  std::uint64_t leaked_slots = 0;          ///< request and snapshot slots not back, admissions still held
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

}  // namespace kvfuse::llama
