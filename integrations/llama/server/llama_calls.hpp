// llama_calls.hpp — the llama.cpp calls kvfuse-llama-server's backend makes of its own, beside
// the server's: the model's architecture from its GGUF header, a sequence's state blob, a run
// of tokens decoded on the ubatch grid, the blob layout learned in a scratch context, and the
// identity of what decides a saved byte.
//
// Threading: llama-server's main loop (a llama_context is not thread-safe), or main() before
// the server starts for architecture_of.
#pragma once

#include "common.h"
#include "gguf.h"
#include "llama.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <kvfuse/kvfuse.hpp>
#include <kvfuse/llama/blob_codec.hpp>

namespace kvfuse::llama_server {

/// The GGUF file's general.architecture, or empty when the file or the key cannot be read.
inline std::string architecture_of(const std::string& path) {
  gguf_init_params p{};
  p.no_alloc = true;
  p.ctx = nullptr;
  gguf_context* g = gguf_init_from_file(path.c_str(), p);
  if (g == nullptr) return {};
  std::string arch;
  const int64_t k = gguf_find_key(g, "general.architecture");
  if (k >= 0) arch = gguf_get_val_str(g, k);
  gguf_free(g);
  return arch;
}

/// Sequence `seq`'s state blob as llama.cpp writes it (`flags` 0: the FULL blob).
inline std::vector<std::uint8_t> sequence_blob(llama_context* ctx, int32_t seq, llama_state_seq_flags flags) {
  std::vector<std::uint8_t> blob(llama_state_seq_get_size_ext(ctx, seq, flags));
  blob.resize(llama_state_seq_get_data_ext(ctx, blob.data(), blob.size(), seq, flags));
  return blob;
}

/// Decodes token(i) for i in [from, to) into sequence `seq` in batches of `ubatch` (so a run
/// that starts on the grid runs the ubatches a prefill from token 0 runs), no outputs, and
/// calls after(at) once the cells of [0, at) exist. Returns how far it got: `to`, or where a
/// decode failed.
template <class TokenAt, class After>
TokenCount decode_run(llama_context* ctx, int32_t seq, TokenCount from, TokenCount to, std::uint32_t ubatch,
                      TokenAt token, After after) {
  llama_batch batch = llama_batch_init(static_cast<std::int32_t>(ubatch), 0, 1);
  TokenCount at = from;
  while (at < to) {
    const TokenCount take = std::min<TokenCount>(ubatch, to - at);
    batch.n_tokens = static_cast<std::int32_t>(take);
    for (TokenCount k = 0; k < take; ++k) {
      batch.token[k] = token(at + k);
      batch.pos[k] = static_cast<llama_pos>(at + k);
      batch.n_seq_id[k] = 1;
      batch.seq_id[k][0] = seq;
      batch.logits[k] = 0;
    }
    if (llama_decode(ctx, batch) != 0) break;
    at += take;
    after(at);
  }
  llama_batch_free(batch);
  return at;
}

/// Learns `family`'s blob layout in a small context of the server's own settings holding one
/// sequence (the codec's grammar) and checks that the codec rebuilds llama.cpp's blob from
/// what it stores. Throws Error (io_failure: no context or a failed decode; corrupt_data: the
/// rebuilt blob differs; what learn_layout throws).
inline std::unique_ptr<llama::SequenceCodec> learn_codec(llama::BlobFamily family, const common_params& params,
                                                         const llama_model* model, std::uint32_t chunk, std::uint32_t ubatch) {
  llama_context_params cp = common_context_params_to_llama(params);
  cp.n_ctx = chunk + 256;
  cp.n_seq_max = 1;
  cp.n_batch = cp.n_ubatch = ubatch;
  cp.kv_unified = true;
  llama_context* c = llama_init_from_model(const_cast<llama_model*>(model), cp);
  if (c == nullptr) throw Error(ErrorCode::io_failure, "llama.cpp could not make a context to learn the blob layout");
  const std::unique_ptr<llama_context, void (*)(llama_context*)> owned(c, llama_free);
  const auto vocab = static_cast<TokenCount>(llama_vocab_n_tokens(llama_model_get_vocab(model)));
  auto token = [&](TokenCount i) { return static_cast<llama_token>(3 + (i * 37) % (vocab - 3)); };
  if (decode_run(c, 0, 0, chunk, ubatch, token, [](TokenCount) {}) != chunk)
    throw Error(ErrorCode::io_failure, "llama_decode failed while learning the blob layout");
  const std::vector<std::uint8_t> full = sequence_blob(c, 0, 0), partial = sequence_blob(c, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
  auto codec = std::make_unique<llama::SequenceCodec>(llama::learn_layout(family, full, partial), chunk);
  std::vector<std::byte> pool(codec->block_bytes());
  const BlockId b0{0};
  codec->store_kv(full, 0, chunk, pool.data(), std::span(&b0, 1));
  std::vector<std::byte> slot(codec->slot_bytes());
  if (!slot.empty()) codec->store_state(partial, slot);
  std::vector<std::uint8_t> rebuilt;
  codec->rebuild(chunk, pool.data(), std::span(&b0, 1), slot, rebuilt);
  if (rebuilt != full)
    throw Error(ErrorCode::corrupt_data, "the rebuilt blob of " + std::to_string(rebuilt.size()) +
                                             " bytes differs from llama.cpp's of " + std::to_string(full.size()));
  return codec;
}

/// Everything besides the tokens that decides a saved byte, hashed: servers that share a tier
/// share an entry only when they would have computed the same bytes.
inline std::uint64_t model_identity(const common_params& params, const llama_model* model, std::uint32_t chunk,
                                    std::uint32_t ubatch) {
  auto mix_in = [](std::uint64_t h, std::uint64_t v) { return mix64(h ^ (v + 0x9e3779b97f4a7c15ULL)); };
  char desc[256] = {};
  (void)llama_model_desc(model, desc, sizeof desc);
  std::uint64_t h = 0x6b7666757365ULL;
  for (const char ch : std::string(desc)) h = mix_in(h, static_cast<unsigned char>(ch));
  for (const std::uint64_t v :
       {std::uint64_t(llama_model_n_params(model)), std::uint64_t(llama_model_size(model)),
        std::uint64_t(llama_vocab_n_tokens(llama_model_get_vocab(model))), std::uint64_t(chunk), std::uint64_t(ubatch),
        std::uint64_t(params.cache_type_k), std::uint64_t(params.cache_type_v), std::uint64_t(params.swa_full),
        std::uint64_t(static_cast<std::int64_t>(params.flash_attn_type)), std::uint64_t(params.cpuparams_batch.n_threads)})
    h = mix_in(h, v);
  return h;
}

}  // namespace kvfuse::llama_server
