// backend_metrics.hpp — the backend's own counters and the Prometheus text kvfuse-llama-server
// appends to /metrics (docs/llama-server.md lists the families).
//
// Threading: llama-server's main loop only, like the backend that owns the counters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>

#include "cache_engine.hpp"
#include "tier_stack.hpp"

namespace kvfuse::llama_server {

/// What the backend counts itself (the SlotCache, index and coordinator count the rest).
/// Plain data.
struct BackendCounters {
  std::uint64_t prompt_tokens = 0;      ///< prompt tokens of the completions the server asked about
  std::uint64_t reused_slot = 0;        ///< of them, kept from the slot's own cells
  std::uint64_t reused_kvfuse = 0;      ///< of them, restored from the tiers
  std::uint64_t loads[4] = {};          ///< loads by LoadKind (none, kv-only, joint, state-only)
  std::uint64_t loads_completed = 0, loads_failed = 0;
  std::uint64_t restores_refused = 0;   ///< restored sequences llama.cpp refused
  std::uint64_t blob_refusals = 0;      ///< slot blobs the backend could not read or cut
  std::uint64_t settles = 0;            ///< ended tasks whose reply was recomputed as a prefill
  std::uint64_t settled_tokens = 0;     ///< tokens those recomputes decoded
  std::uint64_t tampered = 0;           ///< tier entries the tests' control tampered with
};

/// The Prometheus text of kvfuse's families: `engine` may be null (the model is served without
/// kvfuse); `control` says whether the tests' control is on (its family is shown only then).
inline std::string prometheus_text(const BackendCounters& b, const CacheEngine* engine, const TierStackStats& t, bool control) {
  std::ostringstream m;
  auto metric = [&](const char* name, const char* type, const char* help) {
    m << "# HELP kvfuse:" << name << " " << help << "\n# TYPE kvfuse:" << name << " " << type << "\n";
  };
  metric("prompt_tokens_total", "counter", "Prompt tokens of the completions kvfuse was asked about");
  m << "kvfuse:prompt_tokens_total " << b.prompt_tokens << "\n";
  metric("reused_tokens_total", "counter", "Prompt tokens not computed, by where their cells came from");
  m << "kvfuse:reused_tokens_total{source=\"slot\"} " << b.reused_slot << "\n";
  m << "kvfuse:reused_tokens_total{source=\"kvfuse\"} " << b.reused_kvfuse << "\n";
  metric("loads_total", "counter", "Loads from the tiers, by kind");
  static constexpr const char* kinds[] = {"none", "kv-only", "joint", "state-only"};
  for (std::size_t k = 1; k < 4; ++k) m << "kvfuse:loads_total{kind=\"" << kinds[k] << "\"} " << b.loads[k] << "\n";
  metric("load_outcomes_total", "counter", "How loads ended");
  m << "kvfuse:load_outcomes_total{outcome=\"completed\"} " << b.loads_completed << "\n";
  m << "kvfuse:load_outcomes_total{outcome=\"failed\"} " << b.loads_failed << "\n";
  metric("restores_refused_total", "counter", "Restored sequences llama.cpp refused: recomputed from token 0");
  m << "kvfuse:restores_refused_total " << b.restores_refused << "\n";
  metric("blob_refusals_total", "counter", "Slot blobs kvfuse could not read or cut (cells out of order, a state that does not fit): not saved");
  m << "kvfuse:blob_refusals_total " << b.blob_refusals + (engine ? engine->counters().codec_refusals : 0) << "\n";
  metric("settles_total", "counter", "Ended tasks whose reply kvfuse recomputed as a prefill and saved");
  m << "kvfuse:settles_total " << b.settles << "\n";
  metric("settled_tokens_total", "counter", "Tokens those recomputes decoded (outside any request's prompt processing)");
  m << "kvfuse:settled_tokens_total " << b.settled_tokens << "\n";
  if (control) {
    metric("control_tampered_total", "counter", "Tier entries the test control tampered with");
    m << "kvfuse:control_tampered_total " << b.tampered << "\n";
  }
  if (engine) {
    const CoordinatorStats c = engine->coordinator_stats();
    const IndexStats i = engine->index_stats();
    const SlotCacheCounters k = engine->counters();
    metric("checkpoints_total", "counter", "State checkpoints, by event");
    m << "kvfuse:checkpoints_total{event=\"planned\"} " << c.checkpoints_planned << "\n";
    m << "kvfuse:checkpoints_total{event=\"saved\"} " << c.checkpoints_saved << "\n";
    m << "kvfuse:checkpoints_total{event=\"deduplicated\"} " << c.checkpoints_deduplicated << "\n";
    metric("saves_total", "counter", "Saves to the tiers, by result");
    m << "kvfuse:saves_total{result=\"stored\"} " << i.saves_stored << "\n";
    m << "kvfuse:saves_total{result=\"failed\"} " << i.saves_failed << "\n";
    metric("saved_tokens_total", "counter", "Prompt tokens whose KV was saved");
    m << "kvfuse:saved_tokens_total " << k.kv_rows_saved << "\n";
    const HostAudit a = engine->audit();
    metric("must_be_zero", "gauge", "The numbers that must be zero between requests");
    m << "kvfuse:must_be_zero{what=\"invariant_violations\"} " << a.invariant_violations << "\n";
    m << "kvfuse:must_be_zero{what=\"stranded_parked\"} " << a.stranded_parked + k.stranded << "\n";
    m << "kvfuse:must_be_zero{what=\"leaked_blocks\"} " << a.leaked_blocks << "\n";
    m << "kvfuse:must_be_zero{what=\"leaked_slots\"} " << a.leaked_slots << "\n";
    m << "kvfuse:must_be_zero{what=\"held_admissions\"} " << a.held_admissions << "\n";
    if (const std::optional<CacheLedgerStats> l = engine->cache_stats()) {
      metric("cache_ledger_bytes", "gauge", "Bytes the cache ledger keeps (--kvfuse-cache-policy), by kind, and its budget");
      m << "kvfuse:cache_ledger_bytes{kind=\"kv\"} " << l->kv_bytes << "\n";
      m << "kvfuse:cache_ledger_bytes{kind=\"state\"} " << l->state_bytes << "\n";
      m << "kvfuse:cache_ledger_bytes{kind=\"budget\"} " << l->budget_bytes << "\n";
      metric("cache_ledger_total", "counter", "What the cache ledger did with the saves offered to it, by event");
      m << "kvfuse:cache_ledger_total{event=\"admitted\"} " << l->admitted << "\n";
      m << "kvfuse:cache_ledger_total{event=\"evicted_kv\"} " << l->evicted_kv << "\n";
      m << "kvfuse:cache_ledger_total{event=\"evicted_state\"} " << l->evicted_state << "\n";
      m << "kvfuse:cache_ledger_total{event=\"refused_first_seen\"} " << l->refused_first_seen << "\n";
      m << "kvfuse:cache_ledger_total{event=\"refused_too_large\"} " << l->refused_too_large << "\n";
    }
  }
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

}  // namespace kvfuse::llama_server
