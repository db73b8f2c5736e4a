// The cache policy and its owner (docs/reference.md#cache-policy): a table of the pure
// functions, the ledger's behaviour by hand (a checkpoint keeps the KV it stands on, a
// first-seen checkpoint (and, on second sight, a dense KV chunk) is refused under pressure, GDSF's inflation ages a once-hot entry,
// forget heals, a use never allocates), its typed errors, and a property test: on random
// stores, uses and forgets the ledger makes the same choices as a brute-force reference
// written here over a plain vector, which picks each victim with cache_victim().
#include <doctest/doctest.h>

#include <kvfuse/engine/cache_ledger.hpp>
#include <kvfuse/engine/cache_policy.hpp>
#include <kvfuse/testing/alloc_counter.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();

using namespace kvfuse;

namespace {

CacheKey kv(std::uint64_t h) { return CacheKey{PrefixHash{h}, EntryKind::kv_chunk}; }
CacheKey st(std::uint64_t h) { return CacheKey{PrefixHash{h}, EntryKind::state}; }

CacheFacts leaf(double priority, std::uint64_t last_use) {
  CacheFacts f;
  f.priority = priority;
  f.last_use = last_use;
  return f;
}

/// Stores `e` and returns what it evicted, in order.
std::vector<CacheKey> store(CacheLedger& l, const CacheEntry& e, CacheVerdict expect = CacheVerdict::admitted) {
  std::vector<CacheKey> out;
  const CacheVerdict v = l.store(e, [&](const CacheKey& k) { out.push_back(k); });
  CHECK_MESSAGE(v == expect, "store of ", e.key.hash.value, ": ", to_string(v), " (expected ", to_string(expect), ")");
  return out;
}

}  // namespace

TEST_CASE("cache policy functions are constexpr and noexcept") {
  static_assert(noexcept(cache_priority(EntryKind::state, 1, 0, 1, 0.0)));
  static_assert(noexcept(cache_saved_tokens(EntryKind::state, true, 512, 1024)));
  static_assert(noexcept(cache_victim(CachePolicy::cost, std::span<const CacheFacts>{})));
  static_assert(noexcept(cache_admits(CachePolicy::cost, CacheAdmission{})));
  static_assert(cache_priority(EntryKind::kv_chunk, 512, 0, 4096, 0.0) == 0.125);
  static_assert(cache_priority(EntryKind::state, 512, 3, 4096, 2.0) == 2.5);  // uses weigh for a checkpoint
  static_assert(cache_priority(EntryKind::kv_chunk, 512, 3, 4096, 2.0) == 2.125);  // and not for KV
  static_assert(cache_priority(EntryKind::state, 0, 9, 4096, 1.5) == 1.5);
  static_assert(cache_priority(EntryKind::kv_chunk, 7, 0, 0, 0.0) == 7.0);  // zero bytes read as one
  static_assert(cache_saved_tokens(EntryKind::kv_chunk, false, 512, 0) == 512);
  static_assert(cache_saved_tokens(EntryKind::kv_chunk, true, 512, 0) == 128);
  static_assert(cache_saved_tokens(EntryKind::state, true, 512, 4096) == 4096);
  static_assert(to_string(CachePolicy::lru) == "lru" && to_string(CachePolicy::cost) == "cost");
  static_assert(to_string(CacheVerdict::refused_first_seen) == "refused_first_seen");
}

TEST_CASE("cache policy table: which entry goes and which comes in") {
  CacheFacts needed = leaf(0.0, 1);
  needed.needed_by = 1;
  const std::array<CacheFacts, 4> kept{needed, leaf(0.5, 9), leaf(0.25, 20), leaf(0.25, 7)};
  // lru: the oldest, needed or not.
  CHECK(cache_victim(CachePolicy::lru, kept) == 0);
  // cost: the lowest priority among leaves, the older of equals.
  CHECK(cache_victim(CachePolicy::cost, kept) == 3);
  CHECK(cache_evictable(CachePolicy::lru, needed));
  CHECK_FALSE(cache_evictable(CachePolicy::cost, needed));
  CHECK(cache_victim(CachePolicy::cost, std::span<const CacheFacts>(kept.data(), 1)) == 1);  // none evictable: size
  CHECK(cache_victim(CachePolicy::lru, std::span<const CacheFacts>{}) == 0);
  CHECK(cache_evicts_first(CachePolicy::cost, leaf(0.1, 50), leaf(0.2, 1)));
  CHECK(cache_evicts_first(CachePolicy::lru, leaf(0.2, 1), leaf(0.1, 50)));

  struct Row {
    CachePolicy policy;
    EntryKind kind;
    bool fits, seen, light, prompt_end, second_sight, admits;
  };
  constexpr auto lru = CachePolicy::lru, cost = CachePolicy::cost;
  constexpr auto state = EntryKind::state, chunk = EntryKind::kv_chunk;
  const Row rows[] = {
      {lru, state, false, false, false, false, false, true},    // lru lets everything in
      {lru, chunk, false, false, false, false, false, true},
      {lru, chunk, false, false, false, false, true, true},     // second sight is `cost`'s
      {cost, state, true, false, false, false, false, true},    // it fits: no one is evicted
      {cost, state, false, false, false, false, false, false},  // heavy, first seen, mid-prompt: refused
      {cost, state, false, true, false, false, false, true},    // seen before
      {cost, state, false, false, true, false, false, true},    // light
      {cost, state, false, false, false, true, false, true},    // the prompt's end
      {cost, state, false, false, true, false, true, true},     // second sight is for KV only
      {cost, chunk, false, false, false, false, false, true},   // KV is not refused for being new (a hybrid's)
      {cost, chunk, false, false, false, false, true, false},   // dense KV, first seen, no room: refused
      {cost, chunk, false, true, false, false, true, true},     // seen before
      {cost, chunk, true, false, false, false, true, true},     // it fits
      {cost, chunk, false, false, true, true, true, false},     // light and prompt_end are for checkpoints
  };
  for (const Row& r : rows) {
    CAPTURE(to_string(r.policy));
    CAPTURE(r.fits);
    CAPTURE(r.seen);
    CAPTURE(r.light);
    CAPTURE(r.prompt_end);
    CAPTURE(r.second_sight);
    CHECK(cache_admits(r.policy, CacheAdmission{r.kind, r.fits, r.seen, r.light, r.prompt_end, r.second_sight}) == r.admits);
  }
}

TEST_CASE("cache ledger construction names the bad value") {
  auto message = [](const CacheLedgerOptions& o) {
    try {
      CacheLedger l(o);
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message(CacheLedgerOptions{CachePolicy::cost, 0}).find("budget_bytes is 0") != std::string::npos);
  CHECK(message(CacheLedgerOptions{static_cast<CachePolicy>(7), 10}).find("policy 7") != std::string::npos);
  CHECK(message(CacheLedgerOptions{CachePolicy::lru, 10, 0}).find("seen_capacity 0") != std::string::npos);
  CHECK(message(CacheLedgerOptions{CachePolicy::lru, 10, (std::size_t{1} << 31) + 1}).find("seen_capacity 2147483649") !=
        std::string::npos);
}

TEST_CASE("cache ledger under cost keeps the KV a checkpoint stands on, where lru drops it") {
  // A hybrid prefix: chunks 1 <- 2, a checkpoint 10 at the end of chunk 2 (8 bytes, spares
  // 1024 tokens), then an unrelated chunk 3 needing room. The budget holds 12 bytes.
  for (const CachePolicy policy : {CachePolicy::lru, CachePolicy::cost}) {
    CAPTURE(to_string(policy));
    CacheLedger l(CacheLedgerOptions{policy, 12});
    (void)store(l, CacheEntry{kv(1), std::nullopt, 2, 0});
    (void)store(l, CacheEntry{kv(2), kv(1), 2, 0});
    (void)store(l, CacheEntry{st(10), kv(2), 8, 1024});
    CHECK(l.facts(kv(2))->needed_by == 1);
    CHECK(l.facts(kv(1))->needed_by == 1);
    const auto gone = store(l, CacheEntry{kv(3), std::nullopt, 2, 0});
    REQUIRE(gone.size() == 1);
    if (policy == CachePolicy::lru) {
      CHECK(gone[0] == kv(1));  // the oldest: now the checkpoint and chunk 2 are unusable
    } else {
      CHECK(gone[0] == st(10));  // the only leaf besides nothing: the chain's top goes first
      CHECK(l.contains(kv(1)));
      CHECK(l.facts(kv(2))->needed_by == 0);  // its checkpoint went: a leaf again
    }
    const CacheLedgerStats s = l.stats();
    CHECK(s.bytes <= s.budget_bytes);
    CHECK(s.bytes == s.kv_bytes + s.state_bytes);
    CHECK(s.entries == s.admitted - s.evicted_kv - s.evicted_state - s.forgotten);
  }
}

TEST_CASE("cache ledger under cost evicts the KV nothing stands on before a checkpoint") {
  // Budget 10: chunk 1 (2 B), checkpoint 10 on it (4 B, spares 512), a stray chunk 5 above
  // no checkpoint (2 B, saves nothing for a hybrid). A new chunk of 3 B must evict 1 or 2.
  CacheLedger l(CacheLedgerOptions{CachePolicy::cost, 10});
  (void)store(l, CacheEntry{kv(1), std::nullopt, 2, 0});
  (void)store(l, CacheEntry{st(10), kv(1), 4, 512});
  (void)store(l, CacheEntry{kv(5), kv(1), 2, 0});
  CHECK(l.facts(kv(1))->needed_by == 2);
  const auto gone = store(l, CacheEntry{kv(6), std::nullopt, 3, 0});
  REQUIRE(gone.size() == 1);
  CHECK(gone[0] == kv(5));
  CHECK(l.inflation() == 0.0);  // chunk 5's priority: L + 0
  CHECK(l.contains(st(10)));
}

TEST_CASE("cache ledger under cost refuses a first-seen checkpoint under pressure and admits it the second time") {
  CacheLedger l(CacheLedgerOptions{CachePolicy::cost, 8});
  (void)store(l, CacheEntry{kv(1), std::nullopt, 4, 512});
  (void)store(l, CacheEntry{st(20), kv(1), 4, 512});  // fits: admitted though never seen
  (void)store(l, CacheEntry{st(21), kv(1), 4, 512}, CacheVerdict::refused_first_seen);
  CHECK_FALSE(l.contains(st(21)));
  const auto gone = store(l, CacheEntry{st(21), kv(1), 4, 512});  // seen now
  REQUIRE(gone.size() == 1);
  CHECK(gone[0] == st(20));
  CHECK(l.stats().refused_first_seen == 1);
  CHECK(l.stats().evicted_state == 1);
  // A KV chunk is never refused for being new; lru never refuses.
  (void)store(l, CacheEntry{kv(2), std::nullopt, 4, 512});
  // First seen and no room, but at its prompt's end: let in.
  (void)store(l, CacheEntry{st(22), kv(2), 4, 512, 0, true});
  // A light checkpoint (at most light_state_bytes) is let in on first sight too.
  CacheLedger light(CacheLedgerOptions{CachePolicy::cost, 8, 1024, 4});
  (void)store(light, CacheEntry{kv(1), std::nullopt, 4, 512});
  (void)store(light, CacheEntry{st(20), kv(1), 4, 512});
  (void)store(light, CacheEntry{st(21), kv(1), 4, 512});
  (void)store(light, CacheEntry{st(23), kv(1), 5, 512}, CacheVerdict::refused_first_seen);  // one byte heavier
  CHECK(light.stats().refused_first_seen == 1);
  CacheLedger lru(CacheLedgerOptions{CachePolicy::lru, 4});
  (void)store(lru, CacheEntry{st(1), std::nullopt, 4, 1});
  (void)store(lru, CacheEntry{st(2), std::nullopt, 4, 1});
  (void)store(lru, CacheEntry{st(3), std::nullopt, 5, 1}, CacheVerdict::refused_too_large);
  CHECK(lru.stats().refused_too_large == 1);
}

TEST_CASE("cache ledger with kv_on_second_sight admits a first-seen KV chunk only when it fits") {
  CacheLedgerOptions o{CachePolicy::cost, 4};
  o.kv_on_second_sight = true;
  CacheLedger l(o);
  (void)store(l, CacheEntry{kv(1), std::nullopt, 2, 512});  // first seen, but it fits
  (void)store(l, CacheEntry{kv(2), std::nullopt, 2, 512});
  (void)store(l, CacheEntry{kv(3), std::nullopt, 2, 512}, CacheVerdict::refused_first_seen);
  CHECK_FALSE(l.contains(kv(3)));
  CHECK(l.stats().evicted_kv == 0);
  const auto gone = store(l, CacheEntry{kv(3), std::nullopt, 2, 512});  // seen now: evicts the older
  REQUIRE(gone.size() == 1);
  CHECK(gone[0] == kv(1));
  // Too large is too large, first seen or not; and it counts as a sighting.
  (void)store(l, CacheEntry{kv(4), std::nullopt, 5, 512}, CacheVerdict::refused_too_large);
  // A checkpoint's sighting is not a chunk's of the same hash, nor the other way round.
  (void)store(l, CacheEntry{st(5), std::nullopt, 4, 512}, CacheVerdict::refused_first_seen);
  (void)store(l, CacheEntry{kv(5), std::nullopt, 2, 512}, CacheVerdict::refused_first_seen);
  (void)store(l, CacheEntry{kv(6), std::nullopt, 2, 512}, CacheVerdict::refused_first_seen);
  (void)store(l, CacheEntry{st(6), std::nullopt, 4, 512}, CacheVerdict::refused_first_seen);
  CHECK(l.stats().refused_first_seen == 5);
  CHECK(l.stats().refused_too_large == 1);
  {
    detail::AllocationScope scope;  // use and forget stay allocation-free with the option on
    CHECK(l.use(kv(3)));
    CHECK(l.forget(kv(2)));
    CHECK(scope.this_thread() == 0);
  }
  // Off (the default, a hybrid's) or under lru: a new chunk comes in, evicting.
  for (const CachePolicy policy : {CachePolicy::cost, CachePolicy::lru}) {
    CacheLedgerOptions off{policy, 4};
    off.kv_on_second_sight = policy == CachePolicy::lru;
    CacheLedger m(off);
    (void)store(m, CacheEntry{kv(1), std::nullopt, 2, 512});
    (void)store(m, CacheEntry{kv(2), std::nullopt, 2, 512});
    CHECK(store(m, CacheEntry{kv(3), std::nullopt, 2, 512}).size() == 1);
  }
}

TEST_CASE("cache ledger under cost ages a once-used entry below newer ones (GDSF inflation)") {
  // Each entry 1 byte, budget 2. Checkpoint 1 spares 4 tokens and is used twice (priority
  // (1 + 2) x 4 = 12); then KV chunks of 3 tokens come and go: each eviction raises L to the
  // evicted priority, until a newcomer's L + 3 reaches 12 and checkpoint 1 is the lowest.
  CacheLedger l(CacheLedgerOptions{CachePolicy::cost, 2});
  (void)store(l, CacheEntry{st(1), std::nullopt, 1, 4});
  CHECK(l.use(st(1)));
  CHECK(l.use(st(1)));
  CHECK(l.facts(st(1))->priority == 12.0);
  std::uint64_t next = 100;
  (void)store(l, CacheEntry{kv(next), std::nullopt, 1, 3});
  int rounds = 0;
  for (; rounds < 20 && l.contains(st(1)); ++rounds) (void)store(l, CacheEntry{kv(++next), std::nullopt, 1, 3});
  // L climbs 3, 6, 9; then the newest ties checkpoint 1 at 12, and the older of the two goes.
  CHECK(rounds == 4);
  CHECK_FALSE(l.contains(st(1)));
  CHECK(l.inflation() == 12.0);
  CHECK_FALSE(l.use(st(1)));
  // A KV chunk's uses do not weigh: its priority is L + 3 / 1 whatever its hits.
  CHECK(l.use(kv(next)));
  CHECK(l.facts(kv(next))->priority == 15.0);
}

TEST_CASE("cache ledger weighs a checkpoint by its footprint: its bytes and the KV it stands on") {
  CacheLedger l(CacheLedgerOptions{CachePolicy::cost, 100});
  (void)store(l, CacheEntry{st(1), std::nullopt, 4, 1024, 12});
  CHECK(l.facts(st(1))->footprint == 16);
  CHECK(l.facts(st(1))->priority == 64.0);  // 1024 / (4 + 12), L = 0
  CHECK(l.facts(st(1))->bytes == 4);         // the budget counts its own bytes only
  CHECK(l.stats().bytes == 4);
  CHECK(l.use(st(1)));
  CHECK(l.facts(st(1))->priority == 128.0);  // (1 + 1) x 1024 / 16
}

TEST_CASE("cache ledger forget heals without a callback, and use and forget allocate nothing") {
  REQUIRE(detail::AllocationScope::hook_installed());
  CacheLedger l(CacheLedgerOptions{CachePolicy::cost, 100});
  (void)store(l, CacheEntry{kv(1), std::nullopt, 2, 512});
  (void)store(l, CacheEntry{kv(2), kv(1), 2, 512});
  (void)store(l, CacheEntry{st(3), kv(2), 8, 1024});
  CacheLedgerStats s;
  {
    detail::AllocationScope scope;
    CHECK(l.use(kv(2)));
    CHECK(l.use(st(3)));
    CHECK(l.forget(st(3)));  // kv(2) becomes a leaf again: re-filed in its own set node
    CHECK_FALSE(l.forget(st(3)));
    CHECK(l.forget(kv(1)));  // a tier dropped a needed entry: kept no more, chunk 2 stays
    s = l.stats();
    CHECK(scope.this_thread() == 0);
  }
  CHECK(s.forgotten == 2);
  CHECK(s.uses == 2);
  CHECK(s.entries == 1);
  CHECK(l.facts(kv(2))->needed_by == 0);
  CHECK(l.facts(kv(2))->hits == 1);
  const auto gone = store(l, CacheEntry{kv(9), std::nullopt, 99, 1});
  REQUIRE(gone.size() == 1);
  CHECK(gone[0] == kv(2));
  CHECK(l.stats().bytes == 99);
}

namespace {

/// The brute-force reference: every kept entry in a vector, each victim chosen by
/// cache_victim() over all of them, needed_by recounted from scratch each time.
class Reference {
 public:
  explicit Reference(CacheLedgerOptions o) : o_(o) {}

  CacheVerdict store(const CacheEntry& e, std::vector<CacheKey>& evicted) {
    if (use(e.key)) return CacheVerdict::already_kept;
    // Sightings: every checkpoint's; a KV chunk's with kv_on_second_sight under cost, in a
    // list of its own (a chunk and a checkpoint of one hash are different keys).
    const bool state = e.key.kind == EntryKind::state;
    std::vector<std::uint64_t>* sightings =
        state ? &seen_ : (o_.kv_on_second_sight && o_.policy == CachePolicy::cost ? &seen_kv_ : nullptr);
    const bool seen =
        sightings != nullptr && std::find(sightings->begin(), sightings->end(), e.key.hash.value) != sightings->end();
    if (sightings != nullptr && !seen) sightings->push_back(e.key.hash.value);
    if (e.bytes > o_.budget_bytes) return CacheVerdict::refused_too_large;
    // The rule written out, not cache_admits(): the reference must not share a bug with it.
    const bool fits = bytes() + e.bytes <= o_.budget_bytes;
    const bool admits = o_.policy == CachePolicy::lru || fits ||
                        (state ? seen || e.bytes <= o_.light_state_bytes || e.prompt_end : !o_.kv_on_second_sight || seen);
    if (!admits) return CacheVerdict::refused_first_seen;
    pending_ = e;  // counts as a needer while the victims are chosen
    while (bytes() + e.bytes > o_.budget_bytes) {
      std::vector<CacheFacts> facts = current_facts();
      const std::size_t v = cache_victim(o_.policy, facts);
      if (v == facts.size()) break;
      if (o_.policy == CachePolicy::cost) inflation_ = std::max(inflation_, facts[v].priority);
      evicted.push_back(kept_[v].key);
      kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(v));
    }
    pending_.reset();
    if (bytes() + e.bytes > o_.budget_bytes) return CacheVerdict::refused_too_large;
    Item it{e.key, e.needs, CacheFacts{}};
    it.facts.kind = e.key.kind;
    it.facts.bytes = e.bytes;
    it.facts.footprint = e.bytes + e.stands_on;
    it.facts.saved_tokens = e.saved_tokens;
    it.facts.last_use = ++clock_;
    it.facts.priority = cache_priority(e.key.kind, e.saved_tokens, 0, it.facts.footprint, inflation_);
    kept_.push_back(it);
    return CacheVerdict::admitted;
  }
  bool use(const CacheKey& k) {
    for (Item& it : kept_) {
      if (it.key != k) continue;
      ++it.facts.hits;
      it.facts.last_use = ++clock_;
      it.facts.priority = cache_priority(it.facts.kind, it.facts.saved_tokens, it.facts.hits, it.facts.footprint, inflation_);
      return true;
    }
    return false;
  }
  bool forget(const CacheKey& k) {
    const auto it = std::find_if(kept_.begin(), kept_.end(), [&](const Item& i) { return i.key == k; });
    if (it == kept_.end()) return false;
    kept_.erase(it);
    return true;
  }
  std::vector<CacheFacts> current_facts() const {
    std::vector<CacheFacts> out;
    for (const Item& it : kept_) {
      CacheFacts f = it.facts;
      f.needed_by = 0;
      for (const Item& other : kept_) f.needed_by += other.needs == it.key ? 1 : 0;
      if (pending_ && pending_->needs == it.key) ++f.needed_by;
      out.push_back(f);
    }
    return out;
  }
  std::vector<std::pair<CacheKey, CacheFacts>> entries() const {
    std::vector<std::pair<CacheKey, CacheFacts>> out;
    const std::vector<CacheFacts> facts = current_facts();
    for (std::size_t i = 0; i < kept_.size(); ++i) out.emplace_back(kept_[i].key, facts[i]);
    return out;
  }
  double inflation() const { return inflation_; }

 private:
  struct Item {
    CacheKey key;
    std::optional<CacheKey> needs;
    CacheFacts facts;
  };
  std::uint64_t bytes() const {
    std::uint64_t b = 0;
    for (const Item& it : kept_) b += it.facts.bytes;
    return b;
  }
  CacheLedgerOptions o_;
  std::vector<Item> kept_;
  std::vector<std::uint64_t> seen_;
  std::vector<std::uint64_t> seen_kv_;
  std::optional<CacheEntry> pending_;
  double inflation_ = 0;
  std::uint64_t clock_ = 0;
};

bool same_facts(const CacheFacts& a, const CacheFacts& b) {
  return a.kind == b.kind && a.bytes == b.bytes && a.footprint == b.footprint && a.saved_tokens == b.saved_tokens && a.hits == b.hits &&
         a.last_use == b.last_use && a.needed_by == b.needed_by && a.priority == b.priority;
}

}  // namespace

TEST_CASE("cache ledger agrees with a brute-force reference on random stores, uses and forgets") {
  std::mt19937_64 rng(29);
  int checked = 0;
  for (int round = 0; round < 400; ++round) {
    const CachePolicy policy = round % 2 == 0 ? CachePolicy::lru : CachePolicy::cost;
    // Every other pair of rounds a dense ledger: KV on second sight (a no-op under lru).
    const CacheLedgerOptions o{policy, 8 + rng() % 40, 1024, rng() % 3, (round / 2) % 2 == 1};
    CacheLedger ledger(o);
    Reference ref(o);
    // Prefixes over 12 chunk hashes: chunk c needs chunk c - 1 unless it starts a prefix;
    // checkpoints 100 + c stand on chunk c. Bytes and savings in small powers of two, so
    // that priorities tie as often as they differ.
    for (int op = 0; op < 120; ++op) {
      const std::uint64_t c = rng() % 12;
      const unsigned what = static_cast<unsigned>(rng() % 10);
      CAPTURE(round);
      CAPTURE(op);
      if (what < 5) {
        const CacheEntry e{kv(c), c % 4 == 0 ? std::nullopt : std::optional<CacheKey>(kv(c - 1)), std::uint64_t{1} << (rng() % 3),
                           policy == CachePolicy::cost && rng() % 2 ? std::uint64_t{0} : std::uint64_t{512}};
        std::vector<CacheKey> got, want;
        const CacheVerdict v = ledger.store(e, [&](const CacheKey& k) { got.push_back(k); });
        CHECK(v == ref.store(e, want));
        CHECK(got == want);
      } else if (what < 7) {
        const CacheEntry e{st(100 + c), kv(c), std::uint64_t{1} << (rng() % 4), 512 * (1 + rng() % 4), rng() % 5,
                           rng() % 4 == 0};
        std::vector<CacheKey> got, want;
        const CacheVerdict v = ledger.store(e, [&](const CacheKey& k) { got.push_back(k); });
        CHECK(v == ref.store(e, want));
        CHECK(got == want);
      } else if (what < 9) {
        const CacheKey k = rng() % 3 == 0 ? st(100 + c) : kv(c);
        CHECK(ledger.use(k) == ref.use(k));
      } else {
        const CacheKey k = rng() % 3 == 0 ? st(100 + c) : kv(c);
        CHECK(ledger.forget(k) == ref.forget(k));
      }
      const auto want = ref.entries();
      REQUIRE(ledger.stats().entries == want.size());
      for (const auto& [k, f] : want) {
        const std::optional<CacheFacts> got = ledger.facts(k);
        REQUIRE(got.has_value());
        CHECK(same_facts(*got, f));
      }
      CHECK(ledger.inflation() == ref.inflation());
      CHECK(ledger.stats().bytes <= o.budget_bytes);
      ++checked;
    }
  }
  CHECK(checked == 400 * 120);
}
