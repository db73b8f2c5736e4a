// A rank process for the ranks-as-processes tests and benchmarks: attaches to an engine's
// segment and serves a Kimi-K3 connector (MemoryTier, host memory) until the engine is gone.
//
//   kvfuse_shm_rank_process SEGMENT RANK WORLD MODE [REPORT]
//     serve     serve; at the end write REPORT: "loads L kv_saves K state_saves S corrupted C"
//               (C: bytes of every loaded KV range that differ from the test pattern), and
//               "load_blocks H": load_blocks_hash over every load's block ids, in order, and
//               "refused R": why the last bad frame was refused ("nothing" if none)
//     garbage   attach, then write a malformed record into lane 0 and serve
//     flood N   attach, emit N load records (keys {1, 1..N}) as fast as the rings take them
// Exit status: 0 after the engine went away, 2 for bad arguments, 3 when attaching failed
// (the message on stderr), 4 after a bad frame.
#define DOCTEST_CONFIG_DISABLE
#include "connector_harness.hpp"
#include "shm_rank_report.hpp"

#include <kvfuse/ipc/shm_engine.hpp>  // ShmQuorum: the connector type names the group
#include <kvfuse/ipc/shm_rank.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

using Mem = MemoryTier<>;
using Conn = Connector<PagedKv<Mem>, RecurrentState<Mem>, ShmQuorum>;

/// The connector as serve() sees it, keeping each load to check its bytes at the end.
struct Recorder {
  static constexpr bool has_state = true;
  Conn& conn;
  std::vector<LoadRequest>& loads;
  DevicePools<HostRuntime>& pools;
  void load(LoadRequest r) {
    // The destination's bytes are zeroed first, so what the check finds there came from the tier.
    if (r.kv) {
      const RankGeometry& g = pools.geo;
      const TokenCount base = r.kv->hbm - r.kv->hbm % g.block_tokens;
      for (TokenCount t = r.kv->hbm; t < r.kv->end; ++t)
        std::memset(pools.block(r.kv->blocks[(t - base) / g.block_tokens]) + (t % g.block_tokens) * g.kv_bytes_per_token, 0,
                    g.kv_bytes_per_token);
    }
    loads.push_back(r);
    conn.load(std::move(r));
  }
  void save_kv(KvSave s) { conn.save_kv(std::move(s)); }
  void save_state(StateSave s) { conn.save_state(s); }
};

int serve(const std::string& name, RankGeometry geo, const std::string& mode, const std::string& arg) {
  HostRuntime rt;
  std::unique_ptr<ShmRank> rank;
  try {
    rank = std::make_unique<ShmRank>(name, geo);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 3;
  }
  if (mode == "flood") {
    ShmEmitter lane = rank->emitter(0);
    const std::uint64_t n = std::strtoull(arg.c_str(), nullptr, 10);
    for (std::uint64_t g = 1; g <= n; ++g)
      lane.emit(CompletionRecord{LoadKey{RequestId{1}, Generation{g}}, geo.rank, KvOutcome::ok});
    while (!rank->engine_gone()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return 0;
  }
  DevicePools<HostRuntime> pools(rt, geo);
  Mem tier(std::size_t{1} << 22);
  std::vector<LoadRequest> loads;
  Served why;
  {
    Conn conn(geo, rt, pools.memory(), PagedKv<Mem>(tier), RecurrentState<Mem>(tier),
              Conn::Emitters{rank->emitter(0), rank->emitter(1), rank->emitter(2)});
    if (mode == "garbage") {
      // A record no decoder accepts, written straight into lane 0's ring (this program's
      // own mapping of the segment; nothing else produces into that ring yet).
      namespace bip = boost::interprocess;
      detail::MappedSegment raw(bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_write), bip::read_write);
      RecordBytes junk{};
      junk.fill(std::byte{0xA5});
      (void)raw.record_ring(geo.rank, 0).try_push(junk);
    }
    // The "forward" of every block: the test pattern, so saves store it and loads restore it.
    std::vector<BlockId> all;
    for (std::uint32_t b = 0; b < geo.num_blocks; ++b) all.push_back(BlockId{b});
    pools.write_prompt(all, TokenCount{geo.num_blocks} * geo.block_tokens);
    Recorder recorder{conn, loads, pools};
    why = rank->serve(recorder);
    conn.drain();
  }
  std::uint64_t corrupted = 0;
  std::uint64_t blocks_hash = 0;  // which blocks the loads named, in order: the engine checks them
  for (const LoadRequest& r : loads) {
    if (!r.kv) continue;
    if (!pools.holds_prompt(r.kv->blocks, r.kv->hbm, r.kv->end)) corrupted += r.kv->end - r.kv->hbm;
    blocks_hash = load_blocks_hash(blocks_hash, r.kv->blocks);
  }
  const ShmRankStats s = rank->stats();
  if (!arg.empty()) {
    std::ofstream out(arg);
    out << "loads " << s.loads << " kv_saves " << s.kv_saves << " state_saves " << s.state_saves << " corrupted "
        << corrupted << " load_blocks " << blocks_hash << " incarnation " << s.incarnation << " refused "
        << (s.last_refusal.empty() ? std::string_view("nothing") : s.last_refusal) << "\n";
  }
  if (why == Served::bad_frame) {
    std::fprintf(stderr, "rank %u refused a frame: %.*s\n", geo.rank, static_cast<int>(s.last_refusal.size()),
                 s.last_refusal.data());
    return 4;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s SEGMENT RANK WORLD MODE [ARG]\n", argv[0]);
    return 2;
  }
  RankGeometry geo = small_geometry(static_cast<std::uint32_t>(std::atoi(argv[2])), static_cast<std::uint32_t>(std::atoi(argv[3])));
  const std::string mode = argv[4];
  if (mode == "wrong-geometry") geo.block_tokens = 8;
  return serve(argv[1], geo, mode == "wrong-geometry" ? "serve" : mode, argc > 5 ? argv[5] : "");
}
