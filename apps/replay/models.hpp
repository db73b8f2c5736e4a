// kvfuse-replay: the model table. Each model is one entry (models.cpp): its --model name,
// the tier keys' model id, the connector its ranks run — which gives the state layout the
// engine plans by, the state leg and the quorum's lanes, never guessed — how its requests are
// admitted, and the model run beside it on the same workload for comparison.
#pragma once

#include "ranks.hpp"

#include <kvfuse/bridge/state_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

namespace replay {

struct ChildSetup;
class ControlChannel;

/// What the engine admits a model's requests through.
enum class Composition {
  plain,        ///< Coordinator::admit: the offload tier alone
  loopback_pd,  ///< through Multi<LoopbackPd, OffloadSub>: an in-process producer prefilled a quarter of the requests (R16)
};

/// One entry of the model table: everything the engine knows of a model.
struct Model {
  std::string_view name{};      ///< --model, and the report's column
  std::string_view what{};      ///< --help
  std::uint64_t id = 0;         ///< the tier keys' model id: entries of one id read each other's entries
  Composition composition = Composition::plain;
  std::string_view comparison{};  ///< the entry replayed beside this one on the same workload ("": none)
  bool selectable = true;       ///< false: only ever run as another entry's comparison
  // From the connector (with_connector): what the engine plans by and builds.
  kvfuse::StateLayout layout = kvfuse::StateLayout::none;  ///< Conn::layout
  bool stateful = false;                                  ///< Conn::has_state: the ranks need state slots
  std::size_t lanes = 0;                                  ///< Conn::lane_count: the quorum's lanes per rank
  std::unique_ptr<Ranks> (*make_ranks)(const RankSetup& setup) = nullptr;  ///< the ranks as threads, on the setup's tier
  /// A rank process's life (serve_rank, rank_server.hpp): the same connector over a ShmQuorum,
  /// on the setup's tier. Returns its exit status.
  int (*serve_rank)(const ChildSetup& setup, ControlChannel& channel) = nullptr;
};

/// The model table.
const std::vector<Model>& model_table();

/// The entry named `name`, or null.
const Model* find_model(std::string_view name);

}  // namespace replay
