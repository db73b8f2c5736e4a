// kvfuse-replay: the model table (models.hpp). To add a model, add one entry here: a
// connector preset (a template over the rank's tier) and the fields of Model. This file is
// where every connector of the replay is compiled, once per type in the tier table and per
// way ranks run (threads: a TpQuorum; processes: a ShmQuorum in each rank process).
#include "models.hpp"

#include "rank_server.hpp"

#include <kvfuse/compose/presets.hpp>
#include <kvfuse/ipc/shm_engine.hpp>

namespace replay {

namespace {

/// `m` with what its connector says filled in: Preset<T, G> is the connector over tier T
/// whose group is G.
template <template <class, class> class Preset>
Model with_connector(Model m) {
  using Conn = Preset<RankTier<LocalTier>, kvfuse::TpQuorum>;
  m.layout = Conn::layout;
  m.stateful = Conn::has_state;
  m.lanes = Conn::lane_count;
  m.make_ranks = [](const RankSetup& setup) {
    return with_tier(setup.tier, [&]<class Inner>(const TierEntry<Inner>& tier) -> std::unique_ptr<Ranks> {
      static_assert(Preset<RankTier<Inner>, kvfuse::TpQuorum>::layout == Conn::layout &&
                    Preset<RankTier<Inner>, kvfuse::TpQuorum>::lane_count == Conn::lane_count);
      return std::make_unique<RanksOf<Preset<RankTier<Inner>, kvfuse::TpQuorum>, Inner>>(setup, tier);
    });
  };
  m.serve_rank = [](const ChildSetup& setup, ControlChannel& channel) {
    return with_tier(setup.ranks.tier, [&]<class Inner>(const TierEntry<Inner>& tier) {
      using Shm = Preset<RankTier<Inner>, kvfuse::ShmQuorum>;
      static_assert(Shm::layout == Conn::layout && Shm::lane_count == Conn::lane_count);
      return serve_rank<Shm, Inner>(setup, tier, channel);
    });
  };
  return m;
}

template <class T, class G>
using Dense = kvfuse::DenseConnector<T, G>;
template <class T, class G>
using Dsv4 = kvfuse::Dsv4Connector<T, T, G>;
template <class T, class G>
using K3 = kvfuse::KimiK3Connector<T, T, G>;
template <class T, class G>
using K3Serial = kvfuse::KimiK3SerialConnector<T, T, G>;

}  // namespace

const std::vector<Model>& model_table() {
  static const std::vector<Model> table = {
      with_connector<Dense>({.name = "dense", .what = "DenseConnector", .id = 0xd0}),
      with_connector<Dsv4>({.name = "dsv4", .what = "Dsv4Connector: slot state after KV", .id = 0xd4}),
      with_connector<K3>({.name = "k3",
                          .what = "KimiK3Connector: recurrent state on its own lane",
                          .id = 0x3,
                          .comparison = "k3-serial"}),
      with_connector<K3>({.name = "multi",
                          .what = "KimiK3Connector admitted through [P/D loopback, offload]",
                          .id = 0x3,
                          .composition = Composition::loopback_pd}),
      with_connector<K3Serial>({.name = "k3-serial",
                                .what = "KimiK3SerialConnector: k3 with the state leg after KV",
                                .id = 0x3,
                                .selectable = false}),
  };
  return table;
}

const Model* find_model(std::string_view name) {
  for (const Model& m : model_table())
    if (m.name == name) return &m;
  return nullptr;
}

}  // namespace replay
