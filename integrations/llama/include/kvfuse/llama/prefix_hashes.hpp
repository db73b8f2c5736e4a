// kvfuse/llama/prefix_hashes.hpp — what names a llama.cpp engine's saved bytes: the prefix
// hashes of a token sequence at every block boundary (from which the tier's chunk keys, the
// state checkpoints' hashes and the prefix cache's block identities are salted), and the
// model id that goes into every tier key.
//
// Equal hashes mean equal tokens, which is what lets the tier and the prefix cache share
// across requests; the model id names everything that changes a saved byte besides the
// tokens, so engines that share a tier share an entry only when it holds the same
// computation. Pure functions of their inputs: any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/llama/sequence_runner.hpp>

namespace kvfuse::llama {

/// The id for ServeOptions::model_id: a hash of what decides a saved byte — the model's
/// architecture and vocabulary, the grids and the runner's ubatch and threads. Any thread.
inline std::uint64_t model_id_for(const SequenceRunner& runner, std::uint32_t chunk_tokens) {
  std::uint64_t h = 0x6b7666757365ULL;
  for (const char c : runner.model().architecture()) h = mix64(h ^ static_cast<unsigned char>(c));
  for (const std::uint64_t v : {std::uint64_t(runner.model().vocab_size()), std::uint64_t(runner.options().block_tokens),
                                std::uint64_t(chunk_tokens), std::uint64_t(runner.options().ubatch_tokens),
                                std::uint64_t(runner.options().threads)})
    h = mix64(h ^ v);
  return h;
}

/// Content hashes of a token sequence's prefixes at every block boundary. The tier's chunk
/// keys, the state checkpoints' hashes and the cached blocks' identities are three salts of
/// the same prefix hash. Any thread.
class PrefixHashes {
 public:
  PrefixHashes(std::span<const llama_token> tokens, std::uint32_t block_tokens) : block_tokens_(block_tokens) {
    std::uint64_t h = 0x7072656669780aULL;
    at_.push_back(h);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      h = mix64(h ^ (static_cast<std::uint64_t>(static_cast<std::uint32_t>(tokens[i])) + 0x9e3779b97f4a7c15ULL));
      if ((i + 1) % block_tokens == 0) at_.push_back(h);
    }
  }
  /// The hash of tokens [0, boundary), boundary on the block grid and within the tokens.
  [[nodiscard]] std::uint64_t at(TokenCount boundary) const { return at_.at(boundary / block_tokens_); }
  /// The tier key of the chunk that ends at `end`.
  [[nodiscard]] PrefixHash chunk_key(TokenCount end) const { return PrefixHash{mix64(at(end) ^ 0x6b76ULL)}; }
  /// The hash a state checkpoint at `boundary` is indexed and stored under.
  [[nodiscard]] PrefixHash state_hash(TokenCount boundary) const { return PrefixHash{mix64(at(boundary) ^ 0x7374ULL)}; }
  /// The prefix-cache identity of the block that ends at `end`.
  [[nodiscard]] std::uint64_t block_identity(TokenCount end) const { return mix64(at(end) ^ 0x626cULL); }
  /// Whole blocks covered.
  [[nodiscard]] std::size_t blocks() const noexcept { return at_.size() - 1; }

 private:
  std::uint32_t block_tokens_;
  std::vector<std::uint64_t> at_;
};

}  // namespace kvfuse::llama
