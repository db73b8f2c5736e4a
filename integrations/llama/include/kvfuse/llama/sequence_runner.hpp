// kvfuse/llama/sequence_runner.hpp — runs llama.cpp sequences so that a sequence resumed
// from blocks and a slot continues bit for bit as if it had never stopped.
//
// Every sequence gets a fresh context of its own (one sequence, so its cells are its
// positions in order), the same ubatch size and thread count, and flash attention off;
// prefill is cut on a fixed grid of ubatches counted from token 0, so a sequence that
// stops at a block boundary and one that resumes there run the same ubatches with the
// same numbers. docs/llama.md says why each condition matters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <llama.h>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/llama/blob_codec.hpp>

namespace kvfuse::llama {

class SequenceRunner;

/// A model loaded from a GGUF file (CPU only). Load throws Error(io_failure) naming the
/// path. Immutable after construction; contexts of it may run on several threads at once.
class Model {
 public:
  explicit Model(const std::string& path);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  [[nodiscard]] llama_model* get() const noexcept { return model_; }
  /// The GGUF's general.architecture ("llama", "kimi-k3", "deepseek4", ...).
  [[nodiscard]] const std::string& architecture() const noexcept { return architecture_; }
  [[nodiscard]] std::int32_t vocab_size() const noexcept { return vocab_size_; }

 private:
  llama_model* model_ = nullptr;
  std::string architecture_;
  std::int32_t vocab_size_ = 0;
};

/// The settings every context of a runner shares: both passes of a comparison must use the
/// same ones, since each changes how llama.cpp splits its arithmetic.
struct RunnerOptions {
  std::uint32_t ubatch_tokens = 64;    ///< n_batch = n_ubatch; divides block_tokens
  std::int32_t threads = 2;            ///< n_threads = n_threads_batch
  std::uint32_t context_tokens = 1024; ///< n_ctx of each sequence's context
  std::uint32_t block_tokens = 128;    ///< tokens per kvfuse block: the checkpoint grid
};

/// What a sequence produced after its prompt: its greedy tokens, and the logits of the
/// first decode step (the prompt's last position).
struct Decoded {
  std::vector<llama_token> tokens;
  std::vector<float> first_logits;
};

/// One sequence in a context of its own. Only one thread uses a Sequence at a time;
/// its calls may block (they run llama.cpp) and allocate, and throw Error on failure.
class Sequence {
 public:
  ~Sequence();
  Sequence(Sequence&& other) noexcept;
  Sequence& operator=(Sequence&&) = delete;
  Sequence(const Sequence&) = delete;

  /// Tokens the sequence holds.
  [[nodiscard]] TokenCount position() const noexcept { return position_; }

  /// Decodes `tokens` after position(), in ubatches cut on the runner's ubatch grid
  /// (counted from token 0). With `logits_at_end` the last token's logits are kept for
  /// decode(). Throws Error(device_failure) if llama_decode fails.
  void prefill(std::span<const llama_token> tokens, bool logits_at_end);

  /// Takes the FULL blob of the sequence (llama_state_seq_get_data).
  [[nodiscard]] std::vector<std::uint8_t> full_blob() const;
  /// Takes the PARTIAL_ONLY blob (the state part; for llama, the whole cache).
  [[nodiscard]] std::vector<std::uint8_t> partial_blob() const;

  /// Writes tokens [begin, end) of the sequence into blocks of `pool` (SequenceCodec::store_kv).
  void store_kv(TokenCount begin, TokenCount end, std::byte* pool, std::span<const BlockId> blocks) const;
  /// Snapshots the state at position() into `slot` (SequenceCodec::store_state); the
  /// position must be on the block grid.
  void store_state(std::span<std::byte> slot) const;

  /// Greedy decoding of `count` tokens after a prefill that kept its logits.
  Decoded decode(std::size_t count);

 private:
  friend class SequenceRunner;
  Sequence(const SequenceRunner& runner, llama_context* context) noexcept;
  const SequenceRunner* runner_;
  llama_context* context_;
  TokenCount position_ = 0;
  bool have_logits_ = false;
};

/// Makes sequences of one model, fresh or resumed from blocks and a slot, and owns the
/// codec that maps the model's blobs to kvfuse's blocks and slots. Construction runs one
/// short sequence to learn the blob layout and checks that the codec rebuilds llama.cpp's
/// own blob byte for byte; it throws Error(invalid_argument) for options that cannot give
/// bitwise resumes and Error(corrupt_data) if the blob is not what state_blob.hpp says.
/// start() and resume() may be called from any thread.
class SequenceRunner {
 public:
  SequenceRunner(const Model& model, RunnerOptions options);

  [[nodiscard]] const Model& model() const noexcept { return *model_; }
  [[nodiscard]] const RunnerOptions& options() const noexcept { return options_; }
  [[nodiscard]] const SequenceCodec& codec() const noexcept { return *codec_; }

  /// An empty sequence in a fresh context.
  [[nodiscard]] Sequence start() const;

  /// A sequence at `boundary` tokens rebuilt from blocks [0, boundary) of `pool`
  /// (`blocks[i]` holding tokens [i * block_tokens, ...)) and, for a model with state, the
  /// slot snapshotted at that boundary. Throws Error(corrupt_data) if llama.cpp refuses the
  /// rebuilt blob.
  [[nodiscard]] Sequence resume(TokenCount boundary, const std::byte* pool, std::span<const BlockId> blocks,
                                std::span<const std::byte> slot) const;

 private:
  friend class Sequence;
  [[nodiscard]] llama_context* make_context() const;

  const Model* model_;
  RunnerOptions options_;
  std::unique_ptr<SequenceCodec> codec_;
};

}  // namespace kvfuse::llama
