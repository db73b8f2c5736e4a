// Ranks as processes: an engine (Coordinator, OffloadIndex, ShmQuorum, ShmEngine as the
// transport) in this process and rank processes (tests/shm_rank_process.cpp) on the
// shared memory segment. Loads and saves cross it; a rank killed mid-load is seen dead and
// its loads settle without it; a restarted rank counts again; a rank that writes a
// malformed record is killed and the engine goes on; the engine dying ends its ranks; a
// full ring is back-pressure; a crashed engine's segment is removed, a live one is not.
#include "coordinator_harness.hpp"
#include "shm_rank_report.hpp"

#include <kvfuse/ipc/shm_engine.hpp>
#include <kvfuse/ipc/shm_rank.hpp>

#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

extern char** environ;

using namespace kvfuse;
using namespace kvfuse::testing;
using namespace std::chrono_literals;

namespace {

constexpr std::uint32_t kRanks = 2;

/// A rank process: spawned, waited for, reported.
struct RankProcess {
  pid_t pid = -1;
  std::string report;
  RankProcess(const std::string& segment, std::uint32_t rank, const std::string& mode, std::string report_path = "")
      : report(std::move(report_path)) {
    std::vector<std::string> args{KVFUSE_SHM_RANK_PROCESS, segment, std::to_string(rank), std::to_string(kRanks), mode};
    if (!report.empty()) args.push_back(report);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    REQUIRE(::posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) == 0);
  }
  /// The exit status once it exited by itself within `timeout`; -1 if it had to be killed.
  int wait(std::chrono::milliseconds timeout = 10s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        pid = -1;
        return -1;
      }
      std::this_thread::sleep_for(2ms);
    }
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  void signal(int sig) const { ::kill(pid, sig); }
  ~RankProcess() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  /// What the process wrote when it ended: key and value pairs.
  std::map<std::string, std::string> report_fields() const {
    std::ifstream in(report);
    std::map<std::string, std::string> out;
    std::string key, value;
    while (in >> key >> value) out[key] = value;
    return out;
  }
  /// One number from the report (throws if the process did not write it).
  std::uint64_t count(const std::string& key) const { return std::stoull(report_fields().at(key)); }
};

/// The tier as the engine knows it: the chunks whose saves settled stored.
struct SavedLookup {
  std::set<PrefixHash>* saved = nullptr;
  std::size_t operator()(std::span<const PrefixHash> keys) const {
    std::size_t n = 0;
    while (n < keys.size() && saved->contains(keys[n])) ++n;
    return n;
  }
};

ShmOptions options(const std::string& prefix = "kvfuse-test") {
  ShmOptions o;
  o.name_prefix = prefix + "-" + std::to_string(::getpid());
  o.geometry = small_geometry(0, kRanks);
  return o;
}

/// The engine process's side: the segment, the group, the index, the pump, the coordinator.
struct EngineProcess {
  ShmEngine shm;
  ShmQuorum group{shm};
  OffloadIndex<> index{OffloadIndexOptions{.hash_capacity = 1024, .slot_count = 4}};
  SettlementPump<ShmQuorum, OffloadIndex<>> pump{group, index};
  std::set<PrefixHash> saved;
  SavedLookup lookup{&saved};
  Coordinator<ShmQuorum, ShmEngine, SavedLookup> coord{
      CoordinatorOptions{StateLayout::k3_recurrent, PlanGrids{16, 64}, 0, 64, harness_policy()}, index, pump, shm, lookup};
  std::vector<Unpark> unparked;
  std::vector<Freed> freed;
  explicit EngineProcess(ShmOptions o = options()) : shm(std::move(o)) {}
  void step() {
    (void)shm.watch(pump);
    const auto s = coord.step();
    unparked.insert(unparked.end(), s.unparked.begin(), s.unparked.end());
    freed.insert(freed.end(), s.freed.begin(), s.freed.end());
  }
  template <class Pred>
  bool step_until(Pred pred, std::chrono::milliseconds timeout = 10s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      step();
      if (pred()) return true;
      std::this_thread::sleep_for(1ms);
    }
    return false;
  }
  bool unparked_with(RequestId id, bool tokens) const {
    return std::any_of(unparked.begin(), unparked.end(), [&](const Unpark& u) { return u.request == id && (u.tokens > 0) == tokens; });
  }
  /// Request `id` computes `p` into `blocks`, then finishes: its KV and its checkpoint at
  /// `boundary` are saved by every rank.
  void save(RequestId id, const Prompt& p, TokenCount boundary) {
    const std::vector<BlockId> blocks = block_range(0, 13);
    (void)coord.admit(AdmitRequest{id, p.tokens, 0, p.keys, blocks, p.checkpoints, SlotId{0}});
    const std::uint64_t stored = index.stats().saves_stored;
    REQUIRE(coord.finish(FinishRequest{id, p.tokens, p.keys, blocks, Checkpoint{boundary, p.hash_at(boundary)}, SlotId{0}}) == 2);
    REQUIRE(step_until([&] { return index.stats().saves_outstanding == 0 && !freed.empty(); }));
    REQUIRE(index.stats().saves_stored == stored + 2);
    for (std::size_t c = 0; c < 3; ++c) saved.insert(p.keys[c]);
  }
};

std::string temp_path(const std::string& what) {
  return (std::filesystem::temp_directory_path() / ("kvfuse-shm-" + std::to_string(::getpid()) + "-" + what)).string();
}

}  // namespace

TEST_CASE("R1 ranks as processes: loads and saves cross the segment, every rank reports each once, every byte comes back") {
  std::vector<std::unique_ptr<RankProcess>> ranks;
  {
    EngineProcess e;
    struct stat st {};
    REQUIRE(::stat(("/dev/shm/" + e.shm.name()).c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);  // owner only
    for (std::uint32_t r = 0; r < kRanks; ++r)
      ranks.push_back(std::make_unique<RankProcess>(e.shm.name(), r, "serve", temp_path("r" + std::to_string(r))));
    REQUIRE(e.shm.wait_attached(10s));
    const Prompt p(7, 3);
    e.save(RequestId{1}, p, 176);
    const AdmitDecision d =
        e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}});
    REQUIRE(d.parked);
    REQUIRE(std::holds_alternative<JointLoad>(d.plan));
    REQUIRE(e.step_until([&] { return e.unparked_with(RequestId{2}, true); }));
    CHECK(e.unparked.back().tokens == 176);
    CHECK(e.coord.stats().invariant_violations == 0);
    CHECK(e.shm.stats().frames_sent == 3 * kRanks);  // a KV save, a state save, a load: to each rank
    CHECK(e.shm.stats().records_received == 5 * kRanks);  // two records per save, one per load
  }  // the engine shuts down: its ranks stop serving and exit
  for (auto& rank : ranks) {
    CHECK(rank->wait() == 0);
    CHECK(rank->count("loads") == 1);
    CHECK(rank->count("kv_saves") == 1);
    CHECK(rank->count("state_saves") == 1);
    CHECK(rank->count("corrupted") == 0);  // the rank zeroed the load's blocks first: these bytes came from the tier
    const std::vector<BlockId> sent = block_range(20, 12);  // the three saved chunks
    CHECK(rank->count("load_blocks") == load_blocks_hash(0, sent));  // into the blocks the engine named
  }
}

TEST_CASE("R4 a rank process killed mid-load is seen dead within 100 ms and its loads settle without it") {
  EngineProcess e;
  std::vector<std::unique_ptr<RankProcess>> ranks;
  for (std::uint32_t r = 0; r < kRanks; ++r) ranks.push_back(std::make_unique<RankProcess>(e.shm.name(), r, "serve"));
  REQUIRE(e.shm.wait_attached(10s));
  const Prompt p(9, 3);
  e.save(RequestId{1}, p, 176);
  ranks[1]->signal(SIGSTOP);  // rank 1 will not get to the load
  REQUIRE(e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}}).parked);
  for (int i = 0; i < 20; ++i) {
    e.step();
    std::this_thread::sleep_for(1ms);
  }
  CHECK(e.unparked.empty());
  ranks[1]->signal(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  auto seen = killed;
  while (e.shm.watch(e.pump) == 0) {
    REQUIRE(std::chrono::steady_clock::now() - killed < 5s);
    std::this_thread::sleep_for(100us);
  }
  seen = std::chrono::steady_clock::now();
  const auto latency = std::chrono::duration_cast<std::chrono::microseconds>(seen - killed);
  MESSAGE("rank death seen after " << latency.count() << " us");
  CHECK(latency < 100ms);
  CHECK(e.group.stats().live_ranks == 1);
  REQUIRE(e.step_until([&] { return !e.unparked.empty(); }));
  CHECK(e.unparked.back() == Unpark{RequestId{2}, 0, Resolution::failed, false});  // recompute; nothing retracted
  CHECK(e.shm.stats().deaths == 1);
}

TEST_CASE("R3 a restarted rank process attaches with a new incarnation, counts for later keys, and what its dead incarnation left is dropped") {
  EngineProcess e;
  std::vector<std::unique_ptr<RankProcess>> ranks;
  for (std::uint32_t r = 0; r < kRanks; ++r) ranks.push_back(std::make_unique<RankProcess>(e.shm.name(), r, "serve"));
  REQUIRE(e.shm.wait_attached(10s));
  const Prompt p(11, 3);
  e.save(RequestId{1}, p, 176);
  // Rank 1 runs the load and writes its record; it dies before the engine reads it.
  REQUIRE(e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}}).parked);
  std::this_thread::sleep_for(300ms);  // no step: the records wait in the rings
  ranks[1]->signal(SIGKILL);
  CHECK(ranks[1]->wait() == 128 + SIGKILL);
  REQUIRE(e.step_until([&] { return !e.unparked.empty(); }));
  CHECK(e.unparked.back().tokens == 0);  // rank 1's report never counted: the load failed
  CHECK(e.shm.stats().dead_records_dropped >= 1);
  const std::uint64_t late_before = e.pump.stats().late_reports;
  // The restart: a new incarnation; loads issued from now on wait for it again.
  ranks[1] = std::make_unique<RankProcess>(e.shm.name(), 1, "serve");
  REQUIRE(e.step_until([&] { return e.group.stats().live_ranks == kRanks; }));
  CHECK(e.shm.stats().attaches == kRanks + 1);
  // Its tier (MemoryTier, in the process) died with it: a new prompt is saved, then loaded.
  const Prompt q(12, 3);
  e.freed.clear();
  e.save(RequestId{3}, q, 176);
  e.unparked.clear();
  REQUIRE(e.coord.admit(AdmitRequest{RequestId{4}, q.tokens, 0, q.keys, block_range(40, 13), q.checkpoints, SlotId{3}}).parked);
  REQUIRE(e.step_until([&] { return !e.unparked.empty(); }));
  CHECK(e.unparked.back() == Unpark{RequestId{4}, 176, Resolution::completed, false});
  CHECK(e.pump.stats().late_reports == late_before);
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("R19 a rank process that writes a malformed record is killed and the engine serves on, then takes it back") {
  EngineProcess e;
  std::vector<std::unique_ptr<RankProcess>> ranks;
  ranks.push_back(std::make_unique<RankProcess>(e.shm.name(), 0, "serve"));
  ranks.push_back(std::make_unique<RankProcess>(e.shm.name(), 1, "garbage"));
  REQUIRE(e.shm.wait_attached(10s));
  REQUIRE(e.step_until([&] { return e.group.stats().live_ranks == 1; }));
  CHECK(e.shm.stats().faulty == 1);
  CHECK(ranks[1]->wait() == 128 + SIGKILL);
  // Serving goes on with rank 0: a request still completes its round (it recomputes: a
  // load needs every rank's slice).
  const Prompt p(13, 3);
  (void)e.coord.admit(AdmitRequest{RequestId{1}, p.tokens, 0, p.keys, block_range(0, 13), p.checkpoints, SlotId{0}});
  (void)e.coord.finish(FinishRequest{RequestId{1}, p.tokens, p.keys, block_range(0, 13), std::nullopt, std::nullopt});
  REQUIRE(e.step_until([&] { return !e.freed.empty(); }));
  ranks[1] = std::make_unique<RankProcess>(e.shm.name(), 1, "serve");
  REQUIRE(e.step_until([&] { return e.group.stats().live_ranks == kRanks; }));
  e.freed.clear();
  e.save(RequestId{2}, p, 176);
  REQUIRE(e.coord.admit(AdmitRequest{RequestId{3}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}}).parked);
  REQUIRE(e.step_until([&] { return e.unparked_with(RequestId{3}, true); }));
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("R11 a corrupted frame on the way to a rank is refused by name: the rank stops, and its load settles without it") {
  EngineProcess e;
  std::vector<std::unique_ptr<RankProcess>> ranks;
  for (std::uint32_t r = 0; r < kRanks; ++r)
    ranks.push_back(std::make_unique<RankProcess>(e.shm.name(), r, "serve", temp_path("cf" + std::to_string(r))));
  REQUIRE(e.shm.wait_attached(10s));
  const Prompt p(15, 3);
  e.save(RequestId{1}, p, 176);
  // A load frame whose version byte was flipped on the way, queued in rank 1's ring ahead
  // of the next load: rank 1 refuses it before it reads that load.
  const LoadRequest valid{LoadKey{RequestId{9}, Generation{1}}, std::nullopt, std::nullopt};
  std::vector<std::byte> frame(max_frame_bytes);
  const Encoded encoded = to_bytes(valid, std::span<std::byte>(frame));
  REQUIRE(encoded.error == EncodeError::none);
  frame[0] ^= std::byte{0x40};  // the format version
  namespace bip = boost::interprocess;
  detail::MappedSegment raw(bip::shared_memory_object(bip::open_only, e.shm.name().c_str(), bip::read_write), bip::read_write);
  REQUIRE(raw.frame_ring(1).try_push(std::span<const std::byte>(frame.data(), encoded.length)));
  REQUIRE(e.coord.admit(AdmitRequest{RequestId{2}, p.tokens, 0, p.keys, block_range(20, 13), p.checkpoints, SlotId{2}}).parked);
  REQUIRE(e.step_until([&] { return !e.unparked.empty(); }));
  CHECK(e.unparked.back() == Unpark{RequestId{2}, 0, Resolution::failed, false});  // recompute, nothing retracted
  CHECK(ranks[1]->wait() == 4);
  CHECK(ranks[1]->report_fields().at("refused") == "bad_version");
  CHECK(ranks[1]->count("loads") == 0);
  CHECK(e.shm.stats().deaths == 1);
  CHECK(e.coord.stats().invariant_violations == 0);
}

TEST_CASE("R11 a rank process of another world size or geometry is refused, naming both") {
  ShmEngine engine(options());
  RankGeometry other = small_geometry(1, kRanks);
  other.block_tokens = 8;
  try {
    ShmRank rank(engine.name(), other, 1s);
    FAIL("a rank of another geometry attached");
  } catch (const Error& err) {
    CHECK(err.code() == ErrorCode::invalid_argument);
    const std::string what = err.what();
    CHECK(what.find("block_tokens 16") != std::string::npos);  // the segment's
    CHECK(what.find("block_tokens 8") != std::string::npos);   // the rank's
  }
  RankGeometry bigger = small_geometry(1, kRanks + 1);
  try {
    ShmRank rank(engine.name(), bigger, 1s);
    FAIL("a rank of another world attached");
  } catch (const Error& err) {
    CHECK(std::string(err.what()).find("world_size 2") != std::string::npos);
    CHECK(std::string(err.what()).find("world_size 3") != std::string::npos);
  }
}

// The constructor opens the engine's pidfd before it checks the place: a refused attach
// must close it (and the segment) even though no destructor of the rank runs.
TEST_CASE("ranks as processes: a refused attach leaves no descriptor open") {
  auto open_descriptors = [] {
    std::size_t n = 0;
    for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
    return n;
  };
  ShmEngine engine(options());
  ShmRank holder(engine.name(), small_geometry(0, kRanks), 1s);  // rank 0's place is taken
  const std::size_t before = open_descriptors();
  for (int i = 0; i < 5; ++i)
    CHECK_THROWS_WITH_AS(ShmRank(engine.name(), small_geometry(0, kRanks), 20ms), doctest::Contains("still held"), Error);
  CHECK(open_descriptors() == before);
}

TEST_CASE("R20 a full frame ring is back-pressure: send waits, then refuses, and no rank gets the frame") {
  ShmOptions o = options();
  o.frame_ring_bytes = 4096;
  o.send_timeout = 50ms;
  std::vector<std::unique_ptr<RankProcess>> ranks;
  std::size_t sent = 0;
  {
    EngineProcess e(o);
    for (std::uint32_t r = 0; r < kRanks; ++r)
      ranks.push_back(std::make_unique<RankProcess>(e.shm.name(), r, "serve", temp_path("bp" + std::to_string(r))));
    REQUIRE(e.shm.wait_attached(10s));
    ranks[0]->signal(SIGSTOP);  // rank 0 stops reading its ring
    const StateSave save{SaveKey{PrefixHash{5}, Generation{1}}, SlotId{0}, 48};
    while (e.shm.send(save)) ++sent;
    CHECK(sent > 0);
    CHECK(e.shm.stats().backpressure_refusals == 1);
    CHECK(e.shm.stats().frames_sent == kRanks * sent);  // the refused frame went to nobody
    ranks[0]->signal(SIGCONT);
    // Once rank 0 drains, sends go through again.
    REQUIRE(eventually([&] { return e.shm.send(save); }));
    ++sent;
  }  // the engine shuts down; each rank got exactly the frames that went out
  for (auto& rank : ranks) {
    CHECK(rank->wait() == 0);
    CHECK(rank->count("state_saves") == sent);
  }
}

TEST_CASE("a crashed engine's segment is removed by the next engine, a live engine's is left alone") {
  const ShmOptions o = options("kvfuse-stale");
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // the engine that crashes: creates its segment, says its name, dies without cleaning up
    ::close(pipe_fds[0]);
    auto* engine = new ShmEngine(o);
    const std::string name = engine->name() + "\n";
    (void)!::write(pipe_fds[1], name.data(), name.size());
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  char buffer[256] = {};
  const ssize_t got = ::read(pipe_fds[0], buffer, sizeof buffer - 1);
  ::close(pipe_fds[0]);
  ::waitpid(child, nullptr, 0);
  REQUIRE(got > 1);
  const std::string crashed(buffer, static_cast<std::size_t>(got - 1));
  REQUIRE(std::filesystem::exists("/dev/shm/" + crashed));
  ShmEngine live(o);  // a live engine of the same prefix
  CHECK(live.stats().stale_segments_removed == 1);
  CHECK_FALSE(std::filesystem::exists("/dev/shm/" + crashed));
  ShmEngine second(o);
  CHECK(second.stats().stale_segments_removed == 0);  // `live`'s segment is left alone
  CHECK(std::filesystem::exists("/dev/shm/" + live.name()));
  CHECK(second.name() != live.name());
}

TEST_CASE("the engine process dying ends its rank processes") {
  const ShmOptions o = options("kvfuse-orphan");
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  const pid_t engine = ::fork();
  REQUIRE(engine >= 0);
  if (engine == 0) {  // the engine process: makes its segment, says its name, then waits to be killed
    ::close(pipe_fds[0]);
    ShmEngine shm(o);
    const std::string name = shm.name() + "\n";
    (void)!::write(pipe_fds[1], name.data(), name.size());
    ::pause();
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  char buffer[256] = {};
  const ssize_t got = ::read(pipe_fds[0], buffer, sizeof buffer - 1);
  ::close(pipe_fds[0]);
  REQUIRE(got > 1);
  const std::string name(buffer, static_cast<std::size_t>(got - 1));
  std::vector<std::unique_ptr<RankProcess>> ranks;
  for (std::uint32_t r = 0; r < kRanks; ++r) ranks.push_back(std::make_unique<RankProcess>(name, r, "serve"));
  std::this_thread::sleep_for(200ms);  // attached and serving
  ::kill(engine, SIGKILL);
  ::waitpid(engine, nullptr, 0);
  const auto killed = std::chrono::steady_clock::now();
  for (auto& rank : ranks) CHECK(rank->wait(5s) == 0);  // each noticed, stopped serving and exited by itself
  MESSAGE("ranks exited " << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - killed).count()
                          << " ms after the engine died");
  boost::interprocess::shared_memory_object::remove(name.c_str());
}
