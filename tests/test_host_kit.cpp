// The host kit (include/kvfuse/host/): the prefix-caching block pool against a reference
// model of vLLM-style caching over random operations, the slot pool's refusals, the
// admission book's routing of a step (and its refusal to release on an event it cannot
// match), and the end-of-run audit. The book over a real Coordinator is exercised by the
// coordinator model test (tests/test_coordinator_model.cpp).
#include <doctest/doctest.h>

#include <kvfuse/host/admission_book.hpp>
#include <kvfuse/host/audit.hpp>
#include <kvfuse/host/block_pool.hpp>
#include <kvfuse/host/slot_pool.hpp>
#include <kvfuse/kvfuse.hpp>

#include <algorithm>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <vector>

using namespace kvfuse;

namespace {

/// The reference: what prefix caching promises, kept the slow obvious way.
struct ReferencePool {
  std::uint32_t size;
  std::map<std::uint32_t, std::uint32_t> pins;     // block -> pins (> 0)
  std::map<std::uint64_t, std::uint32_t> cached;   // identity -> block (pinned or not)
  std::map<std::uint32_t, std::uint64_t> identity; // published block -> identity
  std::deque<std::uint32_t> lru;                   // cached and unpinned, oldest first
  std::vector<std::uint32_t> free;                 // neither, in the order they were freed

  explicit ReferencePool(std::uint32_t n) : size(n) {
    for (std::uint32_t b = n; b-- > 0;) free.push_back(b);
  }
  std::size_t unpinned() const { return free.size() + lru.size(); }
};

CoordinatorStep step_of(const std::vector<Unpark>& u, const std::vector<Freed>& f, const std::vector<SlotId>& s) {
  return CoordinatorStep{u, f, 0, s};
}

AdmitDecision decision(AdmissionId id, bool parked) {
  AdmitDecision d;
  d.admission = id;
  d.parked = parked;
  d.reason = ComputeReason::planned_no_load;
  return d;
}

}  // namespace

TEST_CASE("host kit: the block pool pins, caches and evicts exactly as the reference over random operations") {
  std::mt19937_64 rng(20261201);
  constexpr std::uint32_t kBlocks = 24;
  PrefixBlockPool pool(kBlocks);
  ReferencePool ref(kBlocks);
  std::vector<std::vector<BlockId>> tables;  // live tables: what the engine pins
  std::uint64_t matched = 0, evicted = 0, forgets = 0;
  for (int op = 0; op < 100'000; ++op) {
    CAPTURE(op);
    const std::uint64_t roll = rng() % 100;
    if (roll < 45) {
      // A request: match a prefix of identities drawn from a few shared prompts, then allocate.
      const std::uint64_t prompt = rng() % 6;
      std::vector<std::uint64_t> ids;
      for (std::uint64_t i = 0; i < 1 + rng() % 6; ++i) ids.push_back(prompt * 100 + i);
      const std::size_t limit = rng() % (ids.size() + 1);
      std::vector<BlockId> table;
      const std::size_t got = pool.match(ids, limit, table);
      std::size_t want = 0;
      for (; want < limit && want < ids.size() && ref.cached.contains(ids[want]); ++want) {
        const std::uint32_t b = ref.cached.at(ids[want]);
        if (ref.pins[b]++ == 0) ref.lru.erase(std::find(ref.lru.begin(), ref.lru.end(), b));
        REQUIRE(table[want].value == b);
      }
      REQUIRE(got == want);
      matched += got;
      const std::size_t more = rng() % 4;
      const bool fits = ref.unpinned() >= more;
      REQUIRE(pool.allocate(more, table) == fits);
      if (fits) {
        for (std::size_t i = 0; i < more; ++i) {
          if (ref.free.empty()) {
            const std::uint32_t victim = ref.lru.front();
            ref.lru.pop_front();
            ref.cached.erase(ref.identity.at(victim));
            ref.identity.erase(victim);
            ref.free.push_back(victim);
            ++evicted;
          }
          const std::uint32_t b = ref.free.back();
          ref.free.pop_back();
          ref.pins[b] = 1;
          REQUIRE(table[got + i].value == b);
        }
        // It publishes what it computed: its whole blocks under the prompt's identities.
        for (std::size_t i = got; i < std::min(table.size(), ids.size()); ++i) {
          pool.publish(table[i], ids[i]);
          const std::uint32_t b = table[i].value;
          if (!ref.identity.contains(b) && !ref.cached.contains(ids[i])) {
            ref.identity[b] = ids[i];
            ref.cached[ids[i]] = b;
          }
        }
        tables.push_back(std::move(table));
      } else {
        REQUIRE(table.size() == got);  // nothing taken beyond the matched ones
        for (const BlockId b : table) {
          pool.release(b);
          if (--ref.pins[b.value] == 0) {
            ref.pins.erase(b.value);
            ref.lru.push_back(b.value);
          }
        }
      }
    } else if (roll < 90 && !tables.empty()) {
      // A request ends: every block back.
      const std::size_t i = rng() % tables.size();
      for (const BlockId b : tables[i]) {
        pool.release(b);
        if (--ref.pins[b.value] == 0) {
          ref.pins.erase(b.value);
          if (ref.identity.contains(b.value)) ref.lru.push_back(b.value);
          else ref.free.push_back(b.value);
        }
      }
      tables.erase(tables.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (roll < 91) {
      pool.forget_cached();
      for (const std::uint32_t b : ref.lru) ref.free.push_back(b);
      ref.lru.clear();
      ref.cached.clear();
      ref.identity.clear();
      ++forgets;
    }
    REQUIRE(pool.pinned() == ref.pins.size());
    REQUIRE(pool.stats().cached == ref.lru.size());
  }
  CHECK(matched > 1000);
  CHECK(evicted > 1000);
  CHECK(forgets > 100);
  CHECK(pool.stats().bad_releases == 0);
}

TEST_CASE("host kit: a block released twice, or a slot given back that was not taken, is refused and counted") {
  PrefixBlockPool pool(4);
  std::vector<BlockId> table;
  REQUIRE(pool.allocate(2, table));
  pool.release(table[0]);
  pool.release(table[0]);  // a second time: nobody pins it
  pool.release(BlockId{99});
  CHECK(pool.stats().bad_releases == 2);
  CHECK(pool.pinned() == 1);
  CHECK_FALSE(pool.allocate(4, table));  // three unpinned: refused, nothing taken
  CHECK(pool.stats().allocation_refusals == 1);
  CHECK(pool.pinned() == 1);

  SlotPool slots(2, 10);
  const std::optional<SlotId> a = slots.take();
  REQUIRE(a);
  CHECK(a->value == 10);  // the lowest-numbered first
  CHECK_FALSE(slots.give(SlotId{11}));  // in the pool, but not taken
  CHECK_FALSE(slots.give(SlotId{3}));   // not in the pool
  CHECK(slots.give(*a));
  CHECK_FALSE(slots.give(*a));  // twice
  CHECK(slots.refused() == 3);
  CHECK(slots.taken() == 0);
  CHECK_THROWS_AS(PrefixBlockPool(0), Error);
  CHECK_THROWS_AS(SlotPool(2, UINT32_MAX), Error);
}

TEST_CASE("host kit: the admission book routes unparks and frees and releases nothing on an event it cannot match") {
  PrefixBlockPool blocks(8);
  SlotPool slots(2), snapshots(2, 2);
  AdmissionBook<int> book;
  std::vector<BlockId> t1, t2;
  REQUIRE(blocks.allocate(3, t1));
  REQUIRE(blocks.allocate(2, t2));
  const std::optional<SlotId> s1 = slots.take(), s2 = slots.take();
  book.open(RequestId{1}, decision(AdmissionId{1}, true), t1, s1, 7);   // parked on a load
  book.open(RequestId{2}, decision(AdmissionId{2}, false), t2, s2, 8);  // computes now
  const std::optional<SlotId> snap = snapshots.take();

  std::vector<RequestId> resumed;
  auto on_resume = [&](auto& e, const Unpark& u) {
    CHECK(e.payload == 7);
    CHECK(e.state == AdmissionState::running);
    resumed.push_back(u.request);
  };
  // Request 2 is running, request 3 is unknown: neither unpark resumes anything. A Freed
  // for admission 1 (still live) releases nothing.
  book.apply(step_of({Unpark{RequestId{2}, 0}, Unpark{RequestId{3}, 0}, Unpark{RequestId{1}, 32}},
                     {Freed{RequestId{1}, AdmissionId{1}}}, {*snap}),
             blocks, slots, snapshots, on_resume);
  CHECK(resumed == std::vector<RequestId>{RequestId{1}});
  CHECK(book.stats().unexpected_unparks == 2);
  CHECK(book.stats().unexpected_frees == 1);
  CHECK(blocks.pinned() == 5);
  CHECK(snapshots.taken() == 0);

  // Both end; their Freeds hand everything back once; a second Freed, a Freed under the
  // wrong request, and a snapshot given twice are protocol errors.
  REQUIRE(book.end(RequestId{1}) != nullptr);
  REQUIRE(book.end(RequestId{2}) != nullptr);
  CHECK(book.end(RequestId{2}) == nullptr);  // a second teardown: nothing changes
  CHECK(book.stats().ended_now == 2);
  book.apply(step_of({}, {Freed{RequestId{1}, AdmissionId{2}}, Freed{RequestId{1}, AdmissionId{1}},
                          Freed{RequestId{1}, AdmissionId{1}}, Freed{RequestId{2}, AdmissionId{2}}},
                     {*snap}),
             blocks, slots, snapshots, on_resume);
  CHECK(book.stats().unexpected_frees == 3);
  CHECK(book.stats().refused_slots == 1);
  CHECK(book.stats().freed == 2);
  CHECK(book.size() == 0);
  CHECK(blocks.pinned() == 0);
  CHECK(slots.taken() == 0);
  CHECK(book.stats().protocol_errors() == 6);
}

TEST_CASE("host kit: a decision that found the request parked opens nothing, and a re-admission ends the running one") {
  PrefixBlockPool blocks(4);
  SlotPool slots(0), snapshots(0);
  AdmissionBook<> book;
  std::vector<BlockId> t;
  REQUIRE(blocks.allocate(1, t));
  book.open(RequestId{5}, decision(AdmissionId{1}, false), t, std::nullopt);
  AdmitDecision twice = decision(AdmissionId{1}, false);
  twice.reason = ComputeReason::already_parked;
  CHECK(book.open(RequestId{5}, twice, {}, std::nullopt) == nullptr);
  CHECK(book.stats().admitted_while_parked == 1);
  // Admitted again while running: the Coordinator ended the first admission; so does the book.
  book.open(RequestId{5}, decision(AdmissionId{2}, true), {}, std::nullopt);
  CHECK(book.find(AdmissionId{1})->state == AdmissionState::ended);
  CHECK(book.live(RequestId{5})->admission == AdmissionId{2});
  CHECK(book.admissions_of(RequestId{5}) == 2);
}

TEST_CASE("host kit: the audit of a clean engine is clean, and each leak shows in its own number") {
  OffloadIndex<> index(OffloadIndexOptions{.hash_capacity = 16, .slot_count = 2});
  PrefixBlockPool blocks(4);
  SlotPool slots(2), snapshots(2, 2);
  AdmissionBook<> book;
  CoordinatorStats cs;
  CHECK(audit_host(index, cs, book, blocks, slots, snapshots).clean());

  std::vector<BlockId> t;
  REQUIRE(blocks.allocate(2, t));
  (void)slots.take();
  book.open(RequestId{1}, decision(AdmissionId{1}, true), t, std::nullopt);
  cs.holding_now = 1;
  const HostAudit a = audit_host(index, cs, book, blocks, slots, snapshots);
  CHECK_FALSE(a.clean());
  CHECK(a.leaked_blocks == 2);
  CHECK(a.leaked_slots == 1);
  CHECK(a.held_admissions == 2);  // on the book, and one the coordinator holds for its ranks
  CHECK(a.stranded_parked == 1);
  CHECK(a.invariant_violations == 0);
  book.apply(step_of({Unpark{RequestId{9}, 0}}, {}, {}), blocks, slots, snapshots, [](auto&, const Unpark&) {});
  CHECK(audit_host(index, cs, book, blocks, slots, snapshots).invariant_violations == 1);
}
