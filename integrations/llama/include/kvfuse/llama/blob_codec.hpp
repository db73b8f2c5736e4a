// kvfuse/llama/blob_codec.hpp — a sequence's saved state as kvfuse blocks and a slot.
//
// kvfuse's rank side moves bytes between a tier and two engine pools: paged KV blocks of
// block_tokens * kv_bytes_per_token bytes, and state slots of slot_bytes. This codec gives
// a llama.cpp sequence that shape. Its KV rows go into blocks in a fixed layout: granule g
// (granule_tokens tokens: 1 for llama and kimi-k3, 128 for deepseek4) starts at byte
// (g * granule_tokens % block_tokens) * kv_bytes_per_token of block table[g * granule_tokens /
// block_tokens] and holds, run after run (layer K rows, layer V rows, compressed rows),
// that granule's rows; with one-token granules token t is at (t % block_tokens) *
// kv_bytes_per_token. A slot holds the state part of a PARTIAL_ONLY blob taken at a
// boundary, behind its length. Blocks [0, B) and the slot taken at B rebuild a blob that
// resumes the sequence at B. What the blob looks like is state_blob.hpp's business only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/error.hpp>
#include <kvfuse/llama/state_blob.hpp>

namespace kvfuse::llama {

/// Maps one model's blobs to blocks and slots. Immutable after construction; every member
/// may be called from any thread at once.
class SequenceCodec {
 public:
  /// Bytes in front of a slot's state: its length, as a little-endian u64.
  static constexpr std::size_t slot_header_bytes = 8;

  /// A codec for `layout` with blocks of `block_tokens` tokens. Throws
  /// Error(invalid_argument) naming block_tokens unless it is a positive multiple of the
  /// layout's granule.
  SequenceCodec(BlobLayout layout, std::uint32_t block_tokens) : layout_(std::move(layout)), block_tokens_(block_tokens) {
    const std::uint32_t granule = layout_.granule_tokens;
    if (block_tokens_ == 0 || granule == 0 || block_tokens_ % granule != 0)
      throw Error(ErrorCode::invalid_argument, "block_tokens must be a positive multiple of the model's granule (" +
                                                   std::to_string(granule) + " tokens), got " + std::to_string(block_tokens));
    kv_bytes_per_token_ = (layout_.granule_bytes() + granule - 1) / granule;
    std::size_t offset = 0;
    for (const RowRun& r : layout_.runs) {
      run_offsets_.push_back(offset);
      offset += std::size_t{granule / r.tokens_per_row} * r.row_bytes;
    }
  }

  /// The blob layout this codec reads and writes.
  [[nodiscard]] const BlobLayout& layout() const noexcept { return layout_; }
  /// Tokens per block; also the grid of boundaries a resume may start from.
  [[nodiscard]] std::uint32_t block_tokens() const noexcept { return block_tokens_; }
  /// KV bytes per token: the granule's bytes over its tokens, rounded up (the rounding is
  /// zero padding at the granule's end).
  [[nodiscard]] std::size_t kv_bytes_per_token() const noexcept { return kv_bytes_per_token_; }
  /// Bytes of one block.
  [[nodiscard]] std::size_t block_bytes() const noexcept { return std::size_t{block_tokens_} * kv_bytes_per_token_; }
  /// Where run `run`'s rows start inside a granule (bytes from the granule's start).
  [[nodiscard]] std::size_t run_offset(std::size_t run) const noexcept { return run_offsets_[run]; }
  /// Bytes of one slot; 0 when the model has no state (the attention family).
  [[nodiscard]] std::size_t slot_bytes() const noexcept {
    return layout_.family == BlobFamily::attention ? 0 : slot_header_bytes + layout_.state_bytes;
  }

  /// Writes tokens [begin, end) of the sequence whose FULL blob is `full` into blocks:
  /// `blocks[i]` (a block of `pool`) receives tokens [begin + i * block_tokens, ...). begin
  /// and end lie on the block grid, end within the blob's tokens. Throws
  /// Error(invalid_argument) for a bad range or too few blocks, Error(corrupt_data) for a
  /// blob that is not this model's. Allocates (the blob's run table).
  void store_kv(std::span<const std::uint8_t> full, TokenCount begin, TokenCount end, std::byte* pool,
                std::span<const BlockId> blocks) const {
    const BlobRows rows = locate_rows(layout_, full);
    check_range(begin, end, rows.tokens, blocks.size());
    const std::uint32_t granule = layout_.granule_tokens;
    for (TokenCount g = begin / granule; g < end / granule; ++g) {
      std::byte* dst = granule_in(pool, blocks, begin, g);
      for (std::size_t i = 0; i < layout_.runs.size(); ++i) {
        const RowRun& r = layout_.runs[i];
        const std::uint64_t per_granule = granule / r.tokens_per_row;
        for (std::uint64_t j = 0; j < per_granule; ++j)
          copy_row(layout_, rows, i, g * per_granule + j, dst + run_offsets_[i] + j * r.row_bytes);
      }
      const std::size_t used = layout_.granule_bytes();
      std::memset(dst + used, 0, std::size_t{granule} * kv_bytes_per_token_ - used);  // deterministic padding
    }
  }

  /// Keeps the state part of a PARTIAL_ONLY blob in `slot` (slot_bytes long), behind its
  /// length, the rest zeroed. Throws Error(invalid_argument) when the model has no state,
  /// the slot has the wrong size, or the state does not fit.
  void store_state(std::span<const std::uint8_t> partial, std::span<std::byte> slot) const {
    if (slot_bytes() == 0) throw Error(ErrorCode::invalid_argument, "this model keeps no state in a slot");
    if (slot.size() != slot_bytes())
      throw Error(ErrorCode::invalid_argument, "a slot must be " + std::to_string(slot_bytes()) + " bytes, got " +
                                                   std::to_string(slot.size()));
    const std::span<const std::uint8_t> state = state_part(layout_.family, partial);
    if (state.size() > layout_.state_bytes)
      throw Error(ErrorCode::invalid_argument, "a state of " + std::to_string(state.size()) + " bytes does not fit a slot for " +
                                                   std::to_string(layout_.state_bytes));
    const std::uint64_t length = state.size();
    std::memcpy(slot.data(), &length, slot_header_bytes);
    std::memcpy(slot.data() + slot_header_bytes, state.data(), state.size());
    std::memset(slot.data() + slot_header_bytes + state.size(), 0, slot.size() - slot_header_bytes - state.size());
  }

  /// Writes into `blob` the FULL blob of the sequence at `boundary` tokens, from blocks
  /// [0, boundary) (`blocks[i]` holding tokens [i * block_tokens, ...)) and, for a model with
  /// state, the slot taken at that boundary (ignored otherwise). Throws
  /// Error(invalid_argument) for a boundary off the block grid or too few blocks,
  /// Error(corrupt_data) for a slot that does not hold a state. Allocates (the blob).
  void rebuild(TokenCount boundary, const std::byte* pool, std::span<const BlockId> blocks,
               std::span<const std::byte> slot, std::vector<std::uint8_t>& blob) const {
    check_range(0, boundary, boundary, blocks.size());
    std::span<const std::uint8_t> state;
    if (slot_bytes() != 0) {
      if (slot.size() != slot_bytes())
        throw Error(ErrorCode::invalid_argument, "a slot must be " + std::to_string(slot_bytes()) + " bytes, got " +
                                                     std::to_string(slot.size()));
      std::uint64_t length = 0;
      std::memcpy(&length, slot.data(), slot_header_bytes);
      if (length == 0 || length > layout_.state_bytes)
        throw Error(ErrorCode::corrupt_data, "a slot says its state is " + std::to_string(length) + " bytes, of at most " +
                                                 std::to_string(layout_.state_bytes));
      state = {reinterpret_cast<const std::uint8_t*>(slot.data()) + slot_header_bytes, static_cast<std::size_t>(length)};
    }
    const std::uint32_t granule = layout_.granule_tokens;
    auto row = [&](std::size_t run, std::uint64_t index) -> const std::byte* {
      const RowRun& r = layout_.runs[run];
      const std::uint64_t per_granule = granule / r.tokens_per_row;
      const std::uint64_t g = index / per_granule;
      return granule_in(pool, blocks, 0, g) + run_offsets_[run] + (index % per_granule) * r.row_bytes;
    };
    write_full_blob(layout_, boundary, state, row, blob);
  }

 private:
  void check_range(TokenCount begin, TokenCount end, TokenCount available, std::size_t block_count) const {
    if (begin >= end || begin % block_tokens_ != 0 || end % block_tokens_ != 0)
      throw Error(ErrorCode::invalid_argument, "a token range must be non-empty and on the " + std::to_string(block_tokens_) +
                                                   "-token block grid, got [" + std::to_string(begin) + ", " +
                                                   std::to_string(end) + ")");
    if (end > available)
      throw Error(ErrorCode::invalid_argument, "the range ends at token " + std::to_string(end) + " but the sequence holds " +
                                                   std::to_string(available));
    if (block_count < (end - begin) / block_tokens_)
      throw Error(ErrorCode::invalid_argument, std::to_string(block_count) + " blocks cannot hold [" +
                                                   std::to_string(begin) + ", " + std::to_string(end) + ")");
  }

  // Where granule g lies, `blocks[0]` holding the block that starts at token `first`.
  template <class Byte>
  Byte* granule_in(Byte* pool, std::span<const BlockId> blocks, TokenCount first, TokenCount g) const noexcept {
    const TokenCount token = g * layout_.granule_tokens;
    const BlockId block = blocks[(token - first) / block_tokens_];
    return pool + std::size_t{block.value} * block_bytes() + (token % block_tokens_) * kv_bytes_per_token_;
  }

  BlobLayout layout_;
  std::uint32_t block_tokens_;
  std::size_t kv_bytes_per_token_ = 0;
  std::vector<std::size_t> run_offsets_;
};

}  // namespace kvfuse::llama
