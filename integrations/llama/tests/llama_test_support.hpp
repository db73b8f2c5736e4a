// What the llama integration's tests share: the tiny models, one runner per model, a
// seeded prompt, and a reference pass that keeps its KV in blocks and its state in slots.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <kvfuse/llama/sequence_runner.hpp>

namespace kvfuse::llama::testing {

/// One model under test and the grid it runs on.
struct ModelCase {
  std::string architecture;
  std::uint32_t block_tokens;            ///< deepseek4's compressed rows need 128
  std::vector<TokenCount> boundaries;    ///< where the reference pass snapshots its state
};

inline const ModelCase& model_case(const std::string& arch) {
  static const std::vector<ModelCase> cases = {
      {"llama", 64, {64, 128, 192, 256}},
      {"kimi-k3", 64, {64, 128, 192, 256}},
      {"deepseek4", 128, {128, 256}},
  };
  for (const ModelCase& c : cases)
    if (c.architecture == arch) return c;
  throw Error(ErrorCode::invalid_argument, "no test case for " + arch);
}

inline constexpr TokenCount prompt_tokens = 300;  // not on the grid: the tail is recomputed
inline constexpr std::size_t decode_tokens = 8;

/// The model and its runner, loaded once per test process.
inline const SequenceRunner& runner_for(const std::string& arch) {
  struct Loaded {
    std::unique_ptr<Model> model;
    std::unique_ptr<SequenceRunner> runner;
  };
  static std::map<std::string, Loaded> loaded;
  Loaded& l = loaded[arch];
  if (!l.runner) {
    l.model = std::make_unique<Model>(std::string(KVFUSE_LLAMA_MODELS_DIR) + "/" + arch + ".gguf");
    RunnerOptions options;
    options.ubatch_tokens = 64;
    options.threads = 2;
    options.context_tokens = 1024;
    options.block_tokens = model_case(arch).block_tokens;
    l.runner = std::make_unique<SequenceRunner>(*l.model, options);
  }
  return *l.runner;
}

/// A seeded prompt of random token ids (the specials 0..2 left out).
inline std::vector<llama_token> prompt(const SequenceRunner& runner, std::uint32_t seed = 7, TokenCount count = prompt_tokens) {
  std::mt19937 rng(seed);
  std::vector<llama_token> tokens(count);
  const auto vocab = static_cast<std::uint32_t>(runner.model().vocab_size());
  for (llama_token& t : tokens) t = static_cast<llama_token>(3 + rng() % (vocab - 3));
  return tokens;
}

/// A pool of blocks with a table that is neither contiguous nor in order, so a codec that
/// ignored the table would be caught.
struct Blocks {
  std::vector<std::byte> pool;
  std::vector<BlockId> table;
  Blocks(const SequenceCodec& codec, TokenCount tokens) {
    const std::size_t count = tokens / codec.block_tokens();
    pool.assign((2 * count + 1) * codec.block_bytes(), std::byte{0xA5});
    for (std::size_t i = 0; i < count; ++i) table.push_back(BlockId{static_cast<std::uint32_t>(2 * (count - i))});
  }
};

/// The pass every comparison is made against: the prompt prefilled with stops at each
/// boundary (its state snapshotted into a slot there), its KV on the block grid stored
/// into blocks, then greedy decoding.
struct Reference {
  std::vector<llama_token> prompt;
  Decoded decoded;
  Blocks blocks;
  std::map<TokenCount, std::vector<std::byte>> slots;
};

inline Reference reference_pass(const SequenceRunner& runner, std::uint32_t seed = 7) {
  const SequenceCodec& codec = runner.codec();
  const ModelCase& c = model_case(runner.model().architecture());
  const TokenCount kv_end = prompt_tokens / codec.block_tokens() * codec.block_tokens();
  Reference ref{prompt(runner, seed), {}, Blocks(codec, kv_end), {}};
  Sequence sequence = runner.start();
  for (const TokenCount boundary : c.boundaries) {
    sequence.prefill(std::span(ref.prompt).subspan(sequence.position(), boundary - sequence.position()), false);
    if (codec.slot_bytes() != 0) {
      std::vector<std::byte>& slot = ref.slots[boundary];
      slot.resize(codec.slot_bytes());
      sequence.store_state(slot);
    }
  }
  sequence.prefill(std::span(ref.prompt).subspan(sequence.position()), true);
  sequence.store_kv(0, kv_end, ref.blocks.pool.data(), ref.blocks.table);
  ref.decoded = sequence.decode(decode_tokens);
  return ref;
}

/// A sequence resumed at `boundary` from `blocks` and `slot`, run to the end of the prompt
/// and decoded.
inline Decoded resumed_pass(const SequenceRunner& runner, const Reference& ref, TokenCount boundary, const Blocks& blocks,
                            std::span<const std::byte> slot) {
  Sequence sequence = runner.resume(boundary, blocks.pool.data(), blocks.table, slot);
  sequence.prefill(std::span(ref.prompt).subspan(boundary), true);
  return sequence.decode(decode_tokens);
}

/// Bitwise equality of two logit vectors.
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// The largest absolute difference of two logit vectors of one size, for messages.
inline double largest_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double most = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    most = std::max(most, static_cast<double>(a[i] > b[i] ? a[i] - b[i] : b[i] - a[i]));
  return most;
}

}  // namespace kvfuse::llama::testing
