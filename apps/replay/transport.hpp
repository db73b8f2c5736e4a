// kvfuse-replay: the engine's transport, the Coordinator's way to its ranks: each load and
// save goes to every live rank, as an RPC layer would send it. A dead rank gets nothing, and
// the quorum settles without it (the death fault).
#pragma once

#include "ranks.hpp"

#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/save_request.hpp>

#include <cstdint>
#include <vector>

namespace replay {

/// Models CoordinatorTransport. Scheduler thread only.
class Transport {
 public:
  explicit Transport(Ranks& ranks) : ranks_(ranks), alive_(ranks.world(), true) {}

  bool send(const kvfuse::LoadRequest& r) {
    for (std::uint32_t i = 0; i < ranks_.world(); ++i)
      if (alive_[i]) {
        ranks_.load(i, r);
        kv_loads_sent_ += r.kv.has_value();
      }
    return true;
  }
  bool send(const kvfuse::KvSave& s) {
    for (std::uint32_t i = 0; i < ranks_.world(); ++i)
      if (alive_[i]) ranks_.save_kv(i, s);
    return true;
  }
  bool send(const kvfuse::StateSave& s) {
    for (std::uint32_t i = 0; i < ranks_.world(); ++i)
      if (alive_[i]) ranks_.save_state(i, s);
    return true;
  }

  bool alive(std::uint32_t rank) const { return alive_[rank]; }
  void set_alive(std::uint32_t rank, bool alive) { alive_[rank] = alive; }
  /// Loads with a KV leg handed to a rank, counted once per rank: each is one KV retrieve there.
  std::uint64_t kv_loads_sent() const noexcept { return kv_loads_sent_; }

 private:
  Ranks& ranks_;
  std::vector<bool> alive_;
  std::uint64_t kv_loads_sent_ = 0;
};

}  // namespace replay
