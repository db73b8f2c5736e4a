// Helpers for tests and benchmarks that start programs of their own (redis-server,
// redis-cli): find one on PATH, spawn it with its output away from the test's, wait for it
// with a bound. No doctest: the benchmarks use it too.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace kvfuse::testing {

/// The executable `name` on PATH (or in /usr/sbin, /usr/bin, /usr/local/bin), or "".
inline std::string find_executable(const std::string& name) {
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH")) {
    std::stringstream in(path);
    for (std::string dir; std::getline(in, dir, ':');) dirs.push_back(dir);
  }
  dirs.insert(dirs.end(), {"/usr/sbin", "/usr/bin", "/usr/local/bin"});
  for (const std::string& dir : dirs) {
    const std::string candidate = dir + "/" + name;
    if (!dir.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return {};
}

/// Starts `args[0]` with `args`, stdin from /dev/null and stdout and stderr to `output`
/// (/dev/null when empty): a server must not hold the test's stdout open. Returns its pid,
/// or 0 if it could not be started.
inline pid_t spawn_quiet(std::vector<std::string> args, const std::string& output = {}) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 0, "/dev/null", O_RDONLY, 0);
  const std::string out = output.empty() ? "/dev/null" : output;
  posix_spawn_file_actions_addopen(&files, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&files, 1, 2);
  pid_t pid = 0;
  const int spawned = ::posix_spawn(&pid, argv[0], &files, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  return spawned == 0 ? pid : 0;
}

/// Waits for `pid` to exit, at most `limit`; its exit status, or -1 if it had to be killed
/// (or was not a child).
inline int wait_exit(pid_t pid, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (r < 0) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace kvfuse::testing
