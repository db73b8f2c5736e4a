// kvfuse/tier/detail/redis_cluster_legs.hpp — one round of a cluster exchange: the commands
// for each touched primary (a leg) written on its own connection, then every leg's replies
// read as they arrive, whichever node answers first (poll(2) over the legs' sockets), until
// each leg has all of its replies, fails, or the round's deadline passes.
//
// Reading the legs in turn would let one frozen node's timeout run out the deadline of
// every leg behind it, although their replies came long before; polling them together
// bounds the round by one command timeout, and a slow node costs only its own keys.
//
// Internal: not part of the public API (RedisClusterTier is). Needs hiredis.
#pragma once

#include <hiredis/hiredis.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <kvfuse/tier/detail/redis_connection.hpp>

namespace kvfuse::detail::redis {

/// One leg of a round: a connection, the replies it waits for, and how it went.
struct Leg {
  std::unique_ptr<Connection> conn;
  std::size_t expected = 0;  ///< replies its commands will get
  std::size_t received = 0;  ///< replies read so far
  Io io = Io::ok;            ///< failed or timed_out once it stopped short of `expected`
  [[nodiscard]] bool pending() const noexcept { return conn != nullptr && io == Io::ok && received < expected; }
};

/// Reads every pending leg's replies, each handed to on_reply(leg index, reply) in that
/// leg's order, until every leg is complete or stopped: a leg whose socket closes, errs or
/// sends a protocol error stops failed; every leg still short when `deadline` passes stops
/// timed_out. Any thread; noexcept if on_reply is; allocates the poll set.
template <class OnReply>
void receive_legs(std::vector<Leg>& legs, Clock::time_point deadline, OnReply&& on_reply) noexcept {
  std::vector<pollfd> fds;
  std::vector<std::size_t> which;
  try {
    fds.reserve(legs.size());
    which.reserve(legs.size());
  } catch (...) {
    for (Leg& leg : legs)
      if (leg.pending()) leg.io = Io::failed;
    return;
  }
  for (;;) {
    // Hand out every reply already parsed from what was read.
    for (std::size_t l = 0; l < legs.size(); ++l) {
      Leg& leg = legs[l];
      while (leg.pending()) {
        void* raw = nullptr;
        if (redisGetReplyFromReader(leg.conn->ctx, &raw) == REDIS_ERR) {
          leg.io = Io::failed;  // protocol error
          break;
        }
        if (raw == nullptr) break;
        ++leg.received;
        on_reply(l, Reply(static_cast<redisReply*>(raw)));
      }
    }
    fds.clear();
    which.clear();
    for (std::size_t l = 0; l < legs.size(); ++l)
      if (legs[l].pending()) {
        fds.push_back(pollfd{legs[l].conn->ctx->fd, POLLIN, 0});
        which.push_back(l);
      }
    if (fds.empty()) return;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    const int ready = left < 0 ? 0 : ::poll(fds.data(), fds.size(), static_cast<int>(std::min<long long>(left + 1, 1 << 30)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      for (const std::size_t l : which) legs[l].io = ready == 0 ? Io::timed_out : Io::failed;
      return;
    }
    for (std::size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      Leg& leg = legs[which[k]];
      Connection& conn = *leg.conn;
      if (conn.in.empty()) {
        try {
          conn.in.resize(Connection::read_bytes);  // first read of this connection
        } catch (...) {
          leg.io = Io::failed;
          continue;
        }
      }
      const ssize_t got = ::read(conn.ctx->fd, conn.in.data(), conn.in.size());
      if (got > 0) {
        if (redisReaderFeed(conn.ctx->reader, conn.in.data(), static_cast<std::size_t>(got)) != REDIS_OK) leg.io = Io::failed;
      } else if (got == 0) {
        leg.io = Io::failed;  // the node closed the connection (killed)
      } else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
        leg.io = Io::failed;
      }
    }
  }
}

}  // namespace kvfuse::detail::redis
