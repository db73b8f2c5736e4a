// Randomised: 8 ranks as threads report random outcomes per key through their lane queues
// while the scheduler thread drains at random moments. Every key settles exactly once, with
// the merge a reference model predicts; records for keys never dispatched are all late.
// Built and run under TSan too.
#include "fake_index.hpp"
#include <doctest/doctest.h>

#include <kvfuse/worker/completion_guard.hpp>
#include <kvfuse/completion/settlement_pump.hpp>
#include <kvfuse/completion/tp_quorum.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

using namespace kvfuse;
using namespace std::chrono_literals;

namespace {

constexpr std::uint32_t world = 8;
constexpr std::uint64_t keys = 20000;  // about 1 s under TSan, 0.2 s without
constexpr std::uint64_t stores = keys / 4;
constexpr std::uint64_t ghosts = 50;  // per rank: records for loads that were never dispatched

std::uint64_t mix(std::uint64_t seed, std::uint64_t a, std::uint64_t b) {
  return mix64(seed ^ mix64(a * 0x9E3779B97F4A7C15ULL + b));
}

// The outcome rank r reports for load key k: a deterministic function of (seed, k, r), so
// the reference model can recompute it. Each load is KV-only, state-only or joint.
struct Outcome {
  bool has_kv;
  bool has_state;
  KvOutcome kv;
  StateOutcome state;
};
Outcome outcome(std::uint64_t seed, std::uint64_t k, std::uint32_t r) {
  const std::uint64_t shape = mix(seed, k, 1000) % 3;  // the same for every rank
  const bool has_kv = shape != 1;
  const bool has_state = shape != 0;
  const std::uint64_t x = mix(seed, k, r);
  Outcome o{has_kv, has_state, has_kv ? KvOutcome::ok : KvOutcome::none,
            has_state ? StateOutcome::restored : StateOutcome::none};
  // Mostly success, so keys that settle ok exist; sometimes each kind of failure.
  if (has_kv && x % 13 == 0) o.kv = KvOutcome::failed;
  if (has_state) {
    switch ((x >> 8) % 17) {
      case 0: o.state = StateOutcome::missed; break;
      case 1: o.state = StateOutcome::failed; break;
      case 2: o.state = StateOutcome::refused; break;
      default: break;
    }
  }
  return o;
}

Settlement reference(std::uint64_t seed, std::uint64_t k) {
  Settlement s{LoadKey{RequestId{k}, Generation{k + 1}}, true, false};
  for (std::uint32_t r = 0; r < world; ++r) {
    const Outcome o = outcome(seed, k, r);
    const bool kv_fine = !o.has_kv || o.kv == KvOutcome::ok;
    const bool state_fine = !o.has_state || o.state == StateOutcome::restored;
    s.ok = s.ok && kv_fine && state_fine;
    s.state_missed = s.state_missed || o.state == StateOutcome::missed;
  }
  return s;
}

SaveSettlement save_reference(std::uint64_t seed, std::uint64_t i, SavePhase phase) {
  SaveSettlement s{SaveKey{PrefixHash{i}, Generation{i + 1}}, phase, true};
  for (std::uint32_t r = 0; r < world; ++r) {
    const std::uint64_t x = mix(seed, i + 1'000'000, r);
    s.ok = s.ok && (phase == SavePhase::stored ? x % 11 != 0 : x % 7 != 0);
  }
  return s;
}

using Index = testing::FakeIndex;

// One rank: its keys in its own random order, through guards, with random pauses.
void run_rank(std::uint64_t seed, std::uint32_t rank, LaneEmitter& lane) {
  std::mt19937_64 rng(seed * 31 + rank);
  std::vector<std::uint64_t> work;  // < keys: a load; [keys, keys+stores): a save; beyond: a ghost
  for (std::uint64_t i = 0; i < keys + stores + ghosts; ++i) work.push_back(i);
  std::shuffle(work.begin(), work.end(), rng);
  for (std::uint64_t w : work) {
    if (w < keys) {
      const Outcome o = outcome(seed, w, rank);
      CompletionGuard guard(LoadLegs{LoadKey{RequestId{w}, Generation{w + 1}}, o.has_kv, o.has_state}, rank, lane);
      if (o.kv == KvOutcome::ok) guard.kv_ok();
      if (o.kv == KvOutcome::failed) guard.kv_failed(Reason::kv_chunk_missing);
      if (o.has_state) guard.state(o.state, o.state == StateOutcome::restored ? Reason::none : Reason::state_transfer_failed);
    } else if (w < keys + stores) {
      const std::uint64_t i = w - keys;
      const std::uint64_t x = mix(seed, i + 1'000'000, rank);
      SaveGuard guard(SaveKey{PrefixHash{i}, Generation{i + 1}}, rank, lane);
      if (x % 11 != 0) guard.stored_ok();
      else guard.fail(Reason::kv_transfer_failed);
      if (x % 7 != 0) guard.release_source();
    } else {
      // A load the engine never dispatched (generation 0 is never issued).
      CompletionGuard guard(LoadLegs{LoadKey{RequestId{w}, Generation{0}}, true, false}, rank, lane);
      guard.kv_ok();
    }
    if (rng() % 64 == 0) std::this_thread::yield();
    if (rng() % 2048 == 0) std::this_thread::sleep_for(50us);
  }
}

}  // namespace

TEST_CASE("R4 randomized: 8 rank threads with random outcomes and drain timing settle each key once as the model says") {
  for (std::uint64_t seed : {1ULL, 2ULL}) {
    CAPTURE(seed);
    TpQuorumOptions cfg;
    cfg.world_size = world;
    cfg.lanes_per_rank = 1;
    cfg.lane_capacity = 64;  // small enough that lanes fill and back off now and then
    cfg.tombstones = 256;    // far fewer than keys: the index, not the FIFO, keeps R3
    cfg.backoff = Backoff{64, 4096, 50us};
    TpQuorum group(cfg);
    Index index;
    SettlementPump<TpQuorum, Index> pump(group, index);
    for (std::uint64_t k = 0; k < keys; ++k) index.outstanding.insert(LoadKey{RequestId{k}, Generation{k + 1}});
    for (std::uint64_t i = 0; i < stores; ++i) index.saves.insert(SaveKey{PrefixHash{i}, Generation{i + 1}});

    std::vector<LaneEmitter> lanes;
    for (std::uint32_t r = 0; r < world; ++r) lanes.push_back(group.emitter(r, 0));
    std::vector<std::thread> ranks;
    std::atomic<std::uint32_t> finished{0};
    for (std::uint32_t r = 0; r < world; ++r)
      ranks.emplace_back([&, r] {
        run_rank(seed, r, lanes[r]);
        finished.fetch_add(1);
      });

    std::mt19937_64 rng(seed);
    std::uint64_t load_settlements = 0;
    std::uint64_t store_settlements = 0;
    while (load_settlements < keys || store_settlements < 2 * stores) {
      const bool all_done = finished.load() == world;  // read before the step: nothing can follow it
      const auto step = pump.step();
      load_settlements += step.resolutions.size();
      store_settlements += step.saves.size();
      if (all_done && step.records == 0) break;  // a bug left keys unsettled: the checks below say which
      if (step.records == 0) std::this_thread::yield();
      const std::uint64_t pause = rng() % 8;
      if (pause == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
    }
    for (auto& t : ranks) t.join();
    const auto last = pump.step();  // the ghosts' stragglers, nothing else
    CHECK(last.resolutions.empty());
    CHECK(last.saves.empty());

    // Exactly once, exactly as the model says.
    CHECK(index.outstanding.empty());
    REQUIRE(index.settled.size() == keys);
    std::uint64_t wrong = 0;
    std::uint64_t ok = 0;
    std::uint64_t missed = 0;
    for (const Settlement& s : index.settled) {
      if (!(s == reference(seed, s.key.request.value))) ++wrong;
      ok += s.ok ? 1 : 0;
      missed += s.state_missed ? 1 : 0;
    }
    CHECK(wrong == 0);
    for (const auto& [key, count] : index.settle_count) CHECK(count == 1);
    CHECK(ok > 0);       // the model's mix produced every kind of verdict
    CHECK(missed > 0);
    CHECK(ok < keys);
    REQUIRE(index.save_settlements.size() == 2 * stores);  // released, then stored, per save
    std::uint64_t wrong_stores = 0;
    std::unordered_map<SaveKey, int> phases_seen;
    for (const SaveSettlement& s : index.save_settlements) {
      if (!(s == save_reference(seed, s.key.hash.value, s.phase))) ++wrong_stores;
      // The released phase of a save always settles before its stored phase.
      const int seen = phases_seen[s.key]++;
      CHECK((s.phase == SavePhase::released) == (seen == 0));
    }
    CHECK(wrong_stores == 0);
    CHECK(phases_seen.size() == stores);

    const PumpStats st = pump.stats();
    CHECK(st.group.pending == 0);
    CHECK(st.group.pending_saves == 0);
    CHECK(st.late_reports == world * ghosts);
    CHECK(st.group.duplicate_reports == 0);
    CHECK(st.group.invalid_reports == 0);
    CHECK(st.group.queues.drained == world * (keys + 2 * stores + ghosts));
    CHECK(st.group.queues.dropped_after_close == 0);
  }
}
