// The README's quick start, compiled and run by the tests: a Kimi-K3 offload tier over two
// ranks (threads of this process), one MemoryTier per rank. It saves one prompt's KV and
// its state checkpoint, then loads both back into other blocks and another slot with one
// joint load, and checks the bytes. Exit status 0 means every step did what it says.
#include <kvfuse/kvfuse.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

using namespace kvfuse;

namespace {

constexpr std::uint32_t kRanks = 2;

RankGeometry geometry(std::uint32_t rank) {
  RankGeometry g;
  g.model = 0x4b33;
  g.rank = rank;
  g.world_size = kRanks;
  g.block_tokens = 16;
  g.chunk_tokens = 64;
  g.kv_bytes_per_token = 32;
  g.num_blocks = 64;
  g.num_slots = 4;
  g.slot_bytes = 1024;
  g.max_chunks_per_load = 16;
  return g;
}

std::byte forward_byte(std::uint32_t rank, std::size_t i) { return std::byte(static_cast<unsigned char>(rank * 31 + i * 7 + 1)); }

/// One rank: its device pools (host memory here), its tier and its connector.
struct Rank {
  using Conn = KimiK3Connector<MemoryTier<>>;  // = Connector<PagedKv<T>, RecurrentState<T>, TpQuorum>
  RankGeometry geo;
  std::vector<std::byte> blocks, slots;
  MemoryTier<> tier{std::size_t{1} << 20};
  Conn conn;
  Rank(std::uint32_t r, HostRuntime& runtime, TpQuorum& group)
      : geo(geometry(r)),
        blocks(geo.num_blocks * geo.block_bytes()),
        slots(geo.num_slots * geo.slot_bytes),
        conn(geo, runtime, DeviceMemory{blocks.data(), slots.data()}, PagedKv(tier), RecurrentState(tier), group) {}
};

}  // namespace

int main() {
  // Engine side, built once, on the scheduler thread.
  EngineOptions config;
  config.connector = "LMCacheConnectorV1";  // any registered spelling of the offload connector
  config.layout = StateLayout::k3_recurrent;
  const Capability capability = state_tier_capability(config);  // PP > 1 with a state tier: Error (R14)
  TpQuorum group(TpQuorumOptions{kRanks, Rank::Conn::lane_count, 1024});
  std::vector<SlotId> freed_by_index;
  OffloadIndex<> index(index_options_for(capability, geometry(0).num_slots), [&](SlotId s) { freed_by_index.push_back(s); });
  SettlementPump pump(group, index);

  // Rank side: one connector per rank; it claims the rank's lane emitters from the group.
  HostRuntime runtime;
  std::vector<std::unique_ptr<Rank>> ranks;
  for (std::uint32_t r = 0; r < kRanks; ++r) ranks.push_back(std::make_unique<Rank>(r, runtime, group));

  const RankGeometry geo = geometry(0);
  const std::vector<PrefixHash> chunk_keys{PrefixHash{0x1001}, PrefixHash{0x1002}};  // a 128-token prompt
  const std::vector<BlockId> prefill_blocks{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
  const TokenCount boundary = 112;  // a checkpoint on the 16-token grid, inside chunk 1
  const PrefixHash checkpoint{0xc0ffee};

  // The forward wrote this prompt's KV into blocks 0..7 and its state into slot 0.
  for (auto& rank : ranks) {
    for (std::size_t i = 0; i < 8 * geo.block_bytes(); ++i) rank->blocks[i] = forward_byte(rank->geo.rank, i);
    for (std::size_t i = 0; i < geo.slot_bytes; ++i) rank->slots[i] = forward_byte(rank->geo.rank, i + 99);
  }

  // Save: the index tickets each save; a refusal means it could not record one, and then
  // nothing is dispatched and the source stays with the engine.
  auto kv_save = index.request_save(KvSave{SaveKey{chunk_keys.back(), {}}, chunk_keys, prefill_blocks});
  auto state_save = index.request_save(StateSave{SaveKey{checkpoint, {}}, SlotId{0}, boundary});
  if (!kv_save || !state_save) return 1;
  const KvSave kv = kv_save.ticket().dispatch();
  const StateSave state = state_save.ticket().dispatch();
  auto compute = runtime.make_stream();
  for (auto& rank : ranks) {
    rank->conn.begin_step(compute);  // the saves wait for this step's forward (R13)
    rank->conn.save_kv(kv);
    rank->conn.save_state(state);
  }

  // The scheduler loop: one pump.step() per step. Sources are freed on `released`.
  int released = 0, stored = 0;
  std::vector<LoadResolution> resolved;
  auto step_until = [&](auto done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      const auto step = pump.step();
      for (const SaveSettlement& s : step.saves) (s.phase == SavePhase::released ? released : stored) += s.ok ? 1 : 0;
      resolved.insert(resolved.end(), step.resolutions.begin(), step.resolutions.end());
      if (step.records == 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return done();
  };
  if (!step_until([&] { return stored == 2; })) return 1;
  std::printf("saved: %d saves released their source, %d stored on every rank; checkpoint servable: %s\n", released,
              stored, index.could_serve(checkpoint) ? "yes" : "no");

  // Load it back: a joint load of [0, 128) into blocks 16..23 and the checkpoint into slot 2.
  const std::vector<BlockId> load_blocks{{16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}};
  LoadGrant grant = index.request_load(RequestId{1}, KvSpec{0, 128, chunk_keys, load_blocks},
                                               StateSpec{boundary, checkpoint, SlotId{2}, geo.block_tokens, geo.chunk_tokens});
  if (!grant) {
    std::printf("refused: %s (compute from scratch; nothing was dispatched)\n", to_string(grant.refusal()).data());
    return 1;
  }
  const LoadRequest request = grant.ticket().dispatch();  // ship it to every rank
  for (auto& rank : ranks) rank->conn.load(request);
  if (!step_until([&] { return !resolved.empty(); })) return 1;
  const LoadResolution& r = resolved.front();
  std::printf("load %s: %s\n", to_string(r.key).c_str(), to_string(r.kind).data());

  std::size_t wrong = 0;
  for (auto& rank : ranks) {
    const std::size_t offset = 16 * geo.block_bytes();
    for (std::size_t i = 0; i < 8 * geo.block_bytes(); ++i) wrong += rank->blocks[offset + i] != forward_byte(rank->geo.rank, i);
    for (std::size_t i = 0; i < geo.slot_bytes; ++i)
      wrong += rank->slots[2 * geo.slot_bytes + i] != forward_byte(rank->geo.rank, i + 99);
  }
  const IndexStats stats = index.stats();
  std::printf("bytes wrong: %zu; index: %llu dispatched, %llu completed, %llu invariant violations\n", wrong,
              static_cast<unsigned long long>(stats.issued), static_cast<unsigned long long>(stats.completed),
              static_cast<unsigned long long>(stats.invariant_violations));
  const bool ok = r.kind == Resolution::completed && wrong == 0 && stats.invariant_violations == 0 && stored == 2 &&
                  released == 2 && freed_by_index.empty();
  return ok ? 0 : 1;
}
