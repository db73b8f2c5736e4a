// kvfuse-replay: the engine's transport, the Coordinator's way to its ranks: each load and
// save goes to every live rank, as an RPC layer would send it. A dead rank gets nothing, and
// the quorum settles without it (the death fault). Ranks as processes get it as one frame in
// each attached rank's ring (ShmEngine); a rank marked dead there still gets the frame, and
// the quorum drops its records as a dead rank's.
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
    const Delivery d = ranks_.deliver(r, alive_);
    if (r.kv) kv_loads_sent_ += d.ranks;
    return d.sent;
  }
  bool send(const kvfuse::KvSave& s) { return ranks_.deliver(s, alive_).sent; }
  bool send(const kvfuse::StateSave& s) { return ranks_.deliver(s, alive_).sent; }

  /// Not marked dead (the death fault) and up (a killed rank process that has not come back is not).
  bool alive(std::uint32_t rank) const { return alive_[rank] && ranks_.up(rank); }
  void set_alive(std::uint32_t rank, bool alive) { alive_[rank] = alive; }
  /// Loads with a KV leg handed to a rank, counted once per rank: each is one KV retrieve there.
  std::uint64_t kv_loads_sent() const noexcept { return kv_loads_sent_; }

 private:
  Ranks& ranks_;
  std::vector<bool> alive_;
  std::uint64_t kv_loads_sent_ = 0;
};

}  // namespace replay
