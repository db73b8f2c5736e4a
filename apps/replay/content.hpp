// kvfuse-replay: what the simulated model writes, so every byte a load restores can be
// checked without keeping a copy. KV content is a function of (token position, the prefix
// block it belongs to, rank); the state is a digest folded over the prompt's blocks, so the
// state at boundary B is a function of the tokens before B and nothing else. Pure functions
// of a request and a position: any thread.
#pragma once

#include "workload.hpp"

#include <kvfuse/bridge/ids.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace replay {

using kvfuse::mix64;

/// The device geometry every model of the replay shares: 64-token blocks, one 8-byte word
/// per token per rank, and state slots of one chunk's KV (4 KiB per rank) unless
/// --state-scale makes them larger (RankSetup::slot_bytes).
inline constexpr std::uint32_t block_tokens = 64;
inline constexpr std::size_t kv_bytes_per_token = 8;
inline constexpr std::size_t block_bytes = block_tokens * kv_bytes_per_token;
inline constexpr std::size_t default_slot_bytes = std::size_t{chunk_tokens} * kv_bytes_per_token;
static_assert(default_slot_bytes == 4096);

/// Identity of the tokens of one block: the chunk's key and the block's position. Two
/// requests whose chunk keys agree up to a block hold the same tokens there.
inline std::uint64_t block_identity(std::uint64_t chunk_key, std::size_t block_index) noexcept {
  return mix64(chunk_key ^ (0x9e3779b97f4a7c15ULL * (block_index + 1)));
}

/// The identity of block `b` of request `q`.
inline std::uint64_t block_id(const Request& q, std::size_t b) noexcept {
  return block_identity(q.chunk_keys[b * block_tokens / chunk_tokens].value, b);
}

/// One 8-byte word of token `t`'s KV on `rank` (word `w` of the token's slice).
inline std::uint64_t kv_word(std::uint64_t block_id, std::uint64_t t, std::uint32_t rank, std::size_t w) noexcept {
  return mix64(block_id ^ mix64(t * 0xff51afd7ed558ccdULL + w) ^ (std::uint64_t{rank} << 48));
}

/// The state before any token.
inline constexpr std::uint64_t initial_state = 0x6b7666757365ULL;

/// The recurrence: the state after one more block of tokens.
inline std::uint64_t advance_state(std::uint64_t state, std::uint64_t block_id) noexcept {
  return mix64(state ^ block_id) + 0x632be59bd9b4e019ULL;
}

/// The state of `q` at `boundary` (whole blocks), continuing from `from_state` at `from`.
inline std::uint64_t state_at(const Request& q, TokenCount boundary, std::uint64_t from_state = initial_state,
                              TokenCount from = 0) noexcept {
  std::uint64_t s = from_state;
  for (std::size_t b = from / block_tokens; b < boundary / block_tokens; ++b) s = advance_state(s, block_id(q, b));
  return s;
}

/// Word j of a state slot on `rank` that holds `digest`: word 0 is the digest itself (what
/// the model continues from), the rest a rank-specific expansion of it.
inline std::uint64_t state_word(std::uint64_t digest, std::uint32_t rank, std::size_t j) noexcept {
  return j == 0 ? digest : mix64(digest + j + (std::uint64_t{rank} << 40));
}

/// The hashes the index keys state checkpoints by: a model's chain over a prompt's chunk
/// keys, so equal hashes mean equal prefixes of the same model.
struct StateChain {
  std::uint64_t value;
  /// The chain before any chunk of `model`'s prompts.
  static StateChain start(std::uint64_t model) noexcept { return {mix64(model ^ 0x5354415445ULL)}; }
  /// The chain after one more chunk.
  StateChain next(kvfuse::PrefixHash chunk_key) const noexcept { return {mix64(value ^ chunk_key.value)}; }
  /// The checkpoint hash at `boundary`, this chain covering the chunks before it.
  kvfuse::PrefixHash at(TokenCount boundary) const noexcept { return kvfuse::PrefixHash{mix64(value + boundary)}; }
  /// The checkpoint hash of `q` at `boundary` (on the block grid), walking the chain from
  /// the start over every chunk the tokens before it touch. A boundary inside a chunk takes
  /// that chunk's key too: the blocks before it are named by it (block_id), so two prompts
  /// that differ in that chunk differ in the state there and must not share the hash.
  static kvfuse::PrefixHash of(std::uint64_t model, const Request& q, TokenCount boundary) noexcept {
    StateChain chain = start(model);
    for (std::size_t c = 0; c * chunk_tokens < boundary; ++c) chain = chain.next(q.chunk_keys[c]);
    return chain.at(boundary);
  }
};

inline void store_word(std::byte* at, std::uint64_t v) noexcept { std::memcpy(at, &v, sizeof v); }
inline std::uint64_t load_word(const std::byte* at) noexcept {
  std::uint64_t v;
  std::memcpy(&v, at, sizeof v);
  return v;
}

/// Bytes of `a` and `b` (8 each) that differ.
inline std::size_t differing_bytes(std::uint64_t a, std::uint64_t b) noexcept {
  std::size_t n = 0;
  for (std::uint64_t x = a ^ b; x != 0; x >>= 8) n += (x & 0xff) != 0;
  return n;
}

}  // namespace replay
