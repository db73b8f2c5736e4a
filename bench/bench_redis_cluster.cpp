// RedisClusterTier against RedisTier, same values, same run (bench/README.md).
//
//   BM_ClusterBatch/chunk_KiB:<16|256>
//       One 64-chunk get_batch from a 3-primary cluster (the chunks spread over the three
//       by their slots: three exchanges written at once, then read as they come), against
//       the same 64 chunks from one RedisTier node (one exchange). Both sides run in every
//       iteration, either first by turns; each ratio uses the median of each side. Counters:
//       cluster_over_single (time ratio = cluster time / single-node time, target <= 1.3),
//       round_trips_per_batch (the cluster tier's own count), nodes_touched (the primaries the
//       64 keys map to: the two must be equal), the two medians.
//   BM_ClusterRouting/chunk_KiB:<16|256>
//       The added cost of routing: a cluster tier over a cluster whose one primary holds every
//       slot, against a RedisTier on that same node, same 64 chunks. Counter:
//       cluster_over_single_throughput (single-node time / cluster time, target >= 0.9).
//
// The single node is the one-primary cluster's node in both rows (a cluster-mode
// redis-server answers single-key GETs as a plain one does), so each pair of sides reads
// from servers started the same way, on loopback TCP. On a shared 2-vCPU machine the three
// primaries, the single node and the benchmark share two cores: absolute scaling is not the
// figure, the round-trip count and the per-batch ratio are.
//
// The benchmark starts its own clusters (tests/redis_cluster.hpp: redis-server and
// redis-cli on PATH) and stops them at the end; without them every row reports an error.
//
// Run: kvfuse_bench_redis_cluster --benchmark_min_time=0.5
#include <benchmark/benchmark.h>

#include <kvfuse/tier/redis_cluster_tier.hpp>
#include <kvfuse/tier/redis_tier.hpp>

#include "redis_cluster.hpp"

#include <algorithm>
#include <chrono>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

using namespace kvfuse;
using namespace kvfuse::testing;

namespace {

constexpr std::size_t kChunks = 64;

/// The run's two clusters: three primaries, and one primary holding every slot.
struct Clusters {
  std::unique_ptr<RedisCluster> three, one;
  std::string error;
  Clusters() {
    try {
      three = std::make_unique<RedisCluster>(RedisClusterSpec{3, 0, "", 5000, {}});
      one = std::make_unique<RedisCluster>(RedisClusterSpec{1, 0, "", 5000, {}});
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
};

Clusters& clusters() {
  static Clusters c;
  return c;
}

struct Samples {
  std::vector<double> s;
  void add(std::chrono::steady_clock::duration d) { s.push_back(std::chrono::duration<double>(d).count()); }
  [[nodiscard]] double median() {
    if (s.empty()) return 0;
    std::nth_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(s.size() / 2), s.end());
    return s[s.size() / 2];
  }
};

TierKey first_key(std::uint64_t model) { return TierKey{model, PrefixHash{}, 1, 0, EntryKind::kv_chunk}; }

std::vector<PrefixHash> hashes_of(std::uint64_t base) {
  std::vector<PrefixHash> out;
  for (std::size_t i = 0; i < kChunks; ++i) out.push_back(PrefixHash{base + i * 0x9e3779b97f4a7c15ULL});
  return out;
}

/// Times one get_batch of `hashes` into `views`, then drops the views (both sides alike).
template <class T>
std::chrono::steady_clock::duration timed_batch(T& tier, const TierKey& first, const std::vector<PrefixHash>& hashes,
                                                std::vector<TierView>& views, bool& all_hit) {
  const auto start = std::chrono::steady_clock::now();
  tier.get_batch(first, hashes, views);
  for (const TierView& v : views) all_hit = all_hit && v.hit();
  for (TierView& v : views) v = TierView{};
  return std::chrono::steady_clock::now() - start;
}

/// Puts the 64 chunks in `tier`.
template <class T>
bool fill(T& tier, const TierKey& first, const std::vector<PrefixHash>& hashes, std::size_t bytes) {
  std::vector<std::byte> payload(bytes);
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 31 + 7);
  for (const PrefixHash h : hashes) {
    TierKey k = first;
    k.hash = h;
    if (!tier.put(k, payload)) return false;
  }
  return true;
}

RedisTier single_tier(const RedisCluster& node, const std::string& prefix) {
  RedisTierOptions o;
  o.set_address(node.address(0));
  o.key_prefix = prefix;
  return RedisTier(o);
}

RedisClusterTierOptions cluster_options(const RedisCluster& c, const std::string& prefix) {
  RedisClusterTierOptions o = c.options(prefix);
  o.connect_timeout = std::chrono::milliseconds(2000);
  o.command_timeout = std::chrono::milliseconds(2000);
  return o;
}

void BM_ClusterBatch(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) << 10;
  if (!clusters().error.empty()) {
    state.SkipWithError(clusters().error.c_str());
    return;
  }
  const std::string prefix = "bench-batch-" + std::to_string(bytes) + ":";
  RedisClusterTier cluster(cluster_options(*clusters().three, prefix));
  RedisTier single = single_tier(*clusters().one, prefix);
  const TierKey first = first_key(11);
  const std::vector<PrefixHash> hashes = hashes_of(bytes);
  if (!fill(cluster, first, hashes, bytes) || !fill(single, first, hashes, bytes)) {
    state.SkipWithError("a put failed");
    return;
  }
  std::set<std::string> owners;
  for (const PrefixHash h : hashes) {
    TierKey k = first;
    k.hash = h;
    owners.insert(cluster.owner_of(cluster.slot_of(k)));
  }
  std::vector<TierView> views(kChunks);
  Samples cluster_time, single_time;
  bool all_hit = true;
  const std::uint64_t trips_before = cluster.stats().totals.round_trips;
  std::uint64_t batches = 0;
  for (auto _ : state) {
    // Either side first by turns: the second reads values the first just warmed.
    if (batches % 2 == 0) {
      cluster_time.add(timed_batch(cluster, first, hashes, views, all_hit));
      single_time.add(timed_batch(single, first, hashes, views, all_hit));
    } else {
      single_time.add(timed_batch(single, first, hashes, views, all_hit));
      cluster_time.add(timed_batch(cluster, first, hashes, views, all_hit));
    }
    ++batches;
  }
  if (!all_hit) state.SkipWithError("a get missed");
  const double trips = static_cast<double>(cluster.stats().totals.round_trips - trips_before) / static_cast<double>(batches);
  const double c = cluster_time.median(), s = single_time.median();
  state.counters["cluster_over_single"] = c / s;
  state.counters["round_trips_per_batch"] = trips;
  state.counters["nodes_touched"] = static_cast<double>(owners.size());
  state.counters["cluster_median_us"] = c * 1e6;
  state.counters["single_median_us"] = s * 1e6;
}

void BM_ClusterRouting(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) << 10;
  if (!clusters().error.empty()) {
    state.SkipWithError(clusters().error.c_str());
    return;
  }
  const std::string prefix = "bench-routing-" + std::to_string(bytes) + ":";
  RedisClusterTier cluster(cluster_options(*clusters().one, prefix));
  RedisTier single = single_tier(*clusters().one, prefix);  // the same node, the same keys
  const TierKey first = first_key(12);
  const std::vector<PrefixHash> hashes = hashes_of(bytes + 1);
  if (!fill(cluster, first, hashes, bytes)) {
    state.SkipWithError("a put failed");
    return;
  }
  std::vector<TierView> views(kChunks);
  Samples cluster_time, single_time;
  bool all_hit = true;
  std::uint64_t batches = 0;
  for (auto _ : state) {
    if (batches++ % 2 == 0) {  // either side first by turns, as above
      cluster_time.add(timed_batch(cluster, first, hashes, views, all_hit));
      single_time.add(timed_batch(single, first, hashes, views, all_hit));
    } else {
      single_time.add(timed_batch(single, first, hashes, views, all_hit));
      cluster_time.add(timed_batch(cluster, first, hashes, views, all_hit));
    }
  }
  if (!all_hit) state.SkipWithError("a get missed");
  const double c = cluster_time.median(), s = single_time.median();
  state.counters["cluster_over_single_throughput"] = s / c;
  state.counters["cluster_median_us"] = c * 1e6;
  state.counters["single_median_us"] = s * 1e6;
}

}  // namespace

BENCHMARK(BM_ClusterBatch)->ArgName("chunk_KiB")->Arg(16)->Arg(256)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ClusterRouting)->ArgName("chunk_KiB")->Arg(16)->Arg(256)->UseRealTime()->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
