// kvfuse-llama: kvfuse inside a real engine. For each model (a dense llama, kimi-k3,
// deepseek4: tiny seeded models run by llama.cpp on the CPU) it serves multi-turn
// conversations with shared system prompts and the first requests of the shipped trace
// twice — offload off, then through a kvfuse Server over a memory+disk tier (or a Redis
// server) — and checks that every request's greedy tokens and first decode step's logits
// are the same bits. It reports the reuse, the loads and the numbers that must be zero as
// kvfuse-replay does, and measures the time to first token of a tier hit against a
// recompute. Exit status: 0 when every number that must be zero is zero, 1 when one is not,
// 2 for bad arguments or input (or a control that found nothing to tamper with).
#include "model_run.hpp"
#include "workload.hpp"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <common/app_support.hpp>
#include <common/command_line.hpp>

namespace {

using namespace llama_app;

using kvfuse_apps::thousands;
using kvfuse_apps::TempRoot;

using kvfuse_apps::fixed;

std::string hex_of(const std::vector<float>& logits) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  const auto* bytes = reinterpret_cast<const unsigned char*>(logits.data());
  for (std::size_t i = 0; i < logits.size() * sizeof(float); ++i) {
    out.push_back(digits[bytes[i] >> 4]);
    out.push_back(digits[bytes[i] & 15]);
  }
  return out;
}

using kvfuse_apps::write_whole;

/// One table for one workload: a column per model.
void print_workload(const std::vector<ModelResult>& models, std::size_t w, bool two_passes) {
  const WorkloadRun& first = models.front().runs[w];
  std::printf("\n%s: %zu requests\n", first.workload.c_str(), first.requests);
  std::printf("  %-36s", "");
  for (const ModelResult& m : models) std::printf(" %16s", m.model.c_str());
  std::printf("\n");
  auto row = [&](const char* name, auto value) {
    std::printf("  %-36s", name);
    for (const ModelResult& m : models) std::printf(" %16s", value(m.runs[w]).c_str());
    std::printf("\n");
  };
  auto num = [](auto f) { return [f](const WorkloadRun& r) { return thousands(static_cast<std::uint64_t>(f(r))); }; };
  row("computed without a load", num([](const WorkloadRun& r) { return r.computed_without_load; }));
  row("loads: kv-only", num([](const WorkloadRun& r) { return r.loads_kv_only; }));
  row("       joint", num([](const WorkloadRun& r) { return r.loads_joint; }));
  row("       state-only", num([](const WorkloadRun& r) { return r.loads_state_only; }));
  row("outcomes: completed / failed", [](const WorkloadRun& r) {
    return thousands(r.outcome_completed) + " / " + thousands(r.outcome_failed + r.outcome_other);
  });
  row("prompt tokens", num([](const WorkloadRun& r) { return r.prompt_tokens; }));
  row("reused tokens: from HBM", num([](const WorkloadRun& r) { return r.reused_hbm; }));
  row("               from the tier", num([](const WorkloadRun& r) { return r.reused_tier; }));
  if (first.has_reuse_bound)
    row("               total / trace bound", [](const WorkloadRun& r) {
      return fixed(100.0 * static_cast<double>(r.reused_hbm + r.reused_tier) /
                       static_cast<double>(std::max<TokenCount>(1, r.reuse_bound)), 1) + "%";
    });
  row("bytes loaded per tier token", [](const WorkloadRun& r) {
    return r.reused_tier ? fixed(static_cast<double>(r.bytes_loaded) / static_cast<double>(r.reused_tier), 0) : std::string("-");
  });
  row("checkpoints: planned", num([](const WorkloadRun& r) { return r.checkpoints_planned; }));
  row("             saved / deduplicated", [](const WorkloadRun& r) {
    return thousands(r.checkpoints_saved) + " / " + thousands(r.checkpoints_deduplicated);
  });
  row("saves stored / failed", [](const WorkloadRun& r) { return thousands(r.saves_stored) + " / " + thousands(r.saves_failed); });
  row("resumes llama.cpp refused", num([](const WorkloadRun& r) { return r.resumes_refused; }));
  if (first.cache_ledger) {
    row("cache ledger: kept / budget bytes", [](const WorkloadRun& r) {
      return r.cache_ledger ? thousands(r.cache_ledger->bytes) + " / " + thousands(r.cache_ledger->budget_bytes) : std::string("-");
    });
    row("              evicted / refused", [](const WorkloadRun& r) {
      if (!r.cache_ledger) return std::string("-");
      const CacheLedgerStats& l = *r.cache_ledger;
      return thousands(l.evicted_kv + l.evicted_state) + " / " + thousands(l.refused_first_seen + l.refused_too_large);
    });
  }
  row("seconds: offload off / on", [&](const WorkloadRun& r) {
    return (two_passes ? fixed(r.seconds_off, 1) : std::string("-")) + " / " + fixed(r.seconds_on, 1);
  });
  std::printf("  must be zero:\n");
  row("  invariant_violations", num([](const WorkloadRun& r) { return r.audit.invariant_violations; }));
  row("  corrupted_loads", num([](const WorkloadRun& r) { return r.corrupted_loads; }));
  row("  stranded_parked", num([](const WorkloadRun& r) { return r.audit.stranded_parked; }));
  row("  leaked_slots", num([](const WorkloadRun& r) { return r.audit.leaked_blocks + r.audit.leaked_slots; }));
  row("  two_pass_delta", [&](const WorkloadRun& r) {
    return two_passes ? thousands(r.two_pass_delta) + " of " + thousands(r.compared) : std::string("not run");
  });
  for (const ModelResult& m : models) {
    const WorkloadRun& r = m.runs[w];
    if (!r.control.empty()) std::printf("  %s control: %s\n", m.model.c_str(), r.control.c_str());
    if (!r.first_difference.empty()) std::printf("  %s first difference: %s\n", m.model.c_str(), r.first_difference.c_str());
    if (!r.first_refusal.empty()) std::printf("  %s first refused resume: %s\n", m.model.c_str(), r.first_refusal.c_str());
  }
}

void print_ttft(const std::vector<ModelResult>& models, std::size_t reps) {
  std::printf("\ntime to first token, median of %zu (ms): a prompt served from the tier against the same prompt recomputed\n", reps);
  std::printf("  %-10s %6s %7s %10s %9s %9s %8s %7s %8s %10s %8s\n", "model", "prompt", "reused", "recompute", "hit:mem",
              "hit:disk", "speedup", "load", "rebuild", "bytes", "B/token");
  for (const ModelResult& m : models)
    for (const TtftRow& t : m.ttft)
      std::printf("  %-10s %6llu %7llu %10s %9s %9s %7sx %7s %8s %10s %8s%s\n", m.model.c_str(),
                  static_cast<unsigned long long>(t.prompt), static_cast<unsigned long long>(t.reused),
                  fixed(t.recompute_ms, 1).c_str(), fixed(t.memory_ms, 1).c_str(), fixed(t.disk_ms, 1).c_str(),
                  fixed(t.recompute_ms / std::max(1e-9, t.memory_ms), 1).c_str(), fixed(t.memory_load_ms, 2).c_str(),
                  fixed(t.memory_rebuild_ms, 1).c_str(), thousands(t.bytes_loaded).c_str(),
                  t.reused ? fixed(static_cast<double>(t.bytes_loaded) / static_cast<double>(t.reused), 0).c_str() : "-",
                  t.same_bits ? "" : "  BITS DIFFER");
  std::printf("  (hit: the request taken to its first logits; load: admission to unpark; rebuild: blob rebuilt from blocks and slot,\n"
              "   a fresh context, llama_state_seq_set_data; hit:disk: a fresh memory tier over the same files)\n");
}

nlohmann::json to_json(const std::vector<ModelResult>& models, bool two_passes) {
  nlohmann::json j;
  bool ok = true;
  for (const ModelResult& m : models) {
    nlohmann::json x;
    for (const WorkloadRun& r : m.runs) {
      nlohmann::json y;
      y["requests"] = r.requests;
      y["computed_without_load"] = r.computed_without_load;
      y["loads"] = {{"kv_only", r.loads_kv_only}, {"joint", r.loads_joint}, {"state_only", r.loads_state_only}};
      y["outcomes"] = {{"completed", r.outcome_completed}, {"failed", r.outcome_failed}, {"other", r.outcome_other},
                       {"state_missed", r.state_missed}};
      y["reused_tokens"] = {{"hbm", r.reused_hbm}, {"tier", r.reused_tier}, {"prompt_tokens", r.prompt_tokens}};
      if (r.has_reuse_bound) y["reused_tokens"]["trace_bound"] = r.reuse_bound;
      y["bytes_loaded"] = r.bytes_loaded;
      y["checkpoints"] = {{"planned", r.checkpoints_planned}, {"saved", r.checkpoints_saved},
                          {"deduplicated", r.checkpoints_deduplicated}};
      y["saves"] = {{"stored", r.saves_stored}, {"failed", r.saves_failed}};
      y["hashes_reseeded"] = r.hashes_reseeded;
      if (r.memory_tier && r.disk_tier)
        y["tier"] = {{"memory_bytes", r.memory_tier->bytes},   {"memory_capacity", r.memory_tier->capacity},
                     {"memory_evictions", r.memory_tier->evictions}, {"disk_entries", r.disk_tier->entries},
                     {"disk_bytes", r.disk_tier->bytes}};
      if (r.cache_ledger) {
        const CacheLedgerStats& l = *r.cache_ledger;
        y["cache_ledger"] = {{"budget_bytes", l.budget_bytes},        {"bytes", l.bytes},
                             {"kv_bytes", l.kv_bytes},                {"state_bytes", l.state_bytes},
                             {"admitted", l.admitted},                {"evicted_kv", l.evicted_kv},
                             {"evicted_state", l.evicted_state},      {"refused_first_seen", l.refused_first_seen},
                             {"refused_too_large", l.refused_too_large}, {"uses", l.uses},
                             {"entries", l.entries}};
        y["cache_keeper"] = {{"erased", r.cache_keeper.erased},
                             {"swept", r.cache_keeper.swept},
                             {"healed", r.cache_keeper.healed},
                             {"chunks_cut", r.cache_keeper.chunks_cut},
                             {"checkpoints_cut", r.cache_keeper.checkpoints_cut}};
      }
      y["resumes_refused"] = r.resumes_refused;
      y["first_refusal"] = r.first_refusal;
      y["first_difference"] = r.first_difference;
      y["control"] = r.control;
      y["seconds"] = {{"offload_off", r.seconds_off}, {"offload_on", r.seconds_on}};
      y["two_pass"] = two_passes ? nlohmann::json{{"compared", r.compared}, {"delta", r.two_pass_delta}} : nlohmann::json(nullptr);
      y["must_be_zero"] = {{"invariant_violations", r.audit.invariant_violations},
                           {"corrupted_loads", r.corrupted_loads},
                           {"stranded_parked", r.audit.stranded_parked},
                           {"leaked_slots", r.audit.leaked_blocks + r.audit.leaked_slots},
                           {"two_pass_delta", r.two_pass_delta}};
      ok = ok && r.must_be_zero() == 0;
      x["workloads"][r.workload] = y;
    }
    x["expected_outputs"] = {{"compared", m.expected_compared}, {"delta", m.expected_delta}};
    ok = ok && m.expected_delta == 0;
    for (const TtftRow& t : m.ttft) {
      x["ttft"].push_back({{"prompt_tokens", t.prompt},         {"reused_tokens", t.reused},
                           {"load", std::string(to_string(t.load))}, {"recompute_ms", t.recompute_ms},
                           {"hit_memory_ms", t.memory_ms},       {"hit_memory_load_ms", t.memory_load_ms},
                           {"hit_memory_rebuild_ms", t.memory_rebuild_ms},
                           {"hit_disk_ms", t.disk_ms},           {"bytes_loaded", t.bytes_loaded},
                           {"same_bits", t.same_bits}});
      ok = ok && t.same_bits;
    }
    j["models"][m.model] = x;
  }
  j["ok"] = ok;
  return j;
}

/// pass 2's outputs, for another process to check its own against.
nlohmann::json outputs_json(const std::vector<ModelResult>& models) {
  nlohmann::json j;
  j["format"] = "kvfuse-llama outputs 1";
  for (const ModelResult& m : models)
    for (const WorkloadRun& r : m.runs)
      for (const Output& o : r.outputs) j["models"][m.model][r.workload].push_back({{"tokens", o.tokens}, {"logits", hex_of(o.logits)}});
  return j;
}

/// Compares pass 2's outputs with a file another run wrote; every request of ours must be
/// there with the same tokens and logits bits.
void compare_expected(std::vector<ModelResult>& models, const nlohmann::json& expected) {
  for (ModelResult& m : models)
    for (const WorkloadRun& r : m.runs) {
      const nlohmann::json* list = nullptr;
      if (expected.contains("models") && expected["models"].contains(m.model) && expected["models"][m.model].contains(r.workload))
        list = &expected["models"][m.model][r.workload];
      for (std::size_t i = 0; i < r.outputs.size(); ++i) {
        ++m.expected_compared;
        const bool same = list != nullptr && i < list->size() && (*list)[i]["tokens"].get<std::vector<llama_token>>() == r.outputs[i].tokens &&
                          (*list)[i]["logits"].get<std::string>() == hex_of(r.outputs[i].logits);
        m.expected_delta += same ? 0 : 1;
      }
    }
}

constexpr std::string_view program = "kvfuse-llama";

int usage_error(const CLI::App& app, const std::string& message) { return kvfuse_apps::usage_error(app, program, message); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvfuse-llama: llama.cpp models served twice, offload off and through kvfuse's tiers, compared bit for bit"};
  Options o;
  std::string control = "none", checkpoints = "default", ttft = "256,1024,2048", json_out, outputs_out, outputs_expected;
  std::size_t passes = 2;
  app.add_option("--model", o.models, "models: llama, kimi-k3, deepseek4")->delimiter(',')->check(CLI::IsMember({"llama", "kimi-k3", "deepseek4"}));
  app.add_option("--models-dir", o.models_dir, "where <model>.gguf lives")->check(CLI::ExistingDirectory);
  app.add_option("--workload", o.workloads, "workloads: conversations, trace")->delimiter(',')->check(CLI::IsMember({"conversations", "trace"}));
  app.add_option("--conversations", o.conversations.conversations, "conversations")->check(CLI::Range(1, 64));
  app.add_option("--system-prompts", o.conversations.system_prompts, "system prompts the conversations share")->check(CLI::Range(1, 64));
  app.add_option("--turns", o.conversations.turns, "turns per conversation")->check(CLI::Range(1, 16));
  std::vector<std::size_t> reply{o.conversations.min_reply, o.conversations.max_reply};
  app.add_option("--reply-tokens", reply, "MIN,MAX output tokens of a conversation turn")->delimiter(',')->expected(2)->check(CLI::Range(1, 1024));
  app.add_option("--seed", o.conversations.seed, "seed of the conversations' tokens");
  o.trace.path = KVFUSE_LLAMA_TRACE;
  app.add_option("--trace", o.trace.path, "a Mooncake-format JSONL trace (default: the shipped one)")->check(CLI::ExistingFile);
  app.add_option("--limit", o.trace.limit, "serve the trace's first N requests")->check(CLI::Range(1, 100000));
  app.add_option("--trace-block-tokens", o.trace.block_tokens, "tokens that stand for one 512-token block of the trace")->check(CLI::Range(1, 512));
  app.add_option("--max-output", o.trace.max_output, "most output tokens of a trace request")->check(CLI::Range(1, 256));
  app.add_option("--passes", passes, "2: offload off, then on, compared; 1: offload on only")->check(CLI::Range(1, 2));
  app.add_option("--tier", o.tier, "the tier of pass 2: memory+disk (a MemoryTier in front of a DiskTier), redis, or redis-cluster")
      ->check(CLI::IsMember({"memory+disk", "redis", "redis-cluster"}));
  app.add_option("--redis", o.redis, "with --tier redis: the server, unix:PATH or HOST:PORT; with --tier redis-cluster: the seeds, HOST:PORT[,HOST:PORT...]");
  app.add_option("--key-prefix", o.key_prefix, "with --tier redis or redis-cluster: the prefix of every key (runs with the same prefix share entries; they expire after 30 minutes)");
  app.add_option("--tier-capacity", o.memory_bytes, "bytes of the memory tier (with --cache-policy: the ledger's budget)")
      ->check(CLI::Range(std::size_t{1} << 16, std::size_t{1} << 40));
  std::string cache_policy;
  app.add_option("--cache-policy", cache_policy,
                 "with --tier memory+disk: the engine owns the --tier-capacity budget of the whole tier and decides what it "
                 "keeps: lru or cost (docs/reference.md#cache-policy); default: the memory tier's LRU, the disk keeps everything")
      ->check(CLI::IsMember({"lru", "cost"}));
  app.add_option("--dir", o.dir, "where the disk tier lives (a temporary directory under it, removed at exit)")->check(CLI::ExistingDirectory);
  app.add_option("--chunk-tokens", o.settings.chunk_tokens, "tokens per tier chunk (a multiple of --block-tokens)")->check(CLI::Range(1, 1 << 16));
  app.add_option("--block-tokens", o.block_tokens, "tokens per block: the checkpoint grid (deepseek4 needs a multiple of 128)")->check(CLI::Range(1, 1 << 16));
  app.add_option("--ubatch", o.ubatch, "tokens per prefill ubatch (divides --block-tokens)")->check(CLI::Range(2, 4096));
  app.add_option("--threads", o.threads, "llama.cpp threads (both passes use the same)")->check(CLI::Range(1, 256));
  app.add_option("--blocks", o.settings.num_blocks, "the engine's block pool (default: 1.5 times the longest request)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--snapshot-slots", o.settings.snapshot_slots, "slots for mid-prefill checkpoints")->check(CLI::Range(1, 4096));
  app.add_option("--checkpoints", checkpoints, "checkpoint policy: default, last, all, every:N");
  app.add_option("--control", control, "tamper with pass 2 to show the check fails: none, flip-kv, wrong-boundary")
      ->check(CLI::IsMember({"none", "flip-kv", "wrong-boundary"}));
  app.add_option("--ttft", ttft, "prompt lengths of the time-to-first-token measurement (multiples of --chunk-tokens), or none");
  app.add_option("--ttft-reps", o.ttft_reps, "repetitions per measurement")->check(CLI::Range(1, 100));
  app.add_option("--json", json_out, "write the report as JSON to FILE");
  app.add_option("--outputs-out", outputs_out, "write pass 2's tokens and logits to FILE");
  app.add_option("--outputs-expected", outputs_expected, "pass 2's outputs must equal FILE's (another run's), bit for bit")->check(CLI::ExistingFile);
  if (const std::optional<int> status = kvfuse_apps::parse_or_usage(app, program, argc, argv)) return *status;

  if (reply[0] > reply[1]) return usage_error(app, "--reply-tokens: MIN " + std::to_string(reply[0]) + " is above MAX " + std::to_string(reply[1]));
  o.conversations.min_reply = reply[0];
  o.conversations.max_reply = reply[1];
  o.settings.two_passes = passes == 2;
  o.settings.control = control == "flip-kv" ? Control::flip_kv : control == "wrong-boundary" ? Control::wrong_boundary : Control::none;
  try {
    o.settings.checkpoints = checkpoint_policy_named(checkpoints);
  } catch (const kvfuse::Error& e) {
    return usage_error(app, std::string("--checkpoints: ") + e.what());
  }
  if (!cache_policy.empty()) {
    if (o.tier != "memory+disk")
      return usage_error(app, "--cache-policy " + cache_policy + ": owns a memory+disk tier's budget, not a " + o.tier +
                                  " one (a shared server keeps its own)");
    o.settings.cache_policy = cache_policy == "cost" ? CachePolicy::cost : CachePolicy::lru;
    o.settings.cache_budget = o.memory_bytes;
  }
  if (o.settings.control != Control::none && passes != 2) return usage_error(app, "--control: needs --passes 2 (the comparison is what fails)");
  if (o.block_tokens % o.ubatch != 0 || o.settings.chunk_tokens % o.block_tokens != 0)
    return usage_error(app, "--ubatch " + std::to_string(o.ubatch) + " must divide --block-tokens " + std::to_string(o.block_tokens) +
                                ", which must divide --chunk-tokens " + std::to_string(o.settings.chunk_tokens));
  o.ttft.clear();
  if (ttft != "none") {
    std::stringstream list(ttft);
    for (std::string item; std::getline(list, item, ',');) {
      try {
        std::size_t used = 0;
        const unsigned long long v = std::stoull(item, &used);
        if (used != item.size() || v == 0 || v % o.settings.chunk_tokens != 0 || v > 16384) throw std::invalid_argument(item);
        o.ttft.push_back(v);
      } catch (const std::exception&) {
        return usage_error(app, "--ttft: \"" + item + "\" is not a multiple of --chunk-tokens " + std::to_string(o.settings.chunk_tokens) +
                                    " up to 16384 (or say none)");
      }
    }
  }
#if KVFUSE_LLAMA_WITH_REDIS
  if (o.tier == "redis") {
    if (o.redis.empty()) return usage_error(app, "--tier redis: needs --redis unix:PATH or HOST:PORT");
    try {
      RedisTierOptions r;
      r.set_address(o.redis);
      r.key_prefix = o.key_prefix;
      r.ttl = std::chrono::minutes(30);  // a run leaves nothing behind in a shared server for long
      RedisTier probe(r);  // a bad address or prefix is a usage error, before anything runs
      o.redis_options = r;
    } catch (const kvfuse::Error& e) {
      return usage_error(app, std::string("--redis: ") + e.what());
    }
  }
  if (o.tier == "redis-cluster") {
    if (o.redis.empty()) return usage_error(app, "--tier redis-cluster: needs --redis HOST:PORT[,HOST:PORT...]");
    try {
      RedisClusterTierOptions r;
      r.add_seeds(o.redis);
      r.key_prefix = o.key_prefix;
      r.ttl = std::chrono::minutes(30);
      RedisClusterTier probe(r);  // bad seeds or no reachable one: a usage error, before anything runs
      o.cluster_options = r;
    } catch (const kvfuse::Error& e) {
      return usage_error(app, std::string("--redis: ") + e.what());
    }
  }
#else
  if (o.tier == "redis" || o.tier == "redis-cluster")
    return usage_error(app, "--tier " + o.tier + ": this kvfuse-llama was built without hiredis (apt-get install libhiredis-dev)");
#endif
  if (o.tier != "redis" && o.tier != "redis-cluster" && !o.redis.empty())
    return usage_error(app, "--redis: only with --tier redis or redis-cluster");

  nlohmann::json expected;
  if (!outputs_expected.empty()) {
    try {
      std::ifstream in(outputs_expected);
      expected = nlohmann::json::parse(in);
      if (expected.value("format", std::string()) != "kvfuse-llama outputs 1") throw std::runtime_error("not a kvfuse-llama outputs file");
    } catch (const std::exception& e) {
      return usage_error(app, "--outputs-expected: \"" + outputs_expected + "\": " + e.what());
    }
  }

  std::vector<ModelResult> results;
  bool control_found_nothing = false, control_applies = false;
  try {
    std::optional<TempRoot> made;
    try {
      made.emplace(o.dir, "kvfuse-llama");
    } catch (const std::filesystem::filesystem_error& e) {
      return usage_error(app, std::string("--dir: ") + e.what());
    }
    const std::filesystem::path root = made->path;
    for (const std::string& name : o.models) {
      const std::string path = o.models_dir + "/" + name + ".gguf";
      if (!std::filesystem::exists(path)) return usage_error(app, "--models-dir: no " + path);
      Model model(path);
      std::vector<Workload> workloads;
      try {
        for (const std::string& w : o.workloads)
          workloads.push_back(w == "trace" ? read_trace(o.trace, model.vocab_size()) : make_conversations(o.conversations, model.vocab_size()));
      } catch (const InputError& e) {
        return usage_error(app, e.what());
      }
      TokenCount context = 1024;
      for (const Workload& w : workloads) context = std::max(context, w.longest);
      for (const TokenCount t : o.ttft) context = std::max<TokenCount>(context, t + 17);
      RunnerOptions ro;
      ro.ubatch_tokens = o.ubatch;
      ro.threads = static_cast<std::int32_t>(o.threads);
      ro.block_tokens = o.block_tokens;
      ro.context_tokens = static_cast<std::uint32_t>(TokenGrid{256}.ceil(context));
      const SequenceRunner runner(model, ro);
      const BlobFamily family = runner.codec().layout().family;
      results.push_back(family == BlobFamily::attention ? run_dense(name, runner, workloads, o, root)
                        : family == BlobFamily::hybrid  ? run_kimi_k3(name, runner, workloads, o, root)
                                                        : run_deepseek4(name, runner, workloads, o, root));
      // A wrong-boundary state needs a model with state; a dense model runs unchanged.
      const bool applies = o.settings.control == Control::flip_kv ||
                           (o.settings.control == Control::wrong_boundary && family != BlobFamily::attention);
      for (const WorkloadRun& r : results.back().runs)
        if (applies && r.control.empty()) control_found_nothing = true;
      control_applies = control_applies || applies;
    }
  } catch (const kvfuse::Error& e) {
    std::fprintf(stderr, "kvfuse-llama: %s\n", e.what());
    return 1;
  }
  if (!outputs_expected.empty()) compare_expected(results, expected);

  std::printf("\nkvfuse-llama: llama.cpp %s, CPU, %u threads, ubatch %u; grids: blocks of %u tokens, chunks of %u; pass 2 tier: %s\n",
              std::string(pinned_llama_commit.substr(0, 8)).c_str(), o.threads, o.ubatch, o.block_tokens, o.settings.chunk_tokens,
              o.tier == "redis" ? ("redis at " + o.redis).c_str() : o.tier == "redis-cluster" ? ("a redis cluster, seeds " + o.redis).c_str() : ("a " + thousands(o.memory_bytes) + "-byte memory tier in front of a disk tier" +
                                                         (o.settings.cache_policy ? ", the cache ledger (" + std::string(to_string(*o.settings.cache_policy)) +
                                                                                        ") owning that budget"
                                                                                  : std::string())).c_str());
  for (std::size_t w = 0; w < o.workloads.size(); ++w) print_workload(results, w, o.settings.two_passes);
  if (!o.ttft.empty()) print_ttft(results, o.ttft_reps);
  if (!outputs_expected.empty())
    for (const ModelResult& m : results)
      std::printf("%s: outputs that differ from %s: %s of %s\n", m.model.c_str(), outputs_expected.c_str(),
                  thousands(m.expected_delta).c_str(), thousands(m.expected_compared).c_str());
  const nlohmann::json j = to_json(results, o.settings.two_passes);
  try {
    if (!json_out.empty()) write_whole(json_out, j.dump(2) + "\n");
    if (!outputs_out.empty()) write_whole(outputs_out, outputs_json(results).dump() + "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvfuse-llama: %s\n", e.what());
    return 2;
  }
  if (o.settings.control != Control::none && !control_applies) {
    std::printf("\nresult: --control %s needs a model with state (kimi-k3, deepseek4)\n", control.c_str());
    return 2;
  }
  if (control_found_nothing) {
    std::printf("\nresult: the control found no load to tamper with (serve more requests)\n");
    return 2;
  }
  const bool ok = j["ok"].get<bool>();
  std::printf("\n%s\n", ok ? "result: every request gave the same tokens and logits bits with offload on, every load settled, every block and slot came back"
                           : "result: PROBLEM: a number that must be zero is not (see above)");
  return ok ? 0 : 1;
}
