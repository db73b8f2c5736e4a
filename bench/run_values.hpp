// bench/run_values.hpp — one number per benchmark, taken from Google Benchmark's runs the way
// every ratio of bench/README.md takes it: the median when the run was repeated
// (--benchmark_repetitions=N), else the single run. A reporter calls note() from its
// ReportRuns; the ratios read the values when it finalises. And the main() such a binary runs.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

namespace kvfuse_bench {

/// Values by benchmark function name. `Of` maps a run to its number (nullopt: the run has
/// none), e.g. its adjusted real time or one of its counters.
class RunValues {
 public:
  using Run = benchmark::BenchmarkReporter::Run;

  template <class Of>
  void note(const std::vector<Run>& runs, Of of) {
    for (const Run& run : runs) {
      const bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      if (run.run_type != Run::RT_Iteration && !median) continue;
      const std::optional<double> v = of(run);
      if (!v) continue;
      const std::string& name = run.run_name.function_name;
      if (median) {
        values_[name] = *v;
        from_median_.insert(name);
      } else if (!from_median_.contains(name)) {
        values_[name] = *v;
      }
    }
  }

  /// The value of `name`, if a run gave one.
  [[nodiscard]] std::optional<double> operator[](const std::string& name) const {
    const auto it = values_.find(name);
    if (it == values_.end()) return std::nullopt;
    return it->second;
  }

 private:
  std::map<std::string, double> values_;
  std::set<std::string> from_median_;
};

/// The main() of a benchmark binary with its own reporter: parse the flags, run, shut down.
/// 1 for a flag Google Benchmark does not know.
inline int run_benchmarks(int argc, char** argv, benchmark::BenchmarkReporter& reporter) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}

}  // namespace kvfuse_bench
