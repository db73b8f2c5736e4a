// kvfuse/tier/detail/redis_entry.hpp — what a kvfuse entry looks like in Redis, for
// RedisTier and RedisClusterTier alike: the key (`<prefix><stem>`, the DiskTier file name
// without ".kvt"), the value (a DiskTier file byte for byte), the commands that carry them
// (GET, SET ... [PX], EXISTS, DEL) and the verdict on a value read back. One spelling and
// one check, so a value one tier writes is exactly what the other reads.
//
// Internal: not part of the public API. Needs hiredis (link kvfuse::redis).
#pragma once

#include <hiredis/hiredis.h>

#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <kvfuse/tier/detail/redis_connection.hpp>
#include <kvfuse/tier/disk_format.hpp>
#include <kvfuse/tier/redis_address.hpp>
#include <kvfuse/tier/redis_client_options.hpp>
#include <kvfuse/tier/tier.hpp>

namespace kvfuse::detail::redis {

/// The kinds that have a key. Any thread; noexcept.
inline bool valid_kind(EntryKind kind) noexcept { return kind == EntryKind::kv_chunk || kind == EntryKind::state; }

/// Bytes as chars, for RESP formatting. noexcept.
template <class Bytes>
std::string_view as_chars(const Bytes& b) noexcept {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

/// The longest redis key kvfuse spells: a 200-byte prefix and a stem.
inline constexpr std::size_t max_key_bytes = 200 + 64;

/// Writes `prefix` + the stem of `key` into `out` (max_key_bytes); returns the key's
/// length, 0 for a kind without a key. Any thread; noexcept; never allocates.
inline std::size_t format_key(std::string_view prefix, const TierKey& key, char (&out)[max_key_bytes]) noexcept {
  char name[64];
  if (prefix.size() > 200 || !disk::format_name(key, name)) return 0;
  std::memcpy(out, prefix.data(), prefix.size());
  std::memcpy(out + prefix.size(), name, disk::stem_length);
  return prefix.size() + disk::stem_length;
}

/// The key a redis key spells, if it is `prefix` + an entry stem. Any thread; noexcept.
inline std::optional<TierKey> parse_key(std::string_view prefix, std::string_view name) noexcept {
  if (!name.starts_with(prefix)) return std::nullopt;
  name.remove_prefix(prefix.size());
  if (name.size() != disk::stem_length) return std::nullopt;
  char file[64];
  std::memcpy(file, name.data(), name.size());
  std::memcpy(file + name.size(), disk::name_suffix.data(), disk::name_suffix.size());
  return disk::parse_name(std::string_view(file, disk::name_length));
}

/// Appends `<command> <key>` (GET, EXISTS, DEL). Precondition: valid_kind(key.kind). May
/// throw std::bad_alloc.
inline void append_key_command(std::string& cmd, std::string_view command, std::string_view prefix, const TierKey& key) {
  char name[max_key_bytes];
  const std::size_t n = format_key(prefix, key, name);
  append_command(cmd, 2);
  append_bulk(cmd, command);
  append_bulk(cmd, std::string_view(name, n));
}

/// Appends `SET <key> <header><bytes> [PX <ttl>]`: the value is the DiskTier entry of
/// `key`. Precondition: valid_kind(key.kind). May throw std::bad_alloc.
inline void append_set(std::string& cmd, std::string_view prefix, const TierKey& key, std::span<const std::byte> bytes,
                       std::chrono::milliseconds ttl) {
  const disk::HeaderBytes header = disk::encode_entry_header(key, bytes);
  char name[max_key_bytes];
  const std::size_t n = format_key(prefix, key, name);
  const bool expires = ttl.count() > 0;
  append_command(cmd, expires ? 5 : 3);
  append_bulk(cmd, "SET");
  append_bulk(cmd, std::string_view(name, n));
  const std::string_view value[] = {as_chars(header), as_chars(bytes)};
  append_bulk(cmd, value);
  if (expires) {
    append_bulk(cmd, "PX");
    char digits[24];
    const auto end = std::to_chars(digits, digits + sizeof digits, ttl.count()).ptr;
    append_bulk(cmd, std::string_view(digits, static_cast<std::size_t>(end - digits)));
  }
}

/// Whether a reply confirms a SET. noexcept.
inline bool set_confirmed(const redisReply& r) noexcept {
  return r.type == REDIS_REPLY_STATUS && std::string_view(r.str, r.len) == "OK";
}

/// What a GET's reply says about an entry.
enum class Verdict : std::uint8_t {
  hit,       ///< the value is `key`'s entry; payload() is its payload
  miss,      ///< nil: no value under the key
  rejected,  ///< a value that fails the entry check (foreign, truncated, corrupt, another key's, another type)
  error,     ///< an error reply other than WRONGTYPE (LOADING, BUSY, MOVED, CLUSTERDOWN, ...): the server may have it
};

/// The verdict on a GET reply for `key`, and a hit's payload (inside the reply).
struct Judged {
  Verdict verdict = Verdict::miss;
  std::span<const std::byte> payload;
};

/// Judges a GET reply for `key` by the DiskTier entry check. Any thread; noexcept.
inline Judged judge_value(const redisReply& reply, const TierKey& key) noexcept {
  if (reply.type == REDIS_REPLY_NIL) return {Verdict::miss, {}};
  if (reply.type == REDIS_REPLY_STRING) {
    const auto value = std::span<const std::byte>(reinterpret_cast<const std::byte*>(reply.str), reply.len);
    const disk::CheckedEntry entry = disk::check_entry(value, key);
    if (entry.ok()) return {Verdict::hit, entry.payload};
  } else if (reply.type == REDIS_REPLY_ERROR && !std::string_view(reply.str, reply.len).starts_with("WRONGTYPE")) {
    return {Verdict::error, {}};
  }
  return {Verdict::rejected, {}};
}

/// Frees a hiredis reply: the release hook of a hit view that points into its reply.
inline void release_reply(void*, void* reply) noexcept { freeReplyObject(reply); }

/// The connection settings of `o` for the server at `a`. Allocates.
inline Endpoint endpoint_of(const RedisClientOptions& o, const RedisAddress& a) {
  return {a.unix_socket, a.host, a.port, o.user, o.password, o.db, o.connect_timeout, o.command_timeout};
}

}  // namespace kvfuse::detail::redis
