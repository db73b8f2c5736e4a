// R1: a guard emits exactly one record per dispatch on every path out of its scope.
#include <doctest/doctest.h>

#include <kvfuse/worker/completion_guard.hpp>
#include <kvfuse/completion/rank_queue.hpp>

#include <stdexcept>
#include <type_traits>
#include <vector>

using namespace kvfuse;

namespace {

/// Collects what a guard emits, in order.
struct RecordingEmitter {
  std::vector<CompletionRecord> loads;
  std::vector<SaveRecord> stores;
  void emit(const CompletionRecord& r) noexcept { loads.push_back(r); }
  void emit(const SaveRecord& r) noexcept { stores.push_back(r); }
};

struct ThrowingEmitEmitter {  // emit may throw: not a RecordEmitter
  void emit(const CompletionRecord&) {}
  void emit(const SaveRecord&) {}
};
struct LoadOnlyEmitter {  // cannot carry store records: not a RecordEmitter
  void emit(const CompletionRecord&) noexcept {}
};

static_assert(RecordEmitter<RecordingEmitter>);
static_assert(RecordEmitter<LaneEmitter>);
static_assert(!RecordEmitter<ThrowingEmitEmitter>);
static_assert(!RecordEmitter<LoadOnlyEmitter>);
static_assert(!std::is_copy_constructible_v<CompletionGuard<RecordingEmitter>>);
static_assert(!std::is_move_constructible_v<CompletionGuard<RecordingEmitter>>);
static_assert(!std::is_move_assignable_v<CompletionGuard<RecordingEmitter>>);
static_assert(!std::is_copy_constructible_v<SaveGuard<RecordingEmitter>>);
static_assert(!std::is_move_constructible_v<SaveGuard<RecordingEmitter>>);

const LoadKey key{RequestId{7}, Generation{3}};

LoadRequest joint_request() {
  LoadRequest req;
  req.key = key;
  req.kv = KvSpec{0, 256, {PrefixHash{1}}, {BlockId{0}}};
  req.state = StateSpec{256, PrefixHash{9}, SlotId{2}, 16, 256};
  return req;
}

struct LegFailure : std::runtime_error {
  LegFailure() : std::runtime_error("leg failed") {}
};

// A load task shaped like a connector's: the guard is its first line.
enum class Path { success, throw_in_state_leg, early_return, refuse_state, kv_only_ran };

void load_task(const LoadRequest& req, RecordingEmitter& out, Path path) {
  CompletionGuard guard(req, 3, out);
  if (path == Path::refuse_state) guard.state(StateOutcome::refused, Reason::grid_mismatch);
  if (path == Path::early_return) {
    guard.kv_failed(Reason::kv_chunk_missing);
    return;  // the state leg never runs
  }
  guard.kv_ok();
  if (path == Path::kv_only_ran) return;
  if (path == Path::throw_in_state_leg) throw LegFailure();
  if (path != Path::refuse_state) guard.state(StateOutcome::restored);
}

}  // namespace

TEST_CASE("R1 a successful joint load emits exactly one ok record") {
  RecordingEmitter out;
  load_task(joint_request(), out, Path::success);
  REQUIRE(out.loads.size() == 1);
  // Its one chunk restored: what a salvage could resume from if the state had failed.
  CHECK(out.loads[0] == CompletionRecord{key, 3, KvOutcome::ok, StateOutcome::restored, Reason::none, Reason::none, 1});
  CHECK(record_ok(out.loads[0]));
  CHECK(out.stores.empty());
}

TEST_CASE("R1 an exception thrown mid-leg still emits exactly one failed record") {
  RecordingEmitter out;
  CHECK_THROWS_AS(load_task(joint_request(), out, Path::throw_in_state_leg), LegFailure);
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0].kv == KvOutcome::ok);                // legs do not gate each other
  CHECK(out.loads[0].state == StateOutcome::failed);      // failed, never missed: retracts nothing
  CHECK(out.loads[0].kv_reason == Reason::none);
  CHECK(out.loads[0].state_reason == Reason::exception);
  CHECK_FALSE(record_ok(out.loads[0]));
}

TEST_CASE("R1 an early return emits exactly one record with the unrun leg failed") {
  RecordingEmitter out;
  load_task(joint_request(), out, Path::early_return);
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0].kv == KvOutcome::failed);
  CHECK(out.loads[0].state == StateOutcome::failed);
  CHECK(out.loads[0].kv_reason == Reason::kv_chunk_missing);
  CHECK(out.loads[0].state_reason == Reason::leg_not_run);  // each leg keeps its own reason
}

TEST_CASE("R1 a refused state leg emits exactly one record carrying the refusal") {
  RecordingEmitter out;
  load_task(joint_request(), out, Path::refuse_state);
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0].kv == KvOutcome::ok);
  CHECK(out.loads[0].state == StateOutcome::refused);
  CHECK(out.loads[0].kv_reason == Reason::none);
  CHECK(out.loads[0].state_reason == Reason::grid_mismatch);
  CHECK_FALSE(record_missed_state(out.loads[0]));
}

TEST_CASE("R1 when only the KV leg ran the record says the state leg did not run") {
  RecordingEmitter out;
  load_task(joint_request(), out, Path::kv_only_ran);
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0].kv == KvOutcome::ok);
  CHECK(out.loads[0].state == StateOutcome::failed);
  CHECK(out.loads[0].state_reason == Reason::leg_not_run);
  CHECK_FALSE(record_ok(out.loads[0]));
}

TEST_CASE("R1 a guard whose task reported nothing emits one record with safe defaults") {
  RecordingEmitter out;
  {
    CompletionGuard guard(joint_request(), 0, out);
    CHECK(out.loads.empty());  // nothing is emitted before the scope ends
  }
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0] == CompletionRecord{key, 0, KvOutcome::failed, StateOutcome::failed, Reason::leg_not_run, Reason::leg_not_run});
}

TEST_CASE("R1 a KV-only and a state-only load report `none` for the leg they do not have") {
  RecordingEmitter out;
  {
    CompletionGuard guard(LoadLegs{key, true, false}, 1, out);
    guard.kv_ok();
    guard.state(StateOutcome::restored);  // no state leg: ignored
  }
  {
    CompletionGuard guard(LoadLegs{key, false, true}, 1, out);
    guard.kv_ok();  // no KV leg: ignored
    guard.state(StateOutcome::restored);
  }
  REQUIRE(out.loads.size() == 2);
  CHECK(out.loads[0] == CompletionRecord{key, 1, KvOutcome::ok, StateOutcome::none, Reason::none, Reason::none});
  CHECK(out.loads[1] == CompletionRecord{key, 1, KvOutcome::none, StateOutcome::restored, Reason::none, Reason::none});
  CHECK(record_ok(out.loads[0]));
  CHECK(record_ok(out.loads[1]));
}

TEST_CASE("R4 within a guard a failure is never overwritten by a later success") {
  RecordingEmitter out;
  {
    CompletionGuard guard(joint_request(), 0, out);
    guard.kv_failed(Reason::kv_transfer_failed);
    guard.kv_ok();
    guard.state(StateOutcome::missed);
    guard.state(StateOutcome::restored);
    guard.state(StateOutcome::failed, Reason::state_transfer_failed);  // the first failure stands
  }
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0] ==
        CompletionRecord{key, 0, KvOutcome::failed, StateOutcome::missed, Reason::kv_transfer_failed, Reason::none});
}

TEST_CASE("R2 a record keeps both legs' reasons when both fail") {
  RecordingEmitter out;
  {
    CompletionGuard guard(joint_request(), 0, out);
    guard.kv_failed(Reason::kv_chunk_missing);
    guard.state(StateOutcome::refused, Reason::entry_size_mismatch);
  }
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0].kv_reason == Reason::kv_chunk_missing);
  CHECK(out.loads[0].state_reason == Reason::entry_size_mismatch);
}

TEST_CASE("R1 a load with neither leg emits one record with invalid_spec on both legs") {
  RecordingEmitter out;
  { CompletionGuard guard(LoadRequest{}, 4, out); }
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0] ==
        CompletionRecord{LoadKey{}, 4, KvOutcome::none, StateOutcome::none, Reason::invalid_spec, Reason::invalid_spec});
  CHECK_FALSE(record_ok(out.loads[0]));
}

TEST_CASE("R2 fail_legs after an exception keeps a genuine miss so the hash is still retracted") {
  RecordingEmitter out;
  {
    CompletionGuard guard(joint_request(), 0, out);
    guard.state(StateOutcome::missed);
    try {
      throw LegFailure();
    } catch (const LegFailure&) {
      guard.fail_legs(Reason::exception);
    }
  }
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0].kv == KvOutcome::failed);
  CHECK(out.loads[0].state == StateOutcome::missed);
  CHECK(record_missed_state(out.loads[0]));
}

TEST_CASE("R2 a state leg cannot vanish: `none` on a stateful load is recorded as failed") {
  RecordingEmitter out;
  {
    CompletionGuard guard(joint_request(), 0, out);
    guard.kv_ok();
    guard.state(StateOutcome::none);
  }
  REQUIRE(out.loads.size() == 1);
  CHECK(out.loads[0].state == StateOutcome::failed);
  CHECK(out.loads[0].state_reason == Reason::leg_not_run);
  CHECK_FALSE(record_ok(out.loads[0]));
}

TEST_CASE("R1 a guard over a lane queue emits one record per dispatch into the lane") {
  RankQueue queue(0, RankQueueOptions{1, 8, {}});
  LaneEmitter lane = queue.emitter(0);
  for (int i = 0; i < 3; ++i) {
    CompletionGuard guard(LoadLegs{LoadKey{RequestId{1}, Generation{static_cast<std::uint64_t>(i + 1)}}, true, false},
                          0, lane);
    if (i == 1) continue;  // the early exit still reports
    guard.kv_ok();
  }
  std::vector<CompletionRecord> seen;
  struct Collect {
    std::vector<CompletionRecord>* out;
    void operator()(const CompletionRecord& r) noexcept { out->push_back(r); }
    void operator()(const SaveRecord&) noexcept {}
  } collect{&seen};
  CHECK(queue.drain(collect) == 3);
  REQUIRE(seen.size() == 3);
  CHECK(seen[0].kv == KvOutcome::ok);
  CHECK(seen[1].kv == KvOutcome::failed);
  CHECK(seen[1].kv_reason == Reason::leg_not_run);
  CHECK(seen[2].kv == KvOutcome::ok);
}

// ---- the save-side guard: two records, released then stored ------------------------------

namespace {
const SaveKey skey{PrefixHash{5}, Generation{9}};
SaveRecord released(std::uint32_t rank, bool ok = true) {
  return SaveRecord{skey, rank, SavePhase::released, ok, ok ? Reason::none : Reason::source_unconfirmed};
}
}  // namespace

TEST_CASE("R1 a save that reported nothing emits two records: source unconfirmed (pinned) and not stored") {
  RecordingEmitter out;
  { SaveGuard guard(skey, 2, out); }
  REQUIRE(out.stores.size() == 2);
  CHECK(out.stores[0] == released(2, false));
  CHECK(out.stores[1] == SaveRecord{skey, 2, SavePhase::stored, false, Reason::leg_not_run});
  CHECK(out.loads.empty());
}

TEST_CASE("R1 a successful save emits released at once and stored when the scope ends") {
  RecordingEmitter out;
  {
    SaveGuard guard(skey, 2, out);
    guard.release_source();
    REQUIRE(out.stores.size() == 1);  // early: before the put
    CHECK(out.stores[0] == released(2));
    CHECK(guard.source_released());
    guard.release_source();  // once only
    guard.stored_ok();
    CHECK(out.stores.size() == 1);
  }
  REQUIRE(out.stores.size() == 2);
  CHECK(out.stores[1] == SaveRecord{skey, 2, SavePhase::stored, true, Reason::none});
}

TEST_CASE("R1 a save that throws after its gather was issued emits two records keeping the source pinned") {
  RecordingEmitter out;
  auto task = [&] {
    SaveGuard guard(skey, 0, out);
    // gather issued here; the exception comes before its completion was observed
    throw LegFailure();
  };
  CHECK_THROWS_AS(task(), LegFailure);
  REQUIRE(out.stores.size() == 2);
  CHECK(out.stores[0] == released(0, false));
  CHECK(out.stores[1].phase == SavePhase::stored);
  CHECK_FALSE(out.stores[1].ok);
  CHECK(out.stores[1].reason == Reason::exception);
}

TEST_CASE("R4 a failed save stays failed and a refused save may release its untouched source") {
  RecordingEmitter out;
  {
    SaveGuard guard(skey, 0, out);
    guard.fail(Reason::no_tier);
    guard.release_source();  // no gather was ever issued
    guard.stored_ok();       // ignored: the failure stands
  }
  REQUIRE(out.stores.size() == 2);
  CHECK(out.stores[0] == released(0));
  CHECK(out.stores[1] == SaveRecord{skey, 0, SavePhase::stored, false, Reason::no_tier});
}

TEST_CASE("R1 a save verdict applied with set() still yields two records and keeps failures sticky") {
  struct Verdict {
    bool stored = false;
    Reason reason = Reason::none;
  };
  RecordingEmitter out;
  {
    SaveGuard guard(SaveKey{PrefixHash{1}, Generation{1}}, 0, out);
    guard.release_source();
    guard.set(Verdict{true, Reason::none});
  }
  {
    SaveGuard guard(SaveKey{PrefixHash{1}, Generation{2}}, 0, out);
    guard.release_source();
    guard.set(Verdict{false, Reason::kv_transfer_failed});
    guard.set(Verdict{true, Reason::none});  // a later success does not overwrite the failure
  }
  REQUIRE(out.stores.size() == 4);
  CHECK(out.stores[1] == SaveRecord{SaveKey{PrefixHash{1}, Generation{1}}, 0, SavePhase::stored, true, Reason::none});
  CHECK(out.stores[3] ==
        SaveRecord{SaveKey{PrefixHash{1}, Generation{2}}, 0, SavePhase::stored, false, Reason::kv_transfer_failed});
}
