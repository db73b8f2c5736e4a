// The index's hash set and LRU order in one open-addressed table
// (engine/detail/lru_hash_set.hpp), against a std::list + std::unordered_map model.
#include <doctest/doctest.h>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/detail/lru_hash_set.hpp>
#include <kvfuse/testing/alloc_counter.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <list>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;
using kvfuse::detail::AllocationScope;
using kvfuse::detail::LruHashSet;
using Outcome = LruHashSet::Outcome;

namespace {

// Exact LRU: front is most recently used. With a window > 1, the victim is the lightest of
// the `window` least recently used (the least recent among equals).
struct Model {
  std::size_t capacity;
  std::list<std::uint64_t> order;
  std::unordered_map<std::uint64_t, std::list<std::uint64_t>::iterator> where;
  std::uint32_t window = 1;
  std::unordered_map<std::uint64_t, std::uint32_t> weight;

  bool touch(std::uint64_t h) {
    const auto it = where.find(h);
    if (it == where.end()) return false;
    order.splice(order.begin(), order, it->second);
    return true;
  }
  LruHashSet::InsertResult insert_or_touch(std::uint64_t h, std::uint32_t w = 0) {
    LruHashSet::InsertResult r;
    weight[h] = w;
    if (touch(h)) {
      r.outcome = Outcome::touched;
      return r;
    }
    if (order.size() >= capacity) {
      auto victim = std::prev(order.end());
      auto it = victim;
      for (std::uint32_t seen = 1; seen < window && it != order.begin(); ++seen) {
        --it;
        if (weight[*it] < weight[*victim]) victim = it;
      }
      r.evicted = true;
      r.evicted_hash = PrefixHash{*victim};
      where.erase(*victim);
      order.erase(victim);
    }
    order.push_front(h);
    where[h] = order.begin();
    return r;
  }
  bool erase(std::uint64_t h) {
    const auto it = where.find(h);
    if (it == where.end()) return false;
    order.erase(it->second);
    where.erase(it);
    return true;
  }
};

std::vector<std::uint64_t> mru_of(const LruHashSet& set) {
  std::vector<std::uint64_t> out;
  set.for_each_mru([&](PrefixHash h) { out.push_back(h.value); });
  return out;
}

bool same_order(const LruHashSet& set, const Model& model) {
  const std::vector<std::uint64_t> got = mru_of(set);
  return got == std::vector<std::uint64_t>(model.order.begin(), model.order.end()) && set.size() == got.size() &&
         set.lru_length() == got.size();
}

// Random inserts, touches, erases and lookups over keys drawn from a range about twice the
// cap (so hits, misses and evictions all happen); check() after every step. Returns the
// number of disagreements with the model.
int churn(LruHashSet& set, Model& model, int steps, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::uint64_t> key(0, 2 * model.capacity + 3);
  std::uniform_int_distribution<int> op(0, 9);
  int bad = 0;
  for (int i = 0; i < steps; ++i) {
    const std::uint64_t k = key(rng);
    switch (op(rng)) {
      case 0:
      case 1:
      case 2:
      case 3: {
        const std::uint32_t w = static_cast<std::uint32_t>((k * 7919) % 13);  // ties on purpose
        const auto want = model.insert_or_touch(k, w);
        const auto got = set.insert_or_touch(PrefixHash{k}, w);
        if (got.outcome != want.outcome || got.evicted != want.evicted ||
            (want.evicted && got.evicted_hash != want.evicted_hash))
          ++bad;
        break;
      }
      case 4:
      case 5:
        if (set.touch(PrefixHash{k}) != model.touch(k)) ++bad;
        break;
      case 6:
      case 7:
        if (set.erase(PrefixHash{k}) != model.erase(k)) ++bad;
        break;
      default:
        if (set.contains(PrefixHash{k}) != (model.where.count(k) != 0)) ++bad;
        break;
    }
    if (const std::string p = set.check(); !p.empty()) {
      FAIL_CHECK("step " << i << ": " << p);
      return bad + 1;
    }
    if (i % 64 == 0 && !same_order(set, model)) ++bad;
  }
  if (!same_order(set, model)) ++bad;
  return bad;
}

// The home slot the set computes for a hash among `slots` (restated here to build runs
// that wrap around the end of the array on purpose).
std::uint32_t home_of(std::uint64_t h, std::size_t slots) {
  return static_cast<std::uint32_t>(((std::hash<PrefixHash>{}(PrefixHash{h}) >> 32) * slots) >> 32);
}

}  // namespace

TEST_CASE("lru hash set: exact LRU against a model, growing and preallocated at small and odd caps") {
  for (const bool preallocate : {false, true}) {
    for (const std::size_t cap : {1u, 2u, 3u, 5u, 16u, 17u, 100u, 1000u}) {
      CAPTURE(preallocate);
      CAPTURE(cap);
      LruHashSet set(cap, preallocate);
      Model model{cap, {}, {}, 1, {}};
      CHECK(set.check().empty());
      CHECK(churn(set, model, cap >= 1000 ? 4000 : 20000, 17 + cap) == 0);
      CHECK(set.size() <= cap);
    }
  }
}

TEST_CASE("lru hash set: the weighted eviction takes the lightest of the window's least recently used, against a model") {
  for (const bool preallocate : {false, true}) {
    for (const std::uint32_t window : {2u, 8u}) {
      for (const std::size_t cap : {1u, 2u, 3u, 16u, 17u, 100u}) {
        CAPTURE(preallocate);
        CAPTURE(window);
        CAPTURE(cap);
        LruHashSet set(cap, preallocate, window);
        Model model{cap, {}, {}, window, {}};
        CHECK(churn(set, model, 20000, 31 + cap + window) == 0);
      }
    }
  }
  // By hand: at the cap, among the 3 least recent, the lightest goes, not the least recent.
  LruHashSet set(4, false, 3);
  set.insert_or_touch(PrefixHash{1}, 500);  // least recent
  set.insert_or_touch(PrefixHash{2}, 100);  // lightest of the three oldest
  set.insert_or_touch(PrefixHash{3}, 300);
  set.insert_or_touch(PrefixHash{4}, 50);   // lighter still, but the most recent: outside the window
  const auto r = set.insert_or_touch(PrefixHash{5}, 400);
  CHECK(r.evicted);
  CHECK(r.evicted_hash == PrefixHash{2});
  CHECK(set.contains(PrefixHash{1}));
}

TEST_CASE("lru hash set: contains does not reorder - touch and erase of the head, tail and middle") {
  LruHashSet set(8, false);
  for (std::uint64_t h = 1; h <= 5; ++h) CHECK(set.insert_or_touch(PrefixHash{h}).outcome == Outcome::inserted);
  CHECK(mru_of(set) == std::vector<std::uint64_t>{5, 4, 3, 2, 1});
  CHECK(set.contains(PrefixHash{1}));
  CHECK_FALSE(set.contains(PrefixHash{6}));
  CHECK(mru_of(set) == std::vector<std::uint64_t>{5, 4, 3, 2, 1});
  CHECK(set.touch(PrefixHash{1}));
  CHECK(set.touch(PrefixHash{1}));  // already the head
  CHECK(set.touch(PrefixHash{3}));
  CHECK_FALSE(set.touch(PrefixHash{6}));
  CHECK(mru_of(set) == std::vector<std::uint64_t>{3, 1, 5, 4, 2});
  CHECK(set.erase(PrefixHash{3}));
  CHECK(set.erase(PrefixHash{2}));
  CHECK(set.erase(PrefixHash{5}));
  CHECK_FALSE(set.erase(PrefixHash{5}));
  CHECK(mru_of(set) == std::vector<std::uint64_t>{1, 4});
  CHECK(set.check().empty());
  CHECK(set.erase(PrefixHash{1}));
  CHECK(set.erase(PrefixHash{4}));
  CHECK(set.size() == 0);
  CHECK(set.lru_length() == 0);
  CHECK(mru_of(set).empty());
  CHECK(set.check().empty());
  CHECK(set.insert_or_touch(PrefixHash{9}).outcome == Outcome::inserted);
  CHECK(mru_of(set) == std::vector<std::uint64_t>{9});
}

TEST_CASE("lru hash set: probe runs that wrap around the end survive erases and evictions in any order") {
  // Cap 16: the array is 32 slots from the start and never grows. Eight hashes whose home
  // is one of the last two slots and eight whose home is slot 0 or 1 make one run that
  // wraps, so every erase shifts members across the end.
  constexpr std::size_t kSlots = 32;
  std::vector<std::uint64_t> keys;
  int high = 0, low = 0;
  for (std::uint64_t h = 1; high + low < 16; ++h) {
    const std::uint32_t home = home_of(h, kSlots);
    if (home >= kSlots - 2 && high < 8) {
      keys.push_back(h);
      ++high;
    } else if (home <= 1 && low < 8) {
      keys.push_back(h);
      ++low;
    }
  }
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    CAPTURE(round);
    LruHashSet set(16, round % 2 == 0);
    Model model{16, {}, {}, 1, {}};
    std::shuffle(keys.begin(), keys.end(), rng);
    for (const std::uint64_t k : keys) {
      set.insert_or_touch(PrefixHash{k});
      model.insert_or_touch(k);
    }
    REQUIRE(set.check().empty());
    std::shuffle(keys.begin(), keys.end(), rng);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (i % 3 == 0) {
        // Touch one and insert a newcomer: the LRU hash is evicted out of the wrapped run.
        set.touch(PrefixHash{keys[i]});
        model.touch(keys[i]);
        const auto want = model.insert_or_touch(1'000'000 + i);
        const auto got = set.insert_or_touch(PrefixHash{1'000'000 + i});
        CHECK(got.evicted == want.evicted);
        CHECK(got.evicted_hash == want.evicted_hash);
      } else {
        CHECK(set.erase(PrefixHash{keys[i]}) == model.erase(keys[i]));
      }
      const std::string p = set.check();
      REQUIRE_MESSAGE(p.empty(), p);
      REQUIRE(same_order(set, model));
    }
  }
}

TEST_CASE("lru hash set: growth keeps the exact order and visits each node once - a preallocated set never walks") {
  LruHashSet grown(std::size_t{1} << 12, false);
  LruHashSet whole(std::size_t{1} << 12, true);
  Model model{std::size_t{1} << 12, {}, {}, 1, {}};
  for (std::uint64_t h = 0; h < 3000; ++h) {
    grown.insert_or_touch(PrefixHash{h * 31});
    whole.insert_or_touch(PrefixHash{h * 31});
    model.insert_or_touch(h * 31);
    if (h % 7 == 0) {  // reorder, so the list is not insertion order
      grown.touch(PrefixHash{h / 2 * 31});
      whole.touch(PrefixHash{h / 2 * 31});
      model.touch(h / 2 * 31);
    }
  }
  // 32 slots to start, doubled as the 17th, 33rd, ..., 2049th hash arrived: each growth
  // re-inserted the 16, 32, ..., 2048 hashes held.
  CHECK(grown.walks() == 4096 - 16);
  CHECK(whole.walks() == 0);
  CHECK(same_order(grown, model));
  CHECK(same_order(whole, model));
  CHECK(grown.check().empty());
  CHECK(whole.check().empty());
}

TEST_CASE("lru hash set: a growth that cannot allocate evicts the LRU hash - a preallocated set never allocates") {
  REQUIRE(AllocationScope::hook_installed());
  LruHashSet set(1000, false);
  Model model{1000, {}, {}, 1, {}};
  for (std::uint64_t h = 1; h <= 16; ++h) {  // 32 slots, now at a load of 1/2
    set.insert_or_touch(PrefixHash{h});
    model.insert_or_touch(h);
  }
  set.touch(PrefixHash{1});
  model.touch(1);
  LruHashSet::InsertResult r;
  {
    AllocationScope::fail_next(1);
    r = set.insert_or_touch(PrefixHash{17});
    AllocationScope::fail_next(0);
  }
  CHECK(r.outcome == Outcome::inserted);
  CHECK(r.evicted);
  CHECK(r.evicted_hash == PrefixHash{2});  // 1 was touched, so 2 is the least recently used
  model.erase(2);
  model.insert_or_touch(17);
  CHECK(set.size() == 16);
  CHECK(set.contains(PrefixHash{17}));
  CHECK_FALSE(set.contains(PrefixHash{2}));
  CHECK(set.check().empty());
  CHECK(same_order(set, model));
  // Memory back: the next insert grows instead, and nothing more is evicted.
  r = set.insert_or_touch(PrefixHash{18});
  model.insert_or_touch(18);
  CHECK_FALSE(r.evicted);
  CHECK(set.size() == 17);
  CHECK(set.check().empty());
  CHECK(same_order(set, model));

  LruHashSet whole(1000, true);
  AllocationScope scope;
  for (std::uint64_t h = 0; h < 3000; ++h) (void)whole.insert_or_touch(PrefixHash{h});
  for (std::uint64_t h = 0; h < 3000; h += 3) (void)whole.erase(PrefixHash{h});
  CHECK(scope.this_thread() == 0);
  CHECK(whole.size() == 667);
  CHECK(whole.check().empty());
}
