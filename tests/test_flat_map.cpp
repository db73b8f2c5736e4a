// The one open-addressing map (detail/flat_map.hpp) under each of its names, and the ring.
#include <doctest/doctest.h>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/detail/flat_map.hpp>
#include <kvfuse/detail/ring.hpp>
#include <kvfuse/testing/alloc_counter.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <new>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <vector>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;
using kvfuse::detail::AllocationScope;

namespace {

// Homes in the first four and the last four slots of any table: probe runs that wrap
// around the end, where the backward shift's cyclic "home between" test is easiest to get
// wrong.
struct WrappingHash {
  std::size_t operator()(std::uint64_t k) const noexcept {
    const std::size_t spot = static_cast<std::size_t>((k >> 1) % 4);
    return (k & 1) != 0 ? std::numeric_limits<std::size_t>::max() - spot : spot;
  }
};

// Random insert / erase / find against std::unordered_map; returns the number of
// disagreements. `Map` is a FlatMap<Key, std::uint64_t, ...>.
template <class Map, class Key, class MakeKey>
std::uint64_t churn(Map& flat, std::unordered_map<Key, std::uint64_t>& model, MakeKey make_key, int steps,
                    std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uint64_t mismatches = 0;
  for (int i = 0; i < steps; ++i) {
    const Key k = make_key(rng);
    switch (rng() % 4) {
      case 0: {  // the allocating path
        auto [v, inserted] = flat.try_emplace(k);
        if (inserted != model.emplace(k, 0).second) ++mismatches;
        *v += 1;
        model[k] += 1;
        break;
      }
      case 1:  // the reserve-then-insert path
        if (!flat.contains(k)) {
          flat.reserve(flat.size() + 1);
          *flat.insert(k, 100) += 1;
          model[k] = 101;
        }
        break;
      case 2:
        if (flat.erase(k) != (model.erase(k) == 1)) ++mismatches;
        break;
      default: {
        const std::uint64_t* v = flat.find(k);
        const auto it = model.find(k);
        if ((v == nullptr) != (it == model.end()) || (v != nullptr && *v != it->second)) ++mismatches;
      }
    }
    if (flat.size() != model.size()) ++mismatches;
  }
  return mismatches;
}

template <class Map, class Key>
void check_same(const Map& flat, const std::unordered_map<Key, std::uint64_t>& model) {
  std::size_t visited = 0;
  flat.for_each([&](const Key& k, std::uint64_t v) {
    ++visited;
    CHECK(model.at(k) == v);
  });
  CHECK(visited == model.size());
  for (const auto& [k, v] : model) {
    REQUIRE(flat.find(k) != nullptr);
    CHECK(*flat.find(k) == v);
  }
}

}  // namespace

TEST_CASE("flat map: agrees with std::unordered_map under random churn") {
  SUBCASE("load keys, few of them: long probe chains, many erases (the quorum's tables)") {
    detail::FlatMap<LoadKey, std::uint64_t> flat(4);
    std::unordered_map<LoadKey, std::uint64_t> model;
    const auto key = [](std::mt19937_64& rng) { return LoadKey{RequestId{rng() % 512}, Generation{rng() % 4}}; };
    CHECK(churn(flat, model, key, 200000, 7) == 0);
    check_same(flat, model);
  }
  SUBCASE("runs that wrap around the end of the table") {
    detail::FlatMap<std::uint64_t, std::uint64_t, WrappingHash> flat;
    std::unordered_map<std::uint64_t, std::uint64_t> model;
    const auto key = [](std::mt19937_64& rng) { return rng() % 24; };
    CHECK(churn(flat, model, key, 100000, 11) == 0);
    check_same(flat, model);
  }
  SUBCASE("growth from empty to many keys and back") {
    detail::FlatMap<std::uint64_t, std::uint64_t> flat;
    std::unordered_map<std::uint64_t, std::uint64_t> model;
    const auto key = [](std::mt19937_64& rng) { return rng() % 20000; };
    CHECK(churn(flat, model, key, 100000, 13) == 0);
    check_same(flat, model);
    for (std::uint64_t k = 0; k < 20000; ++k) CHECK(flat.erase(k) == (model.erase(k) == 1));
    CHECK(flat.empty());
  }
}

TEST_CASE("flat map: reserve may allocate and throw leaving the map as it was - insert never allocates") {
  REQUIRE(AllocationScope::hook_installed());
  detail::FlatIndexMap<Generation> map;
  {
    AllocationScope nothing;
    CHECK(map.find(Generation{1}) == detail::npos32);  // an empty map holds no memory
    CHECK_FALSE(map.erase(Generation{1}));
    CHECK(nothing.this_thread() == 0);
  }
  map.reserve(1000);
  {
    AllocationScope scope;
    for (std::uint32_t i = 0; i < 1000; ++i) map.insert(Generation{i}, i);
    for (std::uint32_t i = 0; i < 1000; i += 2) CHECK(map.erase(Generation{i}));
    for (std::uint32_t i = 0; i < 1000; i += 2) map.insert(Generation{i}, i + 1);
    CHECK(scope.this_thread() == 0);
  }
  CHECK(map.size() == 1000);
  CHECK(map.find(Generation{999}) == 999);
  CHECK(map.find(Generation{998}) == 999);
  CHECK(map.find(Generation{1000}) == detail::npos32);

  // A failed growth is a clean refusal: every entry still there, nothing half-moved.
  bool threw = false;
  AllocationScope::fail_next(1);
  try {
    map.reserve(100000);
  } catch (const std::bad_alloc&) {
    threw = true;
  }
  AllocationScope::fail_next(0);
  CHECK(threw);
  CHECK(map.size() == 1000);
  for (std::uint32_t i = 0; i < 1000; ++i) CHECK(map.find(Generation{i}) == (i % 2 == 0 ? i + 1 : i));

  detail::FlatSet<SaveKey> set;
  set.reserve(64);
  {
    AllocationScope scope;
    for (std::uint64_t i = 0; i < 64; ++i) set.insert(SaveKey{PrefixHash{i}, Generation{i}});
    CHECK(scope.this_thread() == 0);
  }
  CHECK(set.size() == 64);
  CHECK(set.contains(SaveKey{PrefixHash{5}, Generation{5}}));
  CHECK_FALSE(set.contains(SaveKey{PrefixHash{5}, Generation{6}}));
  CHECK(set.erase(SaveKey{PrefixHash{5}, Generation{5}}));
  CHECK_FALSE(set.contains(SaveKey{PrefixHash{5}, Generation{5}}));
  CHECK(set.size() == 63);
}

TEST_CASE("R17 flat map: lookups and updates walk nothing - rehash and for_each count every slot they visit") {
  detail::FlatIndexMap<RequestId> map;
  CHECK(map.walks() == 0);
  map.reserve(8);  // 16 slots, nothing to move
  CHECK(map.walks() == 0);
  for (std::uint32_t i = 0; i < 8; ++i) map.insert(RequestId{i}, i);
  (void)map.find(RequestId{3});
  (void)map.erase(RequestId{3});
  CHECK(map.walks() == 0);
  map.reserve(9);  // 16 -> 32 slots: the rehash visits the 16 old ones
  CHECK(map.walks() == 16);
  std::size_t seen = 0;
  map.for_each([&](RequestId, std::uint32_t) { ++seen; });
  CHECK(seen == 7);
  CHECK(map.walks() == 16 + 32);
}

TEST_CASE("ring: first in, first out across growth and wrap-around - retain keeps order") {
  detail::Ring<int> ring(2);
  std::deque<int> model;
  std::mt19937_64 rng(3);
  int next = 0;
  for (int i = 0; i < 20000; ++i) {
    if (rng() % 3 != 0 || model.empty()) {
      ring.push_back(next);
      model.push_back(next++);
    } else {
      REQUIRE(ring.front() == model.front());
      ring.pop_front();
      model.pop_front();
    }
    REQUIRE(ring.size() == model.size());
  }
  ring.retain([](int v) noexcept { return v % 3 == 0; });
  std::erase_if(model, [](int v) { return v % 3 != 0; });
  REQUIRE(ring.size() == model.size());
  while (!model.empty()) {
    CHECK(ring.front() == model.front());
    ring.pop_front();
    model.pop_front();
  }
  CHECK(ring.empty());
}
