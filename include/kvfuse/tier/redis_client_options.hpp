// kvfuse/tier/redis_client_options.hpp — RedisClientOptions: how kvfuse talks to a Redis
// server once it knows where it is (AUTH, key prefix, TTL, timeouts, pooled connections),
// shared by RedisTierOptions (one server) and RedisClusterTierOptions (a cluster's nodes),
// and the one check both run on them. No hiredis needed.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>

#include <kvfuse/error.hpp>

namespace kvfuse {

/// What every connection of a Redis tier uses, wherever it connects. Plain data; checked by
/// the tier's constructor.
struct RedisClientOptions {
  std::string user;                    ///< ACL user for AUTH; empty: the default user
  std::string password;                ///< AUTH on every connection when non-empty
  int db = 0;                          ///< SELECT this database (0..) on every connection; a cluster has only 0
  std::string key_prefix = "kvfuse:";  ///< every key starts with it; at most 200 bytes, no glob or space characters
  std::chrono::milliseconds ttl{0};    ///< expiry of every entry put (SET ... PX); 0: no expiry
  std::chrono::milliseconds connect_timeout{1000};
  std::chrono::milliseconds command_timeout{1000};
  std::size_t max_idle_connections = 16;  ///< pooled connections kept open per server (one per lane is enough)
};

namespace detail::redis {

/// Throws Error(invalid_argument) "<owner>.<field> ..." naming the first bad value of `o`
/// (negative db, a prefix over 200 bytes or holding a glob, space or control character, a
/// negative TTL, a timeout <= 0, no idle connections). Any thread; allocates on failure.
inline void check_client_options(const RedisClientOptions& o, std::string_view owner) {
  auto bad = [&](const std::string& what) { throw Error(ErrorCode::invalid_argument, std::string(owner) + "." + what); };
  if (o.db < 0) bad("db (" + std::to_string(o.db) + ") is negative");
  if (o.key_prefix.size() > 200) bad("key_prefix '" + o.key_prefix + "' is longer than 200 bytes");
  for (const char c : o.key_prefix)
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\' || static_cast<unsigned char>(c) <= ' ' || c == 0x7f)
      bad("key_prefix '" + o.key_prefix + "' holds a glob, space or control character");
  if (o.ttl.count() < 0) bad("ttl (" + std::to_string(o.ttl.count()) + " ms) is negative");
  if (o.connect_timeout.count() <= 0)
    bad("connect_timeout (" + std::to_string(o.connect_timeout.count()) + " ms) is not positive");
  if (o.command_timeout.count() <= 0)
    bad("command_timeout (" + std::to_string(o.command_timeout.count()) + " ms) is not positive");
  if (o.max_idle_connections == 0) bad("max_idle_connections (0) is not positive");
}

}  // namespace detail::redis
}  // namespace kvfuse
