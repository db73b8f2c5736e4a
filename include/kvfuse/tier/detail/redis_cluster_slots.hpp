// kvfuse/tier/detail/redis_cluster_slots.hpp — what a Redis Cluster client must know about
// slots: the slot of a key (CRC16/XMODEM of the key, or of its hash tag, modulo 16384), the
// MOVED and ASK redirections, and the slot ranges CLUSTER SLOTS lists.
//
// Internal: not part of the public API (RedisClusterTier is). Needs hiredis for the reply
// types.
#pragma once

#include <hiredis/hiredis.h>

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <kvfuse/tier/redis_address.hpp>

namespace kvfuse::detail::redis {

/// Hash slots of a Redis Cluster.
inline constexpr std::size_t slot_count = 16384;

/// CRC16/XMODEM (polynomial 0x1021, initial 0), the checksum Redis Cluster hashes keys with.
/// Any thread; constexpr; noexcept.
constexpr std::uint16_t crc16(std::string_view bytes) noexcept {
  constexpr auto table = [] {
    std::array<std::uint16_t, 256> t{};
    for (unsigned i = 0; i < 256; ++i) {
      auto c = static_cast<std::uint16_t>(i << 8);
      for (int b = 0; b < 8; ++b) c = static_cast<std::uint16_t>((c & 0x8000) != 0 ? (c << 1) ^ 0x1021 : c << 1);
      t[i] = c;
    }
    return t;
  }();
  std::uint16_t crc = 0;
  for (const char ch : bytes)
    crc = static_cast<std::uint16_t>((crc << 8) ^ table[((crc >> 8) ^ static_cast<unsigned char>(ch)) & 0xff]);
  return crc;
}

/// The slot of `key`: when the key holds a '{' followed later by a '}' with at least one
/// byte between the first '{' and the first '}' after it, only those bytes are hashed (the
/// hash tag, which lets keys share a slot); otherwise the whole key. Any thread; constexpr;
/// noexcept.
constexpr std::uint16_t key_slot(std::string_view key) noexcept {
  const std::size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const std::size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return static_cast<std::uint16_t>(crc16(key) % slot_count);
}

static_assert(crc16("123456789") == 0x31c3, "CRC16/XMODEM's check value");
static_assert(key_slot("foo") == 12182 && key_slot("{user1000}.following") == key_slot("user1000") &&
                  key_slot("foo{}{bar}") == crc16("foo{}{bar}") % slot_count && key_slot("foo{{bar}}zap") == key_slot("{bar"),
              "the slots Redis's cluster specification gives");

/// A redirection an error reply carries.
struct Redirect {
  enum Kind : std::uint8_t { none, moved, ask } kind = none;
  std::uint16_t slot = 0;
  RedisAddress to;  ///< the node that serves the slot (MOVED) or this key for now (ASK)
};

/// Reads `MOVED <slot> <host>:<port>` or `ASK <slot> <host>:<port>`; kind none for any
/// other error text (or an unreadable one). An empty host (a node that does not know its
/// own address) becomes `asked`'s host. Any thread; allocates the address.
inline Redirect parse_redirect(std::string_view error, const RedisAddress& asked) {
  Redirect r;
  Redirect::Kind kind = Redirect::none;
  if (error.starts_with("MOVED ")) kind = Redirect::moved, error.remove_prefix(6);
  else if (error.starts_with("ASK ")) kind = Redirect::ask, error.remove_prefix(4);
  else return r;
  const std::size_t space = error.find(' ');
  if (space == std::string_view::npos) return r;
  unsigned slot = 0;
  const auto [end, ec] = std::from_chars(error.data(), error.data() + space, slot);
  if (ec != std::errc() || end != error.data() + space || slot >= slot_count) return r;
  std::string_view where = error.substr(space + 1);
  std::string host_fill;
  if (where.starts_with(":")) {  // ":6380": the host is the one asked
    host_fill = asked.host + std::string(where);
    where = host_fill;
  }
  if (!read_address(where, r.to).empty() || !r.to.unix_socket.empty()) return Redirect{};
  r.kind = kind;
  r.slot = static_cast<std::uint16_t>(slot);
  return r;
}

/// One range of CLUSTER SLOTS: slots [first, last] and the primary serving them.
struct SlotRange {
  std::uint16_t first = 0, last = 0;
  RedisAddress primary;
};

/// The ranges of a CLUSTER SLOTS reply (`[[first, last, [host, port, id, ...], replicas...],
/// ...]`); false when the reply is not that shape (an error: not in cluster mode, NOAUTH).
/// A primary listed with an empty host is at `asked`'s host; one with host "?" (its address
/// unknown to the node asked) is left out, so its slots stay unserved until a later map.
/// Any thread; allocates.
inline bool parse_cluster_slots(const redisReply& reply, const RedisAddress& asked, std::vector<SlotRange>& out) {
  out.clear();
  if (reply.type != REDIS_REPLY_ARRAY) return false;
  for (std::size_t i = 0; i < reply.elements; ++i) {
    const redisReply* e = reply.element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
        e->element[1]->type != REDIS_REPLY_INTEGER || e->element[2]->type != REDIS_REPLY_ARRAY ||
        e->element[2]->elements < 2)
      return false;
    const long long first = e->element[0]->integer, last = e->element[1]->integer;
    if (first < 0 || last < first || last >= static_cast<long long>(slot_count)) return false;
    const redisReply* node = e->element[2];
    if (node->element[0]->type != REDIS_REPLY_STRING || node->element[1]->type != REDIS_REPLY_INTEGER) return false;
    const std::string_view host(node->element[0]->str, node->element[0]->len);
    const long long port = node->element[1]->integer;
    if (host == "?" || port < 1 || port > 65535) continue;
    SlotRange range;
    range.first = static_cast<std::uint16_t>(first);
    range.last = static_cast<std::uint16_t>(last);
    range.primary.host = host.empty() ? asked.host : std::string(host);
    range.primary.port = static_cast<int>(port);
    if (range.primary.host.empty()) continue;  // asked over a unix socket and told "": no address to use
    out.push_back(std::move(range));
  }
  return true;
}

}  // namespace kvfuse::detail::redis
