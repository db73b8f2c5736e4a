// kvfuse/tier/detail/redis_connection.hpp — the hiredis plumbing under RedisTier: one
// connection (connect, AUTH, SELECT, timeouts), RESP formatting into a reused buffer, one
// flush and bounded reads (large reads fed to hiredis's reader), and a pool of idle connections.
//
// Internal: not part of the public API (RedisTier is). Needs hiredis (link kvfuse::redis).
//
// Timeouts. The command timeout is set on the socket (SO_RCVTIMEO / SO_SNDTIMEO), so no
// single read or write blocks longer; a whole exchange also carries a deadline of one
// command timeout, checked between reads, so a reply that trickles in cannot stretch a
// call past about twice the timeout. A connection that timed out or failed is never reused:
// replies to its commands may still arrive.
//
// SIGPIPE. hiredis writes with write(2); a peer that died would raise SIGPIPE and kill the
// process. Every write (send, and the setup commands of a new connection) blocks SIGPIPE in
// the calling thread around it and consumes one it raised, so the caller sees EPIPE as a
// failed exchange and the process's signal setup is left alone.
#pragma once

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvfuse::detail::redis {

using Clock = std::chrono::steady_clock;

/// Where and how to connect; built from RedisTierOptions once.
struct Endpoint {
  std::string unix_socket;  ///< non-empty: connect here, not to host:port
  std::string host;
  int port = 6379;
  std::string user;      ///< empty: AUTH <password> (the default user)
  std::string password;  ///< empty: no AUTH
  int db = 0;
  std::chrono::milliseconds connect_timeout{1000};
  std::chrono::milliseconds command_timeout{1000};

  /// "unix:<path>" or "<host>:<port>", for messages. Allocates.
  [[nodiscard]] std::string text() const {
    return unix_socket.empty() ? host + ":" + std::to_string(port) : "unix:" + unix_socket;
  }
};

inline timeval to_timeval(std::chrono::milliseconds ms) noexcept {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

struct ReplyDeleter {
  void operator()(redisReply* r) const noexcept {
    if (r != nullptr) freeReplyObject(r);
  }
};
/// An owned hiredis reply.
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

/// How an exchange with the server went.
enum class Io : std::uint8_t { ok, failed, timed_out };

/// One connection and the buffer its commands are formatted into (kept between calls, so
/// a warm connection formats without allocating).
struct Connection {
  redisContext* ctx = nullptr;
  /// Bytes read from the socket per read(2) (see receive).
  static constexpr std::size_t read_bytes = std::size_t{256} << 10;
  std::string out;      ///< RESP bytes of the commands of the current exchange
  std::vector<char> in;  ///< receive's read buffer (read_bytes once the connection first reads)
  bool reused = false;  ///< handed out by the pool: it may have gone stale while idle
  bool broken = false;  ///< failed or timed out: never reused
  std::uint64_t epoch = 0;  ///< the pool's epoch when it connected (Pool::drop_idle)
  Connection() = default;
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  ~Connection() {
    if (ctx != nullptr) redisFree(ctx);
  }
  [[nodiscard]] bool usable() const noexcept { return ctx != nullptr && ctx->err == 0 && !broken; }
};

/// Blocks SIGPIPE in this thread while alive; on destruction consumes a SIGPIPE raised
/// meanwhile (unless one was already pending) and restores the mask.
class SigpipeBlock {
 public:
  SigpipeBlock() noexcept {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
  }
  SigpipeBlock(const SigpipeBlock&) = delete;
  SigpipeBlock& operator=(const SigpipeBlock&) = delete;
  ~SigpipeBlock() {
    if (!was_pending_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{};
        (void)sigtimedwait(&pipe_, nullptr, &zero);
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t pipe_{}, old_{};
  bool was_pending_ = false;
};

/// Whether the I/O error hiredis just reported on `ctx` was a wait that ran out (the socket
/// timeout: EAGAIN / EWOULDBLOCK on a blocking socket, or ETIMEDOUT) rather than a refusal
/// or a lost peer. Call it right after the failing call, before anything else sets errno.
inline bool timed_out_now(const redisContext* ctx) noexcept {
  const int e = errno;
  return ctx->err == REDIS_ERR_IO && (e == EAGAIN || e == EWOULDBLOCK || e == ETIMEDOUT);
}

/// Runs one command synchronously on a fresh connection during connect (AUTH, SELECT).
/// Returns the reply, or null (with `why`, and `*io` failed or timed_out) on an I/O error.
inline Reply setup_command(redisContext* ctx, std::span<const std::string_view> args, std::string* why, Io* io) {
  std::vector<const char*> argv;
  std::vector<std::size_t> lens;
  for (const std::string_view a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  // A server that dies between accepting the connection and this write would raise SIGPIPE
  // here as in send(): seen killing a test process whose server was killed mid-load while a
  // lane reconnected.
  SigpipeBlock no_sigpipe;
  Reply r(static_cast<redisReply*>(redisCommandArgv(ctx, static_cast<int>(argv.size()), argv.data(), lens.data())));
  if (!r) {
    const bool timed_out = timed_out_now(ctx);
    *io = timed_out ? Io::timed_out : Io::failed;
    if (why != nullptr) *why = timed_out ? "no answer within the command timeout" : ctx->errstr;
  }
  return r;
}

/// A new connection: connect (connect timeout), command timeout on the socket, AUTH,
/// SELECT, PING. Null on any failure, with the reason in `*why` when `why` is given (AUTH's
/// reason never quotes the password) and how it went in `*io` when `io` is given:
/// timed_out when a wait ran out (the connect, or a set-up command's reply: a server that
/// accepts connections but does not answer, such as a stopped process whose kernel still
/// queues them), failed otherwise (refused, no such socket, an error reply, out of memory).
/// Any thread; blocks up to the timeouts; allocates; noexcept.
inline std::unique_ptr<Connection> connect(const Endpoint& ep, std::string* why, Io* io = nullptr) noexcept {
  Io ignored = Io::failed;
  if (io == nullptr) io = &ignored;
  *io = Io::failed;
  try {
    auto conn = std::make_unique<Connection>();
    const timeval ct = to_timeval(ep.connect_timeout);
    conn->ctx = ep.unix_socket.empty() ? redisConnectWithTimeout(ep.host.c_str(), ep.port, ct)
                                       : redisConnectUnixWithTimeout(ep.unix_socket.c_str(), ct);
    if (conn->ctx == nullptr) {
      if (why != nullptr) *why = "out of memory";
      return nullptr;
    }
    if (conn->ctx->err != 0) {
      if (timed_out_now(conn->ctx)) *io = Io::timed_out;
      if (why != nullptr) *why = conn->ctx->errstr;
      return nullptr;
    }
    if (redisSetTimeout(conn->ctx, to_timeval(ep.command_timeout)) != REDIS_OK) {
      if (why != nullptr) *why = std::string("cannot set the command timeout: ") + conn->ctx->errstr;
      return nullptr;
    }
    if (!ep.password.empty()) {
      const std::string_view with_user[] = {"AUTH", ep.user, ep.password};
      const std::string_view without[] = {"AUTH", ep.password};
      Reply r = ep.user.empty() ? setup_command(conn->ctx, without, why, io)
                                : setup_command(conn->ctx, with_user, why, io);
      if (!r) return nullptr;
      if (r->type == REDIS_REPLY_ERROR) {
        if (why != nullptr) *why = "AUTH refused: " + std::string(r->str, r->len);
        return nullptr;
      }
    }
    if (ep.db != 0) {
      const std::string db = std::to_string(ep.db);
      const std::string_view args[] = {"SELECT", db};
      Reply r = setup_command(conn->ctx, args, why, io);
      if (!r) return nullptr;
      if (r->type == REDIS_REPLY_ERROR) {
        if (why != nullptr) *why = "SELECT " + db + " refused: " + std::string(r->str, r->len);
        return nullptr;
      }
    }
    {  // The server answers and lets us in (a server that wants a password refuses PING).
      const std::string_view args[] = {"PING"};
      Reply r = setup_command(conn->ctx, args, why, io);
      if (!r) return nullptr;
      if (r->type == REDIS_REPLY_ERROR) {
        if (why != nullptr) *why = "PING refused: " + std::string(r->str, r->len);
        return nullptr;
      }
    }
    return conn;
  } catch (...) {
    return nullptr;
  }
}

/// Appends `n` in decimal. May throw std::bad_alloc.
inline void append_decimal(std::string& out, std::uint64_t n) {
  char digits[24];
  const auto end = std::to_chars(digits, digits + sizeof digits, n).ptr;
  out.append(digits, static_cast<std::size_t>(end - digits));
}

/// Appends a RESP array header for a command of `args` arguments. May throw std::bad_alloc.
inline void append_command(std::string& out, std::size_t args) {
  out += '*';
  append_decimal(out, args);
  out += "\r\n";
}

/// Appends one bulk string made of `parts` laid end to end. May throw std::bad_alloc.
inline void append_bulk(std::string& out, std::span<const std::string_view> parts) {
  std::size_t n = 0;
  for (const std::string_view p : parts) n += p.size();
  out += '$';
  append_decimal(out, n);
  out += "\r\n";
  for (const std::string_view p : parts) out.append(p);
  out += "\r\n";
}
inline void append_bulk(std::string& out, std::string_view s) { append_bulk(out, std::span<const std::string_view>(&s, 1)); }

/// Writes every byte of `conn.out` (all the exchange's commands: one write for a small
/// batch). Any thread; noexcept.
inline Io send(Connection& conn, Clock::time_point deadline) noexcept {
  if (redisAppendFormattedCommand(conn.ctx, conn.out.data(), conn.out.size()) != REDIS_OK) return Io::failed;
  SigpipeBlock no_sigpipe;
  int done = 0;
  while (done == 0) {
    if (redisBufferWrite(conn.ctx, &done) == REDIS_ERR) {
      const int e = errno;
      return conn.ctx->err == REDIS_ERR_IO && (e == EAGAIN || e == EWOULDBLOCK) ? Io::timed_out : Io::failed;
    }
    if (done == 0 && Clock::now() > deadline) return Io::timed_out;
  }
  return Io::ok;
}

/// Reads the next reply into `out`. timed_out when a read waited the socket timeout or the
/// deadline passed. Any thread; noexcept.
///
/// The socket is read here, up to `read_bytes` per read(2) into the connection's own buffer,
/// and the bytes are handed to hiredis's reader (redisReaderFeed), which parses them as
/// always. redisBufferRead would read 16 KiB at a time: a 16 MiB load is then a thousand
/// system calls, which cost more than checking every byte of it.
inline Io receive(Connection& conn, Clock::time_point deadline, Reply& out) noexcept {
  for (;;) {
    void* raw = nullptr;
    if (redisGetReplyFromReader(conn.ctx, &raw) == REDIS_ERR) return Io::failed;  // protocol error
    if (raw != nullptr) {
      out.reset(static_cast<redisReply*>(raw));
      return Io::ok;
    }
    if (Clock::now() > deadline) return Io::timed_out;
    if (conn.in.empty()) conn.in.resize(Connection::read_bytes);  // first read of this connection
    const ssize_t got = ::read(conn.ctx->fd, conn.in.data(), conn.in.size());
    if (got > 0) {
      if (redisReaderFeed(conn.ctx->reader, conn.in.data(), static_cast<std::size_t>(got)) != REDIS_OK) return Io::failed;
      continue;
    }
    if (got == 0) return Io::failed;  // the server closed the connection
    const int e = errno;
    if (e == EINTR) continue;
    return e == EAGAIN || e == EWOULDBLOCK ? Io::timed_out : Io::failed;  // SO_RCVTIMEO ran out, or an I/O error
  }
}

/// Idle connections, handed out one per caller: a lane owns the connection for the whole
/// exchange, and the lock is held only to pop or push a pointer, never across I/O.
class Pool {
 public:
  Pool(Endpoint endpoint, std::size_t max_idle) : endpoint_(std::move(endpoint)), max_idle_(max_idle) {
    idle_.reserve(max_idle_);
  }

  /// An idle connection (marked reused), or a new one; null if connecting failed or timed
  /// out (counted apart; `*failure` says which). `fresh`: never an idle one. Any thread;
  /// noexcept; connects with no lock held.
  std::unique_ptr<Connection> take(bool fresh, Io* failure) noexcept {
    const std::uint64_t epoch = epoch_.load(std::memory_order_acquire);
    while (!fresh) {
      std::unique_ptr<Connection> conn;
      {
        std::lock_guard lock(mutex_);
        if (idle_.empty()) break;
        conn = std::move(idle_.back());
        idle_.pop_back();
      }
      if (conn->epoch == epoch) {
        conn->reused = true;
        return conn;
      }
      dropped_.fetch_add(1, std::memory_order_relaxed);  // idle since before drop_idle: closed here, no lock held
    }
    std::unique_ptr<Connection> conn = connect(endpoint_, nullptr, failure);
    if (conn) conn->epoch = epoch;
    (conn ? connects_ : *failure == Io::timed_out ? connect_timeouts_ : connect_failures_)
        .fetch_add(1, std::memory_order_relaxed);
    return conn;
  }

  /// Returns a connection: kept if it is usable and there is room, else closed (outside
  /// the lock). Any thread; noexcept; never allocates (the idle list is reserved).
  void give(std::unique_ptr<Connection> conn) noexcept {
    if (!conn) return;
    if (conn->usable()) {
      conn->reused = false;
      std::lock_guard lock(mutex_);
      if (idle_.size() < max_idle_) {
        idle_.push_back(std::move(conn));
        return;
      }
    }
    dropped_.fetch_add(1, std::memory_order_relaxed);
    conn.reset();
  }

  /// Retires every connection idle now (they went stale together: the server restarted);
  /// take closes them as it meets them. Any thread; noexcept; O(1).
  void drop_idle() noexcept { epoch_.fetch_add(1, std::memory_order_acq_rel); }

  [[nodiscard]] const Endpoint& endpoint() const noexcept { return endpoint_; }
  [[nodiscard]] std::uint64_t connects() const noexcept { return connects_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t connect_failures() const noexcept { return connect_failures_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t connect_timeouts() const noexcept { return connect_timeouts_.load(std::memory_order_relaxed); }
  [[nodiscard]] std::uint64_t dropped() const noexcept { return dropped_.load(std::memory_order_relaxed); }
  /// Adopts a connection made elsewhere (the constructor's first one). Counted as a connect.
  void adopt(std::unique_ptr<Connection> conn) noexcept {
    conn->epoch = epoch_.load(std::memory_order_acquire);
    connects_.fetch_add(1, std::memory_order_relaxed);
    give(std::move(conn));
  }

 private:
  Endpoint endpoint_;
  std::size_t max_idle_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<Connection>> idle_;  // guarded by mutex_; capacity max_idle_
  std::atomic<std::uint64_t> epoch_{0};
  std::atomic<std::uint64_t> connects_{0}, connect_failures_{0}, connect_timeouts_{0}, dropped_{0};
};

}  // namespace kvfuse::detail::redis
