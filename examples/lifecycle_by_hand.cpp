// kvfuse demo: a Kimi-K3 offload tier end to end, on the embedded default — HostRuntime,
// a MemoryTier per rank for KV, a DiskTier per rank for recurrent state, 4 tensor-parallel
// ranks whose connectors run on their own lane threads, a TpQuorum, the OffloadIndex and
// the SettlementPump on this (the scheduler's) thread.
//
// It prefills and saves a batch of prompts, loses a few state entries on one rank,
// re-admits every prompt with a KV-only, joint or state-only load (plus some requests the
// index must refuse, tickets the scheduler drops, and a torn-down request whose load is
// lost), checks every byte each completed load wrote on every rank, and prints what
// happened. Every number in the report is read from the objects after the run.
#include <kvfuse/engine/index_consistency.hpp>
#include <kvfuse/kvfuse.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

using namespace kvfuse;
using Clock = std::chrono::steady_clock;
using KvTier = MemoryTier<HostRuntime>;
using Conn = KimiK3Connector<KvTier, DiskTier>;  // KV in memory, state checkpoints on disk

constexpr std::uint32_t kWorld = 4;
constexpr std::uint32_t kPrompts = 48;

RankGeometry geometry(std::uint32_t rank) {
  RankGeometry g;
  g.model = 0x4b33;  // "K3"
  g.rank = rank;
  g.world_size = kWorld;
  g.block_tokens = 16;
  g.chunk_tokens = 256;
  g.kv_bytes_per_token = 128;  // this rank's slice: 32 KiB per chunk
  g.num_blocks = 4096;
  g.num_slots = 64;
  g.slot_bytes = 16 * 1024;
  g.max_chunks_per_load = 64;
  return g;
}

std::byte kv_byte(std::uint32_t rank, std::uint64_t prompt, TokenCount t, std::size_t j) {
  return std::byte(static_cast<unsigned char>(rank * 29 + prompt * 101 + t * 7 + j * 3));
}
std::byte state_byte(std::uint32_t rank, std::uint64_t prompt, std::size_t j) {
  return std::byte(static_cast<unsigned char>(rank * 53 + prompt * 11 + j * 5 + 1));
}

/// One prompt of the workload: its length, chunk keys, boundary and checkpoint hash.
struct Prompt {
  std::uint64_t id = 0;
  TokenCount tokens = 0;
  std::vector<PrefixHash> keys;
  TokenCount boundary = 0;
  PrefixHash state_hash;
};

/// One rank: device pools, its tiers, its connector.
struct Rank {
  RankGeometry geo;
  HostRuntime& rt;
  std::byte* blocks;
  std::byte* slots;
  KvTier kv_tier;
  DiskTier state_tier;
  Conn conn;
  Rank(std::uint32_t r, HostRuntime& runtime, TpQuorum& group, const std::filesystem::path& dir)
      : geo(geometry(r)),
        rt(runtime),
        blocks(static_cast<std::byte*>(runtime.allocate_device(geo.num_blocks * geo.block_bytes()))),
        slots(static_cast<std::byte*>(runtime.allocate_device(geo.num_slots * geo.slot_bytes))),
        kv_tier(std::size_t{256} << 20, runtime),
        state_tier(dir / ("rank" + std::to_string(r))),
        conn(geo, runtime, DeviceMemory{blocks, slots}, PagedKv<KvTier>(kv_tier), RecurrentState<DiskTier>(state_tier),
             group) {}
  ~Rank() {
    conn.drain();
    rt.free_device(blocks);
    rt.free_device(slots);
  }
  std::byte* block(BlockId b) { return blocks + std::size_t{b.value} * geo.block_bytes(); }
  std::byte* slot(SlotId s) { return slots + std::size_t{s.value} * geo.slot_bytes; }

  void forward(const Prompt& p, const std::vector<BlockId>& ids, SlotId s) {
    for (TokenCount t = 0; t < p.tokens; ++t)
      for (std::size_t j = 0; j < geo.kv_bytes_per_token; ++j)
        block(ids[t / geo.block_tokens])[(t % geo.block_tokens) * geo.kv_bytes_per_token + j] = kv_byte(geo.rank, p.id, t, j);
    for (std::size_t j = 0; j < geo.slot_bytes; ++j) slot(s)[j] = state_byte(geo.rank, p.id, j);
  }
  std::size_t verify_kv(const Prompt& p, const std::vector<BlockId>& ids, TokenCount from, TokenCount to) {
    std::size_t bad = 0;
    for (TokenCount t = from; t < to; ++t)
      for (std::size_t j = 0; j < geo.kv_bytes_per_token; ++j)
        bad += block(ids[(t - from) / geo.block_tokens])[(t % geo.block_tokens) * geo.kv_bytes_per_token + j] !=
               kv_byte(geo.rank, p.id, t, j);
    return bad;
  }
  std::size_t verify_state(const Prompt& p, SlotId s) {
    std::size_t bad = 0;
    for (std::size_t j = 0; j < geo.slot_bytes; ++j) bad += slot(s)[j] != state_byte(geo.rank, p.id, j);
    return bad;
  }
};

/// What the scheduler remembers about a parked request.
struct Parked {
  const Prompt* prompt = nullptr;
  std::string kind;
  std::vector<BlockId> blocks;
  std::optional<SlotId> slot;
  TokenCount kv_from = 0, kv_to = 0;
  bool orphaned = false;
};

}  // namespace

int main() {
  const auto started = Clock::now();
  const auto dir = std::filesystem::temp_directory_path() / ("kvfuse-demo-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);

  HostRuntime runtime;
  TpQuorum group(TpQuorumOptions{kWorld, Conn::lane_count, 1024});
  std::vector<SlotId> free_slots;
  for (std::uint32_t s = 0; s < geometry(0).num_slots; ++s) free_slots.push_back(SlotId{s});
  std::uint64_t slots_returned_by_index = 0;
  EngineOptions config;
  config.connector = " LMCacheConnectorV1 ";  // any registered spelling resolves to the offload connector (R15)
  config.layout = StateLayout::k3_recurrent;
  check_engine_options(config);
  OffloadIndex<> index(index_options_for(state_tier_capability(config), geometry(0).num_slots), [&](SlotId s) {
    free_slots.push_back(s);
    ++slots_returned_by_index;
  });
  SettlementPump pump(group, index);
  std::vector<std::unique_ptr<Rank>> ranks;
  for (std::uint32_t r = 0; r < kWorld; ++r) ranks.push_back(std::make_unique<Rank>(r, runtime, group, dir));

  std::mt19937_64 rng(2026);
  const RankGeometry geo = geometry(0);
  std::vector<Prompt> prompts;
  for (std::uint64_t i = 0; i < kPrompts; ++i) {
    Prompt p;
    p.id = i;
    p.tokens = geo.chunk_tokens * (1 + rng() % 6);
    std::uint64_t h = 0x6b76667573650000ULL + i;
    for (TokenCount c = 0; c < p.tokens / geo.chunk_tokens; ++c) p.keys.push_back(PrefixHash{h = mix64(h + c)});
    p.boundary = p.tokens - geo.block_tokens * (1 + rng() % 4);  // a checkpoint inside the last chunk
    p.state_hash = PrefixHash{mix64(h ^ p.boundary)};
    prompts.push_back(std::move(p));
  }

  // Phase 1: prefill and save every prompt (KV chunks and the state checkpoint).
  std::uint32_t next_block = 0;
  std::size_t saves = 0;
  for (const Prompt& p : prompts) {
    const std::size_t nblocks = p.tokens / geo.block_tokens;
    if (next_block + nblocks > geo.num_blocks) next_block = 0;  // the engine reuses freed blocks
    std::vector<BlockId> ids;
    for (std::size_t b = 0; b < nblocks; ++b) ids.push_back(BlockId{next_block++});
    const SlotId s = free_slots.back();
    for (auto& rank : ranks) rank->forward(p, ids, s);
    // Saves are ticketed like loads: the index issues the key, so no save reaches a rank
    // unannounced (a refusal would mean the index could not record it: keep the source).
    auto kv_save = index.request_save(KvSave{SaveKey{p.keys.back(), {}}, p.keys, ids});
    auto state_save = index.request_save(StateSave{SaveKey{p.state_hash, {}}, s, p.boundary});
    if (!kv_save || !state_save) continue;
    const KvSave kv = kv_save.ticket().dispatch();
    const StateSave st = state_save.ticket().dispatch();
    auto compute = runtime.make_stream();
    for (auto& rank : ranks) {
      rank->conn.begin_step(compute);  // saves wait for this step's forward (R13)
      rank->conn.save_kv(kv);
      rank->conn.save_state(st);
    }
    saves += 2;
    for (auto& rank : ranks) rank->conn.drain();  // the forward of the next prompt reuses the slot
  }
  std::size_t store_settlements = 0, stored = 0, released = 0;
  while (store_settlements < saves) {
    const auto step = pump.step();
    for (const SaveSettlement& s : step.saves) {
      // Two settlements per save: `released` (every rank's gather is done: the engine may
      // reuse the blocks and the slot) and then `stored` (every rank's tier holds it).
      if (s.phase == SavePhase::released) {
        released += s.ok;
        continue;
      }
      ++store_settlements;
      stored += s.ok;
    }
    if (step.records == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }

  // Phase 2: rank 2's disk tier loses 4 checkpoints (a genuine miss on one rank only).
  for (std::size_t i = 0; i < 4; ++i)
    ranks[2]->state_tier.erase(TierKey{geo.model, prompts[i * 7].state_hash, kWorld, 2, EntryKind::state});

  // Phase 3: re-admit every prompt, with a load shape chosen per request.
  std::map<std::string, std::size_t> refusals, admitted_kinds;
  std::map<LoadKey, Parked> parked;
  std::vector<LoadTicket> dropped;
  std::optional<LoadKey> lost;
  next_block = 0;
  const auto loads_started = Clock::now();
  for (std::uint64_t i = 0; i < kPrompts + 6; ++i) {
    const Prompt& p = prompts[i % kPrompts];
    const RequestId request{1000 + i};
    const int shape = static_cast<int>(i % 3);  // 0 joint, 1 KV-only, 2 state-only
    Parked park;
    park.prompt = &p;
    std::optional<KvSpec> kv;
    std::optional<StateSpec> state;
    PrefixHash state_hash = p.state_hash;
    if (i >= kPrompts) state_hash = PrefixHash{0xdead0000 + i};  // never stored: must be refused
    if (shape != 1 || i >= kPrompts) {
      park.slot = free_slots.back();
      state = StateSpec{p.boundary, state_hash, *park.slot, geo.block_tokens, geo.chunk_tokens};
    }
    if (shape != 2 && i < kPrompts) {
      const TokenCount end = TokenGrid{geo.chunk_tokens}.ceil(p.boundary);
      // KV-only loads resume above a resident first chunk when there is more to load.
      const TokenCount hbm = shape == 1 && end > geo.chunk_tokens ? geo.chunk_tokens : 0;
      const std::size_t nblocks = (end - hbm) / geo.block_tokens;
      if (next_block + nblocks > geo.num_blocks) next_block = 0;
      for (std::size_t b = 0; b < nblocks; ++b) park.blocks.push_back(BlockId{next_block++});
      kv = KvSpec{hbm, end, std::vector<PrefixHash>(p.keys.begin() + hbm / geo.chunk_tokens, p.keys.begin() + end / geo.chunk_tokens),
                  park.blocks};
      park.kv_from = hbm;
      park.kv_to = end;
    }
    park.kind = !kv ? "state-only" : state ? "joint" : "KV-only";
    LoadGrant a = index.request_load(request, std::move(kv), state);
    if (!a) {
      ++refusals[std::string(to_string(a.refusal()))];
      continue;
    }
    if (park.slot) free_slots.pop_back();
    ++admitted_kinds[park.kind];
    if (i % 17 == 5) {  // the scheduler changed its mind: dropping the ticket abandons the load (R6)
      dropped.push_back(a.take_ticket());
      parked.emplace(dropped.back().key(), std::move(park));
      continue;
    }
    const LoadRequest request_data = a.ticket().dispatch();
    parked.emplace(request_data.key, std::move(park));
    if (i == 11) {  // torn down mid-load and its dispatch never reached the ranks
      lost = request_data.key;
      continue;
    }
    for (auto& rank : ranks) rank->conn.load(request_data);  // the transport: a copy per rank
    if (i == 12) {  // torn down while its load is in flight: the index keeps the slot (R8)
      index.orphan(request_data.key);
      parked[request_data.key].orphaned = true;
    }
  }
  dropped.clear();
  if (lost) {
    index.orphan(*lost);
    parked[*lost].orphaned = true;
  }

  // Settle: step the pump until every outstanding load except the lost one resolved, then
  // reclaim the lost one as if its timeout had passed.
  std::map<std::string, std::size_t> outcomes;
  std::size_t verified_bytes = 0, bad_bytes = 0, retracted = 0, resolutions = 0;
  // The scheduler's one stream: every load that ended, however it ended (R6).
  auto absorb = [&](std::span<const LoadResolution> resolved) {
    for (const LoadResolution& r : resolved) {
      ++resolutions;
      Parked& park = parked.at(r.key);
      ++outcomes[std::string(to_string(r.kind)) + (r.state_missed ? " (state missed)" : "")];
      retracted += r.state_missed;
      if (r.kind == Resolution::completed && !park.orphaned) {
        for (auto& rank : ranks) {
          const std::size_t kv_bytes = (park.kv_to - park.kv_from) * geo.kv_bytes_per_token;
          if (kv_bytes) bad_bytes += rank->verify_kv(*park.prompt, park.blocks, park.kv_from, park.kv_to);
          if (park.slot) bad_bytes += rank->verify_state(*park.prompt, *park.slot);
          verified_bytes += kv_bytes + (park.slot ? geo.slot_bytes : 0);
        }
      }
      if (park.slot && !park.orphaned) free_slots.push_back(*park.slot);  // the live request gives its slot back
    }
  };
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (index.stats().outstanding > (lost ? 1u : 0u) && Clock::now() < deadline) {
    const auto step = pump.step();
    absorb(step.resolutions);
    if (step.records == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  const auto loads_done = Clock::now();
  const std::size_t reclaimed = index.reclaim(Clock::now() + std::chrono::minutes(10), std::chrono::minutes(5));
  absorb(pump.step().resolutions);
  for (auto& rank : ranks) rank->conn.drain();

  // Report.
  const IndexStats is = index.stats();
  const PumpStats ps = pump.stats();
  const kvfuse::ConsistencyReport consistency = kvfuse::check_consistency(index);
  std::size_t quarantined = 0, disk_entries = 0;
  for (auto& rank : ranks) {
    quarantined += rank->state_tier.stats().quarantined;
    disk_entries += rank->state_tier.stats().entries;
  }
  const double load_ms = std::chrono::duration<double, std::milli>(loads_done - loads_started).count();
  std::printf("kvfuse demo: Kimi-K3 offload tier, %u ranks as threads, HostRuntime, MemoryTier (KV) + DiskTier (state)\n\n", kWorld);
  std::printf("saves\n  %zu saves settled by quorum: %zu stored on every rank, %zu released their source\n", store_settlements,
              stored, released);
  std::printf("  state checkpoints on disk: %zu entries across ranks; 4 removed from rank 2 to force a miss\n\n", disk_entries);
  std::printf("loads admitted by the index\n");
  for (const auto& [kind, n] : admitted_kinds) std::printf("  %-11s %zu\n", kind.c_str(), n);
  for (const auto& [why, n] : refusals) std::printf("  refused (%s): %zu\n", why.c_str(), n);
  std::printf("\nresolutions drained by the scheduler (%zu)\n", resolutions);
  for (const auto& [what, n] : outcomes) std::printf("  %-26s %zu\n", what.c_str(), n);
  std::printf("  reclaimed by timeout: %zu (slots returned by the index: %llu)\n\n", reclaimed,
              static_cast<unsigned long long>(slots_returned_by_index));
  std::printf("bytes\n  %zu bytes checked in blocks and slots across ranks, %zu wrong\n\n", verified_bytes, bad_bytes);
  std::printf("index   dispatched %llu = completed %llu + failed %llu + abandoned %llu + outstanding %llu\n",
              static_cast<unsigned long long>(is.issued), static_cast<unsigned long long>(is.completed),
              static_cast<unsigned long long>(is.failed), static_cast<unsigned long long>(is.abandoned),
              static_cast<unsigned long long>(is.outstanding));
  std::printf("        indexed %llu, retracted %llu, late reports %llu, invariant violations %llu, consistency %s\n",
              static_cast<unsigned long long>(is.indexed), static_cast<unsigned long long>(is.hashes_retracted),
              static_cast<unsigned long long>(is.late_reports), static_cast<unsigned long long>(is.invariant_violations),
              consistency.ok ? "ok" : consistency.problem.c_str());
  std::printf("quorum  %llu records, %llu settled, pending %llu, late %llu, lane-queue full waits %llu\n",
              static_cast<unsigned long long>(ps.group.records), static_cast<unsigned long long>(ps.group.settled),
              static_cast<unsigned long long>(ps.group.pending), static_cast<unsigned long long>(ps.late_reports),
              static_cast<unsigned long long>(ps.group.queues.full_waits));
  const ConnectorStats cs = ranks[0]->conn.stats();
  std::printf("rank 0  %zu lanes, standing staging %zu bytes, %llu loads, %llu saves, %llu fence fallbacks\n", cs.lanes,
              cs.standing_staging_bytes, static_cast<unsigned long long>(cs.loads),
              static_cast<unsigned long long>(cs.saves), static_cast<unsigned long long>(cs.fence_fallbacks));
  std::printf("disk    %zu files quarantined\n", quarantined);
  std::printf("time    loads dispatched and settled in %.1f ms; whole run %.1f ms\n", load_ms,
              std::chrono::duration<double, std::milli>(Clock::now() - started).count());

  ranks.clear();
  std::filesystem::remove_all(dir);
  const bool healthy = bad_bytes == 0 && is.invariant_violations == 0 && consistency.ok && is.outstanding == 0 &&
                       free_slots.size() == geo.num_slots;
  std::printf("\n%s\n", healthy ? "result: every load settled once, every byte matched, every slot came back"
                                  : "result: PROBLEM (see above)");
  return healthy ? 0 : 1;
}
