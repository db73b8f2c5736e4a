// kvfuse-replay: ranks as processes, the engine's side (rank_process.hpp): RankProcesses
// starts the rank processes, calls them over their control channels, sends their frames
// through the segment and watches them die and come back.
#include "rank_process.hpp"

#include "byte_encoding.hpp"
#include "child_setup.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

extern char** environ;

namespace replay {

using namespace kvfuse;

namespace {
constexpr int child_fd = 3;  // the control channel's descriptor in a rank process
}  // namespace

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
    if (!ask({ControlOp::tier_snapshot}, {}, nullptr, &payload)) return {};
    return from_wire(read_as<TierSnapshotWire>(payload));
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

}  // namespace replay
