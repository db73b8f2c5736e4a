// A redis-server of the test's own: started on a unix socket in a temporary directory (TCP
// off with --port 0, no persistence), killed, paused, restarted empty, stopped at the end.
// When redis-server is not installed the test FAILS with the install line; it never skips.
#pragma once

#include <doctest/doctest.h>

#include <hiredis/hiredis.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <kvfuse/tier/redis_tier.hpp>

#include "process_support.hpp"
#include "test_support.hpp"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#ifndef KVFUSE_REDIS_INSTALL
#define KVFUSE_REDIS_INSTALL "apt-get install -y libhiredis-dev redis-server"
#endif

namespace kvfuse::testing {

/// The redis-server executable on PATH (or in /usr/sbin, /usr/bin), or "".
inline std::string find_redis_server() { return find_executable("redis-server"); }

/// One redis-server process for one test.
class RedisServer {
 public:
  /// Starts redis-server with the base arguments plus `extra` ("--maxmemory", "2mb", ...).
  explicit RedisServer(std::vector<std::string> extra = {}) : extra_(std::move(extra)), dir_("kvfuse-redis") {
    executable_ = find_redis_server();
    if (executable_.empty()) FAIL("redis-server is not installed. Run, as root: " KVFUSE_REDIS_INSTALL);
    socket_ = (dir_.path / "redis.sock").string();
    start();
  }
  ~RedisServer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGCONT);
      ::kill(pid_, SIGTERM);
      reap();
    }
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  /// Starts a fresh, empty server on the same socket (after kill or stop).
  void start() {
    REQUIRE(pid_ <= 0);
    std::vector<std::string> args = {executable_, "--port", "0", "--unixsocket", socket_, "--unixsocketperm", "700",
                                     "--save", "", "--appendonly", "no", "--dir", dir_.path.string(),
                                     "--logfile", (dir_.path / "redis.log").string(), "--daemonize", "no"};
    args.insert(args.end(), extra_.begin(), extra_.end());
    std::filesystem::remove(socket_);
    const pid_t pid = spawn_quiet(std::move(args));  // its output goes to its log file
    REQUIRE(pid > 0);
    pid_ = pid;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!answers()) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        FAIL("redis-server exited at start-up; its log:\n" << log());
      }
      if (std::chrono::steady_clock::now() > deadline) {
        kill();
        FAIL("redis-server did not answer within 10 s; its log:\n" << log());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  /// SIGKILL: the process dies at once, its data with it.
  void kill() {
    REQUIRE(pid_ > 0);
    ::kill(pid_, SIGKILL);
    reap();
  }
  /// SIGKILL, then a fresh empty server on the same socket.
  void restart_empty() {
    kill();
    start();
  }
  /// SIGSTOP / SIGCONT: the server stops answering but keeps its connections.
  void pause() { ::kill(pid_, SIGSTOP); }
  void resume() { ::kill(pid_, SIGCONT); }

  [[nodiscard]] const std::string& socket() const { return socket_; }

  /// RedisTier options for this server: its socket, short timeouts.
  [[nodiscard]] RedisTierOptions options(std::string prefix = "kvfuse-test:") const {
    RedisTierOptions o;
    o.unix_socket = socket_;
    o.key_prefix = std::move(prefix);
    o.connect_timeout = std::chrono::milliseconds(500);
    o.command_timeout = std::chrono::milliseconds(500);
    return o;
  }

  /// Runs one command on a fresh connection of the test's own; null if it could not.
  [[nodiscard]] detail::redis::Reply command(std::initializer_list<std::string_view> args) const {
    const timeval two_seconds{2, 0};
    redisContext* ctx = redisConnectUnixWithTimeout(socket_.c_str(), two_seconds);
    if (ctx == nullptr) return nullptr;
    if (ctx->err == 0) redisSetTimeout(ctx, two_seconds);
    detail::redis::Reply reply;
    if (ctx->err == 0) {
      std::vector<const char*> argv;
      std::vector<std::size_t> lens;
      for (const std::string_view a : args) {
        argv.push_back(a.data());
        lens.push_back(a.size());
      }
      reply.reset(static_cast<redisReply*>(redisCommandArgv(ctx, static_cast<int>(argv.size()), argv.data(), lens.data())));
    }
    redisFree(ctx);
    return reply;
  }

  /// The server's log so far.
  [[nodiscard]] std::string log() const {
    std::ifstream in(dir_.path / "redis.log");
    std::stringstream out;
    out << in.rdbuf();
    return out.str();
  }

 private:
  // Whether the server answers at all (PONG, or NOAUTH when it wants a password).
  bool answers() const { return command({"PING"}) != nullptr; }
  void reap() {
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = 0;
  }

  std::vector<std::string> extra_;
  TempDir dir_;
  std::string executable_;
  std::string socket_;
  pid_t pid_ = 0;
};

}  // namespace kvfuse::testing
