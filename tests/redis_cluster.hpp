// A Redis Cluster of the test's own: primaries and replicas of `redis-server
// --cluster-enabled yes` on free loopback ports, each in its own folder of one temporary
// directory (no persistence), joined with `redis-cli --cluster create` (one primary: all
// slots given to it with CLUSTER ADDSLOTSRANGE). Nodes can be killed, frozen (SIGSTOP) and
// thawed; every node is killed and the directory removed whatever happens. Failures throw
// std::runtime_error with what the nodes logged. No doctest: the benchmarks use it too.
#pragma once

#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <kvfuse/tier/detail/redis_connection.hpp>
#include <kvfuse/tier/redis_cluster_tier.hpp>

#include "process_support.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

namespace kvfuse::testing {

/// How a test's cluster is built.
struct RedisClusterSpec {
  int primaries = 3;
  int replicas_per_primary = 1;
  std::string password;        ///< requirepass and masterauth on every node when set
  int node_timeout_ms = 1000;  ///< cluster-node-timeout: how soon a silent primary is failed over
  std::vector<std::string> extra;  ///< more redis-server arguments for every node
};

/// One cluster for one test (or one benchmark run).
class RedisCluster {
 public:
  explicit RedisCluster(RedisClusterSpec spec = {}) : spec_(std::move(spec)) {
    server_ = find_executable("redis-server");
    cli_ = find_executable("redis-cli");
    if (server_.empty() || cli_.empty())
      throw std::runtime_error("redis-server and redis-cli are needed. Run, as root: apt-get install -y redis-server redis-tools");
    char templ[] = "/tmp/kvfuse-cluster-XXXXXX";
    if (::mkdtemp(templ) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = templ;
    try {
      const int n = spec_.primaries * (1 + spec_.replicas_per_primary);
      std::vector<int> ports = free_ports(n);
      for (int i = 0; i < n; ++i) start_node(ports[static_cast<std::size_t>(i)]);
      join();
    } catch (...) {
      stop_all();
      throw;
    }
  }
  ~RedisCluster() { stop_all(); }
  RedisCluster(const RedisCluster&) = delete;
  RedisCluster& operator=(const RedisCluster&) = delete;

  /// Nodes started, dead ones included.
  [[nodiscard]] std::size_t size() const { return nodes_.size(); }
  [[nodiscard]] int port(std::size_t i) const { return nodes_.at(i).port; }
  [[nodiscard]] std::string address(std::size_t i) const { return "127.0.0.1:" + std::to_string(port(i)); }
  [[nodiscard]] bool alive(std::size_t i) const { return nodes_.at(i).pid > 0; }

  /// Every node's address, comma-separated: a seed list.
  [[nodiscard]] std::string seeds() const {
    std::string out;
    for (std::size_t i = 0; i < nodes_.size(); ++i) out += (i ? "," : "") + address(i);
    return out;
  }

  /// RedisClusterTier options for this cluster: every node a seed, short timeouts.
  [[nodiscard]] RedisClusterTierOptions options(std::string prefix = "kvfuse-test:") const {
    RedisClusterTierOptions o;
    o.add_seeds(seeds());
    o.key_prefix = std::move(prefix);
    o.password = spec_.password;
    o.connect_timeout = std::chrono::milliseconds(500);
    o.command_timeout = std::chrono::milliseconds(500);
    return o;
  }

  /// SIGKILL node i: it dies at once, its data with it.
  void kill(std::size_t i) {
    Node& n = nodes_.at(i);
    if (n.pid <= 0) return;
    ::kill(n.pid, SIGKILL);
    int status = 0;
    ::waitpid(n.pid, &status, 0);
    n.pid = 0;
  }
  /// SIGSTOP / SIGCONT node i: it stops answering but keeps its connections.
  void pause(std::size_t i) { ::kill(nodes_.at(i).pid, SIGSTOP); }
  void resume(std::size_t i) { ::kill(nodes_.at(i).pid, SIGCONT); }

  /// One command on node i on a fresh connection (AUTH first when the cluster has a
  /// password); null if it could not be sent or answered.
  [[nodiscard]] detail::redis::Reply command(std::size_t i, std::vector<std::string> args) const {
    const timeval two_seconds{2, 0};
    redisContext* ctx = redisConnectWithTimeout("127.0.0.1", port(i), two_seconds);
    if (ctx == nullptr) return nullptr;
    detail::redis::Reply reply;
    if (ctx->err == 0) redisSetTimeout(ctx, two_seconds);
    auto run = [&](const std::vector<std::string>& a) {
      std::vector<const char*> argv;
      std::vector<std::size_t> lens;
      for (const std::string& s : a) {
        argv.push_back(s.data());
        lens.push_back(s.size());
      }
      return detail::redis::Reply(
          static_cast<redisReply*>(redisCommandArgv(ctx, static_cast<int>(argv.size()), argv.data(), lens.data())));
    };
    if (ctx->err == 0 && !spec_.password.empty()) (void)run({"AUTH", spec_.password});
    if (ctx->err == 0) reply = run(args);
    redisFree(ctx);
    return reply;
  }
  /// A command's reply as text (status, string, error, integer); "" when none came.
  [[nodiscard]] std::string text(std::size_t i, std::vector<std::string> args) const {
    const detail::redis::Reply r = command(i, std::move(args));
    if (!r) return {};
    if (r->type == REDIS_REPLY_INTEGER) return std::to_string(r->integer);
    if (r->str != nullptr) return std::string(r->str, r->len);
    return {};
  }

  /// Node i's cluster id (CLUSTER MYID).
  [[nodiscard]] std::string node_id(std::size_t i) const { return text(i, {"CLUSTER", "MYID"}); }

  /// The node serving `slot` as a live node's CLUSTER SLOTS says; size() if none does.
  [[nodiscard]] std::size_t owner_of(std::uint16_t slot) const {
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (!alive(i)) continue;
      const detail::redis::Reply r = command(i, {"CLUSTER", "SLOTS"});
      if (!r || r->type != REDIS_REPLY_ARRAY) continue;
      for (std::size_t k = 0; k < r->elements; ++k) {
        const redisReply* e = r->element[k];
        if (e->element[0]->integer <= slot && slot <= e->element[1]->integer) return index_of(static_cast<int>(e->element[2]->element[1]->integer));
      }
      return nodes_.size();
    }
    return nodes_.size();
  }

  /// The primaries among the live nodes now (ROLE says master).
  [[nodiscard]] std::vector<std::size_t> primaries() const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (alive(i) && role(i) == "master") out.push_back(i);
    return out;
  }

  /// Waits (at most 60 s, else throws with `what` and the logs) until every live node says
  /// cluster_state:ok, agrees on which live nodes serve the 16384 slots, and every live
  /// replica's link to its primary is up.
  void wait_converged(const std::string& what = "the cluster to converge") const {
    wait_for([&] { return converged(); }, what);
  }

  /// Waits for `done()`, polling, at most 60 s; throws naming `what` with the logs.
  void wait_for(const std::function<bool()>& done, const std::string& what) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("timed out waiting for " + what + "\n" + logs());
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  /// Every node's log, for a failure message.
  [[nodiscard]] std::string logs() const {
    std::string out;
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      std::ifstream in(nodes_[i].dir / "redis.log");
      std::stringstream s;
      s << in.rdbuf();
      std::string tail = s.str();
      if (tail.size() > 2000) tail = tail.substr(tail.size() - 2000);
      out += "--- node " + std::to_string(i) + " (" + address(i) + ") ---\n" + tail;
    }
    return out;
  }

 private:
  struct Node {
    int port = 0;
    pid_t pid = 0;
    std::filesystem::path dir;
  };

  static bool bindable(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return false;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    const bool ok = ::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    return ok;
  }
  // n ports whose cluster bus port (+10000) is free too, clear of `taken` and of each other.
  static std::vector<int> free_ports(int n, const std::vector<int>& taken = {}) {
    std::mt19937 pick(static_cast<std::uint32_t>(::getpid()) ^ static_cast<std::uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
    std::vector<int> out;
    const auto clear = [&](int p) {
      for (int q : {p, p - 10000, p + 10000})
        if (std::find(out.begin(), out.end(), q) != out.end() || std::find(taken.begin(), taken.end(), q) != taken.end())
          return false;
      return true;
    };
    for (int tries = 0; static_cast<int>(out.size()) < n && tries < 10000; ++tries) {
      const int p = 20000 + static_cast<int>(pick() % 25000);
      if (clear(p) && bindable(p) && bindable(p + 10000)) out.push_back(p);
    }
    if (static_cast<int>(out.size()) < n) throw std::runtime_error("no free loopback ports for the cluster");
    return out;
  }

  // Starts a node on `port`. Another process can take a port (or its bus port) between
  // free_ports' probe and the server's bind; the server then exits at once, and the node is
  // started again on other free ports, a few times.
  void start_node(int port) {
    for (int attempt = 0;; ++attempt) {
      Node n;
      n.port = port;
      n.dir = dir_ / ("node" + std::to_string(nodes_.size()));
      std::filesystem::create_directories(n.dir);
      std::vector<std::string> args = {server_, "--port", std::to_string(port), "--bind", "127.0.0.1",
                                       "--cluster-enabled", "yes", "--cluster-config-file", (n.dir / "nodes.conf").string(),
                                       "--cluster-node-timeout", std::to_string(spec_.node_timeout_ms),
                                       "--save", "", "--appendonly", "no", "--dir", n.dir.string(),
                                       "--logfile", (n.dir / "redis.log").string(), "--daemonize", "no"};
      if (!spec_.password.empty()) args.insert(args.end(), {"--requirepass", spec_.password, "--masterauth", spec_.password});
      args.insert(args.end(), spec_.extra.begin(), spec_.extra.end());
      n.pid = spawn_quiet(std::move(args));
      if (n.pid <= 0) throw std::runtime_error("cannot start redis-server");
      nodes_.push_back(n);
      const std::size_t i = nodes_.size() - 1;
      bool exited = false;
      wait_for([&] {
        int status = 0;
        if (::waitpid(nodes_[i].pid, &status, WNOHANG) == nodes_[i].pid) return exited = true;
        return command(i, {"PING"}) != nullptr;
      }, "node " + address(i) + " to answer");
      if (!exited) return;
      if (attempt == 4) throw std::runtime_error("node " + address(i) + " exited at start, five times\n" + logs());
      std::error_code ec;
      std::filesystem::remove_all(nodes_[i].dir, ec);  // its nodes.conf names the old port
      nodes_.pop_back();
      std::vector<int> taken;
      for (const Node& other : nodes_) taken.push_back(other.port);
      port = free_ports(1, taken).front();
    }
  }

  void join() {
    if (spec_.primaries == 1) {
      if (text(0, {"CLUSTER", "ADDSLOTSRANGE", "0", "16383"}) != "OK") throw std::runtime_error("CLUSTER ADDSLOTSRANGE refused\n" + logs());
      for (std::size_t i = 1; i < nodes_.size(); ++i) {
        (void)text(i, {"CLUSTER", "MEET", "127.0.0.1", std::to_string(port(0))});
      }
      if (nodes_.size() > 1) {
        const std::string primary = node_id(0);
        wait_for([&] {
          for (std::size_t i = 1; i < nodes_.size(); ++i)
            if (text(i, {"CLUSTER", "REPLICATE", primary}) != "OK") return false;
          return true;
        }, "the replicas to attach");
      }
    } else {
      std::vector<std::string> args = {cli_, "--cluster", "create"};
      for (std::size_t i = 0; i < nodes_.size(); ++i) args.push_back(address(i));
      args.insert(args.end(), {"--cluster-replicas", std::to_string(spec_.replicas_per_primary), "--cluster-yes"});
      if (!spec_.password.empty()) args.insert(args.end(), {"-a", spec_.password, "--no-auth-warning"});
      const std::string out = (dir_ / "create.log").string();
      const pid_t cli = spawn_quiet(args, out);
      if (cli <= 0 || wait_exit(cli, std::chrono::seconds(60)) != 0) {
        std::ifstream in(out);
        std::stringstream s;
        s << in.rdbuf();
        throw std::runtime_error("redis-cli --cluster create failed:\n" + s.str() + logs());
      }
    }
    wait_converged("the new cluster to converge");
  }

  [[nodiscard]] std::string role(std::size_t i) const {
    const detail::redis::Reply r = command(i, {"ROLE"});
    if (!r || r->type != REDIS_REPLY_ARRAY || r->elements == 0 || r->element[0]->type != REDIS_REPLY_STRING) return {};
    return std::string(r->element[0]->str, r->element[0]->len);
  }

  [[nodiscard]] std::size_t index_of(int port) const {
    for (std::size_t i = 0; i < nodes_.size(); ++i)
      if (nodes_[i].port == port) return i;
    return nodes_.size();
  }

  // One live node's view of the slot owners: (first, last, port) per range, sorted.
  [[nodiscard]] std::vector<std::array<long long, 3>> slot_view(std::size_t i) const {
    std::vector<std::array<long long, 3>> out;
    const detail::redis::Reply r = command(i, {"CLUSTER", "SLOTS"});
    if (!r || r->type != REDIS_REPLY_ARRAY) return out;
    for (std::size_t k = 0; k < r->elements; ++k) {
      const redisReply* e = r->element[k];
      out.push_back({e->element[0]->integer, e->element[1]->integer, e->element[2]->element[1]->integer});
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  [[nodiscard]] bool converged() const {
    std::vector<std::array<long long, 3>> first;
    bool have_first = false;
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (!alive(i)) continue;
      if (text(i, {"CLUSTER", "INFO"}).find("cluster_state:ok") == std::string::npos) return false;
      const auto view = slot_view(i);
      long long covered = 0;
      for (const auto& r : view) {
        covered += r[1] - r[0] + 1;
        const std::size_t owner = index_of(static_cast<int>(r[2]));
        if (owner == nodes_.size() || !alive(owner)) return false;
      }
      if (covered != 16384) return false;
      if (have_first && view != first) return false;
      first = view;
      have_first = true;
      const detail::redis::Reply r = command(i, {"ROLE"});
      if (!r || r->type != REDIS_REPLY_ARRAY || r->elements == 0) return false;
      const std::string_view kind(r->element[0]->str, r->element[0]->len);
      if (kind == "slave" && (r->elements < 4 || std::string_view(r->element[3]->str, r->element[3]->len) != "connected"))
        return false;
    }
    return have_first;
  }

  void stop_all() noexcept {
    for (Node& n : nodes_)
      if (n.pid > 0) {
        ::kill(n.pid, SIGCONT);
        ::kill(n.pid, SIGKILL);
        int status = 0;
        ::waitpid(n.pid, &status, 0);
        n.pid = 0;
      }
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }

  RedisClusterSpec spec_;
  std::string server_, cli_;
  std::filesystem::path dir_;
  std::vector<Node> nodes_;
};

}  // namespace kvfuse::testing
