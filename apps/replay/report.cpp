// kvfuse-replay: the report's rows, the terminal table and the JSON (report.hpp).
#include "report.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>

namespace replay {

namespace {


nlohmann::json latency_json(const Latency& l) { return {{"count", l.count}, {"p50_us", l.p50}, {"p99_us", l.p99}}; }
std::string latency_text(const Latency& l) { return l.count ? fixed(l.p50, 0) + " / " + fixed(l.p99, 0) : "-"; }

nlohmann::json loads_json(const RunResult& r) {
  return {{"kv_only", r.loads_kv_only}, {"joint", r.loads_joint}, {"state_only", r.loads_state_only}, {"pd_transfer", r.loads_pd}};
}

/// How a row's value reads in the table by default.
std::uint64_t reused(const RunResult& r) { return r.reused_hbm + r.reused_tier; }

double per_request(std::uint64_t v, const RunResult& r) {
  return static_cast<double>(v) / static_cast<double>(std::max<std::size_t>(1, r.requests));
}

std::string percent(double share) { return fixed(100.0 * share, 2) + "%"; }

std::string plain(const nlohmann::json& v) {
  if (v.is_number_unsigned()) return thousands(v.get<std::uint64_t>());
  if (v.is_number()) return fixed(v.get<double>(), 0);
  if (v.is_string()) return v.get<std::string>();
  return "-";
}

}  // namespace

std::optional<std::uint64_t> dense_reused(const std::vector<ModelReport>& models) {
  for (const ModelReport& m : models)
    if (m.run.model == "dense") return reused(m.run);
  return std::nullopt;
}

std::vector<Row> report_rows(const Workload& w, std::optional<std::uint64_t> dense) {
  using J = nlohmann::json;
  using M = const ModelReport&;
  std::vector<Row> rows;
  auto add = [&](std::string label, std::string key, std::function<J(M)> value, std::function<std::string(M)> show = {}) {
    rows.push_back(Row{std::move(label), std::move(key), std::move(value), std::move(show)});
  };
  auto heading = [&](std::string label) { rows.push_back(Row{std::move(label), "", {}, {}}); };
  add("ranks as", "/ranks_as", [](M m) { return m.run.ranks_as; });
  add("requests", "/requests/total", [](M m) { return m.run.requests; });
  add("  completed", "/requests/completed", [](M m) { return m.run.completed; });
  add("  aborted mid-load", "/requests/aborted", [](M m) { return m.run.aborted; });
  add("  preempted mid-load (re-admitted)", "/requests/preempted", [](M m) { return m.run.preempted; });
  add("  computed without a load", "/requests/computed_without_load", [](M m) { return m.run.admitted_compute; });
  add("", "/requests/readmitted_while_held", [](M m) { return m.run.readmitted_while_held; });
  add("loads: kv-only", "/loads/kv_only", [](M m) { return m.run.loads_kv_only; });
  add("       joint", "/loads/joint", [](M m) { return m.run.loads_joint; });
  add("       state-only", "/loads/state_only", [](M m) { return m.run.loads_state_only; });
  add("       P/D transfer", "/loads/pd_transfer", [](M m) { return m.run.loads_pd; });
  add("outcomes: completed", "/outcomes/completed", [](M m) { return m.run.outcome_completed; });
  add("          failed", "/outcomes/failed", [](M m) { return m.run.outcome_failed; });
  add("          abandoned", "/outcomes/abandoned", [](M m) { return m.run.outcome_abandoned; });
  add("          state missed", "/outcomes/state_missed", [](M m) { return m.run.outcome_state_missed; });
  add("salvage: failed loads resumed", "/salvage/loads", [](M m) { return m.run.salvaged_loads; });
  add("         second loads", "/salvage/second_loads", [](M m) { return m.run.second_loads; });
  add("         salvaged tokens", "/salvage/salvaged_tokens", [](M m) { return m.run.salvaged_tokens; });
  add("         recomputed / fail-whole", "/salvage/recomputed_tokens", [](M m) { return m.run.recomputed_after_failed_loads; },
      [](M m) { return thousands(m.run.recomputed_after_failed_loads) + " / " + thousands(m.run.fail_whole_would_recompute); });
  add("", "/salvage/fail_whole_tokens", [](M m) { return m.run.fail_whole_would_recompute; });
  add("prompt tokens", "/reused_tokens/prompt_tokens", [](M m) { return m.run.prompt_tokens; });
  add("reused tokens: from HBM", "/reused_tokens/hbm", [](M m) { return m.run.reused_hbm; });
  add("               from the tier", "/reused_tokens/tier", [](M m) { return m.run.reused_tier; });
  if (w.from_trace) {
    auto of_bound = [bound = w.reuse_bound](M m) {
      return static_cast<double>(reused(m.run)) / static_cast<double>(std::max<std::uint64_t>(1, bound));
    };
    add("               total / trace bound", "/reused_share_of_bound", of_bound, [=](M m) { return percent(of_bound(m)); });
  }
  // Beside the bound, what the hybrid models lose to the dense one on the same workload: a
  // stateful model resumes only where a state checkpoint was saved.
  auto of_dense = [dense](M m) -> std::optional<double> {
    if (!dense) return std::nullopt;
    return static_cast<double>(reused(m.run)) / static_cast<double>(std::max<std::uint64_t>(1, *dense));
  };
  add("               total / dense's", "/reused_share_of_dense",
      [=](M m) { return of_dense(m) ? J(*of_dense(m)) : J(nullptr); },
      [=](M m) { return of_dense(m) ? percent(*of_dense(m)) : std::string("n/a"); });
  add("checkpoints: saved per request", "/checkpoints_per_request",
      [](M m) { return per_request(m.run.checkpoints_saved, m.run); },
      [](M m) { return m.model->stateful ? fixed(per_request(m.run.checkpoints_saved, m.run), 2) : "-"; });
  add("             state bytes per request", "/state_bytes_per_request",
      [](M m) { return per_request(m.run.state_bytes_stored, m.run); },
      [](M m) { return m.model->stateful ? thousands(static_cast<std::uint64_t>(per_request(m.run.state_bytes_stored, m.run))) : "-"; });
  add("             deduplicated", "/checkpoints/deduplicated", [](M m) { return m.run.checkpoints_deduplicated; });
  add("             skipped: no snapshot slot", "/checkpoints/skipped", [](M m) { return m.run.checkpoints_skipped; });
  add("", "/checkpoints/saved", [](M m) { return m.run.checkpoints_saved; });
  add("", "/checkpoints/state_bytes", [](M m) { return m.run.state_bytes_stored; });
  add("hashes retracted", "/hashes_retracted", [](M m) { return m.run.hashes_retracted; });
  add("late reports", "/late_reports", [](M m) { return m.run.late_reports; });
  add("orphans reclaimed", "/orphans_reclaimed", [](M m) { return m.run.orphans_reclaimed; });
  add("saves stored / failed", "", {}, [](M m) { return thousands(m.run.saves_stored) + " / " + thousands(m.run.saves_failed); });
  add("", "/saves/stored", [](M m) { return m.run.saves_stored; });
  add("", "/saves/failed", [](M m) { return m.run.saves_failed; });
  // The joint loads each latency is taken over: planned (admitted as joint) / timed (resumed
  // their request with tokens).
  auto joint_counts = [](const RunResult& r) { return thousands(r.loads_joint) + " / " + thousands(r.joint.count); };
  add("joint loads: planned / timed", "", {}, [=](M m) { return m.model->stateful ? joint_counts(m.run) : "-"; });
  add("joint load p50 / p99 (us)", "/latency/joint", [](M m) { return latency_json(m.run.joint); },
      [](M m) { return latency_text(m.run.joint); });
  add("  compared pass: planned / timed", "", {}, [=](M m) { return m.comparison ? joint_counts(*m.comparison) : "-"; });
  add("  compared pass: p50 / p99 (us)", "", {}, [](M m) { return m.comparison ? latency_text(m.comparison->joint) : "-"; });
  add("kv-only load p50 / p99 (us)", "/latency/kv_only", [](M m) { return latency_json(m.run.kv_only); },
      [](M m) { return latency_text(m.run.kv_only); });
  add("", "/latency/state_only", [](M m) { return latency_json(m.run.state_only); });
  add("", "/comparison", [](M m) {
    if (!m.comparison) return J(nullptr);
    return J{{"model", m.comparison->model},
             {"loads", loads_json(*m.comparison)},
             {"latency", {{"joint", latency_json(m.comparison->joint)}}}};
  });
  // One tier read per KV load is a batched tier's promise (a remote tier: one round trip).
  add("tier reads per KV load", "", {}, [](M m) {
    const TierCalls& c = m.run.tier_calls;
    return m.run.kv_loads_sent ? fixed(static_cast<double>(c.kv_reads) / static_cast<double>(m.run.kv_loads_sent), 2) : "-";
  });
  add("", "/tier_calls", [](M m) {
    const TierCalls& c = m.run.tier_calls;
    return J{{"kv_loads_sent", m.run.kv_loads_sent}, {"kv_reads", c.kv_reads}, {"kv_chunks_read", c.kv_chunks_read},
             {"state_reads", c.state_reads}, {"puts", c.puts}, {"contains", c.contains}, {"erases", c.erases},
             {"total", c.total()}};
  });
  add("staging bytes (all ranks)", "/staging_bytes", [](M m) { return m.run.staging_bytes; });
  add("bytes checked", "/verified_bytes", [](M m) { return m.run.verified_bytes; });
  add("throughput (requests/s)", "/requests_per_second",
      [](M m) { return static_cast<double>(m.run.requests) / std::max(1e-9, m.run.wall_seconds); },
      [](M m) { return fixed(static_cast<double>(m.run.requests) / std::max(1e-9, m.run.wall_seconds), 0); });
  add("", "/wall_seconds", [](M m) { return m.run.wall_seconds; });
  const std::vector<FaultRow> faults = fault_rows();
  for (std::size_t i = 0; i < faults.size(); ++i)
    add((i == 0 ? "faults: " : "        ") + std::string(faults[i].label), "/faults/" + std::string(faults[i].key),
        [i](M m) { return m.run.fault_counts[i]; });
  add("rank process deaths seen", "/rank_processes/deaths_seen", [](M m) { return m.run.rank_processes_lost; });
  add("  admissions torn down by them", "/rank_processes/torn_down", [](M m) { return m.run.rank_loss_preemptions; });
  add("rank processes: loads / saves", "", {}, [](M m) {
    if (m.run.rank_processes.empty()) return std::string("-");
    std::uint64_t loads = 0, saves = 0;
    for (const RankCounts& c : m.run.rank_processes) {
      loads += c.loads;
      saves += c.kv_saves + c.state_saves;
    }
    return thousands(loads) + " / " + thousands(saves);
  });
  add("rank processes: bytes checked", "", {}, [](M m) {
    if (m.run.rank_processes.empty()) return std::string("-");
    std::uint64_t bytes = 0;
    for (const RankCounts& c : m.run.rank_processes) bytes += c.bytes_checked;
    return thousands(bytes);
  });
  add("", "/rank_processes/ranks", [](M m) {
    J ranks = J::array();
    for (const RankCounts& c : m.run.rank_processes)
      ranks.push_back(J{{"incarnation", c.incarnation}, {"loads", c.loads}, {"kv_saves", c.kv_saves},
                        {"state_saves", c.state_saves}, {"records_emitted", c.records_emitted},
                        {"records_dropped", c.records_dropped}, {"bytes_checked", c.bytes_checked},
                        {"bytes_corrupted", c.bytes_corrupted}});
    return ranks;
  });
  add("", "/rank_processes/segment", [](M m) {
    if (!m.run.segment) return J(nullptr);
    const kvfuse::ShmEngineStats& g = *m.run.segment;
    return J{{"frames_sent", g.frames_sent},           {"records_received", g.records_received},
             {"dead_records_dropped", g.dead_records_dropped}, {"attaches", g.attaches},
             {"deaths", g.deaths},                     {"faulty", g.faulty},
             {"backpressure_waits", g.backpressure_waits}, {"backpressure_refusals", g.backpressure_refusals}};
  });
  heading("must be zero:");
  add("  invariant_violations", "/must_be_zero/invariant_violations", [](M m) { return m.zero(&RunResult::invariant_violations); });
  add("  corrupted_bytes", "/must_be_zero/corrupted_bytes", [](M m) { return m.zero(&RunResult::corrupted_bytes); });
  add("  stranded_parked", "/must_be_zero/stranded_parked", [](M m) { return m.zero(&RunResult::stranded_parked); });
  add("  leaked_slots", "/must_be_zero/leaked_slots", [](M m) { return m.zero(&RunResult::leaked_slots); });
  add("  two_pass_delta", "/must_be_zero/two_pass_delta", [](M m) { return m.two_pass_delta; },
      [](M m) { return m.two_pass ? thousands(m.two_pass_delta) + " of " + thousands(m.compared) : std::string("not run"); });
  add("", "/two_pass", [](M m) { return m.two_pass ? J{{"compared", m.compared}, {"delta", m.two_pass_delta}} : J(nullptr); });
  return rows;
}


void print_table(const std::vector<ModelReport>& models, const Workload& w) {
  std::printf("\n  %-34s", "");
  for (const ModelReport& m : models) std::printf(" %14s", m.run.model.c_str());
  std::printf("\n");
  for (const Row& row : report_rows(w, dense_reused(models))) {
    if (row.label.empty()) continue;
    if (!row.value && !row.show) {
      std::printf("  %s\n", row.label.c_str());
      continue;
    }
    std::printf("  %-34s", row.label.c_str());
    for (const ModelReport& m : models) std::printf(" %14s", (row.show ? row.show(m) : plain(row.value(m))).c_str());
    std::printf("\n");
  }
  for (const ModelReport& m : models)
    if (m.comparison) {
      const Model* c = find_model(m.model->comparison);
      std::printf("  compared pass of %s: %s (%s), the same workload\n", m.run.model.c_str(), m.comparison->model.c_str(),
                  c ? std::string(c->what).c_str() : "");
    }
  for (const ModelReport& m : models)
    if (const auto& c = m.capacity) {
      char share[32];
      *std::to_chars(share, share + sizeof share - 1, c->percent).ptr = '\0';  // shortest: 10, 2.5
      std::printf("  tier capacity of %s: %s%% of its unlimited working set, %s of %s bytes per rank\n", m.run.model.c_str(),
                  share, thousands(c->capacity_bytes).c_str(), thousands(c->working_set_bytes).c_str());
    }
  for (const ModelReport& m : models)
    if (const auto& l = m.run.cache_ledger) {
      std::printf("  cache ledger of %s (%s): keeps %s of %s bytes per rank (state %s), evicted %s KV / %s state, "
                  "refused %s first-seen checkpoints\n",
                  m.run.model.c_str(), std::string(kvfuse::to_string(*m.run.cache_policy)).c_str(), thousands(l->bytes).c_str(),
                  thousands(l->budget_bytes).c_str(), thousands(l->state_bytes).c_str(), thousands(l->evicted_kv).c_str(),
                  thousands(l->evicted_state).c_str(), thousands(l->refused_first_seen).c_str());
    }
}

nlohmann::json to_json(const std::vector<ModelReport>& models, const Workload& w, const nlohmann::json& options) {
  nlohmann::json j;
  j["workload"] = {{"source", w.source},
                   {"requests", w.requests.size()},
                   {"prompt_tokens", w.prompt_tokens},
                   {"reuse_bound_tokens", w.from_trace ? nlohmann::json(w.reuse_bound) : nlohmann::json(nullptr)}};
  j["options"] = options;
  bool ok = true;
  const std::vector<Row> rows = report_rows(w, dense_reused(models));
  for (const ModelReport& m : models) {
    nlohmann::json x = nlohmann::json::object();
    for (const Row& row : rows)
      if (!row.key.empty() && row.value) x[nlohmann::json::json_pointer(row.key)] = row.value(m);
    if (const auto& c = m.capacity)  // only with a share, so byte-capacity reports keep their keys
      x["tier_capacity"] = {{"percent", c->percent}, {"working_set_bytes", c->working_set_bytes}, {"bytes", c->capacity_bytes}};
    if (const auto& l = m.run.cache_ledger)  // only with --cache-policy
      x["cache_ledger"] = {{"policy", kvfuse::to_string(*m.run.cache_policy)},
                           {"budget_bytes", l->budget_bytes},
                           {"bytes", l->bytes},
                           {"kv_bytes", l->kv_bytes},
                           {"state_bytes", l->state_bytes},
                           {"admitted", l->admitted},
                           {"evicted_kv", l->evicted_kv},
                           {"evicted_state", l->evicted_state},
                           {"refused_first_seen", l->refused_first_seen},
                           {"refused_too_large", l->refused_too_large},
                           {"uses", l->uses},
                           {"forgotten", l->forgotten},
                           {"checkpoints_refused", m.run.checkpoints_refused}};
    ok = ok && m.must_be_zero_total() == 0;
    j["models"][m.run.model] = x;
  }
  j["ok"] = ok;
  return j;
}

std::string replay_metrics(const std::vector<ModelReport>& models, const Workload& w) {
  const std::optional<std::uint64_t> dense = dense_reused(models);
  std::string out;
  auto number = [](double v) {
    char b[32];
    const auto r = std::to_chars(b, b + sizeof b, v);
    return std::string(b, r.ptr);
  };
  auto family = [&](const char* name, const char* type, const char* help, auto value) {
    std::string samples;
    for (const ModelReport& m : models)
      if (const std::optional<double> v = value(m.run))
        samples += std::string(name) + "{model=\"" + m.run.model + "\"} " + number(*v) + "\n";
    if (samples.empty()) return;
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + samples;
  };
  using O = std::optional<double>;
  family("kvfuse_replay_checkpoints_per_request", "gauge", "State checkpoints saved per request of the workload.",
         [](const RunResult& r) -> O { return per_request(r.checkpoints_saved, r); });
  family("kvfuse_replay_checkpoints_skipped_total", "counter", "Prefill checkpoints skipped: no snapshot slot was free.",
         [](const RunResult& r) -> O { return static_cast<double>(r.checkpoints_skipped); });
  family("kvfuse_replay_reused_share_of_bound", "gauge", "Reused prompt tokens (HBM and tier) over the trace's reuse bound.",
         [&](const RunResult& r) -> O {
           if (!w.from_trace) return std::nullopt;
           return static_cast<double>(reused(r)) / static_cast<double>(std::max<std::uint64_t>(1, w.reuse_bound));
         });
  family("kvfuse_replay_reused_share_of_dense", "gauge",
         "Reused prompt tokens over the dense model's on the same workload in the same run.", [&](const RunResult& r) -> O {
           if (!dense) return std::nullopt;
           return static_cast<double>(reused(r)) / static_cast<double>(std::max<std::uint64_t>(1, *dense));
         });
  family("kvfuse_replay_state_bytes_per_request", "gauge", "State checkpoint bytes the tiers stored (all ranks) per request.",
         [](const RunResult& r) -> O { return per_request(r.state_bytes_stored, r); });
  return out;
}

}  // namespace replay
