// kvfuse-llama: what main() hands each model's run, and what comes back. The runs of the
// three models live in a translation unit each (run_<model>.cpp), so their engine
// instantiations compile in parallel.
#pragma once

#include "run.hpp"
#include "workload.hpp"

#if KVFUSE_LLAMA_WITH_REDIS
#include <kvfuse/tier/redis_cluster_tier.hpp>
#include <kvfuse/tier/redis_tier.hpp>
#endif

#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace llama_app {

/// Everything the command line decides.
struct Options {
  std::string models_dir = KVFUSE_LLAMA_MODELS_DIR;
  std::vector<std::string> models{"llama", "kimi-k3", "deepseek4"};
  std::vector<std::string> workloads{"conversations", "trace"};
  ConversationOptions conversations;
  TraceOptions trace;
  RunSettings settings;
  std::string tier = "memory+disk", redis, key_prefix = "kvfuse-llama:";
#if KVFUSE_LLAMA_WITH_REDIS
  std::optional<RedisTierOptions> redis_options;  ///< set when pass 2 runs over a Redis server
  std::optional<RedisClusterTierOptions> cluster_options;  ///< set when pass 2 runs over a Redis Cluster
#endif
  std::size_t memory_bytes = std::size_t{64} << 20;
  std::string dir = std::filesystem::temp_directory_path().string();
  std::vector<TokenCount> ttft{256, 1024, 2048};
  std::size_t ttft_reps = 3;
  std::uint32_t threads = 2, ubatch = 64, block_tokens = 128;
};

/// One model's results: a run per workload, the time-to-first-token rows, and the
/// comparison against another process's outputs (--outputs-expected).
struct ModelResult {
  std::string model;
  std::vector<WorkloadRun> runs;
  std::vector<TtftRow> ttft;
  std::uint64_t expected_compared = 0, expected_delta = 0;
};

/// Runs every workload of one model on servers built by `ServerOf<Tier>`, over the tier
/// the options name (a fresh one per workload), then measures the time to first token.
template <template <class> class ServerOf>
ModelResult run_model(const std::string& name, const SequenceRunner& runner, const std::vector<Workload>& workloads,
                      const Options& o, const std::filesystem::path& root) {
  ModelResult m;
  m.model = name;
  for (const Workload& w : workloads) {
    std::printf("%s: %s ...\n", name.c_str(), w.name.c_str());
    std::fflush(stdout);
#if KVFUSE_LLAMA_WITH_REDIS
    if (o.redis_options) {
      RedisTierOptions r = *o.redis_options;
      r.key_prefix += w.name + ":";  // each workload its keys; runs with the same prefix share them
      RedisTier tier(r);
      m.runs.push_back(run_workload<ServerOf<RedisTier>>(runner, w, o.settings, tier));
      continue;
    }
    if (o.cluster_options) {
      RedisClusterTierOptions r = *o.cluster_options;
      r.key_prefix += w.name + ":";
      RedisClusterTier tier(r);
      m.runs.push_back(run_workload<ServerOf<RedisClusterTier>>(runner, w, o.settings, tier));
      continue;
    }
#endif
    const std::filesystem::path dir = root / (name + "-" + w.name);
    std::filesystem::create_directories(dir);
    // With a cache ledger the memory tier never evicts on its own: the ledger keeps the
    // budget, and what a save landing after its entry's eviction adds is swept after the request.
    MemoryDiskTier tiers(o.settings.cache_policy ? std::size_t{1} << 62 : o.memory_bytes, dir);
    m.runs.push_back(run_workload<ServerOf<TieredTier<MemoryTier<>, DiskTier>>>(runner, w, o.settings, tiers.tier));
    m.runs.back().memory_tier = tiers.front.stats();
    m.runs.back().disk_tier = tiers.back.stats();
  }
  for (const TokenCount length : o.ttft) {
    std::printf("%s: time to first token at %llu tokens ...\n", name.c_str(), static_cast<unsigned long long>(length));
    std::fflush(stdout);
    m.ttft.push_back(measure_ttft<ServerOf<TieredTier<MemoryTier<>, DiskTier>>>(runner, length, o.ttft_reps, o.settings,
                                                                                  root / (name + "-ttft")));
  }
  return m;
}

ModelResult run_dense(const std::string& name, const SequenceRunner& runner, const std::vector<Workload>& workloads,
                      const Options& o, const std::filesystem::path& root);
ModelResult run_kimi_k3(const std::string& name, const SequenceRunner& runner, const std::vector<Workload>& workloads,
                        const Options& o, const std::filesystem::path& root);
ModelResult run_deepseek4(const std::string& name, const SequenceRunner& runner, const std::vector<Workload>& workloads,
                          const Options& o, const std::filesystem::path& root);

}  // namespace llama_app
