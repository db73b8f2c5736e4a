// The one doctest main every test executable links.
//
// A run that executes no test case is a failure, not a pass. ctest runs each test case
// as its own entry, selected with --test-case=<name>; a name the filter syntax misreads
// (a `,` or `;`, a wildcard) selects nothing, and plain doctest would still exit 0 having
// run zero cases. A listener counts the cases that passed the filters, and main exits
// non-zero, saying so, when that count is zero. Queries (--list-test-cases, --count,
// --help, ...) run no test and are not affected.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

namespace {

/// What the last test run saw. Written by the listener on the main thread, read by main
/// after Context::run returned (doctest deletes its reporters before run returns).
struct RunOutcome {
  bool ran = false;                  ///< a run (not a query) reached its end
  unsigned cases_passing_filters = 0;
};
RunOutcome run_outcome;

/// Records how many test cases passed the filters when the run ends. Main thread only.
struct ZeroCaseListener : doctest::IReporter {
  explicit ZeroCaseListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& stats) override {
    run_outcome.ran = true;
    run_outcome.cases_passing_filters = stats.numTestCasesPassingFilters;
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

REGISTER_LISTENER("kvfuse_zero_case_run", 1, ZeroCaseListener);

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit()) return rc;
  if (run_outcome.ran && run_outcome.cases_passing_filters == 0) {
    std::fprintf(stderr,
                 "kvfuse: this run matched no test case (a --test-case filter that selects nothing, e.g. a test "
                 "name containing ',' ';' '*' '?' '[' or '\\'); a run that tests nothing fails\n");
    return 1;
  }
  return rc;
}
