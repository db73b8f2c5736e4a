// bench_restore_cost.cpp — what kvfuse adds to a hit, against llama.cpp's own restore.
//
// A prompt of L tokens was prefilled once; its sequence blob is kept in memory, and its KV
// was saved through a SlotCache over the memory tier as kvfuse-llama-server saves it. Each
// iteration then empties the sequence and brings the prefix back, and decodes the prompt's
// next token with its logits (the time to first token of a request whose whole prefix hits):
//   llama: llama_state_seq_set_data_ext of the kept blob (the bound: no lookup, no copy);
//   kvfuse: SlotCache::begin (admission, the load of every chunk from the tier through the
//     connector's lanes, the codec's rebuild of the blob), the stream cut, the same
//     set_data, and the admission's finish, as the server runs them on its main loop.
// The ratio kvfuse / llama at the same L is the number docs/llama-server.md reports (goal:
// at most 1.2). Model: the tiny dense llama the tests build (its path is compiled in).
#include <benchmark/benchmark.h>

#include "common.h"
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "llama_calls.hpp"
#include "slot_cache.hpp"
#include "stream_blob.hpp"
#include "tier_stack.hpp"

namespace {

using namespace kvfuse;
using namespace kvfuse::llama_server;

constexpr std::uint32_t kUbatch = 64;
constexpr std::uint32_t kChunk = 64;

struct Rig {
  common_params params;
  llama_model* model = nullptr;
  llama_context* ctx = nullptr;
  std::unique_ptr<llama::SequenceCodec> codec;
  std::unique_ptr<TierStack> tier;
  std::unique_ptr<SlotCache<TierStack, NoState>> cache;

  Rig() {
    llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);  // llama.cpp logs every restore
    llama_backend_init();
    params.model.path = KVFUSE_LLAMA_MODELS_DIR "/llama.gguf";
    params.n_ctx = 4096;
    params.n_batch = params.n_ubatch = kUbatch;
    params.n_parallel = 1;
    params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 2;
    llama_model_params mp = common_model_params_to_llama(params);
    model = llama_model_load_from_file(params.model.path.c_str(), mp);
    if (model == nullptr) throw std::runtime_error("cannot load " + params.model.path);
    llama_context_params cp = common_context_params_to_llama(params);
    ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) throw std::runtime_error("cannot make a context");
    codec = learn_codec(llama::BlobFamily::attention, params, model, kChunk, kUbatch);
    TierStackOptions to;
    to.memory_bytes = std::size_t{256} << 20;
    tier = std::make_unique<TierStack>(to);
    SlotCacheOptions so;
    so.chunk_tokens = kChunk;
    so.slots = 1;
    so.max_prompt_tokens = 4096;
    so.model_id = model_identity(params, model, kChunk, kUbatch);
    cache = std::make_unique<SlotCache<TierStack, NoState>>(*codec, *tier, so);
  }
  ~Rig() {
    cache.reset();
    llama_free(ctx);
    llama_model_free(model);
  }

  // Prefills `prompt[0, n)` from an empty sequence; returns the FULL blob.
  std::vector<std::uint8_t> prefill(const std::vector<llama_token>& prompt, TokenCount n) {
    llama_memory_seq_rm(llama_get_memory(ctx), 0, -1, -1);
    if (decode_run(ctx, 0, 0, n, kUbatch, [&](TokenCount i) { return prompt[i]; }, [](TokenCount) {}) != n)
      throw std::runtime_error("prefill failed");
    return sequence_blob(ctx, 0, 0);
  }

  // Decodes prompt[n] with its logits: the first token of the reply is sampled from them.
  void first_token(const std::vector<llama_token>& prompt, TokenCount n) {
    llama_batch one = llama_batch_init(1, 0, 1);
    one.n_tokens = 1;
    one.token[0] = prompt[n];
    one.pos[0] = static_cast<llama_pos>(n);
    one.n_seq_id[0] = 1;
    one.seq_id[0][0] = 0;
    one.logits[0] = 1;
    const int rc = llama_decode(ctx, one);
    llama_batch_free(one);
    if (rc != 0) throw std::runtime_error("decode failed");
    benchmark::DoNotOptimize(llama_get_logits_ith(ctx, 0));
  }
};

Rig& rig() {
  static Rig r;
  return r;
}

std::vector<llama_token> prompt_of(TokenCount n) {
  std::mt19937 rng(static_cast<std::uint32_t>(n));
  std::vector<llama_token> p(n + 1);
  for (auto& t : p) t = static_cast<llama_token>(3 + rng() % 300);
  return p;
}

void BM_restore_llama(benchmark::State& state) {
  Rig& r = rig();
  const auto n = static_cast<TokenCount>(state.range(0));
  const std::vector<llama_token> prompt = prompt_of(n);
  const std::vector<std::uint8_t> blob = r.prefill(prompt, n);
  llama_memory_t mem = llama_get_memory(r.ctx);
  for (auto _ : state) {
    llama_memory_seq_rm(mem, 0, -1, -1);
    if (llama_state_seq_set_data_ext(r.ctx, blob.data(), blob.size(), 0, 0) == 0) state.SkipWithError("refused");
    r.first_token(prompt, n);
  }
  state.counters["blob_MiB"] = static_cast<double>(blob.size()) / (1 << 20);
}

void BM_restore_kvfuse(benchmark::State& state) {
  Rig& r = rig();
  const auto n = static_cast<TokenCount>(state.range(0));
  const std::vector<llama_token> prompt = prompt_of(n);
  {
    const std::vector<std::uint8_t> full = r.prefill(prompt, n);
    (void)r.cache->begin(0, prompt, 0);
    r.cache->finish(0, prompt, n, full);
  }
  llama_memory_t mem = llama_get_memory(r.ctx);
  const StreamPlace place{1, 0};
  TokenCount restored = 0;
  std::chrono::nanoseconds in_begin{0}, in_set{0}, in_decode{0}, in_finish{0};
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    llama_memory_seq_rm(mem, 0, -1, -1);
    Restore got = r.cache->begin(0, prompt, n);
    restored = got.boundary;
    const std::vector<std::uint8_t> blob = into_stream(r.codec->layout(), std::move(got.blob), place);
    const auto t1 = std::chrono::steady_clock::now();
    if (got.boundary != n || llama_state_seq_set_data_ext(r.ctx, blob.data(), blob.size(), 0, 0) == 0)
      state.SkipWithError("kvfuse did not restore the whole prefix");
    const auto t2 = std::chrono::steady_clock::now();
    r.first_token(prompt, n);
    const auto t3 = std::chrono::steady_clock::now();
    r.cache->finish(0, prompt, 0);
    in_begin += t1 - t0;
    in_set += t2 - t1;
    in_decode += t3 - t2;
    in_finish += std::chrono::steady_clock::now() - t3;
  }
  state.counters["restored"] = static_cast<double>(restored);
  // Where an iteration's time goes, in µs: the load and rebuild, llama.cpp's read of the blob,
  // the first token's decode, the admission's end.
  const double iterations = static_cast<double>(std::max<benchmark::IterationCount>(state.iterations(), 1));
  auto us = [&](std::chrono::nanoseconds d) { return static_cast<double>(d.count()) / 1e3 / iterations; };
  state.counters["load_us"] = us(in_begin);
  state.counters["set_us"] = us(in_set);
  state.counters["decode_us"] = us(in_decode);
  state.counters["finish_us"] = us(in_finish);
}

BENCHMARK(BM_restore_llama)->Arg(256)->Arg(1024)->Arg(2048)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_restore_kvfuse)->Arg(256)->Arg(1024)->Arg(2048)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
