// RedisTier against plain hiredis, same server, same values, same run (bench/README.md).
//
//   BM_RedisLoad/chunk_KiB:<16|256>/connector:0
//       One 64-chunk KV load through PagedKv::retrieve over a RedisTier (one get_batch: every
//       GET in one write, the socket read 256 KiB at a time, the replies' payloads checked (XXH3-64) and copied into the blocks by
//       an inline HostRuntime stream), against a hand-written pipelined hiredis load of the
//       same 64 values from the same server: 64 redisAppendCommand GETs, 64 redisGetReply,
//       a memcpy of each value's payload into the same blocks, no check. The sides
//       alternate inside the same iterations; each ratio uses the median of each side.
//       Counters: kvfuse_over_hiredis (throughput ratio = hiredis time / kvfuse time,
//       target >= 0.9), round_trips_per_load (RedisTier's own count, must be 1), the two
//       medians and the throughput in GB/s.
//   BM_RedisLoad/chunk_KiB:<16|256>/connector:1
//       The same, the kvfuse side a whole DenseConnector load on its lane (load() until the
//       record is drained by this thread): adds the lane hand-off to the tier's cost.
//
// The benchmark starts its own redis-server (unix socket in a temporary directory, no
// persistence; `redis-server` on PATH) and stops it at the end; without redis-server or
// hiredis every row reports an error naming the install line.
//
// Run: kvfuse_bench_redis --benchmark_min_time=0.3
#include <benchmark/benchmark.h>

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <kvfuse/completion/single_rank.hpp>
#include <kvfuse/compose/presets.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/tier/redis_tier.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

using namespace kvfuse;

namespace {

constexpr std::size_t kChunks = 64;
constexpr const char* kInstall = "redis-server not found: apt-get install -y libhiredis-dev redis-server";

/// A redis-server of the benchmark's own, for the whole run.
class Server {
 public:
  Server() {
    char templ[] = "/tmp/kvfuse-bench-redis-XXXXXX";
    if (::mkdtemp(templ) == nullptr) return;
    dir_ = templ;
    socket_ = dir_ + "/redis.sock";
    std::vector<std::string> args = {"redis-server", "--port", "0", "--unixsocket", socket_, "--save", "", "--appendonly",
                                     "no", "--dir", dir_, "--logfile", dir_ + "/redis.log"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t files;
    posix_spawn_file_actions_init(&files);
    for (const int fd : {0, 1, 2}) posix_spawn_file_actions_addopen(&files, fd, "/dev/null", fd == 0 ? O_RDONLY : O_WRONLY, 0);
    if (::posix_spawnp(&pid_, "redis-server", &files, nullptr, argv.data(), environ) != 0) pid_ = 0;
    posix_spawn_file_actions_destroy(&files);
    for (int i = 0; pid_ > 0 && i < 2000 && !ready_; ++i) {
      redisContext* c = redisConnectUnix(socket_.c_str());
      ready_ = c != nullptr && c->err == 0;
      if (c != nullptr) redisFree(c);
      if (!ready_) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  ~Server() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }
  [[nodiscard]] bool ready() const { return ready_; }
  [[nodiscard]] const std::string& socket() const { return socket_; }

 private:
  std::string dir_, socket_;
  pid_t pid_ = 0;
  bool ready_ = false;
};

Server& server() {
  static Server s;
  return s;
}

struct Samples {
  std::vector<double> s;
  void add(std::chrono::steady_clock::duration d) { s.push_back(std::chrono::duration<double>(d).count()); }
  [[nodiscard]] double median() {
    if (s.empty()) return 0;
    std::nth_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(s.size() / 2), s.end());
    return s[s.size() / 2];
  }
};

/// Counts the load records drained from the group on this thread.
struct Drain {
  int loads = 0;
  void operator()(std::uint32_t, const CompletionRecord&) noexcept { ++loads; }
  void operator()(std::uint32_t, const SaveRecord&) noexcept {}
};

void BM_RedisLoad(benchmark::State& state) {
  const std::size_t chunk_bytes = static_cast<std::size_t>(state.range(0)) << 10;
  const bool through_connector = state.range(1) != 0;
  if (!server().ready()) {
    state.SkipWithError(kInstall);
    return;
  }
  RankGeometry geo;
  geo.model = 9;
  geo.rank = 0;
  geo.world_size = 1;
  geo.block_tokens = 16;
  geo.chunk_tokens = 64;
  geo.kv_bytes_per_token = chunk_bytes / geo.chunk_tokens;
  geo.num_blocks = static_cast<std::uint32_t>(kChunks * 4);
  geo.num_slots = 0;
  geo.slot_bytes = 0;
  geo.max_chunks_per_load = kChunks;

  RedisTierOptions options;
  options.unix_socket = server().socket();
  options.key_prefix = "bench:";
  RedisTier tier(options);
  std::vector<PrefixHash> keys;
  std::vector<std::string> names;
  std::vector<std::byte> payload(chunk_bytes);
  for (std::size_t c = 0; c < kChunks; ++c) {
    keys.push_back(PrefixHash{0x1000 + c + (chunk_bytes << 8)});
    for (std::size_t i = 0; i < chunk_bytes; ++i) payload[i] = static_cast<std::byte>(i * 131 + c * 7);
    const TierKey key{geo.model, keys.back(), 1, 0, EntryKind::kv_chunk};
    if (!tier.put(key, payload)) {
      state.SkipWithError("put failed");
      return;
    }
    names.push_back(tier.key_name(key));
  }
  std::vector<BlockId> blocks;
  for (std::uint32_t b = 0; b < geo.num_blocks; ++b) blocks.push_back(BlockId{b});
  const KvSpec spec{0, kChunks * geo.chunk_tokens, keys, blocks};
  const std::size_t load_bytes = kChunks * chunk_bytes;

  HostRuntime rt(HostRuntimeOptions{.default_mode = HostStreamMode::inline_calls});
  std::vector<std::byte> device(load_bytes);
  auto stream = rt.make_stream(HostStreamMode::inline_calls);
  std::vector<std::byte> staging(chunk_bytes);
  std::vector<std::uint8_t> mask(kChunks);
  std::vector<TierView> views(kChunks);
  LaneContext<HostRuntime> lane{rt, stream, staging, mask, geo, DeviceMemory{device.data(), nullptr}, views};
  const PagedKv<RedisTier> leg(tier);

  Drain drain;
  SingleRank group;
  std::unique_ptr<DenseConnector<RedisTier, SingleRank>> conn;
  if (through_connector)
    conn = std::make_unique<DenseConnector<RedisTier, SingleRank>>(
        geo, rt, DeviceMemory{device.data(), nullptr}, PagedKv<RedisTier>(tier), NoState{}, group);
  LoadRequest request;
  request.kv = spec;

  redisContext* plain = redisConnectUnix(server().socket().c_str());
  std::vector<std::byte> plain_device(load_bytes);

  Samples ours, theirs;
  bool wrong = false;
  const std::uint64_t trips_before = tier.stats().round_trips;
  std::uint64_t loads = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    if (through_connector) {
      const int before = drain.loads;
      request.key = LoadKey{RequestId{loads + 1}, Generation{loads + 1}};
      conn->load(request);
      while (drain.loads == before)
        if (group.drain(drain) == 0) std::this_thread::yield();
    } else {
      wrong |= !leg.retrieve(spec, lane).complete();
    }
    auto t1 = std::chrono::steady_clock::now();
    ++loads;
    ours.add(t1 - t0);
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());

    t0 = std::chrono::steady_clock::now();
    for (const std::string& n : names) redisAppendCommand(plain, "GET %b", n.data(), n.size());
    for (std::size_t c = 0; c < kChunks; ++c) {
      void* raw = nullptr;
      if (redisGetReply(plain, &raw) != REDIS_OK || raw == nullptr) {
        wrong = true;
        break;
      }
      auto* reply = static_cast<redisReply*>(raw);
      if (reply->type == REDIS_REPLY_STRING && reply->len == chunk_bytes + detail::disk::header_bytes)
        std::memcpy(plain_device.data() + c * chunk_bytes, reply->str + detail::disk::header_bytes, chunk_bytes);
      else
        wrong = true;
      freeReplyObject(reply);
    }
    t1 = std::chrono::steady_clock::now();
    theirs.add(t1 - t0);
  }
  if (conn) conn->drain();
  redisFree(plain);
  if (wrong || device != plain_device) state.SkipWithError("a load did not complete or the bytes differ");
  const double k = ours.median(), h = theirs.median();
  state.counters["kvfuse_us"] = 1e6 * k;
  state.counters["hiredis_us"] = 1e6 * h;
  state.counters["kvfuse_GBps"] = static_cast<double>(load_bytes) / k / 1e9;
  state.counters["hiredis_GBps"] = static_cast<double>(load_bytes) / h / 1e9;
  state.counters["kvfuse_over_hiredis"] = h / k;
  state.counters["round_trips_per_load"] =
      static_cast<double>(tier.stats().round_trips - trips_before) / static_cast<double>(std::max<std::uint64_t>(loads, 1));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * load_bytes));
}

BENCHMARK(BM_RedisLoad)
    ->ArgNames({"chunk_KiB", "connector"})
    ->Args({16, 0})
    ->Args({256, 0})
    ->Args({16, 1})
    ->Args({256, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
