// kvfuse-replay: a rank process's setup and its bytes (child_setup.hpp).
#include "child_setup.hpp"

#include "byte_encoding.hpp"

#include <chrono>
#include <utility>

namespace replay {

#if KVFUSE_REPLAY_WITH_REDIS
namespace {

// The options every Redis tier shares (RedisClientOptions), in one order for both ways.
void write_client(ByteWriter& w, const kvfuse::RedisClientOptions& r) {
  w.text(r.user);
  w.text(r.password);
  w.value(r.db);
  w.text(r.key_prefix);
  w.value(static_cast<std::int64_t>(r.ttl.count()));
  w.value(static_cast<std::int64_t>(r.connect_timeout.count()));
  w.value(static_cast<std::int64_t>(r.command_timeout.count()));
  w.value(static_cast<std::uint64_t>(r.max_idle_connections));
}

void read_client(ByteReader& rd, kvfuse::RedisClientOptions& r) {
  r.user = rd.text();
  r.password = rd.text();
  r.db = rd.value<int>();
  r.key_prefix = rd.text();
  r.ttl = std::chrono::milliseconds(rd.value<std::int64_t>());
  r.connect_timeout = std::chrono::milliseconds(rd.value<std::int64_t>());
  r.command_timeout = std::chrono::milliseconds(rd.value<std::int64_t>());
  r.max_idle_connections = static_cast<std::size_t>(rd.value<std::uint64_t>());
}

}  // namespace
#endif

std::vector<std::byte> ChildSetup::encode() const {
  ByteWriter w;
  w.text(segment);
  w.text(model);
  w.value(rank);
  w.value(ranks.model);
  w.value(ranks.world);
  w.value(ranks.num_blocks);
  w.value(ranks.num_slots);
  w.value(ranks.max_chunks_per_load);
  w.value(static_cast<std::uint64_t>(ranks.slot_bytes));
  w.value(static_cast<std::uint64_t>(ranks.tier));
  w.value(static_cast<std::uint64_t>(tier.memory_bytes));
  w.text(tier.dir.string());
  w.text(tier.pass);
#if KVFUSE_REPLAY_WITH_REDIS
  w.value(static_cast<std::uint8_t>(tier.redis.has_value()));
  if (tier.redis) {
    const kvfuse::RedisTierOptions& r = *tier.redis;
    w.text(r.host);
    w.value(r.port);
    w.text(r.unix_socket);
    write_client(w, r);
  }
  w.value(static_cast<std::uint8_t>(tier.redis_cluster.has_value()));
  if (tier.redis_cluster) {
    const kvfuse::RedisClusterTierOptions& c = *tier.redis_cluster;
    w.value(static_cast<std::uint32_t>(c.seeds.size()));
    for (const kvfuse::RedisAddress& a : c.seeds) w.text(a.text());
    w.value(static_cast<std::int64_t>(c.refresh_interval.count()));
    write_client(w, c);
  }
#else
  w.value(std::uint8_t{0});
  w.value(std::uint8_t{0});
#endif
  return std::move(w.out);
}

ChildSetup ChildSetup::decode(std::span<const std::byte> bytes) {
  ByteReader rd{bytes};
  ChildSetup s;
  s.segment = rd.text();
  s.model = rd.text();
  s.rank = rd.value<std::uint32_t>();
  s.ranks.model = rd.value<std::uint64_t>();
  s.ranks.world = rd.value<std::uint32_t>();
  s.ranks.num_blocks = rd.value<std::uint32_t>();
  s.ranks.num_slots = rd.value<std::uint32_t>();
  s.ranks.max_chunks_per_load = rd.value<std::uint32_t>();
  s.ranks.slot_bytes = static_cast<std::size_t>(rd.value<std::uint64_t>());
  s.ranks.tier = static_cast<std::size_t>(rd.value<std::uint64_t>());
  s.tier.memory_bytes = static_cast<std::size_t>(rd.value<std::uint64_t>());
  s.tier.dir = rd.text();
  s.tier.pass = rd.text();
  if (rd.value<std::uint8_t>() != 0) {
#if KVFUSE_REPLAY_WITH_REDIS
    kvfuse::RedisTierOptions r;
    r.host = rd.text();
    r.port = rd.value<int>();
    r.unix_socket = rd.text();
    read_client(rd, r);
    s.tier.redis = r;
#else
    throw InputError("rank process setup: a redis tier, but this binary has no redis");
#endif
  }
  if (rd.value<std::uint8_t>() != 0) {
#if KVFUSE_REPLAY_WITH_REDIS
    kvfuse::RedisClusterTierOptions c;
    for (auto n = rd.value<std::uint32_t>(); n > 0; --n) c.seeds.push_back(kvfuse::parse_redis_address(rd.text()));
    c.refresh_interval = std::chrono::milliseconds(rd.value<std::int64_t>());
    read_client(rd, c);
    s.tier.redis_cluster = c;
#else
    throw InputError("rank process setup: a redis cluster tier, but this binary has no redis");
#endif
  }
  if (!rd.in.empty() || s.rank >= s.ranks.world || s.ranks.tier >= tier_count)
    throw InputError("rank process setup: rank " + std::to_string(s.rank) + " of " + std::to_string(s.ranks.world) +
                     ", tier " + std::to_string(s.ranks.tier) + ", " + std::to_string(rd.in.size()) + " bytes left over");
  return s;
}

}  // namespace replay
