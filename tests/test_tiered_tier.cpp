// TieredTier: a MemoryTier in front of a DiskTier. Write-through, promotion, eviction,
// corruption, restart, its counters, and a K3 connector over it on two ranks.
#include "connector_harness.hpp"
#include "tier_test_support.hpp"
#include "test_support.hpp"

#include <kvfuse/tier/tiered_tier.hpp>

#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;
namespace fs = std::filesystem;

namespace {

using Mem = MemoryTier<>;
using Tiered = TieredTier<Mem, DiskTier>;

static_assert(Tier<Tiered>);
static_assert(Tier<TieredTier<Mem, Mem>>);
static_assert(Tier<TieredTier<Mem, Tiered>>);  // tiers stack
template <class T>
constexpr bool has_keys = requires(const T& t) { t.keys(EntryKind::state); };
static_assert(has_keys<Tiered>);                 // forwarded: the back (DiskTier) has keys(kind)
static_assert(!has_keys<TieredTier<Mem, Mem>>);  // MemoryTier has none, so neither does this
static_assert(!std::is_copy_constructible_v<Tiered> && !std::is_move_constructible_v<Tiered>);

/// A front and a back in a fresh directory, and the tier over them.
struct Stack {
  TempDir dir{"kvfuse-tiered"};
  Mem front;
  DiskTier back{dir.path};
  Tiered tier{front, back};
  std::vector<std::byte> staging = std::vector<std::byte>(8192);
  explicit Stack(std::size_t front_capacity = std::size_t{1} << 20) : front(front_capacity) {}
};

void flip_payload_byte(const fs::path& file) {
  std::vector<char> raw;
  {
    std::ifstream in(file, std::ios::binary);
    raw.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  REQUIRE(raw.size() > detail::disk::header_bytes);
  raw.back() = static_cast<char>(raw.back() ^ 0x40);
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(raw.data(), static_cast<std::streamsize>(raw.size()));
  REQUIRE(out.good());
}

/// A tier whose gets fail while `failing` is set (time out while `slow` is); otherwise a MemoryTier.
struct FlakyTier {
  Mem inner{std::size_t{1} << 20};
  std::atomic<bool> failing{false};
  std::atomic<bool> slow{false};
  TierView get(const TierKey& key, std::span<std::byte> staging) noexcept {
    if (failing.load()) return TierView(GetStatus::failed);
    if (slow.load()) return TierView(GetStatus::timed_out);
    return inner.get(key, staging);
  }
  bool put(const TierKey& key, std::span<const std::byte> bytes) noexcept { return inner.put(key, bytes); }
  bool contains(const TierKey& key) const noexcept { return inner.contains(key); }
  bool erase(const TierKey& key) noexcept { return inner.erase(key); }
};

}  // namespace

TEST_CASE("tiered tier: put writes through to both tiers and a get is served by the front") {
  Stack s;
  const auto a = pattern(1, 3000);
  REQUIRE(s.tier.put(key_of(1), a));
  CHECK(s.front.contains(key_of(1)));
  CHECK(s.back.contains(key_of(1)));
  CHECK(fs::exists(s.back.path_of(key_of(1))));
  {
    const TierView v = s.tier.get(key_of(1), s.staging);
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), a));
    CHECK(v.bytes().data() != s.staging.data());  // the front's own bytes: no read into staging
  }
  CHECK(s.back.stats().hits == 0);  // the back was not read
  const TieredTierStats st = s.tier.stats();
  CHECK(st.front_hits == 1);
  CHECK(st.back_hits == 0);
  CHECK(st.promotions == 0);
  CHECK(st.put_failures == 0);
  CHECK(st.front_put_failures == 0);
}

TEST_CASE("tiered tier: an absent key misses in both tiers and contains and erase see either tier") {
  Stack s;
  CHECK(s.tier.get(key_of(9), s.staging).status() == GetStatus::miss);
  CHECK(s.tier.stats().misses == 1);
  CHECK(s.tier.stats().failures == 0);
  CHECK_FALSE(s.tier.contains(key_of(9)));
  CHECK_FALSE(s.tier.erase(key_of(9)));

  const auto a = pattern(2, 100);
  REQUIRE(s.back.put(key_of(2), a));  // only in the back
  CHECK(s.tier.contains(key_of(2)));
  REQUIRE(s.front.put(key_of(3), a));  // only in the front
  CHECK(s.tier.contains(key_of(3)));
  CHECK(s.tier.erase(key_of(2)));
  CHECK(s.tier.erase(key_of(3)));
  CHECK_FALSE(s.tier.contains(key_of(2)));
  CHECK_FALSE(s.tier.contains(key_of(3)));

  REQUIRE(s.tier.put(key_of(4), a));
  CHECK(s.tier.erase(key_of(4)));  // from both
  CHECK_FALSE(s.front.contains(key_of(4)));
  CHECK_FALSE(s.back.contains(key_of(4)));
  CHECK_FALSE(fs::exists(s.back.path_of(key_of(4))));
  CHECK(s.tier.get(key_of(4), s.staging).status() == GetStatus::miss);
}

TEST_CASE("tiered tier: an entry the front evicted is served from the back into staging and promoted") {
  Stack s(4096);  // the front holds two 2000-byte entries
  const auto a = pattern(11, 2000), b = pattern(12, 2000), c = pattern(13, 2000);
  REQUIRE(s.tier.put(key_of(1), a));
  REQUIRE(s.tier.put(key_of(2), b));
  REQUIRE(s.tier.put(key_of(3), c));  // evicts key 1 from the front
  REQUIRE_FALSE(s.front.contains(key_of(1)));
  CHECK(s.front.stats().evictions == 1);
  CHECK(s.tier.contains(key_of(1)));

  {
    const TierView v = s.tier.get(key_of(1), s.staging);
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), a));
    CHECK(v.bytes().data() == s.staging.data());  // read from disk into the caller's staging
  }
  CHECK(s.front.contains(key_of(1)));  // promoted (evicting key 2, the least recently used)
  TieredTierStats st = s.tier.stats();
  CHECK(st.back_hits == 1);
  CHECK(st.promotions == 1);
  CHECK(st.front_hits == 0);

  {
    const TierView v = s.tier.get(key_of(1), s.staging);  // now from the front
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), a));
    CHECK(v.bytes().data() != s.staging.data());
  }
  st = s.tier.stats();
  CHECK(st.front_hits == 1);
  CHECK(st.back_hits == 1);
  CHECK(s.back.stats().hits == 1);  // the disk was read once
}

TEST_CASE("tiered tier: a corrupt back file fails the get and is neither served nor promoted") {
  Stack s;
  const auto a = pattern(21, 2000);
  REQUIRE(s.tier.put(key_of(1), a));
  REQUIRE(s.front.erase(key_of(1)));  // as if evicted
  flip_payload_byte(s.back.path_of(key_of(1)));

  {
    const TierView v = s.tier.get(key_of(1), s.staging);
    CHECK(v.status() == GetStatus::failed);  // never masked as a miss
    CHECK(v.bytes().empty());
  }
  CHECK_FALSE(s.front.contains(key_of(1)));
  const TieredTierStats st = s.tier.stats();
  CHECK(st.failures == 1);
  CHECK(st.misses == 0);
  CHECK(st.back_hits == 0);
  CHECK(st.promotions == 0);
  CHECK(s.back.stats().quarantined == 1);
  // The back quarantined the file: the entry is gone, and a later get is a genuine miss.
  CHECK(s.tier.get(key_of(1), s.staging).status() == GetStatus::miss);
}

TEST_CASE("tiered tier: an entry larger than the caller's staging fails on the back and is not promoted") {
  Stack s;
  const auto a = pattern(22, 3000);
  REQUIRE(s.tier.put(key_of(1), a));
  REQUIRE(s.front.erase(key_of(1)));
  std::vector<std::byte> small(1000);
  CHECK(s.tier.get(key_of(1), small).status() == GetStatus::failed);
  CHECK_FALSE(s.front.contains(key_of(1)));
  CHECK(s.tier.stats().failures == 1);
  const TierView v = s.tier.get(key_of(1), s.staging);  // still servable with room for it
  REQUIRE(v.hit());
  CHECK(same(v.bytes(), a));
}

TEST_CASE("tiered tier: write-through survives reopening the disk tier and the new front fills from it") {
  TempDir dir("kvfuse-tiered-restart");
  const auto a = pattern(31, 1500), b = pattern(32, 700);
  const TierKey state_key = key_of(2, 0, EntryKind::state);
  {
    Mem front(std::size_t{1} << 20);
    DiskTier back(dir.path);
    Tiered tier(front, back);
    REQUIRE(tier.put(key_of(1), a));
    REQUIRE(tier.put(state_key, b));
  }
  Mem front(std::size_t{1} << 20);  // a cold front, as after a restart
  DiskTier back(dir.path);
  Tiered tier(front, back);
  CHECK(back.stats().entries == 2);
  const auto states = tier.keys(EntryKind::state);  // what an engine re-seeds its index from
  REQUIRE(states.size() == 1);
  CHECK(states[0] == state_key);
  CHECK(tier.keys(EntryKind::kv_chunk).size() == 1);

  std::vector<std::byte> staging(4096);
  {
    const TierView v = tier.get(key_of(1), staging);
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), a));
  }
  {
    const TierView v = tier.get(state_key, staging);
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), b));
  }
  CHECK(tier.stats().back_hits == 2);
  CHECK(tier.stats().promotions == 2);
  CHECK(front.contains(key_of(1)));
  CHECK(front.contains(state_key));
}

TEST_CASE("tiered tier: a put the back refuses returns false and leaves nothing in the front") {
  Stack s;
  TierKey odd = key_of(1);
  odd.kind = static_cast<EntryKind>(9);  // a kind DiskTier has no file name for: its put fails
  CHECK_FALSE(s.tier.put(odd, pattern(41, 100)));
  CHECK_FALSE(s.front.contains(odd));
  CHECK_FALSE(s.tier.contains(odd));
  CHECK(s.tier.stats().put_failures == 1);
  CHECK(s.tier.stats().front_put_failures == 0);

  // A front copy the back then fails to replace is dropped: the front never serves bytes
  // the back may not hold.
  REQUIRE(s.front.put(odd, pattern(42, 100)));
  CHECK_FALSE(s.tier.put(odd, pattern(43, 100)));
  CHECK_FALSE(s.front.contains(odd));
  CHECK(s.tier.stats().put_failures == 2);
}

TEST_CASE("tiered tier: a put the front refuses is stored and counted and the front keeps no stale copy") {
  Stack s(1024);
  const auto small = pattern(51, 500), big = pattern(52, 2000);
  REQUIRE(s.tier.put(key_of(1), small));
  REQUIRE(s.front.contains(key_of(1)));
  CHECK(s.tier.put(key_of(1), big));  // too big for the front; the back stores it
  TieredTierStats st = s.tier.stats();
  CHECK(st.front_put_failures == 1);
  CHECK(st.put_failures == 0);
  CHECK_FALSE(s.front.contains(key_of(1)));  // the old 500-byte copy would be stale
  {
    const TierView v = s.tier.get(key_of(1), s.staging);
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), big));
  }
  st = s.tier.stats();
  CHECK(st.back_hits == 1);
  CHECK(st.promotions == 0);
  CHECK(st.promote_failures == 1);  // the front refused the copy; the get still hit
}

TEST_CASE("tiered tier: a front failure falls through to the back and fails only when the back misses") {
  FlakyTier front;
  Mem back(std::size_t{1} << 20);
  TieredTier<FlakyTier, Mem> tier(front, back);
  std::vector<std::byte> staging(4096);
  const auto a = pattern(61, 800);
  REQUIRE(tier.put(key_of(1), a));
  front.failing = true;
  {
    const TierView v = tier.get(key_of(1), staging);
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), a));
  }
  CHECK(tier.stats().back_hits == 1);
  CHECK(tier.stats().promotions == 1);  // rewrites the front's copy
  // Not in the back, and the front cannot say whether it has it: failed, not a miss.
  REQUIRE(front.inner.put(key_of(2), a));
  CHECK(tier.get(key_of(2), staging).status() == GetStatus::failed);
  CHECK(tier.stats().failures == 1);
  CHECK(tier.stats().misses == 0);
  front.failing = false;
  CHECK(tier.get(key_of(3), staging).status() == GetStatus::miss);
  CHECK(tier.stats().misses == 1);
}

TEST_CASE("tiered tier: a back failure is reported even when the front could be asked again") {
  Mem front(std::size_t{1} << 20);
  FlakyTier back;
  TieredTier<Mem, FlakyTier> tier(front, back);
  std::vector<std::byte> staging(4096);
  REQUIRE(tier.put(key_of(1), pattern(71, 64)));
  REQUIRE(front.erase(key_of(1)));
  back.failing = true;
  CHECK(tier.get(key_of(1), staging).status() == GetStatus::failed);
  CHECK(tier.get(key_of(2), staging).status() == GetStatus::failed);  // absent, but the back cannot tell
  CHECK(tier.stats().failures == 2);
  CHECK(tier.stats().misses == 0);
  CHECK_FALSE(front.contains(key_of(1)));
}

TEST_CASE("tiered tier: a back that times out is reported as timed out and never as a miss") {
  Mem front(std::size_t{1} << 20);
  FlakyTier back;
  TieredTier<Mem, FlakyTier> tier(front, back);
  std::vector<std::byte> staging(4096);
  REQUIRE(tier.put(key_of(1), pattern(72, 64)));
  REQUIRE(front.erase(key_of(1)));
  back.slow = true;
  CHECK(tier.get(key_of(1), staging).status() == GetStatus::timed_out);
  CHECK(tier.get(key_of(2), staging).status() == GetStatus::timed_out);
  CHECK(tier.stats().failures == 2);
  CHECK(tier.stats().misses == 0);
  CHECK_FALSE(front.contains(key_of(1)));  // nothing promoted from an answer that never came
}

TEST_CASE("tiered tier: a front that times out falls through to the back and a back miss is then no miss") {
  FlakyTier front;
  Mem back(std::size_t{1} << 20);
  TieredTier<FlakyTier, Mem> tier(front, back);
  std::vector<std::byte> staging(4096);
  const auto a = pattern(73, 64);
  REQUIRE(tier.put(key_of(1), a));
  front.slow = true;
  {
    const TierView v = tier.get(key_of(1), staging);
    REQUIRE(v.hit());
    CHECK(same(v.bytes(), a));
  }
  REQUIRE(front.inner.put(key_of(2), a));  // only the front has it, and the front cannot answer
  CHECK(tier.get(key_of(2), staging).status() == GetStatus::failed);
  CHECK(tier.stats().misses == 0);
}

TEST_CASE("tiered tier: as a KimiK3Connector's tier on two ranks a joint load is served byte-exact from the back") {
  constexpr std::uint32_t world = 2;
  using Conn = KimiK3Connector<Tiered, Tiered, TpQuorum>;
  TempDir dir("kvfuse-tiered-k3");
  HostRuntime rt;
  TpQuorum group{TpQuorumOptions{world, 3, 1024}};
  const RankGeometry geo = small_geometry(0, world);
  const TokenCount prompt = 4 * geo.chunk_tokens;         // 4 chunks of 2 KiB
  const TokenCount boundary = prompt - geo.block_tokens;  // its chunk ends at the prompt's end
  const auto keys = chunk_keys(5, 4);
  const PrefixHash state_hash{0x51a7e};

  struct Rank {
    DevicePools<HostRuntime> pools;
    Mem front{2 * 2048 + 512};  // holds two chunks and the state entry: the rest is on disk only
    DiskTier back;
    Tiered tier{front, back};
    Conn conn;
    Rank(HostRuntime& rt, std::uint32_t r, TpQuorum& g, const fs::path& dir)
        : pools(rt, small_geometry(r, world)),
          back(dir / ("rank" + std::to_string(r))),
          conn(pools.geo, rt, pools.memory(), PagedKv<Tiered>(tier), RecurrentState<Tiered>(tier), g) {}
  };
  std::vector<std::unique_ptr<Rank>> ranks;
  for (std::uint32_t r = 0; r < world; ++r) ranks.push_back(std::make_unique<Rank>(rt, r, group, dir.path));

  RecordLog log;
  const auto saved = block_range(0, prompt / geo.block_tokens);
  for (auto& rank : ranks) {
    rank->pools.write_prompt(saved, prompt);
    rank->pools.write_state(SlotId{0}, state_hash);
    rank->conn.save_kv(KvSave{SaveKey{keys.back(), Generation{1}}, keys, saved});
    rank->conn.save_state(StateSave{SaveKey{state_hash, Generation{2}}, SlotId{0}, boundary});
  }
  REQUIRE(drain_until(group, log, [&] { return log.stores.size() == 4 * world; }));
  for (const SaveRecord& rec : log.stores) CHECK(rec.ok);
  for (auto& rank : ranks) {
    CHECK(rank->back.stats().entries == 5);  // everything is on disk
    CHECK(rank->front.stats().evictions > 0);  // the front could not hold it all
    std::memset(rank->pools.blocks, 0, geo.num_blocks * geo.block_bytes());
    std::memset(rank->pools.slots, 0, geo.num_slots * geo.slot_bytes);
  }

  auto load_blocks = block_range(32, prompt / geo.block_tokens);
  std::swap(load_blocks[2], load_blocks[11]);
  LoadRequest request;
  request.key = LoadKey{RequestId{1}, Generation{3}};
  request.kv = KvSpec{0, prompt, keys, load_blocks};
  request.state = StateSpec{boundary, state_hash, SlotId{2}, geo.block_tokens, geo.chunk_tokens};
  for (auto& rank : ranks) rank->conn.load(request);
  REQUIRE(drain_until(group, log, [&] { return log.loads.size() == world; }));
  for (const CompletionRecord& rec : log.loads) {
    CAPTURE(rec.rank);
    CHECK(rec.key == request.key);
    CHECK(rec.kv == KvOutcome::ok);
    CHECK(rec.state == StateOutcome::restored);
  }
  for (auto& rank : ranks) {
    CAPTURE(rank->pools.geo.rank);
    CHECK(rank->pools.holds_prompt(load_blocks, 0, prompt));
    CHECK(rank->pools.holds_state(SlotId{2}, state_hash));
    const TieredTierStats st = rank->tier.stats();
    CHECK(st.back_hits >= 2);  // the evicted chunks came from disk
    CHECK(st.front_hits + st.back_hits == 5);
    CHECK(st.promotions == st.back_hits);
    CHECK(st.failures == 0);
    CHECK(st.misses == 0);
  }
}
