// CacheKeeper (host/cache_keeper.hpp): an engine loop's side of the CacheLedger. The
// ledger's own choices are tests/test_cache_policy.cpp's; here, what the keeper adds: the
// cut of a save at the first chunk the ledger refuses, the checkpoints it does not offer,
// the uses of a load, the erase of each victim, and the sweep of victims whose save landed
// after their eviction.
#include <doctest/doctest.h>

#include <kvfuse/host/cache_keeper.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

using namespace kvfuse;

namespace {

constexpr std::uint64_t chunk_bytes = 1000;
constexpr std::uint32_t chunk_tokens = 256;

std::vector<PrefixHash> chain(std::uint64_t first, std::size_t n) {
  std::vector<PrefixHash> keys;
  for (std::size_t i = 0; i < n; ++i) keys.push_back(PrefixHash{first + i});
  return keys;
}

CacheKeeperOptions options(CachePolicy policy, std::uint64_t budget, bool stateful, bool second_sight = false) {
  CacheKeeperOptions o;
  o.ledger = CacheLedgerOptions{policy, budget, 1024, 0, second_sight};
  o.chunk_tokens = chunk_tokens;
  o.kv_chunk_bytes = chunk_bytes;
  o.state_bytes = 3 * chunk_bytes;
  o.stateful = stateful;
  return o;
}

CacheKey kv(std::uint64_t h) { return CacheKey{PrefixHash{h}, EntryKind::kv_chunk}; }
CacheKey state(std::uint64_t h) { return CacheKey{PrefixHash{h}, EntryKind::state}; }

// What a tier holds: the engine's erase removes from it; a put lands in it.
struct FakeTier {
  std::set<std::pair<std::uint64_t, bool>> held;
  std::vector<CacheKey> erased;
  void erase(const CacheKey& k) {
    erased.push_back(k);
    held.erase({k.hash.value, k.kind == EntryKind::state});
  }
  void land(const CacheKey& k) { held.insert({k.hash.value, k.kind == EntryKind::state}); }
  bool holds(const CacheKey& k) const { return held.count({k.hash.value, k.kind == EntryKind::state}) > 0; }
};

// What the keeper is given: the engine's tiers, by reference here so the test can look.
struct Tiers {
  FakeTier* t;
  void erase(const CacheKey& k) { t->erase(k); }
  bool holds(const CacheKey& k) const { return t->holds(k); }
};
static_assert(CacheTiers<Tiers>);
static_assert(!CacheTiers<int>);

}  // namespace

TEST_CASE("cache keeper off: every offer is kept, nothing is counted or erased") {
  FakeTier tier;
  CacheKeeperOptions o;
  o.chunk_tokens = chunk_tokens;
  CacheKeeper keeper(o, Tiers{&tier});
  const auto keys = chain(1, 4);
  CHECK_FALSE(keeper.on());
  CHECK(keeper.ledger() == nullptr);
  CHECK(keeper.keep_chunks(keys, 1, 4) == 4);
  CHECK(keeper.keep_checkpoint(keys, 512, PrefixHash{99}, 1000));
  keeper.note_uses(keys, 0, 1024, PrefixHash{99});
  CHECK_FALSE(keeper.contains(kv(1)));
  CHECK_FALSE(keeper.forget(kv(1)));
  CHECK(keeper.sweep() == 0);
  CHECK(tier.erased.empty());
}

TEST_CASE("cache keeper construction names the bad value") {
  auto thrown = [](CacheKeeperOptions o) {
    try {
      FakeTier tier;
      CacheKeeper keeper(o, Tiers{&tier});
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    return std::string("nothing thrown");
  };
  CacheKeeperOptions o = options(CachePolicy::cost, 10 * chunk_bytes, true);
  o.chunk_tokens = 0;
  CHECK(thrown(o).find("chunk_tokens must be > 0, got 0") != std::string::npos);
  o = options(CachePolicy::cost, 10 * chunk_bytes, true);
  o.kv_chunk_bytes = 0;
  CHECK(thrown(o).find("kv_chunk_bytes must be > 0") != std::string::npos);
  o = options(CachePolicy::cost, 10 * chunk_bytes, true);
  o.state_bytes = 0;
  CHECK(thrown(o).find("state_bytes must be > 0") != std::string::npos);
  o = options(CachePolicy::cost, 10 * chunk_bytes, true);
  o.sweep_capacity = 0;
  CHECK(thrown(o).find("sweep_capacity must be > 0") != std::string::npos);
  o = options(CachePolicy::cost, 0, true);
  CHECK(thrown(o).find("budget_bytes") != std::string::npos);  // the ledger's own
}

TEST_CASE("cache keeper cuts a save at the first chunk the ledger refuses, and every chunk above counts as seen") {
  FakeTier tier;
  CacheKeeper keeper(options(CachePolicy::cost, 3 * chunk_bytes, false, true), Tiers{&tier});
  const auto a = chain(10, 3), b = chain(20, 3);
  REQUIRE(keeper.keep_chunks(a, 0, 3) == 3);  // fits: first sight does not matter
  // Three new chunks that need room: the first is refused, so nothing is sent; the two
  // above it are seen too (and refused).
  CHECK(keeper.keep_chunks(b, 0, 3) == 0);
  CHECK(keeper.stats().chunks_cut == 3);
  CHECK(tier.erased.empty());
  // The second sight of the same prompt: all three come in, evicting a's, leaves first.
  CHECK(keeper.keep_chunks(b, 0, 3) == 3);
  REQUIRE(tier.erased.size() == 3);
  CHECK(tier.erased[0] == kv(12));
  CHECK(tier.erased[1] == kv(11));
  CHECK(tier.erased[2] == kv(10));
  CHECK(keeper.stats().erased == 3);
  for (std::uint64_t h = 20; h < 23; ++h) CHECK(keeper.contains(kv(h)));
}

TEST_CASE("cache keeper forgets a chunk admitted above the cut: it is not sent, so nothing holds it") {
  FakeTier tier;
  CacheKeeper keeper(options(CachePolicy::cost, 3 * chunk_bytes, false, true), Tiers{&tier});
  REQUIRE(keeper.keep_chunks(chain(10, 3), 0, 3) == 3);  // the budget is full
  // Chunk 31 was seen before (a refused offer), chunk 30 below it never: 30 is refused and
  // cuts the save, 31 is admitted on its second sight but sits above the cut.
  const std::vector<PrefixHash> seen_first{PrefixHash{40}, PrefixHash{31}};
  REQUIRE(keeper.keep_chunks(seen_first, 0, 2) == 0);
  const std::vector<PrefixHash> keys{PrefixHash{30}, PrefixHash{31}};
  CHECK(keeper.keep_chunks(keys, 0, 2) == 0);
  CHECK_FALSE(keeper.contains(kv(30)));
  CHECK_FALSE(keeper.contains(kv(31)));  // admitted, then forgotten: not sent
  CHECK(keeper.ledger()->stats().forgotten == 1);
  CHECK(keeper.ledger()->stats().bytes <= 3 * chunk_bytes);
}

TEST_CASE("cache keeper offers no checkpoint over a cut chunk, nor any when a chunk exceeds the budget") {
  FakeTier tier;
  CacheKeeper keeper(options(CachePolicy::cost, 10 * chunk_bytes, true), Tiers{&tier});
  const auto keys = chain(1, 4);
  // Boundary 600 is covered by chunk 2 (tokens 512..767): kept through chunk 2 it is offered.
  CHECK(keeper.keep_checkpoint(keys, 600, PrefixHash{77}, 1000, 3));
  CHECK(keeper.contains(state(77)));
  const std::optional<CacheFacts> f = keeper.ledger()->facts(state(77));
  REQUIRE(f);
  CHECK(f->footprint == 3 * chunk_bytes + 3 * chunk_bytes);  // its bytes and chunks 0..2
  CHECK(f->saved_tokens == 600);
  // Chunk 2 cut: it would stand on nothing.
  CHECK_FALSE(keeper.keep_checkpoint(keys, 600, PrefixHash{78}, 1000, 2));
  CHECK_FALSE(keeper.contains(state(78)));
  CHECK(keeper.stats().checkpoints_cut == 1);
  // A budget below one chunk keeps no KV: no checkpoint is offered at all.
  CacheKeeper small(options(CachePolicy::cost, chunk_bytes - 1, true), Tiers{&tier});
  CHECK_FALSE(small.keep_checkpoint(keys, 256, PrefixHash{79}, 1000));
  CHECK(small.ledger()->stats().entries == 0);
  CHECK(small.ledger()->stats().refused_too_large == 0);  // never asked
  CHECK(small.stats().checkpoints_cut == 1);
}

TEST_CASE("cache keeper marks a checkpoint at its prompt's last chunk boundary as the prompt end") {
  FakeTier tier;
  CacheKeeper keeper(options(CachePolicy::cost, 100 * chunk_bytes, true), Tiers{&tier});
  const auto keys = chain(1, 4);
  // Prompt of 1000 tokens: its last token 999 lies in chunk 3, whose start 768 is the end.
  CHECK(keeper.state_entry(keys, 768, PrefixHash{5}, 1000).prompt_end);
  CHECK_FALSE(keeper.state_entry(keys, 512, PrefixHash{5}, 1000).prompt_end);
  CHECK(keeper.state_entry(keys, 768, PrefixHash{5}, 1000).needs == kv(3));
  CHECK(keeper.state_entry(keys, 512, PrefixHash{5}, 1000).needs == kv(2));
  CHECK(keeper.kv_entry(keys, 0).needs == std::nullopt);
  CHECK(keeper.kv_entry(keys, 2).needs == kv(2));
  CHECK(keeper.kv_entry(keys, 2).saved_tokens == chunk_tokens / 4);  // stateful: a quarter
}

TEST_CASE("cache keeper counts a load's chunks from its HBM floor and its checkpoint as uses") {
  FakeTier tier;
  CacheKeeper keeper(options(CachePolicy::cost, 100 * chunk_bytes, true), Tiers{&tier});
  const auto keys = chain(1, 4);
  REQUIRE(keeper.keep_chunks(keys, 0, 4) == 4);
  REQUIRE(keeper.keep_checkpoint(keys, 768, PrefixHash{50}, 1000, 4));
  // Resumed at 768 over 256 tokens of HBM: chunks 1 and 2 came from the tier, and the state.
  keeper.note_uses(keys, 256, 768, PrefixHash{50});
  const CacheLedger& l = *keeper.ledger();
  CHECK(l.facts(kv(1))->hits == 0);  // below the HBM floor
  CHECK(l.facts(kv(2))->hits == 1);
  CHECK(l.facts(kv(3))->hits == 1);
  CHECK(l.facts(kv(4))->hits == 0);  // above the resume point
  CHECK(l.facts(state(50))->hits == 1);
  CHECK(l.stats().uses == 3);
  keeper.note_uses(keys, 0, 0, PrefixHash{50});  // resumed nowhere: nothing read
  CHECK(l.stats().uses == 3);
}

TEST_CASE("cache keeper sweep erases again a victim whose save landed after its eviction, unless it came back") {
  FakeTier tier;
  CacheKeeper keeper(options(CachePolicy::lru, 2 * chunk_bytes, false), Tiers{&tier});
  const auto a = chain(1, 1), b = chain(2, 1), c = chain(3, 1), d = chain(4, 1);
  // a is admitted; its put has not landed yet when b and c push it out.
  REQUIRE(keeper.keep_chunks(a, 0, 1) == 1);
  REQUIRE(keeper.keep_chunks(b, 0, 1) == 1);
  tier.land(kv(2));
  REQUIRE(keeper.keep_chunks(c, 0, 1) == 1);  // evicts a: erased before it landed
  tier.land(kv(3));
  CHECK(tier.erased.size() == 1);
  tier.land(kv(1));  // a's put lands now: the tier holds what the ledger does not count
  CHECK(keeper.stats().unswept == 1);
  CHECK(keeper.sweep() == 1);
  CHECK_FALSE(tier.holds(kv(1)));
  CHECK(keeper.stats().swept == 1);
  CHECK(keeper.stats().unswept == 0);
  // A victim stored again before the sweep is the ledger's again: left alone.
  REQUIRE(keeper.keep_chunks(d, 0, 1) == 1);  // evicts b
  REQUIRE(keeper.keep_chunks(b, 0, 1) == 1);  // b again, evicting c
  tier.land(kv(2));
  CHECK(keeper.sweep() == 1);  // c only
  CHECK(tier.holds(kv(2)));
  CHECK(keeper.contains(kv(2)));
}

TEST_CASE("cache keeper past sweep_capacity victims erases the oldest again at once") {
  FakeTier tier;
  CacheKeeperOptions o = options(CachePolicy::lru, chunk_bytes, false);
  o.sweep_capacity = 2;
  CacheKeeper keeper(o, Tiers{&tier});
  for (std::uint64_t h = 1; h <= 4; ++h) REQUIRE(keeper.keep_chunks(chain(h, 1), 0, 1) == 1);
  // Victims 1, 2, 3; the third pushes 1 out of the list, erased a second time.
  CHECK(keeper.stats().erased == 3);
  CHECK(keeper.stats().unswept == 2);
  CHECK(keeper.stats().swept == 1);
  CHECK(std::count(tier.erased.begin(), tier.erased.end(), kv(1)) == 2);
}

TEST_CASE("cache keeper sweep forgets a victim kept again whose new save never reached the tiers") {
  // A checkpoint saved mid-prefill is evicted by the chunks of its own finish while its save
  // is in flight, then offered again as the generation-end checkpoint: the ledger keeps it,
  // but the Coordinator skips the save as a duplicate of the one in flight, whose entry the
  // eviction erased after it landed. The ledger would count what nothing holds.
  FakeTier tier;
  CacheKeeper keeper(options(CachePolicy::lru, 4 * chunk_bytes, true), Tiers{&tier});
  const auto keys = chain(1, 2);
  REQUIRE(keeper.keep_checkpoint(keys, 256, PrefixHash{90}, 600));  // 3 chunks' bytes
  tier.land(state(90));
  REQUIRE(keeper.keep_chunks(keys, 0, 2) == 2);  // the second chunk evicts the checkpoint
  CHECK_FALSE(tier.holds(state(90)));
  CHECK_FALSE(keeper.contains(state(90)));
  REQUIRE(keeper.keep_checkpoint(keys, 256, PrefixHash{90}, 600, 2));  // kept again, never sent
  CHECK(keeper.contains(state(90)));
  const std::size_t erases = tier.erased.size();
  CHECK(keeper.sweep() >= 1);
  CHECK_FALSE(keeper.contains(state(90)));  // healed: nothing holds it
  CHECK(keeper.stats().healed == 1);
  CHECK(tier.erased.size() > erases);  // and the index was told (the erase forgets its hash)
  CHECK(std::count(tier.erased.begin(), tier.erased.end(), state(90)) == 2);
}

TEST_CASE("cache keeper offer_checkpoint sends what it keeps and forgets a new one the engine could not send") {
  FakeTier tier;
  CacheKeeper keeper(options(CachePolicy::cost, 10 * chunk_bytes, true), Tiers{&tier});
  const auto keys = chain(1, 2);
  using Offer = decltype(keeper)::Offer;
  int sends = 0;
  CHECK(keeper.offer_checkpoint(keys, 128, PrefixHash{60}, 600, [&] { return ++sends, true; }) == Offer::sent);
  CHECK(keeper.contains(state(60)));
  // No snapshot slot, say: kept, not sent, so not counted.
  CHECK(keeper.offer_checkpoint(keys, 192, PrefixHash{61}, 600, [&] { return ++sends, false; }) == Offer::not_sent);
  CHECK_FALSE(keeper.contains(state(61)));
  // Kept before this offer: the tiers hold it from then, so it stays.
  CHECK(keeper.offer_checkpoint(keys, 128, PrefixHash{60}, 600, [&] { return ++sends, false; }) == Offer::not_sent);
  CHECK(keeper.contains(state(60)));
  CHECK(sends == 3);
  // Refused (a budget below one chunk): `send` is never called.
  FakeTier other;
  CacheKeeper small(options(CachePolicy::cost, chunk_bytes - 1, true), Tiers{&other});
  CHECK(small.offer_checkpoint(keys, 128, PrefixHash{62}, 600, [&] { return ++sends, true; }) == Offer::refused);
  CHECK(sends == 3);
  // Off: always sent as the engine says.
  CacheKeeperOptions off;
  CacheKeeper none(off, Tiers{&other});
  CHECK(none.offer_checkpoint(keys, 128, PrefixHash{63}, 600, [&] { return ++sends, true; }) == Offer::sent);
  CHECK(sends == 4);
}
