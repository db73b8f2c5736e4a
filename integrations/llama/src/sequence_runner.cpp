#include <kvfuse/llama/sequence_runner.hpp>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <utility>

namespace kvfuse::llama {

namespace {

// llama.cpp logs every context's set-up at info level; only its errors are worth a line.
void log_errors_only(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

void init_llama_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    llama_log_set(log_errors_only, nullptr);
    llama_backend_init();
  });
}

llama_token argmax(const float* logits, std::int32_t count) {
  return static_cast<llama_token>(std::max_element(logits, logits + count) - logits);
}

// The tokens a runner decodes to learn the blob layout: any fixed tokens would do.
std::vector<llama_token> learning_prompt(TokenCount count, std::int32_t vocab) {
  std::vector<llama_token> tokens(count);
  for (TokenCount i = 0; i < count; ++i) tokens[i] = static_cast<llama_token>(3 + (i * 37) % (vocab - 3));
  return tokens;
}

}  // namespace

Model::Model(const std::string& path) {
  init_llama_once();
  llama_model_params params = llama_model_default_params();
  params.n_gpu_layers = 0;
  model_ = llama_model_load_from_file(path.c_str(), params);
  if (model_ == nullptr) throw Error(ErrorCode::io_failure, "llama.cpp could not load the model '" + path + "'");
  char arch[128] = {};
  if (llama_model_meta_val_str(model_, "general.architecture", arch, sizeof arch) < 0) {
    llama_model_free(model_);
    throw Error(ErrorCode::corrupt_data, "the model '" + path + "' names no general.architecture");
  }
  architecture_ = arch;
  vocab_size_ = llama_vocab_n_tokens(llama_model_get_vocab(model_));
}

Model::~Model() { llama_model_free(model_); }

Sequence::Sequence(const SequenceRunner& runner, llama_context* context) noexcept : runner_(&runner), context_(context) {}

Sequence::Sequence(Sequence&& other) noexcept
    : runner_(other.runner_),
      context_(std::exchange(other.context_, nullptr)),
      position_(other.position_),
      have_logits_(other.have_logits_) {}

Sequence::~Sequence() {
  if (context_ != nullptr) llama_free(context_);
}

void Sequence::prefill(std::span<const llama_token> tokens, bool logits_at_end) {
  const std::uint32_t ubatch = runner_->options().ubatch_tokens;
  llama_batch batch = llama_batch_init(static_cast<std::int32_t>(ubatch), 0, 1);
  std::size_t done = 0;
  while (done < tokens.size()) {
    // Never cross a multiple of the ubatch: a resumed sequence then runs the same ubatches.
    const std::size_t take = std::min<std::size_t>(tokens.size() - done, ubatch - position_ % ubatch);
    batch.n_tokens = static_cast<std::int32_t>(take);
    for (std::size_t k = 0; k < take; ++k) {
      batch.token[k] = tokens[done + k];
      batch.pos[k] = static_cast<llama_pos>(position_ + k);
      batch.n_seq_id[k] = 1;
      batch.seq_id[k][0] = 0;
      batch.logits[k] = logits_at_end && done + k + 1 == tokens.size();
    }
    const std::int32_t rc = llama_decode(context_, batch);
    if (rc != 0) {
      llama_batch_free(batch);
      throw Error(ErrorCode::device_failure, "llama_decode returned " + std::to_string(rc) + " at position " +
                                                 std::to_string(position_));
    }
    position_ += take;
    done += take;
  }
  llama_batch_free(batch);
  have_logits_ = logits_at_end && !tokens.empty();
}

std::vector<std::uint8_t> Sequence::full_blob() const {
  std::vector<std::uint8_t> blob(llama_state_seq_get_size(context_, 0));
  if (blob.empty() || llama_state_seq_get_data(context_, blob.data(), blob.size(), 0) != blob.size())
    throw Error(ErrorCode::device_failure, "llama_state_seq_get_data failed at position " + std::to_string(position_));
  return blob;
}

std::vector<std::uint8_t> Sequence::partial_blob() const {
  std::vector<std::uint8_t> blob(llama_state_seq_get_size_ext(context_, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY));
  if (blob.empty() ||
      llama_state_seq_get_data_ext(context_, blob.data(), blob.size(), 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) != blob.size())
    throw Error(ErrorCode::device_failure, "llama_state_seq_get_data_ext(PARTIAL_ONLY) failed at position " +
                                               std::to_string(position_));
  return blob;
}

void Sequence::store_kv(TokenCount begin, TokenCount end, std::byte* pool, std::span<const BlockId> blocks) const {
  runner_->codec().store_kv(full_blob(), begin, end, pool, blocks);
}

void Sequence::store_state(std::span<std::byte> slot) const {
  if (position_ % runner_->codec().block_tokens() != 0)
    throw Error(ErrorCode::invalid_argument, "a state snapshot must be taken on the block grid, not at position " +
                                                 std::to_string(position_));
  runner_->codec().store_state(partial_blob(), slot);
}

Decoded Sequence::decode(std::size_t count) {
  if (!have_logits_) throw Error(ErrorCode::invalid_argument, "decode() needs a prefill that kept its last logits");
  const std::int32_t vocab = runner_->model().vocab_size();
  Decoded out;
  llama_batch batch = llama_batch_init(1, 0, 1);
  for (std::size_t step = 0; step < count; ++step) {
    const float* logits = llama_get_logits_ith(context_, -1);
    if (step == 0) out.first_logits.assign(logits, logits + vocab);
    const llama_token next = argmax(logits, vocab);
    out.tokens.push_back(next);
    if (step + 1 == count) break;
    batch.n_tokens = 1;
    batch.token[0] = next;
    batch.pos[0] = static_cast<llama_pos>(position_);
    batch.n_seq_id[0] = 1;
    batch.seq_id[0][0] = 0;
    batch.logits[0] = 1;
    if (const std::int32_t rc = llama_decode(context_, batch); rc != 0) {
      llama_batch_free(batch);
      throw Error(ErrorCode::device_failure, "llama_decode returned " + std::to_string(rc) + " decoding position " +
                                                 std::to_string(position_));
    }
    ++position_;
  }
  llama_batch_free(batch);
  have_logits_ = false;
  return out;
}

SequenceRunner::SequenceRunner(const Model& model, RunnerOptions options) : model_(&model), options_(options) {
  const auto bad = [](const std::string& what) { throw Error(ErrorCode::invalid_argument, what); };
  if (options_.ubatch_tokens == 0) bad("ubatch_tokens must be > 0, got 0");
  if (options_.threads <= 0) bad("threads must be > 0, got " + std::to_string(options_.threads));
  if (options_.block_tokens == 0 || options_.block_tokens % options_.ubatch_tokens != 0)
    bad("block_tokens must be a positive multiple of ubatch_tokens (" + std::to_string(options_.ubatch_tokens) + "), got " +
        std::to_string(options_.block_tokens));
  const BlobFamily family = family_of_architecture(model.architecture());

  // Learn the layout from a sequence long enough that a sliding window is full, so its
  // state has the size it keeps at every later boundary.
  const TokenCount window = static_cast<TokenCount>(std::max(0, llama_model_n_swa(model.get())));
  const TokenCount length = options_.block_tokens * std::max<TokenCount>(1, (window + options_.block_tokens - 1) / options_.block_tokens);
  if (length > options_.context_tokens)
    bad("context_tokens must hold " + std::to_string(length) + " tokens (the sliding window on the block grid), got " +
        std::to_string(options_.context_tokens));
  Sequence probe = start();
  probe.prefill(learning_prompt(length, model.vocab_size()), false);
  const std::vector<std::uint8_t> full = probe.full_blob();
  const std::vector<std::uint8_t> partial = probe.partial_blob();
  codec_ = std::make_unique<SequenceCodec>(learn_layout(family, full, partial), options_.block_tokens);

  // The codec must give llama.cpp's own blob back, byte for byte, or nothing it rebuilds
  // can be trusted.
  const std::size_t blocks = length / options_.block_tokens;
  std::vector<std::byte> pool(blocks * codec_->block_bytes());
  std::vector<BlockId> table(blocks);
  for (std::size_t i = 0; i < blocks; ++i) table[i] = BlockId{static_cast<std::uint32_t>(blocks - 1 - i)};
  std::vector<std::byte> slot(codec_->slot_bytes());
  codec_->store_kv(full, 0, length, pool.data(), table);
  if (!slot.empty()) codec_->store_state(partial, slot);
  std::vector<std::uint8_t> rebuilt;
  codec_->rebuild(length, pool.data(), table, slot, rebuilt);
  if (rebuilt != full)
    throw Error(ErrorCode::corrupt_data, "the codec does not rebuild llama.cpp's blob of " + std::to_string(full.size()) +
                                             " bytes for '" + model.architecture() + "' byte for byte");
}

llama_context* SequenceRunner::make_context() const {
  llama_context_params params = llama_context_default_params();
  params.n_ctx = options_.context_tokens;
  params.n_batch = options_.ubatch_tokens;
  params.n_ubatch = options_.ubatch_tokens;
  params.n_seq_max = 1;
  params.n_threads = options_.threads;
  params.n_threads_batch = options_.threads;
  params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  params.kv_unified = false;
  params.no_perf = true;
  llama_context* context = llama_init_from_model(model_->get(), params);
  if (context == nullptr) throw Error(ErrorCode::device_failure, "llama_init_from_model failed for '" + model_->architecture() + "'");
  return context;
}

Sequence SequenceRunner::start() const { return Sequence(*this, make_context()); }

Sequence SequenceRunner::resume(TokenCount boundary, const std::byte* pool, std::span<const BlockId> blocks,
                                std::span<const std::byte> slot) const {
  std::vector<std::uint8_t> blob;
  codec_->rebuild(boundary, pool, blocks, slot, blob);
  Sequence sequence(*this, make_context());
  if (llama_state_seq_set_data(sequence.context_, blob.data(), blob.size(), 0) != blob.size())
    throw Error(ErrorCode::corrupt_data, "llama.cpp refused the rebuilt blob of " + std::to_string(blob.size()) +
                                             " bytes at boundary " + std::to_string(boundary));
  // A state snapshotted at another boundary can carry its own positions (deepseek4's
  // window does); llama.cpp would refuse the next token only later, with a less telling
  // message. (A hybrid model reports the lower of its two caches' last positions, so a
  // kimi-k3 KDA state of an earlier boundary is caught here and one of a later boundary is
  // not: the KDA state's bytes say nothing else about where it was taken.)
  const llama_pos last = llama_memory_seq_pos_max(llama_get_memory(sequence.context_), 0);
  if (last + 1 != static_cast<llama_pos>(boundary))
    throw Error(ErrorCode::corrupt_data, "the rebuilt sequence ends at position " + std::to_string(last) +
                                             ", not at boundary " + std::to_string(boundary) +
                                             " - 1: its state slot belongs to another boundary");
  sequence.position_ = boundary;
  return sequence;
}

}  // namespace kvfuse::llama
