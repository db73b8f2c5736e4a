// kvfuse-replay: the admission path of Composition::loopback_pd. A producer engine in the same
// process (its own block pool per rank) prefilled a quarter of the requests and published
// them to a LoopbackPd; the engine admits through Multi<LoopbackPd, OffloadSub>, so the P/D
// sub wins those requests' KV (R16) and copies it rank by rank into the request's blocks (at
// Ranks::pd_landing: the device memory itself, or for ranks as processes a landing area the
// engine then ships to each rank process, Ranks::pd_landed).
#pragma once

#include "content.hpp"
#include "forward.hpp"
#include "ranks.hpp"

#include <kvfuse/compose/loopback_pd.hpp>
#include <kvfuse/compose/multi.hpp>
#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/engine/arbitration.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace replay {

/// [LoopbackPd, OffloadSub] over `ranks`. Scheduler thread only; holds references: the
/// ranks and the runtime outlive it.
class LoopbackComposition {
 public:
  using Arbiter = kvfuse::Multi<kvfuse::LoopbackPd, kvfuse::OffloadSub>;

  LoopbackComposition(Ranks& ranks, kvfuse::HostRuntime& rt, std::uint32_t num_blocks)
      : ranks_(ranks), rt_(rt), pd_(pairs(ranks, rt, num_blocks, producer_), block_tokens, block_bytes), multi_(pd_, offload_) {}
  ~LoopbackComposition() {
    for (std::byte* p : producer_) rt_.free_device(p);
  }
  LoopbackComposition(const LoopbackComposition&) = delete;
  LoopbackComposition& operator=(const LoopbackComposition&) = delete;

  /// The producer computes the whole blocks of `q`'s prompt and publishes them as `id`'s.
  void publish(kvfuse::RequestId id, const Request& q) {
    const TokenCount tokens = q.prompt_tokens - q.prompt_tokens % block_tokens;
    std::vector<kvfuse::BlockId> table;
    for (std::uint32_t b = 0; b < tokens / block_tokens; ++b) table.push_back(kvfuse::BlockId{b});
    for (std::uint32_t r = 0; r < ranks_.world(); ++r)
      for (std::size_t b = 0; b < table.size(); ++b) write_block(producer_[r] + b * block_bytes, q, b, r, 0, block_tokens);
    pd_.publish(id, tokens, std::move(table));
  }

  Arbiter& arbiter() noexcept { return multi_; }
  kvfuse::LoopbackPd::Stats stats() const noexcept { return pd_.stats(); }

 private:
  static std::vector<kvfuse::LoopbackRank> pairs(Ranks& ranks, kvfuse::HostRuntime& rt, std::uint32_t num_blocks,
                                                 std::vector<std::byte*>& producer) {
    std::vector<kvfuse::LoopbackRank> out;
    for (std::uint32_t r = 0; r < ranks.world(); ++r) {
      producer.push_back(static_cast<std::byte*>(rt.allocate_device(std::size_t{num_blocks} * block_bytes)));
      out.push_back(kvfuse::LoopbackRank{producer.back(), ranks.pd_landing(r)});
    }
    return out;
  }

  const Ranks& ranks_;
  kvfuse::HostRuntime& rt_;
  std::vector<std::byte*> producer_;  // before pd_: pairs() fills it while pd_ is built
  kvfuse::LoopbackPd pd_;
  kvfuse::OffloadSub offload_;
  Arbiter multi_;
};

}  // namespace replay
