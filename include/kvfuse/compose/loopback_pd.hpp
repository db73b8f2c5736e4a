// kvfuse/compose/loopback_pd.hpp — LoopbackPd: a P/D sub-connector between two engines in
// one process, so the production composition [P/D sub, offload sub] runs for real in tests
// and in the replay.
//
// The producer engine (a prefill instance) publishes the KV it computed for a request: its
// block ids and how many tokens they hold. When this engine admits that request through a
// Multi, LoopbackPd offers those tokens; if it wins, start() copies them, rank by rank,
// from the producer's blocks into this engine's blocks, and the next drain_finished()
// reports the transfer ended. A real P/D connector (NIXL, Mooncake) moves bytes on its own
// threads and finishes later; the loopback copies at start (host memory, HostRuntime
// pools) and reports at the next drain, which keeps the same contract: a transfer that
// started ends exactly once, and until it ends the request's blocks are the sub's.
//
// Threading: not thread-safe. Scheduler thread only (matched_tokens, cancel, start,
// drain_finished, publish). The producer must not change a published prefix's blocks
// until it is withdrawn or transferred.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/engine/arbitration.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// One rank's pair of KV block pools: the producer's (read) and this engine's (written).
struct LoopbackRank {
  const std::byte* producer_blocks = nullptr;
  std::byte* consumer_blocks = nullptr;
};

/// The P/D sub-connector "loopback_pd" (a registered P/D name, R15). Models PdSubConnector.
class LoopbackPd {
 public:
  static constexpr std::string_view connector_name = "loopback_pd";

  /// Counters, read in O(1).
  struct Stats {
    std::uint64_t offered = 0;      ///< matched_tokens calls that offered tokens
    std::uint64_t cancelled = 0;    ///< offers withdrawn because another sub won
    std::uint64_t transfers = 0;    ///< transfers started
    std::uint64_t bytes = 0;        ///< bytes copied, all ranks
  };

  /// `ranks`: one pool pair per rank; `block_tokens` and `block_bytes` are both engines'
  /// (they must agree). Throws Error(invalid_argument) naming the value for no ranks, a null
  /// pool, or a zero block size.
  LoopbackPd(std::vector<LoopbackRank> ranks, std::uint32_t block_tokens, std::size_t block_bytes)
      : ranks_(std::move(ranks)), block_tokens_(block_tokens), block_bytes_(block_bytes) {
    if (ranks_.empty()) throw Error(ErrorCode::invalid_argument, "LoopbackPd needs at least one rank, got 0");
    for (std::size_t r = 0; r < ranks_.size(); ++r)
      if (ranks_[r].producer_blocks == nullptr || ranks_[r].consumer_blocks == nullptr)
        throw Error(ErrorCode::invalid_argument, "LoopbackPd rank " + std::to_string(r) + " has a null block pool");
    if (block_tokens_ == 0 || block_bytes_ == 0)
      throw Error(ErrorCode::invalid_argument, "LoopbackPd block size must be > 0, got " + std::to_string(block_tokens_) +
                                                   " tokens / " + std::to_string(block_bytes_) + " bytes");
  }

  /// The producer computed `tokens` tokens of `request` into `blocks` (block i holding
  /// tokens [i*block, (i+1)*block)). Replaces an earlier publication. Scheduler thread.
  void publish(RequestId request, TokenCount tokens, std::vector<BlockId> blocks) {
    published_[request] = Published{tokens - tokens % block_tokens_, std::move(blocks)};
  }

  /// Offers the published tokens beyond hbm (whole blocks; never the prompt's last token,
  /// which is always computed) and arms them. 0 when nothing is published above hbm.
  TokenCount matched_tokens(const AdmissionQuery& q) noexcept {
    const auto it = published_.find(q.request);
    if (it == published_.end() || q.prompt_tokens == 0) return 0;
    const TokenCount limit = (q.prompt_tokens - 1) - (q.prompt_tokens - 1) % block_tokens_;
    const TokenCount usable = std::min(it->second.tokens, limit);
    if (usable <= q.hbm) return 0;
    ++stats_.offered;
    armed_[q.request] = usable - q.hbm;
    return usable - q.hbm;
  }

  /// Another sub won: withdraw the offer.
  void cancel(RequestId request) noexcept {
    if (armed_.erase(request) > 0) ++stats_.cancelled;
  }

  /// Copies the armed tokens [hbm, hbm + tokens) into the transfer's blocks on every rank;
  /// the transfer ends at the next drain_finished. False (nothing copied) if nothing was
  /// armed for the request, the span differs from the armed one, or a block table is short.
  bool start(const PdTransfer& t) {
    const auto armed = armed_.find(t.request);
    const auto pub = published_.find(t.request);
    if (armed == armed_.end() || pub == published_.end() || armed->second != t.tokens) return false;
    const std::size_t first = t.hbm / block_tokens_;
    const std::size_t last = (t.hbm + t.tokens) / block_tokens_;
    if (t.hbm % block_tokens_ != 0 || last > t.blocks.size() || last > pub->second.blocks.size()) return false;
    for (const LoopbackRank& rank : ranks_)
      for (std::size_t b = first; b < last; ++b) {
        std::memcpy(rank.consumer_blocks + std::size_t{t.blocks[b].value} * block_bytes_,
                    rank.producer_blocks + std::size_t{pub->second.blocks[b].value} * block_bytes_, block_bytes_);
        stats_.bytes += block_bytes_;
      }
    armed_.erase(armed);
    finished_.push_back(t.request);
    ++stats_.transfers;
    return true;
  }

  /// Calls f(request, true) for every transfer started since the last call; returns how many.
  template <class F>
  std::size_t drain_finished(F&& f) {
    std::vector<RequestId> done;
    done.swap(finished_);
    for (const RequestId r : done) f(r, true);
    return done.size();
  }

  [[nodiscard]] const Stats& stats() const noexcept { return stats_; }

 private:
  struct Published {
    TokenCount tokens = 0;
    std::vector<BlockId> blocks;
  };
  std::vector<LoopbackRank> ranks_;
  std::uint32_t block_tokens_;
  std::size_t block_bytes_;
  std::unordered_map<RequestId, Published> published_;
  std::unordered_map<RequestId, TokenCount> armed_;
  std::vector<RequestId> finished_;
  Stats stats_{};
};

static_assert(PdSubConnector<LoopbackPd>);

}  // namespace kvfuse
