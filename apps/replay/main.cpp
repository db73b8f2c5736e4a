// kvfuse-replay: the main job. An engine (Coordinator, OffloadIndex, TpQuorum, planner)
// and N ranks — as threads, or as processes (--ranks-as processes) — on the embedded default (HostRuntime; per rank a bounded
// MemoryTier in front of a DiskTier in a temporary directory) replay a workload — built-in
// agentic sessions or a Mooncake-format trace — with seeded faults, check every byte each
// load restores, and print what happened. Exit status: 0 when the numbers that must be zero
// are zero, 1 when one is not, 2 for bad arguments or input.
//
// This file is the command line. The models, the tiers and the faults are tables
// (models.cpp, tiers.hpp, faults.cpp); one pass is pass.cpp; the report is report.hpp.
#include "pass.hpp"
#include "faults.hpp"
#include "models.hpp"
#include "rank_process_main.hpp"
#include "report.hpp"
#include "tiers.hpp"
#include "workload.hpp"

#include <CLI/CLI.hpp>
#include <common/app_support.hpp>
#include <common/command_line.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <unistd.h>
#include <utility>
#include <vector>

namespace {

using namespace replay;

using kvfuse_apps::TempRoot;

using kvfuse_apps::write_whole;

/// Runs one pass of `model` in a directory of its own under `root`.
RunResult run_one(const Model& model, const Workload& w, RunOptions o, Progress& progress, const std::filesystem::path& root,
                  const std::string& pass) {
  std::string tag = std::string(model.name) + "-" + pass;
  std::replace(tag.begin(), tag.end(), ' ', '_');
  o.tier_options.dir = root / tag;
  o.tier_options.pass = tag;  // a shared server keeps each pass's keys apart (k3, multi and k3-serial share a model id)
  std::filesystem::create_directories(o.tier_options.dir);
  progress.begin(std::string(model.name) + (pass == "offload" ? "" : " (" + pass + ")"));
  o.progress = [&](std::size_t done, std::size_t total, std::size_t in_flight) { progress.update(done, total, in_flight); };
  RunResult r = replay_pass(model, w, o);
  progress.end();
  std::filesystem::remove_all(o.tier_options.dir);
  return r;
}

/// The bytes the fullest rank's memory tier holds at the end of `r` (with an unlimited tier
/// nothing was evicted, so this is everything the pass stored).
std::uint64_t fullest_memory_tier(const RunResult& r) {
  std::uint64_t most = 0;
  for (const TierSnapshot& t : r.snapshot.tiers)
    if (t.memory) most = std::max<std::uint64_t>(most, t.memory->bytes);
  return most;
}

/// A model's passes: offload on; offload off when `two_pass`; its comparison entry's. With a
/// share (`percent`), first the same pass with an unlimited memory tier, whose fullest rank
/// sizes the tier of every pass after it (the comparison entry's included).
ModelReport run_model(const Model& model, const Workload& w, RunOptions o, bool two_pass, Progress& progress,
                      const std::filesystem::path& root, std::optional<double> percent) {
  ModelReport m;
  m.model = &model;
  if (percent) {
    RunOptions unlimited = o;
    unlimited.tier_options.memory_bytes = std::size_t{1} << 62;
    unlimited.cache_policy.reset();
    const RunResult ws = run_one(model, w, unlimited, progress, root, "working set");
    SizedCapacity c{*percent, fullest_memory_tier(ws), 0};
    c.capacity_bytes = std::max<std::uint64_t>(
        1, static_cast<std::uint64_t>(std::ceil(*percent / 100.0 * static_cast<double>(c.working_set_bytes))));
    // With a cache policy the ledger owns the budget and the tier stays unlimited.
    if (o.cache_policy) o.cache_budget = c.capacity_bytes;
    else o.tier_options.memory_bytes = static_cast<std::size_t>(c.capacity_bytes);
    m.capacity = c;
  }
  m.run = run_one(model, w, o, progress, root, "offload");
  if (two_pass) {
    RunOptions off = o;
    off.offload = false;
    const RunResult base = run_one(model, w, off, progress, root, "offload off");
    m.two_pass = true;
    for (std::size_t i = 0; i < base.outputs.size(); ++i)
      if (base.outputs[i] != 0 && m.run.outputs[i] != 0) {
        ++m.compared;
        m.two_pass_delta += base.outputs[i] != m.run.outputs[i];
      }
  }
  if (!model.comparison.empty()) m.comparison = run_one(*find_model(model.comparison), w, o, progress, root, "offload");
  return m;
}

/// Bytes from "<digits>[unit]": no unit or B, K / KB / KiB, M / MB / MiB, G / GB / GiB,
/// T / TB / TiB, in any case, each a power of 1024 (as the --tier-capacity help says).
/// Returns what is wrong with `text` ("" when it is a size): no digits first, a fraction, an
/// exponent, a sign or an unknown unit is "not a size"; more than 2^64 - 1 bytes "too large".
std::string parse_size(const std::string& text, std::uint64_t& bytes) {
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits])) != 0) ++digits;
  if (digits == 0) return "is not a size";
  std::string unit = text.substr(digits);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  static constexpr std::pair<std::string_view, unsigned> units[] = {
      {"", 0},    {"b", 0},    {"k", 10},   {"kb", 10}, {"kib", 10}, {"m", 20}, {"mb", 20},
      {"mib", 20}, {"g", 30},  {"gb", 30},  {"gib", 30}, {"t", 40},  {"tb", 40}, {"tib", 40}};
  const auto known = std::find_if(std::begin(units), std::end(units), [&](const auto& u) { return u.first == unit; });
  if (known == std::end(units)) return "is not a size";
  std::uint64_t n = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + digits, n);
  if (ec == std::errc::result_out_of_range || n > (UINT64_MAX >> known->second)) return "is too large (say unlimited)";
  if (ec != std::errc() || end != text.data() + digits) return "is not a size";
  bytes = n << known->second;
  return {};
}

/// A share from "<decimal>%" in (0, 100]: digits with at most one point, nothing else.
/// Returns what is wrong with `text` ("" when it is a share).
std::string parse_percent(const std::string& text, double& percent) {
  const std::string number = text.substr(0, text.size() - 1);
  const bool digits_only = !number.empty() && number.find_first_not_of("0123456789.") == std::string::npos &&
                           std::count(number.begin(), number.end(), '.') <= 1 && number != ".";
  if (!digits_only) return "is not a share (say 10% or 2.5%)";
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), percent);
  if (ec != std::errc() || end != number.data() + number.size()) return "is not a share (say 10% or 2.5%)";
  if (!(percent > 0) || percent > 100) return "must be a share in (0%, 100%]";
  return {};
}

constexpr std::string_view program = "kvfuse-replay";

int usage_error(const CLI::App& app, const std::string& message) { return kvfuse_apps::usage_error(app, program, message); }

}  // namespace

/// "> 0", with a message that names the value.
const CLI::Validator positive(
    [](std::string& value) {
      try {
        std::size_t used = 0;
        if (std::stod(value, &used) > 0 && used == value.size()) return std::string();
      } catch (const std::exception&) {
      }
      return "must be > 0, got " + value;
    },
    "> 0", "positive");

int main(int argc, char** argv) {
  // The hidden mode: this binary started by itself as one rank process (rank_process_main.hpp).
  if (argc == 3 && std::string_view(argv[1]) == "--rank-process") return rank_process_main(std::atoi(argv[2]));
  CLI::App app{"kvfuse-replay: replays a workload through kvfuse's offload tier, with faults, and checks every byte"};
  std::vector<std::string> selectable, tier_names;
  std::string model_help = "models to replay:", tier_help = "each rank's tier:", fault_help = "comma-separated:";
  for (const Model& m : model_table())
    if (m.selectable) {
      selectable.emplace_back(m.name);
      model_help += (selectable.size() > 1 ? ", " : " ") + std::string(m.name) + " (" + std::string(m.what) +
                    (m.comparison.empty() ? "" : "; " + std::string(m.comparison) + " beside it") + ")";
    }
  for (const TierKind& t : tier_kinds()) {
    tier_names.emplace_back(t.name);
    tier_help += (tier_names.size() > 1 ? ", " : " ") + std::string(t.name) + " (" + std::string(t.what) + ")";
  }
  // Without hiredis the choices stay, and say how to get them.
  for (const char* remote : {"redis", "redis-cluster"})
    if (std::find(tier_names.begin(), tier_names.end(), remote) == tier_names.end()) tier_names.emplace_back(remote);
  for (const Fault& f : fault_table()) fault_help += (&f == &fault_table().front() ? " " : ", ") + std::string(f.name);
  fault_help += "; all; none";
  std::vector<std::string> models = selectable;
  std::string dir = std::filesystem::temp_directory_path().string(), trace, tier = "memory+disk", capacity = "1MiB", faults = "all", json_out, metrics_out;
  std::size_t limit = 0, sessions = 24, turns = 6;
  std::uint64_t seed = 1;
  std::uint32_t ranks = 8, blocks = 0, slots = 16, snapshot_slots = RunOptions{}.snapshot_slots, state_scale = 1;
  std::string checkpoints = "default", hash_eviction = "lru", cache_policy;
  std::size_t state_capacity = RunOptions{}.state_capacity;
  double speed = 0;
  bool two_pass = false, sync_saves = false;
  app.add_option("--model", models, model_help)->delimiter(',')->check(CLI::IsMember(selectable));
  app.add_option("--trace", trace, "a Mooncake-format JSONL trace (default: built-in agentic sessions)")->check(CLI::ExistingFile);
  app.add_option("--limit", limit, "replay the first N requests of the trace")->check(positive);
  app.add_option("--sessions", sessions, "built-in workload: conversations")->check(positive);
  app.add_option("--turns", turns, "built-in workload: turns per conversation")->check(positive);
  app.add_option("--seed", seed, "seed of the built-in workload and of the faults");
  app.add_option("--speed", speed, "follow arrival times at this multiple of real time (default: as fast as possible)")
      ->check(positive);
  app.add_option("--ranks", ranks, "tensor-parallel ranks")->check(CLI::Range(1, 64));
  std::string ranks_as = "threads";
  app.add_option("--ranks-as", ranks_as,
                 "threads: every rank's connector on threads of this process; processes: one process per rank, "
                 "over a shared memory segment")
      ->check(CLI::IsMember({"threads", "processes"}));
  std::string redis_address;
  // redis-cluster carries its seed list in the choice itself: --tier redis-cluster:SEED[,SEED...].
  app.add_option("--tier", tier, tier_help + "; redis-cluster is spelled redis-cluster:SEED[,SEED...]")
      ->check(CLI::Validator(
          [tier_names](std::string& value) {
            if (value.starts_with("redis-cluster:")) return std::string();
            return std::find(tier_names.begin(), tier_names.end(), value) != tier_names.end()
                       ? std::string()
                       : "\"" + value + "\" is not a tier (say " + [&] {
                           std::string all;
                           for (const std::string& t : tier_names) all += (all.empty() ? "" : ", ") + t;
                           return all;
                         }() + ")";
          },
          "TIER", "a tier name"));
  app.add_option("--redis", redis_address, "with --tier redis: the server, unix:PATH or HOST:PORT");
  app.add_option("--tier-capacity", capacity,
                 "bytes of each rank's memory tier (1MiB, 64KiB, ...), unlimited, or a share of the working set (10%: of what the "
                 "fullest rank's tier holds when the same pass first runs unlimited)");
  app.add_option("--blocks", blocks, "device KV blocks of 64 tokens per rank (default: twice the longest request)")
      ->check(positive);
  app.add_option("--slots", slots, "device state slots per rank, one per admitted request")->check(CLI::Range(1, 4096));
  app.add_option("--state-scale", state_scale,
                 "every state checkpoint is F chunks' worth of KV (4 KiB per rank each; default 1): a large hybrid state on the "
                 "replay's tiny model")
      ->check(CLI::Range(1, 1024));
  app.add_option("--snapshot-slots", snapshot_slots,
                 "device state slots per rank beside --slots that prefill checkpoints are copied into until saved; "
                 "none free: the checkpoint is skipped (counted)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--checkpoints", checkpoints,
                 "where stateful models capture state checkpoints: default (branch point, prompt end, every 8 chunks, "
                 "at most 4, and the generation end), last (the generation end only), all (every chunk), every:N "
                 "(every N chunks and the generation end)");
  app.add_option("--state-capacity", state_capacity,
                 "state checkpoints the engine's index keeps servable (its hash capacity), 1 to 2147483648")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 31));
  app.add_option("--hash-eviction", hash_eviction,
                 "which checkpoint the index drops at --state-capacity: lru (least recently used) or spared_tokens "
                 "(of the 8 least recently used, the one sparing the fewest tokens)")
      ->check(CLI::IsMember({"lru", "spared_tokens"}));
  app.add_option("--cache-policy", cache_policy,
                 "the engine owns the --tier-capacity budget and decides what the tiers keep: lru (least recently "
                 "used goes) or cost (prefill saved per byte, dependency-aware, a heavy checkpoint let in on its second sight "
                 "under pressure); default: each memory tier evicts by its own LRU")
      ->check(CLI::IsMember({"lru", "cost"}));
  app.add_option("--dir", dir, "where the disk tiers live (a temporary directory under it, removed at exit)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--faults", faults, fault_help);
  app.add_flag("--two-pass", two_pass, "replay each model with offload off, then on, and compare every request's output");
  app.add_flag("--sync-saves", sync_saves, "every request's saves land before the next request arrives");
  app.add_option("--json", json_out, "write the report as JSON to FILE");
  app.add_option("--metrics-out", metrics_out, "write every stats counter in the Prometheus text format to FILE");
  if (const std::optional<int> status = kvfuse_apps::parse_or_usage(app, program, argc, argv)) return *status;

  std::string cluster_seeds;
  if (tier.starts_with("redis-cluster:")) {
    cluster_seeds = tier.substr(std::string_view("redis-cluster:").size());
    tier = "redis-cluster";
  }
  // Before any server is reached: a share sizes the memory tier from a run without a limit.
  if (capacity.ends_with('%') && (tier == "redis" || tier == "redis-cluster"))
    return usage_error(app, "--tier-capacity: \"" + capacity + "\" sizes a memory tier, and --tier " + tier + " has none");
  RunOptions o;
  o.world = ranks;
  o.ranks_as = ranks_as == "processes" ? RanksAs::processes : RanksAs::threads;
  o.seed = seed;
  o.speed = speed;
  o.sync_saves = sync_saves;
  const std::vector<TierKind> kinds = tier_kinds();
  o.tier = static_cast<std::size_t>(
      std::find_if(kinds.begin(), kinds.end(), [&](const TierKind& k) { return k.name == tier; }) - kinds.begin());
  if (tier == "redis" && redis_address.empty()) return usage_error(app, "--tier redis: needs --redis unix:PATH or HOST:PORT");
  if (tier != "redis" && !redis_address.empty()) return usage_error(app, "--redis: only with --tier redis");
  if (tier == "redis") {
#if KVFUSE_REPLAY_WITH_REDIS
    try {
      kvfuse::RedisTierOptions r;
      r.set_address(redis_address);
      // Every run gets keys of its own: two runs (or two passes) never read each other's entries.
      r.key_prefix = "kvfuse-replay:" + std::to_string(::getpid()) + ":";
      r.ttl = std::chrono::minutes(30);
      kvfuse::RedisTier probe(r);  // a bad address is a usage error, before anything runs
      o.tier_options.redis = r;
    } catch (const kvfuse::Error& e) {
      return usage_error(app, std::string("--redis: ") + e.what());
    }
#else
    return usage_error(app, "--tier redis: this kvfuse-replay was built without hiredis (apt-get install libhiredis-dev)");
#endif
  }
  if (tier == "redis-cluster") {
    if (cluster_seeds.empty()) return usage_error(app, "--tier redis-cluster: needs its seeds, redis-cluster:HOST:PORT[,HOST:PORT...]");
#if KVFUSE_REPLAY_WITH_REDIS
    try {
      kvfuse::RedisClusterTierOptions r;
      r.add_seeds(cluster_seeds);
      r.key_prefix = "kvfuse-replay:" + std::to_string(::getpid()) + ":";
      r.ttl = std::chrono::minutes(30);
      kvfuse::RedisClusterTier probe(r);  // no reachable seed is a usage error, before anything runs
      o.tier_options.redis_cluster = r;
    } catch (const kvfuse::Error& e) {
      return usage_error(app, std::string("--tier redis-cluster: ") + e.what());
    }
#else
    return usage_error(app, "--tier redis-cluster: this kvfuse-replay was built without hiredis (apt-get install libhiredis-dev)");
#endif
  }
  o.num_slots = slots;
  o.snapshot_slots = snapshot_slots;
  o.state_scale = state_scale;
  // Every rank allocates its slot pool at this size, request and snapshot slots alike.
  if (const std::uint64_t slot_memory = std::uint64_t{slots + snapshot_slots} * state_scale * default_slot_bytes;
      slot_memory > (std::uint64_t{1} << 30))
    return usage_error(app, "--state-scale " + std::to_string(state_scale) + ": " + std::to_string(slots + snapshot_slots) +
                                " slots of " + std::to_string(std::uint64_t{state_scale} * default_slot_bytes) + " bytes need " +
                                thousands(slot_memory) + " bytes per rank, more than 1 GiB");
  try {
    o.checkpoints = kvfuse::checkpoint_policy_named(checkpoints);
  } catch (const kvfuse::Error& e) {
    return usage_error(app, std::string("--checkpoints: ") + e.what());
  }
  o.state_capacity = state_capacity;
  o.hash_eviction = hash_eviction == "spared_tokens" ? kvfuse::HashEviction::spared_tokens : kvfuse::HashEviction::lru;
  std::optional<double> capacity_percent;
  if (capacity == "unlimited") {
    o.tier_options.memory_bytes = std::size_t{1} << 62;
  } else if (!capacity.empty() && capacity.back() == '%') {
    double percent = 0;
    if (const std::string error = parse_percent(capacity, percent); !error.empty())
      return usage_error(app, "--tier-capacity: \"" + capacity + "\" " + error);
    capacity_percent = percent;
  } else {
    std::uint64_t bytes = 0;
    if (const std::string error = parse_size(capacity, bytes); !error.empty())
      return usage_error(app, "--tier-capacity: \"" + capacity + "\" " + error +
                                  (error == "is not a size" ? " (say 1MiB, 65536 or unlimited)" : ""));
    if (bytes == 0) return usage_error(app, "--tier-capacity: must be > 0, got \"" + capacity + "\"");
    o.tier_options.memory_bytes = bytes;
  }
  if (!cache_policy.empty()) {
    o.cache_policy = cache_policy == "cost" ? kvfuse::CachePolicy::cost : kvfuse::CachePolicy::lru;
    o.cache_budget = o.tier_options.memory_bytes;  // a share sets it per model, in run_model
    o.tier_options.memory_bytes = std::size_t{1} << 62;
  }
  try {
    o.faults = parse_faults(faults);
  } catch (const InputError& e) {
    return usage_error(app, e.what());
  }
  if (!trace.empty() && (::access(trace.c_str(), R_OK) != 0))
    return usage_error(app, "--trace: cannot read \"" + trace + "\"");
  if (trace.empty() && limit != 0) return usage_error(app, "--limit: only with --trace");

  Workload w;
  try {
    w = trace.empty() ? make_sessions(seed, sessions, turns) : read_trace(trace, limit);
  } catch (const InputError& e) {
    return usage_error(app, e.what());
  }
  const std::uint32_t longest = static_cast<std::uint32_t>((w.max_request_tokens + block_tokens - 1) / block_tokens);
  o.num_blocks = blocks != 0 ? blocks : std::max<std::uint32_t>(1024, 2 * longest);
  if (o.num_blocks < longest)
    return usage_error(app, "--blocks: " + std::to_string(blocks) + " blocks cannot hold the longest request (" +
                                std::to_string(longest) + " blocks)");

  const std::string tiers = tier == "redis"           ? "a RedisTier at " + redis_address
                            : tier == "redis-cluster" ? "a RedisClusterTier with seeds " + cluster_seeds
                                                      : "a " + capacity + " memory tier" + (kinds[o.tier].disk ? " in front of a disk tier" : "");
  std::printf("kvfuse-replay: %s requests (%s), %u ranks as %s, HostRuntime, per rank %s\n",
              thousands(w.requests.size()).c_str(),
              w.from_trace ? ("trace " + w.source).c_str() : ("built-in sessions, seed " + std::to_string(seed)).c_str(), ranks,
              ranks_as.c_str(), tiers.c_str());
  const bool any_fault = std::find(o.faults.begin(), o.faults.end(), true) != o.faults.end();
  std::printf("faults: %s%s%s\n", any_fault ? faults.c_str() : "none", two_pass ? "; two passes (offload off, then on)" : "",
              sync_saves ? "; saves land before the next arrival" : "");
  std::fflush(stdout);

  std::optional<TempRoot> made;
  try {
    made.emplace(dir, "kvfuse-replay");
  } catch (const std::filesystem::filesystem_error& e) {
    return usage_error(app, std::string("--dir: ") + e.what());
  }
  TempRoot& root = *made;
  Progress progress;
  std::vector<ModelReport> reports;
  try {
    for (const std::string& name : models)
      reports.push_back(run_model(*find_model(name), w, o, two_pass, progress, root.path, capacity_percent));
  } catch (const kvfuse::Error& e) {
    std::fprintf(stderr, "kvfuse-replay: %s\n", e.what());
    return 1;
  }

  print_table(reports, w);
  nlohmann::json options = {{"ranks", ranks},         {"ranks_as", ranks_as}, {"tier", tier},       {"tier_capacity", capacity}, {"faults", faults},
                            {"two_pass", two_pass},   {"sync_saves", sync_saves}, {"seed", seed},  {"blocks", o.num_blocks},
                            {"slots", slots},         {"snapshot_slots", snapshot_slots}, {"checkpoints", checkpoints},
                            {"state_capacity", state_capacity}, {"hash_eviction", hash_eviction}};
  if (state_scale != 1) options["state_scale"] = state_scale;
  if (!cache_policy.empty()) options["cache_policy"] = cache_policy;
  const nlohmann::json j = to_json(reports, w, options);
  try {
    if (!json_out.empty()) write_whole(json_out, j.dump(2) + "\n");
    if (!metrics_out.empty()) {
      kvfuse::PrometheusText text;
      for (const ModelReport& m : reports) add_metrics(text, m.run);
      write_whole(metrics_out, text.str() + replay_metrics(reports, w));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvfuse-replay: %s\n", e.what());
    return 2;
  }
  const bool ok = j["ok"].get<bool>();
  std::printf("\n%s\n", ok ? "result: every load settled once, every byte matched, every slot came back, the outputs agree"
                           : "result: PROBLEM: a number that must be zero is not (see above)");
  return ok ? 0 : 1;
}
