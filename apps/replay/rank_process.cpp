// kvfuse-replay: ranks as processes (rank_process.hpp): the control channel, the engine's
// RankProcesses, and the rank process's RankServer and entry point.
#include "rank_process.hpp"

#include "models.hpp"
#include "rank_process_child.hpp"
#include "workload.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

extern char** environ;

namespace replay {

namespace {

using namespace kvfuse;

constexpr std::uint64_t max_payload = std::uint64_t{1} << 30;
constexpr int child_fd = 3;  // the control channel's descriptor in a rank process

/// Every counter of a TierSnapshot as one trivially copyable struct.
struct TierSnapshotWire {
  TierCalls calls;
  bool has_memory = false, has_disk = false, has_stack = false, has_redis = false;
  MemoryTierStats memory;
  DiskTierStats disk;
  TieredTierStats stack;
  RedisTierStats redis;
  std::uint64_t quarantined = 0;
};
static_assert(std::is_trivially_copyable_v<TierSnapshotWire> && std::is_trivially_copyable_v<ConnectorStats> &&
              std::is_trivially_copyable_v<RankCounts> && std::is_trivially_copyable_v<TierKey> &&
              std::is_trivially_copyable_v<BlockId>);

template <class T>
std::span<const std::byte> bytes_of(const T& v) noexcept {
  return std::as_bytes(std::span<const T>(&v, 1));
}
template <class T>
std::span<const std::byte> bytes_of(std::span<const T> v) noexcept {
  return std::as_bytes(v);
}
/// `payload` as `n` values of T, or an empty span when its size is not exactly that.
template <class T>
std::span<const T> as_items(std::span<const std::byte> payload, std::size_t n) noexcept {
  if (payload.size() != n * sizeof(T) || reinterpret_cast<std::uintptr_t>(payload.data()) % alignof(T) != 0) return {};
  return {reinterpret_cast<const T*>(payload.data()), n};
}
template <class T>
T read_as(std::span<const std::byte> payload) noexcept {
  T v{};
  if (payload.size() == sizeof(T)) std::memcpy(&v, payload.data(), sizeof(T));
  return v;
}

// ---- the setup's encoding ------------------------------------------------------------------
struct Writer {
  std::vector<std::byte> out;
  template <class T>
  void value(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto b = bytes_of(v);
    out.insert(out.end(), b.begin(), b.end());
  }
  void text(const std::string& s) {
    value(static_cast<std::uint32_t>(s.size()));
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    out.insert(out.end(), p, p + s.size());
  }
};
struct Reader {
  std::span<const std::byte> in;
  template <class T>
  T value() {
    if (in.size() < sizeof(T)) throw InputError("rank process setup: truncated");
    T v;
    std::memcpy(&v, in.data(), sizeof(T));
    in = in.subspan(sizeof(T));
    return v;
  }
  std::string text() {
    const auto n = value<std::uint32_t>();
    if (in.size() < n) throw InputError("rank process setup: truncated text");
    std::string s(reinterpret_cast<const char*>(in.data()), n);
    in = in.subspan(n);
    return s;
  }
};

}  // namespace

// ---- ControlChannel ------------------------------------------------------------------------
ControlChannel& ControlChannel::operator=(ControlChannel&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

bool ControlChannel::put(ControlHeader h, std::span<const std::byte> payload) noexcept {
  if (fd_ < 0) return false;
  h.bytes = payload.size();
  auto send_all = [&](const std::byte* p, std::size_t n) {
    while (n > 0) {
      const ssize_t sent = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (sent < 0 && errno == EINTR) continue;
      if (sent <= 0) return false;
      p += sent;
      n -= static_cast<std::size_t>(sent);
    }
    return true;
  };
  return send_all(reinterpret_cast<const std::byte*>(&h), sizeof h) && send_all(payload.data(), payload.size());
}

bool ControlChannel::get(ControlHeader& h, std::vector<std::byte>& payload) noexcept {
  if (fd_ < 0) return false;
  auto recv_all = [&](std::byte* p, std::size_t n) {
    while (n > 0) {
      const ssize_t got = ::recv(fd_, p, n, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      p += got;
      n -= static_cast<std::size_t>(got);
    }
    return true;
  };
  if (!recv_all(reinterpret_cast<std::byte*>(&h), sizeof h) || h.bytes > max_payload) return false;
  try {
    payload.resize(h.bytes);
  } catch (const std::bad_alloc&) {
    return false;
  }
  return recv_all(payload.data(), payload.size());
}

void ControlChannel::shut_down() noexcept {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void ControlChannel::close() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

// ---- ChildSetup ----------------------------------------------------------------------------
std::vector<std::byte> ChildSetup::encode() const {
  Writer w;
  w.text(segment);
  w.text(model);
  w.value(rank);
  w.value(ranks.model);
  w.value(ranks.world);
  w.value(ranks.num_blocks);
  w.value(ranks.num_slots);
  w.value(ranks.max_chunks_per_load);
  w.value(static_cast<std::uint64_t>(ranks.tier));
  w.value(static_cast<std::uint64_t>(tier.memory_bytes));
  w.text(tier.dir.string());
  w.text(tier.pass);
#if KVFUSE_REPLAY_WITH_REDIS
  w.value(static_cast<std::uint8_t>(tier.redis.has_value()));
  if (tier.redis) {
    const RedisTierOptions& r = *tier.redis;
    w.text(r.host);
    w.value(r.port);
    w.text(r.unix_socket);
    w.text(r.user);
    w.text(r.password);
    w.value(r.db);
    w.text(r.key_prefix);
    w.value(static_cast<std::int64_t>(r.ttl.count()));
    w.value(static_cast<std::int64_t>(r.connect_timeout.count()));
    w.value(static_cast<std::int64_t>(r.command_timeout.count()));
    w.value(static_cast<std::uint64_t>(r.max_idle_connections));
  }
#else
  w.value(std::uint8_t{0});
#endif
  return std::move(w.out);
}

ChildSetup ChildSetup::decode(std::span<const std::byte> bytes) {
  Reader rd{bytes};
  ChildSetup s;
  s.segment = rd.text();
  s.model = rd.text();
  s.rank = rd.value<std::uint32_t>();
  s.ranks.model = rd.value<std::uint64_t>();
  s.ranks.world = rd.value<std::uint32_t>();
  s.ranks.num_blocks = rd.value<std::uint32_t>();
  s.ranks.num_slots = rd.value<std::uint32_t>();
  s.ranks.max_chunks_per_load = rd.value<std::uint32_t>();
  s.ranks.tier = static_cast<std::size_t>(rd.value<std::uint64_t>());
  s.tier.memory_bytes = static_cast<std::size_t>(rd.value<std::uint64_t>());
  s.tier.dir = rd.text();
  s.tier.pass = rd.text();
  if (rd.value<std::uint8_t>() != 0) {
#if KVFUSE_REPLAY_WITH_REDIS
    RedisTierOptions r;
    r.host = rd.text();
    r.port = rd.value<int>();
    r.unix_socket = rd.text();
    r.user = rd.text();
    r.password = rd.text();
    r.db = rd.value<int>();
    r.key_prefix = rd.text();
    r.ttl = std::chrono::milliseconds(rd.value<std::int64_t>());
    r.connect_timeout = std::chrono::milliseconds(rd.value<std::int64_t>());
    r.command_timeout = std::chrono::milliseconds(rd.value<std::int64_t>());
    r.max_idle_connections = static_cast<std::size_t>(rd.value<std::uint64_t>());
    s.tier.redis = r;
#else
    throw InputError("rank process setup: a redis tier, but this binary has no redis");
#endif
  }
  if (!rd.in.empty() || s.rank >= s.ranks.world || s.ranks.tier >= tier_count)
    throw InputError("rank process setup: rank " + std::to_string(s.rank) + " of " + std::to_string(s.ranks.world) +
                     ", tier " + std::to_string(s.ranks.tier) + ", " + std::to_string(rd.in.size()) + " bytes left over");
  return s;
}

// ---- the engine side ------------------------------------------------------------------------

/// Rank r's tier over its control channel. A rank that is down answers as an empty tier.
class RemoteTier final : public TierControl {
 public:
  RemoteTier(RankProcesses& owner, std::uint32_t rank) noexcept : owner_(owner), rank_(rank) {}

  bool contains(const TierKey& key) const noexcept override { return leading(std::span<const TierKey>(&key, 1)) == 1; }
  std::size_t leading(std::span<const TierKey> keys) const noexcept override {
    ControlHeader reply;
    if (!ask({ControlOp::tier_leading, static_cast<std::uint32_t>(keys.size())}, bytes_of(keys), &reply)) return 0;
    return static_cast<std::size_t>(reply.a);
  }
  bool erase(const TierKey& key) noexcept override { return ask_flag(ControlOp::tier_erase, key); }
  void set_delay(std::chrono::microseconds d) noexcept override {
    owner_.children_[rank_].delay_us = static_cast<std::uint64_t>(d.count());
    (void)ask({ControlOp::tier_set_delay, 0, static_cast<std::uint64_t>(d.count())}, {});
  }
  std::pair<std::size_t, std::size_t> reopen_disk() override {
    ControlHeader reply;
    if (!ask({ControlOp::tier_reopen_disk}, {}, &reply)) return {0, 0};
    return {static_cast<std::size_t>(reply.a), static_cast<std::size_t>(reply.b)};
  }
  bool erase_from_memory(const TierKey& key) noexcept override { return ask_flag(ControlOp::tier_erase_from_memory, key); }
  std::filesystem::path disk_path(const TierKey& key) const override {
    std::vector<std::byte> text;
    if (!ask({ControlOp::tier_disk_path, 1}, bytes_of(key), nullptr, &text)) return {};
    return std::string(reinterpret_cast<const char*>(text.data()), text.size());
  }
  TierSnapshot snapshot() const override {
    std::vector<std::byte> payload;
    TierSnapshot s;
    if (!ask({ControlOp::tier_snapshot}, {}, nullptr, &payload)) return s;
    const auto w = read_as<TierSnapshotWire>(payload);
    s.calls = w.calls;
    if (w.has_memory) s.memory = w.memory;
    if (w.has_disk) s.disk = w.disk;
    if (w.has_stack) s.stack = w.stack;
    if (w.has_redis) s.redis = w.redis;
    s.quarantined = w.quarantined;
    return s;
  }

 private:
  bool ask(const ControlHeader& h, std::span<const std::byte> payload, ControlHeader* reply = nullptr,
           std::vector<std::byte>* reply_payload = nullptr) const noexcept {
    try {
      return owner_.call(rank_, h, payload, reply, reply_payload);
    } catch (...) {
      return false;
    }
  }
  bool ask_flag(ControlOp op, const TierKey& key) const noexcept {
    ControlHeader reply;
    return ask({op, 1}, bytes_of(key), &reply) && reply.a != 0;
  }

  RankProcesses& owner_;
  std::uint32_t rank_;
};

RankProcesses::RankProcesses(const RankSetup& setup, std::string_view model, ShmEngine& shm)
    : setup_(setup), model_(model), shm_(shm), children_(setup.world), landing_(setup.world) {
  world_ = setup.world;
  setup_.runtime = nullptr;
  setup_.group = nullptr;
  for (std::uint32_t r = 0; r < world_; ++r) tiers_.push_back(std::make_unique<RemoteTier>(*this, r));
  try {
    for (std::uint32_t r = 0; r < world_; ++r) spawn(r);
    if (!shm_.wait_attached(std::chrono::seconds(30)))
      throw Error(ErrorCode::io_failure, "the rank processes did not all attach to /" + shm_.name() + " within 30 s");
  } catch (...) {
    (void)stop_all();
    throw;
  }
}

RankProcesses::~RankProcesses() { (void)stop_all(); }

void RankProcesses::spawn(std::uint32_t r) {
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0)
    throw Error(ErrorCode::io_failure, std::string("socketpair: ") + std::strerror(errno));
  ControlChannel mine(pair[0]);
  // A rank process that stops answering fails the call after this long (its channel is
  // closed) instead of hanging the engine.
  const timeval answer_within{60, 0};
  (void)::setsockopt(pair[0], SOL_SOCKET, SO_RCVTIMEO, &answer_within, sizeof answer_within);
  // Above the descriptor the child gets (dup2 onto itself would keep close-on-exec).
  const int theirs = ::fcntl(pair[1], F_DUPFD_CLOEXEC, child_fd + 1);
  ::close(pair[1]);
  if (theirs < 0) throw Error(ErrorCode::io_failure, std::string("fcntl: ") + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawn_file_actions_adddup2(&actions, theirs, child_fd);
  std::string fd_text = std::to_string(child_fd);
  char name[] = "kvfuse-replay";
  char flag[] = "--rank-process";
  char* argv[] = {name, flag, fd_text.data(), nullptr};
  pid_t pid = 0;
  const int spawned = ::posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv, environ);
  ::posix_spawn_file_actions_destroy(&actions);
  ::close(theirs);
  if (spawned != 0) throw Error(ErrorCode::io_failure, std::string("cannot start a rank process: ") + std::strerror(spawned));
  Child& c = children_[r];
  c.pid = pid;
  c.channel = std::move(mine);
  ChildSetup s;
  s.segment = shm_.name();
  s.model = model_;
  s.rank = r;
  s.ranks = setup_;
  s.tier = setup_.tier_options[r];
  ControlHeader reply;
  std::vector<std::byte> text;
  if (!c.channel.put({ControlOp::ready}, s.encode()) || !c.channel.get(reply, text) || reply.a != 1) {
    const std::string why = text.empty() ? "it exited" : std::string(reinterpret_cast<const char*>(text.data()), text.size());
    throw Error(ErrorCode::io_failure, "rank " + std::to_string(r) + "'s process did not start: " + why);
  }
  if (c.delay_us != 0) (void)call(r, {ControlOp::tier_set_delay, 0, c.delay_us}, {});
}

std::string RankProcesses::stop_all() noexcept {
  for (Child& c : children_)
    if (c.pid > 0) (void)c.channel.put({ControlOp::quit});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  std::string problems;
  for (std::uint32_t r = 0; r < children_.size(); ++r) {
    Child& c = children_[r];
    if (c.pid <= 0) continue;
    int status = 0;
    while (::waitpid(c.pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(c.pid, SIGKILL);
        (void)::waitpid(c.pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      try {
        problems += (problems.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + "'s process " +
                    (WIFSIGNALED(status) ? "was killed by signal " + std::to_string(WTERMSIG(status))
                                         : "exited with status " + std::to_string(WEXITSTATUS(status)));
      } catch (...) {
      }
    }
    c.pid = 0;
    c.channel.close();
  }
  return problems;
}

void RankProcesses::quit_all() {
  if (const std::string problems = stop_all(); !problems.empty()) throw Error(ErrorCode::io_failure, problems);
}

bool RankProcesses::up(std::uint32_t r) const { return children_[r].state == State::running && shm_.attached(r); }

bool RankProcesses::all_up() const {
  for (std::uint32_t r = 0; r < world_; ++r)
    if (!up(r)) return false;
  return true;
}

bool RankProcesses::kill(std::uint32_t r) {
  Child& c = children_[r];
  if (c.state != State::running || c.pid <= 0) return false;
  ::kill(c.pid, SIGKILL);
  int status = 0;
  (void)::waitpid(c.pid, &status, 0);
  c.pid = 0;
  c.channel.close();
  c.state = State::killed;
  c.killed = true;
  return true;
}

void RankProcesses::seen_dead(std::uint32_t r) {
  Child& c = children_[r];
  if (c.pid > 0) {  // a death nobody here caused: reap it, and say how it ended
    int status = 0;
    (void)::waitpid(c.pid, &status, 0);
    c.pid = 0;
    c.killed = false;
    c.ended = WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                                  : "exited with status " + std::to_string(WEXITSTATUS(status));
  }
  c.channel.close();
  c.state = State::lost;
}

bool RankProcesses::restart(std::uint32_t r) {
  if (children_[r].state != State::lost) return false;
  spawn(r);
  children_[r].state = State::restarting;
  return true;
}

bool RankProcesses::call(std::uint32_t r, const ControlHeader& h, std::span<const std::byte> payload, ControlHeader* reply,
                         std::vector<std::byte>* reply_payload) {
  Child& c = children_[r];
  ControlHeader got;
  std::vector<std::byte>& into = reply_payload != nullptr ? *reply_payload : reply_;
  if (!c.channel.put(h, payload) || !c.channel.get(got, into)) {
    c.channel.close();  // gone: watch() will see the process die
    return false;
  }
  if (reply != nullptr) *reply = got;
  return true;
}

template <class Each>
void RankProcesses::call_all(const ControlHeader& h, std::span<const std::byte> payload, Each&& each) {
  std::vector<bool> asked(world_, false);
  for (std::uint32_t r = 0; r < world_; ++r) {
    Child& c = children_[r];
    if (!c.channel.open()) continue;
    asked[r] = c.channel.put(h, payload);
    if (!asked[r]) c.channel.close();
  }
  for (std::uint32_t r = 0; r < world_; ++r) {
    if (!asked[r]) continue;
    ControlHeader got;
    if (!children_[r].channel.get(got, reply_)) {
      children_[r].channel.close();
      continue;
    }
    each(r, got, reply_);
  }
}

namespace {
template <class Frame>
Delivery broadcast(ShmEngine& shm, std::uint32_t world, const Frame& frame) {
  Delivery d;
  for (std::uint32_t r = 0; r < world; ++r) d.ranks += shm.attached(r) ? 1 : 0;
  d.sent = shm.send(frame);
  if (!d.sent) d.ranks = 0;
  return d;
}
}  // namespace

Delivery RankProcesses::deliver(const LoadRequest& request, const std::vector<bool>&) { return broadcast(shm_, world_, request); }
Delivery RankProcesses::deliver(const KvSave& save, const std::vector<bool>&) { return broadcast(shm_, world_, save); }
Delivery RankProcesses::deliver(const StateSave& save, const std::vector<bool>&) { return broadcast(shm_, world_, save); }

void RankProcesses::write_kv(std::span<const BlockSpan> spans) {
  call_all({ControlOp::write_kv, static_cast<std::uint32_t>(spans.size())}, bytes_of(spans),
           [](std::uint32_t, const ControlHeader&, const std::vector<std::byte>&) {});
}

void RankProcesses::write_state(SlotId slot, std::uint64_t digest) {
  call_all({ControlOp::write_state, 0, slot.value, digest}, {},
           [](std::uint32_t, const ControlHeader&, const std::vector<std::byte>&) {});
}

std::uint64_t RankProcesses::read_state(SlotId slot) {
  ControlHeader reply;
  return call(0, {ControlOp::read_state, 0, slot.value}, {}, &reply) ? reply.a : 0;
}

void RankProcesses::fold_kv(std::span<const BlockSpan> spans, std::span<std::uint64_t> out) {
  std::fill(out.begin(), out.end(), 0);
  call_all({ControlOp::fold_kv, static_cast<std::uint32_t>(spans.size())}, bytes_of(spans),
           [&](std::uint32_t r, const ControlHeader& reply, const std::vector<std::byte>&) { out[r] = reply.a; });
}

Checked RankProcesses::check(std::span<const BlockSpan> spans, std::optional<SlotId> slot, std::uint64_t digest) {
  Checked c;
  call_all({ControlOp::check, static_cast<std::uint32_t>(spans.size()), slot ? std::uint64_t{slot->value} + 1 : 0, digest},
           bytes_of(spans), [&](std::uint32_t, const ControlHeader& reply, const std::vector<std::byte>&) {
             c.verified += reply.a;
             c.corrupted += reply.b;
           });
  return c;
}

std::byte* RankProcesses::pd_landing(std::uint32_t r) {
  if (landing_[r].empty()) landing_[r].resize(std::size_t{setup_.num_blocks} * block_bytes);
  return landing_[r].data();
}

void RankProcesses::pd_landed(std::span<const BlockId> blocks) {
  std::vector<std::byte> payload;
  for (std::uint32_t r = 0; r < world_; ++r) {
    if (!children_[r].channel.open() || landing_[r].empty()) continue;
    payload.assign(reinterpret_cast<const std::byte*>(blocks.data()),
                   reinterpret_cast<const std::byte*>(blocks.data() + blocks.size()));
    for (const BlockId b : blocks) {
      const std::byte* at = landing_[r].data() + std::size_t{b.value} * block_bytes;
      payload.insert(payload.end(), at, at + block_bytes);
    }
    (void)call(r, {ControlOp::put_blocks, static_cast<std::uint32_t>(blocks.size())}, payload);
  }
}

TierControl& RankProcesses::tier(std::uint32_t r) { return *tiers_[r]; }

ConnectorStats RankProcesses::connector_stats(std::uint32_t r) {
  std::vector<std::byte> payload;
  if (!call(r, {ControlOp::connector_stats}, {}, nullptr, &payload)) return {};
  return read_as<ConnectorStats>(payload);
}

std::vector<RankCounts> RankProcesses::rank_counts() {
  std::vector<RankCounts> out(world_);
  call_all({ControlOp::counts}, {}, [&](std::uint32_t r, const ControlHeader&, const std::vector<std::byte>& payload) {
    out[r] = read_as<RankCounts>(payload);
  });
  return out;
}

void RankProcesses::drain() {
  call_all({ControlOp::drain}, {}, [](std::uint32_t, const ControlHeader&, const std::vector<std::byte>&) {});
}

// ---- the rank process ------------------------------------------------------------------------
bool send_ready(ControlChannel& channel) { return channel.put({ControlOp::ready, 0, 1}); }

void RankServer::on_serving_thread(const std::function<void()>& task) {
  std::unique_lock<std::mutex> lock(mutex_);
  task_ = &task;
  pending_.store(true, std::memory_order_release);
  done_.wait(lock, [&] { return task_ == nullptr || stopped_.load(std::memory_order_acquire); });
  task_ = nullptr;
  pending_.store(false, std::memory_order_release);
}

#if defined(__SANITIZE_THREAD__)
#define KVFUSE_REPLAY_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVFUSE_REPLAY_TSAN 1
#endif
#endif

void RankServer::on_memory(const std::function<void()>& op) {
#if KVFUSE_REPLAY_TSAN
  // What orders a lane's writes before this request (its record, read by the engine, which
  // then asks) and this request's writes before a later save (the engine's reply, then its
  // frame) crosses the engine's process, where ThreadSanitizer cannot see it. Under it the
  // op runs on the serving thread after the lanes settle: an order within this process.
  on_serving_thread([&] {
    work_.settle();
    op();
  });
#else
  op();
#endif
}

void RankServer::do_work() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (task_ != nullptr) (*task_)();
  task_ = nullptr;
  pending_.store(false, std::memory_order_release);
  done_.notify_all();
}

void RankServer::stop() noexcept {
  channel_.shut_down();
  std::lock_guard<std::mutex> lock(mutex_);
  stopped_.store(true, std::memory_order_release);
  done_.notify_all();
}

void RankServer::run() {
  ControlHeader h;
  std::vector<std::byte> payload;
  while (!stopped() && channel_.get(h, payload) && answer(h, payload)) {
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stopped_.store(true, std::memory_order_release);
}

bool RankServer::answer(const ControlHeader& h, std::span<const std::byte> payload) {
  ControlHeader reply{h.op};
  std::vector<std::byte> out;
  const auto spans = as_items<BlockSpan>(payload, h.count);
  const auto keys = as_items<TierKey>(payload, h.count);
  if ((h.op == ControlOp::write_kv || h.op == ControlOp::fold_kv || h.op == ControlOp::check) && spans.size() != h.count)
    return false;  // not what this binary sends: stop
  if ((h.op == ControlOp::tier_leading || h.op == ControlOp::tier_erase || h.op == ControlOp::tier_erase_from_memory ||
       h.op == ControlOp::tier_disk_path) &&
      (keys.size() != h.count || (h.op != ControlOp::tier_leading && h.count != 1)))
    return false;
  switch (h.op) {
    case ControlOp::write_kv: on_memory([&] { memory_.write_kv(spans); }); break;
    case ControlOp::write_state: on_memory([&] { memory_.write_state(SlotId{static_cast<std::uint32_t>(h.a)}, h.b); }); break;
    case ControlOp::read_state: on_memory([&] { reply.a = memory_.read_state(SlotId{static_cast<std::uint32_t>(h.a)}); }); break;
    case ControlOp::fold_kv: on_memory([&] { reply.a = memory_.fold_kv(spans); }); break;
    case ControlOp::check: {
      const std::optional<SlotId> slot = h.a == 0 ? std::nullopt : std::optional<SlotId>(SlotId{static_cast<std::uint32_t>(h.a - 1)});
      Checked c;
      on_memory([&] { c = memory_.check(spans, slot, h.b); });
      verified_ += c.verified;
      corrupted_ += c.corrupted;
      reply.a = c.verified;
      reply.b = c.corrupted;
      break;
    }
    case ControlOp::put_blocks: {
      const std::size_t ids = std::size_t{h.count} * sizeof(BlockId);
      if (payload.size() != ids + std::size_t{h.count} * block_bytes) return false;
      on_memory([&] {
        for (std::uint32_t i = 0; i < h.count; ++i) {
          BlockId b;
          std::memcpy(&b, payload.data() + i * sizeof(BlockId), sizeof b);
          std::memcpy(memory_.block(b.value), payload.data() + ids + std::size_t{i} * block_bytes, block_bytes);
        }
      });
      break;
    }
    case ControlOp::tier_leading: reply.a = tier_.leading(keys); break;
    case ControlOp::tier_erase: reply.a = tier_.erase(keys[0]); break;
    case ControlOp::tier_set_delay: tier_.set_delay(std::chrono::microseconds(h.a)); break;
    case ControlOp::tier_reopen_disk: {
      const auto [before, after] = tier_.reopen_disk();
      reply.a = before;
      reply.b = after;
      break;
    }
    case ControlOp::tier_erase_from_memory: reply.a = tier_.erase_from_memory(keys[0]); break;
    case ControlOp::tier_disk_path: {
      const std::string p = tier_.disk_path(keys[0]).string();
      const auto* b = reinterpret_cast<const std::byte*>(p.data());
      out.assign(b, b + p.size());
      break;
    }
    case ControlOp::tier_snapshot: {
      const TierSnapshot s = tier_.snapshot();
      TierSnapshotWire w;
      w.calls = s.calls;
      w.has_memory = s.memory.has_value();
      w.has_disk = s.disk.has_value();
      w.has_stack = s.stack.has_value();
      w.has_redis = s.redis.has_value();
      if (s.memory) w.memory = *s.memory;
      if (s.disk) w.disk = *s.disk;
      if (s.stack) w.stack = *s.stack;
      if (s.redis) w.redis = *s.redis;
      w.quarantined = s.quarantined;
      const auto b = bytes_of(w);
      out.assign(b.begin(), b.end());
      break;
    }
    case ControlOp::connector_stats: {
      ConnectorStats s{};
      on_serving_thread([&] { s = work_.stats(); });
      const auto b = bytes_of(s);
      out.assign(b.begin(), b.end());
      break;
    }
    case ControlOp::counts: {
      RankCounts c{};
      on_serving_thread([&] { c = work_.counts(); });
      c.bytes_checked = verified_;
      c.bytes_corrupted = corrupted_;
      const auto b = bytes_of(c);
      out.assign(b.begin(), b.end());
      break;
    }
    case ControlOp::drain: on_serving_thread(work_.drain); break;
    case ControlOp::quit: (void)channel_.put(reply); return false;
    case ControlOp::ready: return false;
  }
  return channel_.put(reply, out);
}

int rank_process_main(int fd) {
  ControlChannel channel(fd);
  ControlHeader h;
  std::vector<std::byte> payload;
  if (!channel.get(h, payload) || h.op != ControlOp::ready) return 3;
  auto refuse = [&](const std::string& why) {
    const auto* b = reinterpret_cast<const std::byte*>(why.data());
    (void)channel.put({ControlOp::ready, 0, 0}, std::span<const std::byte>(b, why.size()));
    return 3;
  };
  try {
    const ChildSetup s = ChildSetup::decode(payload);
    const Model* m = find_model(s.model);
    if (m == nullptr || m->serve_rank == nullptr) return refuse("no model \"" + s.model + "\"");
    return m->serve_rank(s, channel);
  } catch (const std::exception& e) {
    return refuse(e.what());
  }
}

}  // namespace replay
