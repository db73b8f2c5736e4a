// kvfuse/tier/redis_address.hpp — RedisAddress and parse_redis_address: where a Redis
// server (or a Redis Cluster node) listens, spelled `HOST:PORT` or `unix:PATH`.
//
// One spelling for every place an address is written: RedisTierOptions::set_address, the
// seed list of RedisClusterTierOptions, the node a MOVED or ASK reply names, and the
// addresses that CLUSTER SLOTS lists. No hiredis needed.
#pragma once

#include <charconv>
#include <string>
#include <string_view>
#include <system_error>

#include <kvfuse/error.hpp>

namespace kvfuse {

/// A server's address: a unix socket path, or a TCP host and port. Plain data.
struct RedisAddress {
  std::string host;         ///< TCP host (name or address, an IPv6 address without brackets); empty with unix_socket
  int port = 0;             ///< TCP port, 1..65535; 0 with unix_socket
  std::string unix_socket;  ///< non-empty: a unix socket path, and host and port are unused

  /// `unix:<path>`, `<host>:<port>`, or `[<host>]:<port>` for an IPv6 host: what
  /// parse_redis_address reads back to the same address. Any thread; allocates.
  [[nodiscard]] std::string text() const {
    if (!unix_socket.empty()) return "unix:" + unix_socket;
    const bool v6 = host.find(':') != std::string::npos;
    return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
  }
  /// The same host, port and socket, byte for byte (no name resolution). noexcept.
  friend bool operator==(const RedisAddress&, const RedisAddress&) = default;
};

namespace detail::redis {

/// Reads `text` into `out` as parse_redis_address does; returns what is wrong with it
/// ("" when nothing is). Any thread; allocates only `out`'s strings.
inline std::string_view read_address(std::string_view text, RedisAddress& out) {
  out = RedisAddress{};
  if (text.starts_with("unix:")) {
    const std::string_view path = text.substr(5);
    if (path.empty()) return "has an empty socket path";
    if (path.size() > 107) return "has a socket path longer than 107 bytes";
    out.unix_socket = std::string(path);
    return {};
  }
  const std::size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) return "has no port";
  std::string_view host = text.substr(0, colon);
  const std::string_view port = text.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty()) return "has an empty host";
  if (port.empty()) return "has no port";
  int value = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || end != port.data() + port.size()) return "has a port that is not a decimal number";
  if (value < 1 || value > 65535) return "has a port outside [1, 65535]";
  out.host = std::string(host);
  out.port = value;
  return {};
}

/// The message of a bad address: it quoted, what is wrong, what was expected.
inline std::string address_problem(std::string_view text, std::string_view why) {
  return "redis address '" + std::string(text) + "' " + std::string(why) + " (expected HOST:PORT or unix:PATH)";
}

}  // namespace detail::redis

/// Reads `unix:PATH` (PATH non-empty, at most 107 bytes) or `HOST:PORT` (HOST non-empty,
/// `[v6]` brackets allowed, PORT decimal in [1, 65535]; the last ':' splits, so a bare IPv6
/// address with a port also reads). Throws Error(invalid_argument) quoting `text` and
/// saying what is wrong with it. Any thread; allocates.
[[nodiscard]] inline RedisAddress parse_redis_address(std::string_view text) {
  RedisAddress out;
  if (const std::string_view why = detail::redis::read_address(text, out); !why.empty())
    throw Error(ErrorCode::invalid_argument, detail::redis::address_problem(text, why));
  return out;
}

}  // namespace kvfuse
