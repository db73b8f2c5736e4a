// The Coordinator against a small reference model: 10^5 random operations — admit
// (re-admission of a running request included), step, teardown (twice in a row
// included), finish (of a parked request included), mid-prefill checkpoints from snapshot
// slots, progress saves, tick, rank records delivered in any order with any outcome, rank
// death (every rank at once included) and return — on one thread, with the ranks simulated (records go through the pump's ingest). After every
// operation the invariants hold; every event the coordinator hands out is checked against
// what the model allows:
//   - a request unparks only while it is parked, exactly once per admission, with the
//     tokens its load claimed when the load completed and 0 otherwise;
//   - an admission's blocks and slot are freed only once it ended and no rank can
//     still write or read them: no record of any of its loads or saves is still
//     undelivered from a live rank; each admission is freed exactly once, under its id;
//   - a snapshot slot comes back only once no live rank may still read it, exactly once
//     per checkpoint saved from it;
//   - at the end, with every record delivered, nothing is parked, nothing is held, every
//     admission that ended was freed exactly once and every snapshot slot came back.
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/host/admission_book.hpp>
#include <kvfuse/kvfuse.hpp>
#include <kvfuse/engine/index_consistency.hpp>

#include <algorithm>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

using namespace kvfuse;
using namespace std::chrono_literals;

namespace {

using Clock = testing::ManualClock<struct CoordinatorModelTag>;
constexpr std::uint32_t kWorld = 3;
constexpr std::uint64_t kRequests = 12;
constexpr std::uint32_t kSlots = 12;
constexpr std::uint32_t kChunk = 64, kBlock = 16;
constexpr std::uint32_t kSnapshots = 4;  // snapshot slots 100..103, beside the requests' slots

/// One record a simulated rank still owes.
struct Owed {
  std::uint32_t rank;
  bool is_load;
  LoadKey load;
  SaveKey save;
  SavePhase phase = SavePhase::released;
  std::uint32_t chunks = 0;  ///< a load's KV chunks: what an ok record restored
};

/// Captures what the coordinator ships; the simulated ranks owe one record per load and two
/// per save.
struct SimTransport {
  std::vector<Owed>* owed = nullptr;
  std::set<std::uint32_t>* dead = nullptr;
  std::mt19937_64* rng = nullptr;
  std::uint64_t drops = 0;
  std::function<void(const LoadKey&)> on_load;  // a salvage's second load, sent inside a step
  bool throw_next = false;                      // a transport that throws instead of answering
  bool send(const LoadRequest& r) {
    if (std::exchange(throw_next, false)) throw std::runtime_error("transport down");
    if (on_load) on_load(r.key);
    if ((*rng)() % 40 == 0) {  // the connector found the prefix gone at build time
      ++drops;
      return false;
    }
    const auto chunks = static_cast<std::uint32_t>(r.kv ? r.kv->chunk_keys.size() : 0);
    for (std::uint32_t k = 0; k < kWorld; ++k)
      if (!dead->contains(k)) owed->push_back(Owed{k, true, r.key, {}, SavePhase::released, chunks});
    return true;
  }
  template <class Save>
  bool send(const Save& s) {
    if (std::exchange(throw_next, false)) throw std::runtime_error("transport down");
    for (std::uint32_t k = 0; k < kWorld; ++k)
      if (!dead->contains(k)) owed->push_back(Owed{k, false, {}, s.key, SavePhase::released});
    return true;
  }
};

/// Where the book hands freed blocks and slots: the requests share one block table and
/// draw slots from pairs of their own (slot_for), so the model only counts them.
struct Returned {
  std::uint64_t blocks = 0, slots = 0;
  void release(BlockId) { ++blocks; }
  bool give(SlotId) {
    ++slots;
    return true;
  }
};

struct AllHeld {
  std::size_t operator()(std::span<const PrefixHash> keys) const { return keys.size(); }
};

/// What the model knows of one admission: every load key it had (an orphan included) and
/// every save it sent.
struct ModelAdmission {
  std::set<LoadKey> loads;
  std::set<SaveKey> saves;
};

/// What the model knows of one request: its live admission, and the ended ones whose
/// release is still due.
struct ModelRequest {
  enum class State { idle, parked, running } state = State::idle;  // idle: no live admission
  LoadKey key{};
  TokenCount claims = 0;
  AdmissionId live{};
  ModelAdmission current;
  std::map<AdmissionId, ModelAdmission> ended;  // freed exactly once each, and only when safe
};

struct Run {
  std::mt19937_64 rng;
  std::vector<Owed> owed;
  std::set<std::uint32_t> dead;
  OffloadIndex<Clock> index{OffloadIndexOptions{.hash_capacity = 256, .slot_count = kSlots}};
  TpQuorum group{TpQuorumOptions{kWorld, 0, 64, 256}};
  SettlementPump<TpQuorum, OffloadIndex<Clock>> pump{group, index};
  SimTransport transport;
  AllHeld lookup;
  Coordinator<TpQuorum, SimTransport, AllHeld, Clock> coord{
      CoordinatorOptions{StateLayout::k3_recurrent, PlanGrids{kBlock, kChunk}, 0, 64}, index, pump, transport, lookup};
  std::map<std::uint64_t, ModelRequest> model;
  AdmissionBook<> book;  // the host kit's book, fed every decision and step: it must agree
  Returned returned;
  std::map<SaveKey, std::uint64_t> save_owner;
  std::vector<PrefixHash> keys;
  std::vector<BlockId> blocks;
  std::vector<Checkpoint> checkpoints;
  std::uint64_t unparks = 0, releases = 0, completed = 0, readmissions = 0, repeated_teardowns = 0, every_rank_dead = 0;
  std::uint64_t finishes_without_admission = 0, admitted_while_parked = 0, salvaged = 0;
  std::set<AdmissionId> admissions_seen;
  std::vector<SlotId> free_snapshots;
  std::map<SlotId, SaveKey> held_snapshots;  // snapshot -> the state save that reads it
  std::uint64_t checkpoints_saved = 0, checkpoints_refused_as_indexed = 0, snapshots_back = 0, progress = 0;

  explicit Run(std::uint64_t seed) : rng(seed) {
    for (std::uint32_t i = 0; i < kSnapshots; ++i) free_snapshots.push_back(SlotId{100 + i});
    transport.owed = &owed;
    transport.dead = &dead;
    transport.rng = &rng;
    // A load the coordinator sends on its own (a salvage's second load) belongs to the
    // request's parked admission: its ranks write that admission's slot.
    transport.on_load = [this](const LoadKey& k) {
      ModelRequest& m = model.at(k.request.value);
      if (m.state == ModelRequest::State::parked) m.current.loads.insert(k);
    };
    for (std::uint64_t c = 0; c < 4; ++c) keys.push_back(PrefixHash{900 + c});
    for (std::uint32_t b = 0; b < 16; ++b) blocks.push_back(BlockId{b});
    for (TokenCount b = kBlock; b < 4 * kChunk; b += kBlock) checkpoints.push_back(Checkpoint{b, PrefixHash{5000 + b}});
    for (const Checkpoint& c : checkpoints)
      if (c.boundary % 48 == 0) index.note_stored(c.hash);
    for (std::uint64_t r = 0; r < kRequests; ++r) model[r];
  }
  std::uint64_t pick(std::uint64_t n) { return rng() % n; }

  std::set<LoadKey> reclaimed;  // orphans reclaim aged out: R8 lets their memory go on the timeout

  /// True if some live rank still owes a record that touches the admission's device memory
  /// (reclaimed orphans aside: that is what the reclaim timeout is for, R8).
  bool owes(const ModelAdmission& a) const {
    for (const Owed& o : owed) {
      if (dead.contains(o.rank)) continue;
      if (o.is_load && a.loads.contains(o.load) && !reclaimed.contains(o.load)) return true;
      if (!o.is_load && o.phase == SavePhase::released && a.saves.contains(o.save)) return true;
    }
    return false;
  }

  /// The request's live admission ends (finish or teardown): its release is now due.
  void end_live(ModelRequest& m) {
    m.ended.emplace(m.live, std::move(m.current));
    m.current = {};
    m.state = ModelRequest::State::idle;
  }

  void absorb(const typename decltype(coord)::StepResult& s) {
    Returned snapshots_returned;
    std::uint64_t book_resumed = 0;
    book.apply(s, returned, returned, snapshots_returned, [&](auto&, const Unpark&) { ++book_resumed; });
    const AdmissionBookStats bs = book.stats();
    REQUIRE(bs.unexpected_unparks + bs.unexpected_frees + bs.refused_slots == 0);  // it agrees with the coordinator
    CHECK(book_resumed == s.unparked.size());
    for (const Unpark& u : s.unparked) {
      ++unparks;
      ModelRequest& m = model.at(u.request.value);
      REQUIRE_MESSAGE(m.state == ModelRequest::State::parked, "request " << u.request.value << " unparked while not parked");
      if (u.salvaged) {
        // A partly failed load resumes below its claim: a second load's checkpoint (a
        // stateful model resumes on the block grid only).
        CHECK(u.tokens > 0);
        CHECK(u.tokens <= m.claims);
        CHECK(u.tokens % kBlock == 0);
        ++salvaged;
      } else {
        CHECK(u.tokens == (u.kind == Resolution::completed ? m.claims : 0));
      }
      completed += u.kind == Resolution::completed;
      m.state = ModelRequest::State::running;
    }
    for (const Freed& rel : s.freed) {
      ++releases;
      ModelRequest& m = model.at(rel.request.value);
      const auto it = m.ended.find(rel.admission);
      REQUIRE_MESSAGE(it != m.ended.end(), "request " << rel.request.value << " admission " << rel.admission.value
                                                      << " freed unasked (not ended, or twice)");
      REQUIRE_MESSAGE(!owes(it->second), "request " << rel.request.value << " freed while a rank may still touch its memory");
      m.ended.erase(it);
    }
    for (const SlotId slot : s.snapshots) {
      ++snapshots_back;
      const auto it = held_snapshots.find(slot);
      REQUIRE_MESSAGE(it != held_snapshots.end(), "snapshot " << slot.value << " handed back but not held");
      for (const Owed& o : owed)
        REQUIRE_MESSAGE(!(!o.is_load && o.save == it->second && o.phase == SavePhase::released && !dead.contains(o.rank)),
                        "snapshot " << slot.value << " handed back while rank " << o.rank << " may still read it; save "
                                    << it->second.hash.value << "/" << it->second.generation.value << " in flight "
                                    << index.is_save_in_flight(it->second) << " last op " << last_op);
      held_snapshots.erase(it);
      free_snapshots.push_back(slot);
    }
  }

  // The saves a call just sent: keys on the owed list that no one has claimed yet.
  std::vector<SaveKey> new_saves() {
    std::vector<SaveKey> out;
    for (const Owed& o : owed)
      if (!o.is_load && !save_owner.contains(o.save) && std::find(out.begin(), out.end(), o.save) == out.end())
        out.push_back(o.save);
    return out;
  }

  void op_checkpoint() {
    if (free_snapshots.empty()) return;
    const std::uint64_t r = pick(kRequests);
    const Checkpoint c = checkpoints[pick(checkpoints.size())];
    const SlotId slot = free_snapshots.back();
    const bool served = index.could_serve(c.hash);
    const CheckpointResult result = coord.checkpoint(c, slot);
    if (served) CHECK(result == CheckpointResult::already_indexed);
    if (result == CheckpointResult::already_indexed) ++checkpoints_refused_as_indexed;
    const std::vector<SaveKey> sent = new_saves();
    if (result != CheckpointResult::saved) {
      CHECK(sent.empty());  // nothing went out: the engine keeps its slot
      return;
    }
    ++checkpoints_saved;
    REQUIRE(sent.size() <= 1);  // none when every rank is dead: nobody owes it, it settles at the next step
    if (!sent.empty()) save_owner[sent[0]] = r;
    free_snapshots.pop_back();
    held_snapshots.emplace(slot, sent.empty() ? SaveKey{} : sent[0]);
  }

  void op_progress() {
    const std::uint64_t r = pick(kRequests);
    ModelRequest& m = model[r];
    if (m.state != ModelRequest::State::running || free_snapshots.empty()) return;
    const SlotId slot = free_snapshots.back();
    const Checkpoint c = checkpoints[pick(checkpoints.size())];
    const std::uint64_t saved_before = coord.stats().checkpoints_saved;
    const std::size_t sent_count = coord.save_progress(
        ProgressSave{RequestId{r}, kBlock * (1 + pick(16)), keys, blocks, c, slot});
    SaveKey state_save{};  // stays empty when every rank is dead: nobody owes it
    for (const SaveKey& k : new_saves()) {
      save_owner[k] = r;
      if (k.hash == c.hash) state_save = k;  // the state save reads the snapshot
      else m.current.saves.insert(k);        // the KV save reads the running admission's blocks
    }
    if (coord.stats().checkpoints_saved > saved_before) {
      ++checkpoints_saved;
      free_snapshots.pop_back();
      held_snapshots.emplace(slot, state_save);
    }
    progress += sent_count > 0;
  }

  // Slots: each request admission draws from its own pair, so a re-admitted request never
  // asks for the slot its orphan still holds.
  SlotId slot_for(std::uint64_t r, AdmissionId a) const { return SlotId{static_cast<std::uint32_t>((r * 2 + a.value % 2) % kSlots)}; }

  void op_admit() {
    const std::uint64_t r = pick(kRequests);
    ModelRequest& m = model[r];
    const TokenCount prompt = kChunk * (1 + pick(3)) + kBlock * (1 + pick(3));
    const TokenCount hbm = kBlock * pick(prompt / kBlock);
    const std::uint64_t next = admissions_seen.empty() ? 1 : admissions_seen.rbegin()->value + 1;
    const AdmitDecision d = coord.admit(AdmitRequest{RequestId{r}, prompt, hbm, keys, blocks, checkpoints, slot_for(r, AdmissionId{next})});
    if (m.state == ModelRequest::State::parked) {  // a second admit of a parked request starts nothing
      CHECK(book.open(RequestId{r}, d, {}, std::nullopt) == nullptr);  // nor does the book
      CHECK(book.stats().admitted_while_parked == ++admitted_while_parked);
      CHECK_FALSE(d.parked);
      CHECK(d.reason == ComputeReason::already_parked);
      CHECK(d.admission == m.live);
      return;
    }
    (void)book.open(RequestId{r}, d, {}, std::nullopt);
    REQUIRE_MESSAGE(admissions_seen.insert(d.admission).second, "admission " << d.admission.value << " issued twice");
    CHECK(d.admission.value == next);
    if (m.state == ModelRequest::State::running) {  // re-admitted without a teardown: the old admission ended
      ++readmissions;
      end_live(m);
    }
    m.live = d.admission;
    if (d.parked) {
      m.state = ModelRequest::State::parked;
      m.key = d.key;
      m.claims = d.claimed_tokens;
      m.current.loads.insert(d.key);
    } else {
      m.state = ModelRequest::State::running;  // computes from scratch
    }
  }

  void op_teardown() {
    const std::uint64_t r = pick(kRequests);
    ModelRequest& m = model[r];
    coord.teardown(RequestId{r});
    (void)book.end(RequestId{r});
    if (m.state == ModelRequest::State::idle) {
      ++repeated_teardowns;  // nothing live: nothing new is due
      return;
    }
    end_live(m);
  }

  void op_finish() {
    const std::uint64_t r = pick(kRequests);
    ModelRequest& m = model[r];
    if (m.state == ModelRequest::State::idle) {
      // No live admission (torn down with its load maybe in flight, finished with its save
      // maybe still reading, or never admitted): left alone, nothing sent, nothing freed.
      const std::size_t sent = coord.finish(FinishRequest{RequestId{r}, kBlock * (1 + pick(16)), keys, blocks,
                                                          checkpoints[pick(checkpoints.size())], SlotId{static_cast<std::uint32_t>(r)}});
      CHECK(sent == 0);
      CHECK(new_saves().empty());
      ++finishes_without_admission;
      return;
    }
    const TokenCount computed = kBlock * (1 + pick(16));
    const bool parked = m.state == ModelRequest::State::parked;
    const std::size_t sent = coord.finish(FinishRequest{RequestId{r}, computed, keys, blocks,
                                                        checkpoints[pick(checkpoints.size())], slot_for(r, m.live)});
    if (parked) CHECK(sent == 0);  // a parked request is torn down, not finished
    (void)book.end(RequestId{r});
    // Learn the saves it sent from the owed list (their keys are new).
    for (const Owed& o : owed)
      if (!o.is_load && !save_owner.contains(o.save)) {
        save_owner[o.save] = r;
        m.current.saves.insert(o.save);
      }
    end_live(m);
  }

  void op_deliver() {
    if (owed.empty()) return;
    const std::size_t i = pick(owed.size());
    Owed o = owed[i];
    owed[i] = owed.back();
    owed.pop_back();
    if (o.is_load) {
      const std::uint64_t roll = pick(20);
      const bool kv_failed = roll == 0 && o.chunks > 0;
      CompletionRecord rec{o.load,
                           o.rank,
                           o.chunks == 0 ? KvOutcome::none : kv_failed ? KvOutcome::failed : KvOutcome::ok,
                           roll == 1 ? StateOutcome::missed : StateOutcome::restored,
                           kv_failed ? Reason::kv_chunk_missing : Reason::none,
                           Reason::none,
                           kv_failed ? static_cast<std::uint32_t>(pick(o.chunks)) : o.chunks};
      pump.ingest(o.rank, std::span<const CompletionRecord>(&rec, 1));
    } else {
      SaveRecord rec{o.save, o.rank, o.phase, pick(10) != 0, Reason::none};
      if (!rec.ok) rec.reason = Reason::kv_transfer_failed;
      if (o.phase == SavePhase::released) {
        rec.ok = true;
        rec.reason = Reason::none;
        owed.push_back(Owed{o.rank, false, {}, o.save, SavePhase::stored});  // the same rank then reports stored
      }
      pump.ingest(o.rank, std::span<const SaveRecord>(&rec, 1));
    }
  }

  // Any rank may die, the last one too: a key whose every owing rank died settles then
  // (and a key dispatched while all are dead, at the next step).
  void op_rank() {
    // Dead ranks mostly come back soon (so most loads meet a live world), now and then all die.
    std::uint32_t k = static_cast<std::uint32_t>(pick(kWorld));
    if (!dead.empty() && pick(3) != 0) k = *std::next(dead.begin(), static_cast<std::ptrdiff_t>(pick(dead.size())));
    if (dead.contains(k)) {
      pump.mark_rank_alive(k);
      dead.erase(k);
    } else {
      pump.mark_rank_dead(k);
      dead.insert(k);
      every_rank_dead += dead.size() == kWorld;
      std::erase_if(owed, [k](const Owed& o) { return o.rank == k; });  // it will never report
    }
  }

  void op_tick() {
    Clock::current += std::chrono::seconds(1 + pick(20));
    const auto t = coord.tick(Clock::now(), 30s, 10s);
    CHECK(t.overdue.size() == coord.stats().overdue);
    if (t.reclaimed > 0)
      for (const Owed& o : owed)
        if (o.is_load && !index.is_in_flight(o.load)) reclaimed.insert(o.load);
  }

  int last_op = -1;
  void check_invariants() {
    const CoordinatorStats s = coord.stats();
    REQUIRE_MESSAGE(s.invariant_violations == 0, "after operation kind " << last_op);
    const IndexStats is = index.stats();
    REQUIRE(is.invariant_violations == 0);
    std::uint64_t parked = 0;
    for (const auto& [r, m] : model) parked += m.state == ModelRequest::State::parked;
    CHECK(s.waiting_now == parked);
  }

  void one() {
    const std::uint64_t roll = pick(100);
    last_op = static_cast<int>(roll);
    if (roll < 18) op_admit();
    else if (roll < 42) absorb(coord.step());
    else if (roll < 70) op_deliver();
    else if (roll < 77) op_teardown();
    else if (roll < 86) op_finish();
    else if (roll < 90) op_checkpoint();
    else if (roll < 93) op_progress();
    else if (roll < 97) op_tick();
    else op_rank();
    check_invariants();
  }
};

}  // namespace

TEST_CASE("coordinator model: 10^5 random operations keep every invariant and every release is safe") {
  for (const std::uint64_t seed : {20261130ULL, 7ULL}) {
    CAPTURE(seed);
    Clock::current = Clock::time_point{};
    Run run(seed);
    for (int i = 0; i < 50'000; ++i) {
      CAPTURE(i);
      run.one();
    }
    // Drain: every live rank delivers everything; every request still running finishes.
    while (!run.owed.empty()) {
      run.op_deliver();
      run.absorb(run.coord.step());
    }
    for (int i = 0; i < 4; ++i) run.absorb(run.coord.step());
    for (auto& [r, m] : run.model)
      if (m.state == ModelRequest::State::running) {
        run.coord.teardown(RequestId{r});
        (void)run.book.end(RequestId{r});
        run.end_live(m);
      }
    Clock::current += 1h;
    (void)run.coord.tick(Clock::now(), 30s, 10s);  // orphans whose ranks died: reclaimed
    while (!run.owed.empty()) {
      run.op_deliver();
      run.absorb(run.coord.step());
    }
    for (int i = 0; i < 4; ++i) run.absorb(run.coord.step());
    const CoordinatorStats s = run.coord.stats();
    CHECK(s.invariant_violations == 0);
    CHECK(s.waiting_now == 0);
    CHECK(s.holding_now == 0);
    CHECK(run.held_snapshots.empty());  // every snapshot came back
    CHECK(run.free_snapshots.size() == kSnapshots);
    CHECK(s.snapshots_held == 0);
    CHECK(run.book.size() == 0);  // the book freed every admission the coordinator freed
    CHECK(run.book.stats().freed == run.releases);
    for (const auto& [r, m] : run.model) {
      CAPTURE(r);
      CHECK(m.ended.empty());  // every admission that ended was freed
      CHECK(m.state != ModelRequest::State::parked);
    }
    const IndexStats is = run.index.stats();
    CHECK(is.outstanding == 0);
    CHECK(is.saves_outstanding == 0);
    CHECK(check_consistency(run.index).ok);
    // The mix did what it is for.
    CHECK(run.unparks > 1000);
    CHECK(run.completed > 100);
    CHECK(run.releases > 1000);
    CHECK(run.transport.drops > 10);
    CHECK(run.readmissions > 100);
    CHECK(run.repeated_teardowns > 100);
    CHECK(run.finishes_without_admission > 100);
    CHECK(run.salvaged > 10);  // second loads after a partly failed load, resumed at their checkpoint
    CHECK(s.finish_without_admission == run.finishes_without_admission);
    CHECK(run.every_rank_dead > 0);
    CHECK(run.checkpoints_saved > 100);
    CHECK(run.checkpoints_refused_as_indexed > 100);
    CHECK(run.snapshots_back == run.checkpoints_saved);  // one back per snapshot save, none pinned here
    CHECK(s.snapshots_returned == run.snapshots_back);
    CHECK(run.progress > 50);
    MESSAGE("unparks " << run.unparks << ", completed " << run.completed << ", releases " << run.releases
                       << ", re-admissions " << run.readmissions << ", repeated teardowns " << run.repeated_teardowns
                       << ", every rank dead " << run.every_rank_dead << ", checkpoints " << run.checkpoints_saved
                       << " saved, " << run.checkpoints_refused_as_indexed << " already indexed, progress saves "
                       << run.progress
                       << ", drops " << run.transport.drops << ", saves " << is.saves_issued);
  }
}

TEST_CASE("coordinator: a save whose source a rank could not confirm free keeps the blocks pinned") {
  Clock::current = Clock::time_point{};
  Run run(1);
  const AdmitDecision d = run.coord.admit(AdmitRequest{RequestId{3}, 10, 0, run.keys, run.blocks, run.checkpoints, SlotId{3}});
  REQUIRE_FALSE(d.parked);
  REQUIRE(run.coord.finish(FinishRequest{RequestId{3}, 192, run.keys, run.blocks, std::nullopt, std::nullopt}) == 1);
  REQUIRE(run.owed.size() == kWorld);
  for (const Owed& o : run.owed) {
    // Rank 1's device failed to synchronize after its gather: released, not confirmed.
    const bool confirmed = o.rank != 1;
    SaveRecord released{o.save, o.rank, SavePhase::released, confirmed, confirmed ? Reason::none : Reason::source_unconfirmed};
    run.pump.ingest(o.rank, std::span<const SaveRecord>(&released, 1));
    SaveRecord stored{o.save, o.rank, SavePhase::stored, false, Reason::kv_transfer_failed};
    run.pump.ingest(o.rank, std::span<const SaveRecord>(&stored, 1));
  }
  for (int i = 0; i < 3; ++i) CHECK(run.coord.step().freed.empty());
  CHECK(run.coord.stats().sources_pinned == 1);
  CHECK(run.index.stats().saves_outstanding == 0);  // the save itself ended (failed)
}

// finish() on a request whose admission already ended must not start a new one: the engine
// would get a Freed (and, on a stateful model, the ranks a StateSave from the slot) while a
// rank still writes or reads what the ended admission holds.
TEST_CASE("R8 coordinator: finish after a teardown frees nothing and saves nothing while the orphaned load may still write") {
  Clock::current = Clock::time_point{};
  Run run(3);
  const TokenCount prompt = 2 * kChunk + kBlock;  // 144: a joint load to the checkpoint at 96
  const AdmitDecision d = run.coord.admit(AdmitRequest{RequestId{1}, prompt, 0, run.keys, run.blocks, run.checkpoints, SlotId{2}});
  REQUIRE(d.parked);
  REQUIRE(run.owed.size() == kWorld);  // the load, owed by every rank
  run.coord.teardown(RequestId{1});    // orphaned: its ranks may still write its blocks and slot
  CHECK(run.coord.finish(FinishRequest{RequestId{1}, prompt, run.keys, run.blocks, Checkpoint{128, PrefixHash{5128}}, SlotId{2}}) == 0);
  CHECK(run.owed.size() == kWorld);  // no save went out: nothing reads the slot the load restores into
  CHECK(run.coord.stats().finish_without_admission == 1);
  for (int i = 0; i < 3; ++i) CHECK(run.coord.step().freed.empty());
  // The ranks report: now, and only now, the torn-down admission comes back, once.
  std::size_t freed = 0;
  while (!run.owed.empty()) {
    run.op_deliver();
    for (const Freed& f : run.coord.step().freed) {
      CHECK(f.admission == d.admission);
      ++freed;
    }
  }
  CHECK(freed == 1);
  CHECK(run.coord.stats().invariant_violations == 0);
}

TEST_CASE("R8 coordinator: a second finish frees nothing while the first finish's save still reads the blocks") {
  Clock::current = Clock::time_point{};
  Run run(5);
  const AdmitDecision d = run.coord.admit(AdmitRequest{RequestId{3}, 10, 0, run.keys, run.blocks, run.checkpoints, SlotId{3}});
  REQUIRE_FALSE(d.parked);
  REQUIRE(run.coord.finish(FinishRequest{RequestId{3}, 192, run.keys, run.blocks, std::nullopt, std::nullopt}) == 1);
  REQUIRE(run.owed.size() == kWorld);  // the KV save's released phase, owed by every rank
  CHECK(run.coord.finish(FinishRequest{RequestId{3}, 256, run.keys, run.blocks, std::nullopt, std::nullopt}) == 0);
  CHECK(run.owed.size() == kWorld);
  CHECK(run.coord.stats().finish_without_admission == 1);
  for (int i = 0; i < 3; ++i) CHECK(run.coord.step().freed.empty());
  std::size_t freed = 0;
  while (!run.owed.empty()) {
    run.op_deliver();
    for (const Freed& f : run.coord.step().freed) {
      CHECK(f.admission == d.admission);
      ++freed;
    }
  }
  CHECK(freed == 1);
}

// A transport that throws is one that dropped what it was handed: the request still parks
// on a load that settles (failed, at the next step), a save's source comes back, and the
// exception does not leave the Coordinator with a dispatched item nobody tracks.
TEST_CASE("R6 coordinator: a transport that throws drops the load or save, and nothing is left untracked") {
  Clock::current = Clock::time_point{};
  Run run(11);
  run.transport.throw_next = true;
  const AdmitDecision d = run.coord.admit(AdmitRequest{RequestId{1}, 2 * kChunk + kBlock, 0, run.keys, run.blocks,
                                                       run.checkpoints, SlotId{2}});
  REQUIRE(d.parked);
  CHECK(run.owed.empty());
  const auto s = run.coord.step();
  REQUIRE(s.unparked.size() == 1);
  CHECK(s.unparked[0].tokens == 0);
  CHECK(s.unparked[0].kind == Resolution::failed);
  run.transport.throw_next = true;
  CHECK(run.coord.finish(FinishRequest{RequestId{1}, 192, run.keys, run.blocks, std::nullopt, std::nullopt}) == 0);
  std::size_t freed = 0;
  for (int i = 0; i < 3; ++i) freed += run.coord.step().freed.size();
  CHECK(freed == 1);  // the dropped save read nothing: the admission comes back
  const CoordinatorStats cs = run.coord.stats();
  CHECK(cs.transport_drops == 2);
  CHECK(cs.invariant_violations == 0);
  CHECK(run.index.stats().outstanding == 0);
  CHECK(run.index.stats().saves_outstanding == 0);
}
