// kvfuse-replay: the report — a terminal table, the same numbers as JSON, and the progress
// line while a run goes.
#pragma once

#include "cluster.hpp"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <string>
#include <unistd.h>
#include <vector>

namespace replay {

/// One model's result, with its two-pass comparison and the after-KV latency beside it.
struct ModelReport {
  RunResult run;
  bool two_pass = false;
  std::size_t compared = 0;         ///< requests with an output in both passes
  std::uint64_t two_pass_delta = 0; ///< ... whose outputs differ
  std::optional<Latency> joint_after_kv;  ///< k3: the same workload with the state leg after KV
  std::uint64_t must_be_zero_total() const {
    return run.invariant_violations + run.corrupted_bytes + run.stranded_parked + run.leaked_slots + two_pass_delta;
  }
};

/// Terminal progress: a bar that redraws itself on a terminal, a plain line every two
/// seconds otherwise; silent for runs shorter than a second.
class Progress {
 public:
  Progress() : tty_(::isatty(STDOUT_FILENO) == 1) {}
  void begin(std::string label) {
    label_ = std::move(label);
    started_ = last_ = WallClock::now();
    drawn_ = false;
  }
  void update(std::size_t done, std::size_t total, std::size_t in_flight) {
    const auto now = WallClock::now();
    const double elapsed = std::chrono::duration<double>(now - started_).count();
    if (elapsed < 1.0 || (!tty_ && now - last_ < std::chrono::seconds(2))) return;
    last_ = now;
    const double rate = static_cast<double>(done) / elapsed;
    const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0;
    const std::size_t width = 24, filled = total ? width * done / total : 0;
    if (tty_) {
      std::printf("\r%-12s [%s%s] %zu/%zu requests, %zu loads in flight, %.0f req/s, ETA %.0f s   ", label_.c_str(),
                  std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(), done, total, in_flight, rate, eta);
      drawn_ = true;
    } else {
      std::printf("%s: %zu/%zu requests, %zu loads in flight, %.0f req/s, ETA %.0f s\n", label_.c_str(), done, total, in_flight,
                  rate, eta);
    }
    std::fflush(stdout);
  }
  void end() {
    if (drawn_) std::printf("\r%*s\r", 110, "");
    drawn_ = false;
    std::fflush(stdout);
  }

 private:
  bool tty_;
  bool drawn_ = false;
  std::string label_;
  WallClock::time_point started_, last_;
};

inline std::string thousands(std::uint64_t v) {
  const std::string digits = std::to_string(v);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

/// The terminal table: one column per model.
inline void print_table(const std::vector<ModelReport>& models, const Workload& w) {
  auto row = [&](const char* name, auto value) {
    std::printf("  %-34s", name);
    for (const ModelReport& m : models) std::printf(" %14s", value(m).c_str());
    std::printf("\n");
  };
  auto num = [](auto f) { return [f](const ModelReport& m) { return thousands(static_cast<std::uint64_t>(f(m))); }; };
  auto us = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.0f", v);
    return std::string(b);
  };
  std::printf("\n  %-34s", "");
  for (const ModelReport& m : models) std::printf(" %14s", m.run.model.c_str());
  std::printf("\n");
  row("requests", num([](const ModelReport& m) { return m.run.requests; }));
  row("  completed", num([](const ModelReport& m) { return m.run.completed; }));
  row("  aborted mid-load", num([](const ModelReport& m) { return m.run.aborted; }));
  row("  preempted mid-load (re-admitted)", num([](const ModelReport& m) { return m.run.preempted; }));
  row("  computed without a load", num([](const ModelReport& m) { return m.run.admitted_compute; }));
  row("loads: kv-only", num([](const ModelReport& m) { return m.run.loads_kv_only; }));
  row("       joint", num([](const ModelReport& m) { return m.run.loads_joint; }));
  row("       state-only", num([](const ModelReport& m) { return m.run.loads_state_only; }));
  row("       P/D transfer", num([](const ModelReport& m) { return m.run.loads_pd; }));
  row("outcomes: completed", num([](const ModelReport& m) { return m.run.outcome_completed; }));
  row("          failed", num([](const ModelReport& m) { return m.run.outcome_failed; }));
  row("          abandoned", num([](const ModelReport& m) { return m.run.outcome_abandoned; }));
  row("          state missed", num([](const ModelReport& m) { return m.run.outcome_state_missed; }));
  row("prompt tokens", num([](const ModelReport& m) { return m.run.prompt_tokens; }));
  row("reused tokens: from HBM", num([](const ModelReport& m) { return m.run.reused_hbm; }));
  row("               from the tier", num([](const ModelReport& m) { return m.run.reused_tier; }));
  if (w.from_trace) {
    row("               total / trace bound", [&](const ModelReport& m) {
      char b[32];
      std::snprintf(b, sizeof b, "%.2f%%", 100.0 * static_cast<double>(m.run.reused_hbm + m.run.reused_tier) /
                                               static_cast<double>(std::max<std::uint64_t>(1, w.reuse_bound)));
      return std::string(b);
    });
  }
  row("hashes retracted", num([](const ModelReport& m) { return m.run.hashes_retracted; }));
  row("late reports", num([](const ModelReport& m) { return m.run.late_reports; }));
  row("orphans reclaimed", num([](const ModelReport& m) { return m.run.orphans_reclaimed; }));
  row("saves stored / failed", [](const ModelReport& m) { return thousands(m.run.saves_stored) + " / " + thousands(m.run.saves_failed); });
  row("joint load p50 / p99 (us)", [&](const ModelReport& m) {
    return m.run.joint.count ? us(m.run.joint.p50) + " / " + us(m.run.joint.p99) : std::string("-");
  });
  row("  same, state leg after KV", [&](const ModelReport& m) {
    return m.joint_after_kv && m.joint_after_kv->count ? us(m.joint_after_kv->p50) + " / " + us(m.joint_after_kv->p99) : std::string("-");
  });
  row("kv-only load p50 / p99 (us)", [&](const ModelReport& m) {
    return m.run.kv_only.count ? us(m.run.kv_only.p50) + " / " + us(m.run.kv_only.p99) : std::string("-");
  });
  row("staging bytes (all ranks)", num([](const ModelReport& m) { return m.run.staging_bytes; }));
  row("bytes checked", num([](const ModelReport& m) { return m.run.verified_bytes; }));
  row("throughput (requests/s)", [](const ModelReport& m) {
    char b[32];
    std::snprintf(b, sizeof b, "%.0f", static_cast<double>(m.run.requests) / std::max(1e-9, m.run.wall_seconds));
    return std::string(b);
  });
  row("faults: tier entries evicted", num([](const ModelReport& m) { return m.run.f_evicted; }));
  row("        state entries removed", num([](const ModelReport& m) { return m.run.f_state_removed; }));
  row("        rank deaths", num([](const ModelReport& m) { return m.run.f_deaths; }));
  row("        disk tiers reopened", num([](const ModelReport& m) { return m.run.f_reopens; }));
  row("        files corrupted / quarantined",
      [](const ModelReport& m) { return thousands(m.run.f_corrupted) + " / " + thousands(m.run.f_quarantined); });
  std::printf("  must be zero:\n");
  row("  invariant_violations", num([](const ModelReport& m) { return m.run.invariant_violations; }));
  row("  corrupted_bytes", num([](const ModelReport& m) { return m.run.corrupted_bytes; }));
  row("  stranded_parked", num([](const ModelReport& m) { return m.run.stranded_parked; }));
  row("  leaked_slots", num([](const ModelReport& m) { return m.run.leaked_slots; }));
  row("  two_pass_delta", [](const ModelReport& m) {
    return m.two_pass ? thousands(m.two_pass_delta) + " of " + thousands(m.compared) : std::string("not run");
  });
}

inline nlohmann::json latency_json(const Latency& l) { return {{"count", l.count}, {"p50_us", l.p50}, {"p99_us", l.p99}}; }

/// The same numbers for machines.
inline nlohmann::json to_json(const std::vector<ModelReport>& models, const Workload& w, const nlohmann::json& options) {
  nlohmann::json j;
  j["workload"] = {{"source", w.source},
                   {"requests", w.requests.size()},
                   {"prompt_tokens", w.prompt_tokens},
                   {"reuse_bound_tokens", w.from_trace ? nlohmann::json(w.reuse_bound) : nlohmann::json(nullptr)}};
  j["options"] = options;
  bool ok = true;
  for (const ModelReport& m : models) {
    const RunResult& r = m.run;
    nlohmann::json x;
    x["requests"] = {{"total", r.requests}, {"completed", r.completed}, {"aborted", r.aborted}, {"preempted", r.preempted},
                     {"computed_without_load", r.admitted_compute}};
    x["loads"] = {{"kv_only", r.loads_kv_only}, {"joint", r.loads_joint}, {"state_only", r.loads_state_only}, {"pd_transfer", r.loads_pd}};
    x["outcomes"] = {{"completed", r.outcome_completed}, {"failed", r.outcome_failed}, {"abandoned", r.outcome_abandoned},
                     {"state_missed", r.outcome_state_missed}};
    x["reused_tokens"] = {{"hbm", r.reused_hbm}, {"tier", r.reused_tier}, {"prompt_tokens", r.prompt_tokens}};
    x["hashes_retracted"] = r.hashes_retracted;
    x["late_reports"] = r.late_reports;
    x["orphans_reclaimed"] = r.orphans_reclaimed;
    x["saves"] = {{"stored", r.saves_stored}, {"failed", r.saves_failed}};
    x["latency"] = {{"joint", latency_json(r.joint)}, {"kv_only", latency_json(r.kv_only)}, {"state_only", latency_json(r.state_only)}};
    if (m.joint_after_kv) x["latency"]["joint_state_after_kv"] = latency_json(*m.joint_after_kv);
    x["staging_bytes"] = r.staging_bytes;
    x["verified_bytes"] = r.verified_bytes;
    x["wall_seconds"] = r.wall_seconds;
    x["requests_per_second"] = static_cast<double>(r.requests) / std::max(1e-9, r.wall_seconds);
    x["faults"] = {{"tier_entries_evicted", r.f_evicted}, {"state_entries_removed", r.f_state_removed},
                   {"rank_deaths", r.f_deaths},       {"disk_reopens", r.f_reopens},
                   {"files_corrupted", r.f_corrupted}, {"files_quarantined", r.f_quarantined},
                   {"aborts", r.f_aborts},             {"preemptions", r.f_preempts}};
    x["two_pass"] = m.two_pass ? nlohmann::json{{"compared", m.compared}, {"delta", m.two_pass_delta}} : nlohmann::json(nullptr);
    x["must_be_zero"] = {{"invariant_violations", r.invariant_violations}, {"corrupted_bytes", r.corrupted_bytes},
                         {"stranded_parked", r.stranded_parked},           {"leaked_slots", r.leaked_slots},
                         {"two_pass_delta", m.two_pass_delta}};
    ok = ok && m.must_be_zero_total() == 0;
    j["models"][r.model] = x;
  }
  j["ok"] = ok;
  return j;
}

}  // namespace replay
