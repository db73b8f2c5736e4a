// OffloadIndex against a simple reference model: 10^5 random operations (request,
// dispatch, drop a ticket, complete, fail with and without a miss, abandon, orphan,
// reclaim on a manual clock, late reports, re-admission, stores, drains), checked after
// every step: no slot released twice, no live slot released, every counter identical to
// the model's, the same resolutions in the same order, no invariant violation.
#include "test_support.hpp"
#include <doctest/doctest.h>

#include <kvfuse/engine/index_consistency.hpp>
#include <kvfuse/engine/offload_index.hpp>

#include <algorithm>
#include <array>
#include <sstream>
#include <chrono>
#include <cstdlib>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace kvfuse;
using namespace std::chrono_literals;

namespace {

using ModelClock = testing::ManualClock<struct ModelClockTag>;

using Index = OffloadIndex<ModelClock>;

constexpr std::uint32_t kSlots = 24;
constexpr std::uint64_t kRequests = 40;
constexpr std::uint64_t kHashes = 64;
constexpr std::size_t kHashCap = 24;

// The reference: plain containers, linear scans, no cleverness.
struct Model {
  struct Load {
    LoadKey key;
    bool has_kv = false;
    bool has_state = false;
    StateSpec leg;
    bool dispatched = false;
    bool orphaned = false;
    ModelClock::time_point orphaned_at{};
    std::uint64_t orphan_seq = 0;
  };

  std::list<std::uint64_t> lru;            // front = most recently used
  std::map<std::uint64_t, Load> loads;     // generation -> outstanding load
  std::vector<SaveKey> stores;            // outstanding stores
  IndexStats s;
  std::uint64_t next_generation = 1;
  std::uint64_t orphan_seq = 0;
  std::vector<LoadResolution> resolutions;   // queued, not yet drained
  std::vector<SlotId> expected_releases;     // by the current operation
  std::vector<SlotId> live_slots_freed;      // by the current operation: back to the engine

  bool indexed(std::uint64_t h) const { return std::find(lru.begin(), lru.end(), h) != lru.end(); }
  void touch(std::uint64_t h) {
    auto it = std::find(lru.begin(), lru.end(), h);
    if (it != lru.end()) lru.splice(lru.begin(), lru, it);
  }
  void note_stored(std::uint64_t h) {
    if (indexed(h)) {
      touch(h);
      return;
    }
    if (lru.size() == kHashCap) {
      lru.pop_back();
      ++s.hashes_evicted;
    }
    lru.push_front(h);
    s.indexed = lru.size();
  }
  bool forget(std::uint64_t h) {
    auto it = std::find(lru.begin(), lru.end(), h);
    if (it == lru.end()) return false;
    lru.erase(it);
    s.indexed = lru.size();
    return true;
  }

  const Load* live_of(std::uint64_t request) const {
    for (const auto& [g, l] : loads)
      if (l.key.request.value == request && !l.orphaned) return &l;
    return nullptr;
  }
  bool slot_held(std::uint32_t slot) const {
    for (const auto& [g, l] : loads)
      if (l.has_state && l.leg.slot.value == slot) return true;
    return false;
  }

  LoadRefusal admission(std::uint64_t request, bool has_kv, const std::optional<StateSpec>& st) const {
    if (!has_kv && !st) return LoadRefusal::empty_load;
    if (st) {
      if (st->slot.value >= kSlots) return LoadRefusal::invalid_slot;
      if (st->block_tokens == 0 || st->chunk_tokens == 0 || st->boundary_tokens % st->block_tokens != 0)
        return LoadRefusal::invalid_state_leg;
    }
    if (live_of(request) != nullptr) return LoadRefusal::load_in_flight;
    if (st) {
      if (slot_held(st->slot.value)) return LoadRefusal::slot_in_use;
      if (!indexed(st->boundary_hash.value)) return LoadRefusal::hash_not_servable;
    }
    return LoadRefusal::none;
  }

  LoadKey admit(std::uint64_t request, bool has_kv, const std::optional<StateSpec>& st) {
    Load l;
    l.key = LoadKey{RequestId{request}, Generation{next_generation++}};
    l.has_kv = has_kv;
    if (st) {
      l.has_state = true;
      l.leg = *st;
      touch(st->boundary_hash.value);
    }
    loads[l.key.generation.value] = l;
    ++s.issued;
    ++s.outstanding;
    return l.key;
  }

  Load* find(LoadKey k) {
    auto it = loads.find(k.generation.value);
    if (it == loads.end() || it->second.key != k) return nullptr;
    return &it->second;
  }
  Load* in_flight(LoadKey k) {
    Load* l = find(k);
    return l != nullptr && l->dispatched ? l : nullptr;
  }

  void resolve(LoadKey k, Resolution kind, bool missing) {
    Load l = loads.at(k.generation.value);
    loads.erase(k.generation.value);
    const bool missed = missing && l.has_state;
    switch (kind) {
      case Resolution::completed: ++s.completed; break;
      case Resolution::failed: ++s.failed; break;
      case Resolution::abandoned: ++s.abandoned; break;
      case Resolution::reclaimed: ++s.abandoned; ++s.reclaimed; break;
    }
    --s.outstanding;
    if (l.dispatched) --s.in_flight;
    if (l.orphaned) --s.orphaned;
    if (missed && forget(l.leg.boundary_hash.value)) ++s.hashes_retracted;
    resolutions.push_back(LoadResolution{k, kind, missed, l.orphaned, l.dispatched});
    if (l.has_state) {
      if (l.orphaned) {
        expected_releases.push_back(l.leg.slot);
        ++s.slots_freed;
      } else {
        live_slots_freed.push_back(l.leg.slot);
      }
    }
  }

  // A rank-backed settlement: true if applied.
  bool settle(LoadKey k, Resolution kind, bool missing) {
    if (in_flight(k) == nullptr) {
      ++s.late_reports;
      return false;
    }
    resolve(k, kind, missing);
    return true;
  }

  // complete/fail/abandon by key: as settle, except that an orphan is left alone (R8).
  bool settle_by_engine(LoadKey k, Resolution kind, bool missing) {
    const Load* l = in_flight(k);
    if (l != nullptr && l->orphaned) return false;
    return settle(k, kind, missing);
  }

  std::vector<LoadKey> reclaimable(ModelClock::time_point now, ModelClock::duration timeout) const {
    std::vector<const Load*> c;
    if (timeout <= ModelClock::duration::zero()) return {};
    for (const auto& [g, l] : loads)
      if (l.orphaned && now - l.orphaned_at >= timeout) c.push_back(&l);
    std::sort(c.begin(), c.end(), [](const Load* a, const Load* b) {
      return a->orphaned_at != b->orphaned_at ? a->orphaned_at < b->orphaned_at : a->orphan_seq < b->orphan_seq;
    });
    std::vector<LoadKey> out;
    for (const Load* l : c) out.push_back(l->key);
    return out;
  }
};

enum class Owner : std::uint8_t { free, engine, index };

struct Run {
  std::mt19937_64 rng;
  Model model;
  std::vector<SlotId> released;  // by the index, in the current operation
  Index index;
  std::vector<LoadTicket> tickets;
  std::vector<LoadKey> resolved_keys;  // for late reports
  std::vector<Owner> owner = std::vector<Owner>(kSlots, Owner::free);
  std::uint64_t step = 0;

  static OffloadIndexOptions options() {
    OffloadIndexOptions o;
    o.hash_capacity = kHashCap;
    o.slot_count = kSlots;
    return o;
  }

  explicit Run(std::uint64_t seed) : rng(seed), index(options(), [this](SlotId s) { released.push_back(s); }) {}

  std::uint64_t pick(std::uint64_t n) { return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng); }

  std::optional<LoadKey> random_outstanding(bool dispatched_only, bool live_only = false) {
    std::vector<LoadKey> c;
    for (const auto& [g, l] : model.loads)
      if ((!dispatched_only || l.dispatched) && (!live_only || !l.orphaned)) c.push_back(l.key);
    if (c.empty()) return std::nullopt;
    return c[pick(c.size())];
  }

  LoadKey random_late_key() {
    if (!resolved_keys.empty() && chance(0.8)) return resolved_keys[pick(resolved_keys.size())];
    return LoadKey{RequestId{pick(kRequests)}, Generation{model.next_generation + pick(100)}};
  }

  std::optional<std::uint32_t> free_slot() {
    std::vector<std::uint32_t> c;
    for (std::uint32_t s = 0; s < kSlots; ++s)
      if (owner[s] == Owner::free) c.push_back(s);
    if (c.empty()) return std::nullopt;
    return c[pick(c.size())];
  }

  void op_request(std::uint64_t request) {
    const bool has_kv = chance(0.6);
    std::optional<StateSpec> st;
    std::optional<std::uint32_t> engine_slot;
    if (!has_kv || chance(0.6)) {
      StateSpec leg{16 * (1 + pick(64)), PrefixHash{pick(kHashes)}, SlotId{0}, 16, 256};
      const std::uint64_t roll = pick(100);
      if (roll < 80) {
        engine_slot = free_slot();
        if (!engine_slot) return;
        leg.slot = SlotId{*engine_slot};
      } else if (roll < 90) {
        leg.slot = SlotId{static_cast<std::uint32_t>(kSlots + pick(4))};  // outside the pool
      } else {
        leg.slot = SlotId{static_cast<std::uint32_t>(pick(kSlots))};  // maybe held by a load
        if (owner[leg.slot.value] == Owner::free) engine_slot = leg.slot.value;
        else if (!model.slot_held(leg.slot.value)) return;  // the engine never double-books its own slots
      }
      if (chance(0.03)) leg.boundary_tokens += 3;  // off the checkpoint grid
      st = leg;
    }
    std::optional<KvSpec> kv;
    if (has_kv) kv = KvSpec{0, 256, {PrefixHash{request}}, {BlockId{1}}};
    const LoadRefusal expected = model.admission(request, has_kv, st);
    LoadGrant a = index.request_load(RequestId{request}, std::move(kv), st);
    REQUIRE(a.refusal() == expected);
    if (!a.granted()) {
      ++model.s.refused;
      return;
    }
    const LoadKey k = model.admit(request, has_kv, st);
    REQUIRE(a.ticket().key() == k);
    if (engine_slot) owner[*engine_slot] = Owner::engine;
    tickets.push_back(a.take_ticket());
  }

  std::size_t random_ticket() { return static_cast<std::size_t>(pick(tickets.size())); }

  void op_dispatch() {
    if (tickets.empty()) return;
    const std::size_t i = random_ticket();
    const LoadRequest req = tickets[i].dispatch();
    tickets.erase(tickets.begin() + static_cast<std::ptrdiff_t>(i));
    Model::Load* l = model.find(req.key);
    REQUIRE(l != nullptr);
    l->dispatched = true;
    ++model.s.in_flight;
    REQUIRE(req.kv.has_value() == l->has_kv);
    REQUIRE(req.state.has_value() == l->has_state);
    if (l->has_state) REQUIRE(*req.state == l->leg);
  }

  void op_drop_ticket(bool explicit_abandon) {
    if (tickets.empty()) return;
    const std::size_t i = random_ticket();
    const LoadKey k = tickets[i].key();
    if (explicit_abandon) tickets[i].abandon();
    tickets.erase(tickets.begin() + static_cast<std::ptrdiff_t>(i));
    model.resolve(k, Resolution::abandoned, false);
  }

  LoadKey settle_target() {
    if (chance(0.85)) {
      if (auto k = random_outstanding(true)) return *k;
    }
    if (!tickets.empty() && chance(0.3)) return tickets[random_ticket()].key();  // undispatched: late
    return random_late_key();
  }

  void op_settle(int how) {
    const LoadKey k = settle_target();
    bool got = false, want = false;
    switch (how) {
      case 0: want = model.settle_by_engine(k, Resolution::completed, false); got = index.complete(k); break;
      case 1: want = model.settle_by_engine(k, Resolution::failed, false); got = index.fail(k, false); break;
      case 2: want = model.settle_by_engine(k, Resolution::failed, true); got = index.fail(k, true); break;
      case 3: want = model.settle_by_engine(k, Resolution::abandoned, false); got = index.abandon(k); break;
      default: {
        const Settlement s{k, chance(0.5), chance(0.5)};
        want = s.ok ? model.settle(k, Resolution::completed, false) : model.settle(k, Resolution::failed, s.state_missed);
        got = index.settle(s);
      }
    }
    REQUIRE(got == want);
  }

  void op_late_report() {
    const LoadKey k = random_late_key();
    const bool ok = chance(0.5);
    REQUIRE_FALSE(model.settle(k, Resolution::failed, true));
    const bool applied = ok ? index.complete(k) : index.fail(k, true);
    REQUIRE_FALSE(applied);
  }

  void op_fail_all() {
    std::vector<LoadKey> keys;
    const std::uint64_t n = 1 + pick(6);
    for (std::uint64_t i = 0; i < n; ++i) keys.push_back(settle_target());
    const bool missing = chance(0.5);
    std::size_t want = 0;
    for (const LoadKey& k : keys) want += model.settle_by_engine(k, Resolution::failed, missing) ? 1 : 0;
    REQUIRE(index.fail_all(keys, missing) == want);
  }

  bool op_orphan(std::optional<LoadKey> key = std::nullopt) {
    LoadKey k;
    if (key) k = *key;
    else if (chance(0.8)) {
      auto c = random_outstanding(true, true);
      if (!c) return false;
      k = *c;
    } else if (!tickets.empty() && chance(0.5)) {
      k = tickets[random_ticket()].key();
    } else {
      k = random_late_key();
    }
    Model::Load* l = model.in_flight(k);
    const bool want = l != nullptr && !l->orphaned;
    REQUIRE(index.orphan(k) == want);
    if (want) {
      l->orphaned = true;
      l->orphaned_at = ModelClock::now();
      l->orphan_seq = model.orphan_seq++;
      ++model.s.orphaned;
      if (l->has_state) {
        REQUIRE(owner[l->leg.slot.value] == Owner::engine);
        owner[l->leg.slot.value] = Owner::index;
      }
    }
    return want;
  }

  void op_readmit() {
    // A request torn down mid-load comes back at once: its new load must not be blocked
    // by, nor touch, the orphan.
    auto c = random_outstanding(true, true);
    if (!c) return;
    if (op_orphan(*c)) op_request(c->request.value);
  }

  void op_clock_and_reclaim() {
    if (chance(0.1)) ModelClock::current -= std::chrono::seconds(pick(5));
    else ModelClock::current += std::chrono::milliseconds(pick(20'000));
    static constexpr std::array<std::chrono::seconds, 5> timeouts{-1s, 0s, 5s, 15s, 30s};
    const ModelClock::duration timeout = timeouts[pick(timeouts.size())];
    const std::vector<LoadKey> due = model.reclaimable(ModelClock::now(), timeout);
    for (const LoadKey& k : due) model.resolve(k, Resolution::reclaimed, false);
    REQUIRE(index.reclaim(ModelClock::now(), timeout) == due.size());
  }

  void op_hashes() {
    const std::uint64_t h = pick(kHashes);
    switch (pick(5)) {
      case 0:
      case 1:
      case 2: model.note_stored(h); index.note_stored(PrefixHash{h}); break;
      case 3: REQUIRE(index.forget(PrefixHash{h}) == model.forget(h)); break;
      default: REQUIRE(index.could_serve(PrefixHash{h}) == model.indexed(h));
    }
  }

  void op_store() {
    if (model.stores.empty() || chance(0.5)) {
      const PrefixHash h{pick(kHashes)};
      auto a = index.request_save(StateSave{SaveKey{h, {}}, SlotId{0}, 0});
      REQUIRE(a.granted());
      REQUIRE(a.ticket().key() == SaveKey{h, Generation{model.next_generation++}});  // one source for loads and saves
      ++model.s.saves_issued;
      if (chance(0.1)) {
        a.ticket().abandon();
        ++model.s.saves_abandoned;
        return;
      }
      model.stores.push_back(a.ticket().dispatch().key);
      return;
    }
    const bool late = chance(0.1);
    const std::size_t i = static_cast<std::size_t>(pick(model.stores.size()));
    const SaveKey k = late ? SaveKey{PrefixHash{1}, Generation{model.next_generation + 1000}} : model.stores[i];
    if (chance(0.5)) {  // the released phase first, as ranks send it
      const bool released = chance(0.9);
      REQUIRE(index.settle_save(SaveSettlement{k, SavePhase::released, released}) == !late);
      if (late) ++model.s.late_reports;
      else if (released) ++model.s.saves_released;
    }
    const bool stored = chance(0.7);
    REQUIRE(index.settle_save(SaveSettlement{k, SavePhase::stored, stored}) == !late);
    if (late) {
      ++model.s.late_reports;
      return;
    }
    model.stores.erase(model.stores.begin() + static_cast<std::ptrdiff_t>(i));
    if (stored) {
      ++model.s.saves_stored;
      model.note_stored(k.hash.value);
    } else {
      ++model.s.saves_failed;
    }
  }

  void op_drain() {
    std::vector<LoadResolution> got;
    REQUIRE(index.drain_resolutions(got) == model.resolutions.size());
    REQUIRE(got == model.resolutions);
    for (const LoadResolution& r : got) {
      resolved_keys.push_back(r.key);
      if (resolved_keys.size() > 256) resolved_keys.erase(resolved_keys.begin());
    }
    model.resolutions.clear();
  }

  void one_step() {
    model.expected_releases.clear();
    model.live_slots_freed.clear();
    released.clear();
    const std::uint64_t roll = pick(1000);
    if (roll < 260) op_request(pick(kRequests));
    else if (roll < 400) op_dispatch();
    else if (roll < 430) op_drop_ticket(false);
    else if (roll < 450) op_drop_ticket(true);
    else if (roll < 600) op_settle(static_cast<int>(pick(5)));
    else if (roll < 610) op_fail_all();
    else if (roll < 660) op_orphan();
    else if (roll < 690) op_readmit();
    else if (roll < 740) op_clock_and_reclaim();
    else if (roll < 800) op_late_report();
    else if (roll < 900) op_hashes();
    else if (roll < 950) op_store();
    else op_drain();

    // Slots: each release is an orphan's (never a live request's), and exactly the ones
    // the model expects, in order; a second release of one slot finds it free and fails.
    REQUIRE(released == model.expected_releases);
    for (const SlotId s : released) {
      REQUIRE_MESSAGE(owner[s.value] == Owner::index, "slot " << s.value << " released while not held by an orphan");
      owner[s.value] = Owner::free;
    }
    for (const SlotId s : model.live_slots_freed) {
      REQUIRE(owner[s.value] == Owner::engine);
      owner[s.value] = Owner::free;  // the request is done with it; the engine frees it
    }
    model.s.indexed = model.lru.size();
    model.s.saves_outstanding = model.stores.size();
    const IndexStats got = index.stats();
    REQUIRE(got.invariant_violations == 0);
    REQUIRE(got == model.s);
    if (step % 32 == 0) {
      const kvfuse::ConsistencyReport rep = kvfuse::check_consistency(index);
      REQUIRE_MESSAGE(rep.ok, rep.problem);
      std::vector<std::uint64_t> order;
      index.for_each_indexed([&](PrefixHash h) { order.push_back(h.value); });
      REQUIRE(order == std::vector<std::uint64_t>(model.lru.begin(), model.lru.end()));
    }
    ++step;
  }
};

}  // namespace

template <>
struct doctest::StringMaker<IndexStats> {
  static String convert(const IndexStats& s) {
    std::ostringstream o;
    o << "{issued " << s.issued << ", in_flight " << s.in_flight << ", completed " << s.completed << ", failed "
      << s.failed << ", abandoned " << s.abandoned << ", reclaimed " << s.reclaimed << ", outstanding " << s.outstanding
      << ", orphaned " << s.orphaned << ", late " << s.late_reports << ", refused " << s.refused << ", indexed "
      << s.indexed << ", evicted " << s.hashes_evicted << ", retracted " << s.hashes_retracted << ", slots freed "
      << s.slots_freed << ", slot free errors " << s.slot_free_errors
      << ", violations " << s.invariant_violations << ", saves " << s.saves_issued << "/" << s.saves_released << "/"
      << s.saves_stored << "/" << s.saves_failed << "/" << s.saves_abandoned << "/" << s.saves_outstanding << "}";
    return o.str().c_str();
  }
};

TEST_CASE("model: 10^5 random operations agree with the reference model at every step") {
  std::uint64_t seed = 20261129;
  if (const char* env = std::getenv("KVFUSE_MODEL_SEED")) seed = std::strtoull(env, nullptr, 10);
  CAPTURE(seed);
  Run run(seed);
  for (int i = 0; i < 100'000; ++i) {
    CAPTURE(i);
    run.one_step();
  }
  // Whatever is left resolves cleanly: drop the tickets, settle the rest.
  run.model.expected_releases.clear();
  run.released.clear();
  while (!run.tickets.empty()) run.op_drop_ticket(false);
  while (auto k = run.random_outstanding(true)) {
    REQUIRE(run.index.settle(Settlement{*k, true, false}));
    run.model.resolve(*k, Resolution::completed, false);
  }
  CHECK(run.released == run.model.expected_releases);
  run.op_drain();
  const IndexStats s = run.index.stats();
  CHECK(s.outstanding == 0);
  CHECK(s.orphaned == 0);
  CHECK(s.invariant_violations == 0);
  CHECK(s.issued == s.completed + s.failed + s.abandoned);
  CHECK(kvfuse::check_consistency(run.index).ok);
  // The run exercised every path it claims to.
  CHECK(s.completed > 1000);
  CHECK(s.failed > 1000);
  CHECK(s.abandoned > 1000);
  CHECK(s.reclaimed > 50);
  CHECK(s.late_reports > 1000);
  CHECK(s.slots_freed > 100);
  CHECK(s.hashes_retracted > 100);
  CHECK(s.hashes_evicted > 100);
  CHECK(s.refused > 1000);
  MESSAGE("issued " << s.issued << ", completed " << s.completed << ", failed " << s.failed << ", abandoned "
                        << s.abandoned << ", reclaimed " << s.reclaimed << ", late " << s.late_reports << ", refused "
                        << s.refused << ", slots released " << s.slots_freed);
}
