// kvfuse-replay: what one pass measured (RunResult), read from the objects after the run,
// and every stats counter for the Prometheus text.
#pragma once

#include "rank_tier.hpp"
#include "ranks.hpp"

#include <kvfuse/compose/loopback_pd.hpp>
#include <kvfuse/compose/prometheus.hpp>
#include <kvfuse/ipc/shm_engine.hpp>
#include <kvfuse/kvfuse.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace replay {

/// Percentiles of a latency sample, in microseconds.
struct Latency {
  std::size_t count = 0;
  double p50 = 0, p99 = 0;
  static Latency of(std::vector<double> v) {
    Latency l;
    l.count = v.size();
    if (v.empty()) return l;
    std::sort(v.begin(), v.end());
    auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))]; };
    l.p50 = at(0.50);
    l.p99 = at(0.99);
    return l;
  }
};

/// Everything one pass measured.
struct RunResult {
  std::string model;
  bool offload = true;
  std::size_t requests = 0, completed = 0, aborted = 0, preempted = 0;
  std::size_t admitted_compute = 0;  ///< admissions told to compute (no load)
  std::size_t readmitted_while_held = 0;  ///< admissions of a request whose earlier admission still held its resources
  std::size_t loads_kv_only = 0, loads_joint = 0, loads_state_only = 0, loads_pd = 0;
  std::size_t outcome_completed = 0, outcome_failed = 0, outcome_abandoned = 0, outcome_state_missed = 0;
  std::size_t resumed_from_load = 0;
  std::uint64_t salvaged_loads = 0;   ///< failed loads that resumed above 0 anyway (the Coordinator's salvage)
  std::uint64_t salvaged_tokens = 0;  ///< tokens above the HBM floor they kept
  std::uint64_t second_loads = 0;     ///< state-only loads sent after a stateful load failed part way
  std::uint64_t recomputed_after_failed_loads = 0;  ///< prompt tokens recomputed by requests whose load failed (or was salvaged)
  std::uint64_t fail_whole_would_recompute = 0;     ///< ... what they would have recomputed had a failed load kept nothing
  std::uint64_t prompt_tokens = 0, reused_hbm = 0, reused_tier = 0, reuse_bound = 0;
  std::uint64_t hashes_retracted = 0, late_reports = 0, orphans_reclaimed = 0, saves_stored = 0, saves_failed = 0;
  Latency joint, kv_only, state_only;  ///< loads that resumed their request, by kind
  std::uint64_t staging_bytes = 0, verified_bytes = 0;
  std::uint64_t kv_loads_sent = 0;     ///< loads with a KV leg handed to a rank, per rank
  std::string ranks_as = "threads";    ///< "threads" or "processes"
  std::uint64_t rank_processes_lost = 0;    ///< rank process deaths the engine saw
  std::uint64_t rank_loss_preemptions = 0;  ///< admissions torn down because a rank process died
  std::vector<RankCounts> rank_processes;   ///< per rank, what its process reported (processes only)
  std::optional<kvfuse::ShmEngineStats> segment;  ///< the engine side of the segment (processes only)
  std::uint64_t checkpoints_saved = 0;         ///< state checkpoints sent (mid-prefill and at finish)
  std::uint64_t checkpoints_deduplicated = 0;  ///< not sent: the index already had the hash
  std::uint64_t checkpoints_skipped = 0;       ///< prefill checkpoints not taken: no snapshot slot was free
  std::uint64_t checkpoints_refused = 0;       ///< not sent: the cache ledger refused them (--cache-policy cost)
  std::uint64_t state_bytes_stored = 0;        ///< state bytes the ranks' tiers stored, all ranks
  std::optional<kvfuse::CachePolicy> cache_policy;     ///< --cache-policy: the ledger's policy
  std::optional<kvfuse::CacheLedgerStats> cache_ledger;  ///< --cache-policy: the ledger's counters at the end
  TierCalls tier_calls;                ///< every rank's tier calls, summed
  double wall_seconds = 0;
  // the numbers that must be zero
  std::uint64_t invariant_violations = 0, corrupted_bytes = 0, stranded_parked = 0, leaked_slots = 0;
  std::vector<std::uint64_t> fault_counts;  ///< as injected, indexed like fault_rows()
  std::vector<std::uint64_t> outputs;       ///< per request: its output checksum, 0 = no output (aborted)
  /// Every stats counter after the run, for the Prometheus text (one family per counter
  /// across models, so main() formats all models' snapshots together).
  struct Snapshot {
    kvfuse::IndexStats index;
    kvfuse::PumpStats pump;
    kvfuse::CoordinatorStats coordinator;
    std::vector<kvfuse::ConnectorStats> connectors;
    std::vector<TierSnapshot> tiers;
    std::optional<kvfuse::LoopbackPd::Stats> pd;
  } snapshot;
};

/// Adds one pass's counters to `text`, every sample labelled with its model (and rank).
inline void add_metrics(kvfuse::PrometheusText& text, const RunResult& r) {
  const RunResult::Snapshot& s = r.snapshot;
  text.add(s.index, {{"model", r.model}});
  text.add(s.pump, {{"model", r.model}});
  text.add(s.coordinator, {{"model", r.model}});
  for (std::size_t i = 0; i < s.connectors.size(); ++i) {
    const std::string rank = std::to_string(i);
    text.add(s.connectors[i], {{"model", r.model}, {"rank", rank}});
    const TierSnapshot& t = s.tiers[i];
    if (t.memory) text.add(*t.memory, {{"model", r.model}, {"rank", rank}});
    if (t.disk) text.add(*t.disk, {{"model", r.model}, {"rank", rank}});
    if (t.stack) text.add(*t.stack, {{"model", r.model}, {"rank", rank}});
    if (t.redis && t.cluster) text.add(kvfuse::RedisClusterTierStats{*t.redis, *t.cluster, {}}, {{"model", r.model}, {"rank", rank}});
    else if (t.redis) text.add(*t.redis, {{"model", r.model}, {"rank", rank}});
  }
  if (s.pd) text.add(*s.pd, {{"model", r.model}});
}

}  // namespace replay
