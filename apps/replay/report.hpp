// kvfuse-replay: the report — a terminal table with one column per model, the same numbers
// as JSON, and the progress line while a pass runs. Both come from one table of rows
// (report_rows): a row is a label in the terminal table and/or a key in each model's JSON,
// so adding a number to the report is adding one row.
#pragma once

#include "faults.hpp"
#include "models.hpp"
#include "result.hpp"
#include "workload.hpp"

#include <common/app_support.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <unistd.h>
#include <vector>

namespace replay {

/// One model's result, with its two-pass comparison and its comparison entry's pass.
/// What a --tier-capacity share resolved to for one model: its unlimited working set and the
/// capacity cut from it, in bytes per rank.
struct SizedCapacity {
  double percent = 0;
  std::uint64_t working_set_bytes = 0;  ///< the most bytes any rank's memory tier held with no limit
  std::uint64_t capacity_bytes = 0;     ///< ceil(percent / 100 x working set), at least 1
};

struct ModelReport {
  const Model* model = nullptr;
  RunResult run;
  std::optional<SizedCapacity> capacity;  ///< set when --tier-capacity was a share
  std::optional<RunResult> comparison;  ///< the model's comparison entry on the same workload
  bool two_pass = false;
  std::size_t compared = 0;          ///< requests with an output in both passes
  std::uint64_t two_pass_delta = 0;  ///< ... whose outputs differ
  /// A number that must be zero, over this pass and the comparison pass.
  std::uint64_t zero(std::uint64_t RunResult::*field) const {
    return run.*field + (comparison ? (*comparison).*field : 0);
  }
  std::uint64_t must_be_zero_total() const {
    return zero(&RunResult::invariant_violations) + zero(&RunResult::corrupted_bytes) + zero(&RunResult::stranded_parked) +
           zero(&RunResult::leaked_slots) + two_pass_delta;
  }
};

/// Terminal progress: a bar that redraws itself on a terminal, a plain line every two
/// seconds otherwise; silent for passes shorter than a second. Main thread only.
class Progress {
 public:
  Progress() : tty_(::isatty(STDOUT_FILENO) == 1) {}
  void begin(std::string label) {
    label_ = std::move(label);
    started_ = last_ = Clock::now();
    drawn_ = false;
  }
  void update(std::size_t done, std::size_t total, std::size_t in_flight) {
    const auto now = Clock::now();
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
  using Clock = std::chrono::steady_clock;
  bool tty_;
  bool drawn_ = false;
  std::string label_;
  Clock::time_point started_, last_;
};

using kvfuse_apps::fixed;
using kvfuse_apps::thousands;

/// One row of the report. `label`: the terminal table's row ("" = JSON only; no value = a
/// heading). `key`: a JSON pointer under the model's object ("" = terminal only). `show`:
/// the table's text, by default `value` shown plainly (numbers with thousands separators).
struct Row {
  std::string label;
  std::string key;
  std::function<nlohmann::json(const ModelReport&)> value;
  std::function<std::string(const ModelReport&)> show;
};

/// The dense model's reused tokens (HBM + tier) when it is among `models`.
std::optional<std::uint64_t> dense_reused(const std::vector<ModelReport>& models);

/// The report's rows, top to bottom (report.cpp). `w` decides the trace-only rows; `dense`
/// (dense_reused) the share of the dense model's reuse ("n/a" without it).
std::vector<Row> report_rows(const Workload& w, std::optional<std::uint64_t> dense);

/// The terminal table: one column per model, then what each compared pass is.
void print_table(const std::vector<ModelReport>& models, const Workload& w);

/// The replay's own Prometheus families (kvfuse_replay_*, one sample per model): the
/// checkpoints and state bytes per request, the skipped checkpoints, and the reused shares
/// of the bound (a trace) and of the dense model's (when it ran). Appended to the stats'
/// exposition by --metrics-out.
std::string replay_metrics(const std::vector<ModelReport>& models, const Workload& w);

/// The same numbers for machines.
nlohmann::json to_json(const std::vector<ModelReport>& models, const Workload& w, const nlohmann::json& options);

}  // namespace replay
