// kvfuse-replay: the fault table. Each fault is one entry: its --faults name, what it does,
// the counters it reports (one report row and one JSON key under "faults" each), and
// `arm`, which returns the hooks it acts through for one pass. The engine calls each armed
// fault's hooks at fixed points of its loop (FaultHooks says where) and offers what they may
// touch through a FaultSite. The --faults parsing, the report rows and the JSON all come
// from this table (faults.cpp).
#pragma once

#include "rank_tier.hpp"
#include "tiers.hpp"
#include "workload.hpp"

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/tier/tier.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace replay {

/// What a fault may touch while a pass runs: the engine's ranks and their tiers, rank
/// liveness, the seeded dice. Scheduler thread only.
class FaultSite {
 public:
  virtual std::uint32_t world() const = 0;
  virtual bool disk() const = 0;  ///< the ranks' tiers keep files on disk
  virtual TierControl& tier(std::uint32_t rank) = 0;
  virtual kvfuse::TierKey kv_key(kvfuse::PrefixHash h, std::uint32_t rank) const = 0;
  virtual kvfuse::TierKey state_key(kvfuse::PrefixHash h, std::uint32_t rank) const = 0;
  virtual bool alive(std::uint32_t rank) const = 0;
  /// A dead rank gets no loads or saves, and the quorum settles without it.
  virtual void set_alive(std::uint32_t rank, bool alive) = 0;
  /// A per-request coin that lands the same way in every pass and every model.
  virtual bool coin(const Request& q, std::uint64_t salt, std::uint32_t per_mille) const = 0;
  /// The pass's seeded random stream.
  virtual std::uint64_t random() = 0;
  /// Chunk keys of recent KV saves.
  virtual std::span<const kvfuse::PrefixHash> saved_chunks() const = 0;
  /// The fault found the system broken (counted as an invariant violation).
  virtual void violation() = 0;
  /// Whether the ranks run as processes (the kill fault acts only then).
  virtual bool processes_mode() const = 0;
  /// Requests parked on a load now.
  virtual std::size_t loads_in_flight() const = 0;
  /// SIGKILLs rank r's process; false when ranks are threads or it is not running.
  virtual bool kill_rank(std::uint32_t rank) = 0;
  /// Whether the engine saw rank r's process die and it was not restarted yet.
  virtual bool rank_lost(std::uint32_t rank) const = 0;
  /// Starts a new process for a lost rank r; false when it is not lost.
  virtual bool restart_rank(std::uint32_t rank) = 0;

 protected:
  ~FaultSite() = default;
};

/// What happens to a request parked on its load.
enum class TearDown { none, abort, preempt };

/// One fault's hooks for one pass; an empty one is not called. `counts` (given to arm) are
/// the fault's report counters, in the order of its rows.
struct FaultHooks {
  std::function<void(std::uint32_t rank, TierOptions&)> set_up_tier;  ///< before rank r's tier is built
  std::function<void()> ranks_built;                                  ///< the ranks exist, nothing ran
  std::function<void(std::size_t arrived, std::size_t total)> arrival;  ///< request `arrived` (from 1) of `total` arrived
  /// The lookup counted `held` leading chunks of `keys` on every live rank (held > 0).
  std::function<void(std::span<const kvfuse::PrefixHash> keys, std::size_t held)> lookup;
  /// The request parked on a load; `first` for its first admission only.
  std::function<TearDown(const Request&, bool first)> parked;
  std::function<void(const Request&, kvfuse::PrefixHash)> checkpoint_saved;  ///< a checkpoint went to the coordinator
  std::function<void()> step;      ///< once per turn of the engine loop
  std::function<void()> collect;   ///< the pass drained: read what the tiers counted
};

/// One report row (and JSON key) of a fault.
struct FaultRow {
  std::string_view key;    ///< under "faults" in the JSON
  std::string_view label;  ///< the report's row
};

/// One entry of the fault table.
struct Fault {
  std::string_view name;  ///< --faults
  std::string_view what;  ///< what happens
  std::vector<FaultRow> rows;
  FaultHooks (*arm)(FaultSite& site, std::span<std::uint64_t> counts);
};

/// The fault table, in the order the hooks run.
const std::vector<Fault>& fault_table();

/// Every fault's rows, flattened in table order: RunResult::fault_counts is indexed alike.
std::vector<FaultRow> fault_rows();

/// Which faults a pass arms, by table index.
using FaultSet = std::vector<bool>;

/// Parses --faults: a comma-separated list of names, "all" or "none". Returns the faults
/// chosen, or throws InputError naming an unknown name.
FaultSet parse_faults(const std::string& list);

/// The armed faults of one pass, each with its hooks and its slice of `counts`. Scheduler
/// thread only.
class ArmedFaults {
 public:
  /// Arms every fault in `chosen`; `counts` (one per fault_rows() entry) receives their counters.
  ArmedFaults(const FaultSet& chosen, FaultSite& site, std::span<std::uint64_t> counts);
  void set_up_tier(std::uint32_t rank, TierOptions& options) const;
  void ranks_built() const;
  void arrival(std::size_t arrived, std::size_t total) const;
  void lookup(std::span<const kvfuse::PrefixHash> keys, std::size_t held) const;
  TearDown parked(const Request& q, bool first) const;
  void checkpoint_saved(const Request& q, kvfuse::PrefixHash hash) const;
  void step() const;
  void collect() const;

 private:
  std::vector<FaultHooks> hooks_;
};

/// True when request `arrived` (from 1) of `total` is the one `percent`% of the way in.
inline bool arrival_at(std::size_t arrived, std::size_t total, std::size_t percent) noexcept {
  return arrived == std::max<std::size_t>(1, total * percent / 100);
}

}  // namespace replay
