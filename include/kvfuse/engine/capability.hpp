// kvfuse/engine/capability.hpp — whether the state tier exists, decided once, from config
// alone (R14).
//
// One owner: the engine computes a Capability from its EngineOptions before any rank
// exists and hands the answer to the ranks; a rank never re-decides it from its own view
// of the world. The predicate does no I/O and is deterministic. A malformed config is an
// Error, never a quiet "no tier": a tier that is silently off while the operator believes
// it is on is the failure this header exists to prevent.
//
// Everything here is thread-safe (pure functions over their arguments).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <kvfuse/bridge/state_layout.hpp>
#include <kvfuse/engine/connector_names.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// What this engine does with the offload tier.
enum class KvRole : std::uint8_t {
  producer,  ///< stores only
  consumer,  ///< loads only
  both,      ///< stores and loads
};

/// Stable names, for messages. Thread-safe, noexcept.
constexpr std::string_view to_string(KvRole r) noexcept {
  switch (r) {
    case KvRole::producer: return "producer";
    case KvRole::consumer: return "consumer";
    case KvRole::both: return "both";
  }
  return "unknown_role";
}

/// Whether `r` is one of the enum's named values, as is_known(StateLayout) (bridge/) for
/// layouts: a value cast from an out-of-range integer is refused by every configuration
/// check. Thread-safe, noexcept.
constexpr bool is_known(KvRole r) noexcept {
  return r == KvRole::producer || r == KvRole::consumer || r == KvRole::both;
}

/// One sub-connector of a configured multi. `kv_role` empty: the multi's role applies.
struct SubConnectorOptions {
  std::string name;
  std::optional<KvRole> kv_role;
};

/// The plain config the capability is decided from.
struct EngineOptions {
  std::string connector = "offload";         ///< any spelling; a multi spelling means `subs` is used
  std::vector<SubConnectorOptions> subs;      ///< only for a multi; must be empty otherwise
  KvRole kv_role = KvRole::both;
  std::uint32_t pipeline_parallel_size = 1;  ///< must be >= 1
  StateLayout layout = StateLayout::none;
};

/// The one answer to "what may this engine do with the offload tier".
struct Capability {
  bool state_can_save = false;///< the state tier exists and this role stores state into it
  bool state_can_load = false;///< the state tier exists and this role loads state from it
  bool kv_can_save = false;  ///< an offload connector is configured and this role stores KV
  bool kv_can_load = false;   ///< an offload connector is configured and this role loads KV
  /// Why the state tier is off or one-sided (empty when state_can_save && state_can_load). Names the
  /// deciding config value.
  std::string reason;
  friend bool operator==(const Capability&, const Capability&) = default;
};

namespace detail {
struct OffloadPresence {
  bool present = false;
  KvRole role = KvRole::both;
  std::string where;  // for reasons
};

// Canonicalises every name in the config (throwing on unknown names, a multi without
// subs, subs on a non-multi, nested multis and duplicate offload subs) and finds the
// offload connector, if any, with its effective role.
inline OffloadPresence find_offload(const EngineOptions& cfg) {
  OffloadPresence p;
  const std::string_view top = canonical_connector_name(cfg.connector);
  if (top != "multi") {
    if (!cfg.subs.empty())
      throw Error(ErrorCode::invalid_argument, "connector '" + cfg.connector + "' is not a multi but lists " +
                                                   std::to_string(cfg.subs.size()) + " sub-connectors");
    p.present = top == "offload";
    p.role = cfg.kv_role;
    p.where = "connector '" + cfg.connector + "'";
    return p;
  }
  std::vector<std::string_view> names;
  names.reserve(cfg.subs.size());
  for (const SubConnectorOptions& s : cfg.subs) names.emplace_back(s.name);
  const std::vector<std::string_view> canonical = resolve_multi_subs(std::span<const std::string_view>(names));
  for (std::size_t i = 0; i < canonical.size(); ++i) {
    if (canonical[i] != "offload") continue;
    p.present = true;
    p.role = cfg.subs[i].kv_role.value_or(cfg.kv_role);
    p.where = "multi sub-connector '" + cfg.subs[i].name + "'";
  }
  if (!p.present) p.where = "multi connector '" + cfg.connector + "'";
  return p;
}

// Refuses an enum field outside its enum, naming the field and the value as a number.
inline void check_enums(const EngineOptions& cfg) {
  auto refuse = [](const std::string& what) { throw Error(ErrorCode::invalid_argument, what); };
  const std::string roles = " is not a KvRole (producer, consumer, both)";
  if (!is_known(cfg.kv_role)) refuse("kv_role=" + std::to_string(static_cast<unsigned>(cfg.kv_role)) + roles);
  if (!is_known(cfg.layout))
    refuse("layout=" + std::to_string(static_cast<unsigned>(cfg.layout)) +
           " is not a StateLayout (none, dsv4_slot, k3_recurrent)");
  for (std::size_t i = 0; i < cfg.subs.size(); ++i)
    if (cfg.subs[i].kv_role && !is_known(*cfg.subs[i].kv_role))
      refuse("subs[" + std::to_string(i) + "].kv_role=" + std::to_string(static_cast<unsigned>(*cfg.subs[i].kv_role)) +
             " of sub-connector '" + cfg.subs[i].name + "'" + roles);
}

inline Capability capability_impl(const EngineOptions& cfg) {
  check_enums(cfg);
  if (cfg.pipeline_parallel_size == 0)
    throw Error(ErrorCode::invalid_argument, "pipeline_parallel_size must be >= 1, got 0");
  const OffloadPresence p = find_offload(cfg);
  Capability cap;
  if (!p.present) {
    cap.reason = p.where + " hosts no offload connector";
    return cap;
  }
  cap.kv_can_save = p.role != KvRole::consumer;
  cap.kv_can_load = p.role != KvRole::producer;
  if (cfg.layout == StateLayout::none) {
    cap.reason = "layout=none: the model carries no per-request state";
    return cap;
  }
  if (cfg.pipeline_parallel_size > 1)
    throw Error(ErrorCode::unsupported_parallelism,
                "pipeline_parallel_size=" + std::to_string(cfg.pipeline_parallel_size) + " with state layout " +
                    std::string(to_string(cfg.layout)) +
                    ": the state tier is unsupported under pipeline parallelism; use pipeline_parallel_size=1 "
                    "or layout=none");
  cap.state_can_save = cap.kv_can_save;
  cap.state_can_load = cap.kv_can_load;
  if (!cap.state_can_load || !cap.state_can_save)
    cap.reason = "kv_role=" + std::string(to_string(p.role)) + " of " + p.where + ": state " +
                 (cap.state_can_load ? "loads only" : "stores only");
  return cap;
}
}  // namespace detail

/// The config-only predicate (R14): whether the state tier exists and which way this
/// role may use it, and whether the offload connector's KV path stores/loads. Refuses
/// rather than turning the tier off: pipeline_parallel_size > 1 with a state tier (an
/// offload connector and a stateful layout, whatever the role) throws
/// Error(unsupported_parallelism) naming both values; a config that would host no state
/// tier (a dense layout, no offload connector) answers under any pp. Throws Error for a
/// malformed config too: unknown_connector, duplicate_offload, or invalid_argument (pp = 0,
/// subs on a non-multi, a multi with no subs or a nested multi, a kv_role or layout that is
/// none of its enum's values, naming the field and the number). No I/O. Thread-safe.
inline Capability state_tier_capability(const EngineOptions& cfg) { return detail::capability_impl(cfg); }

/// The engine-construction check, run before any rank exists: throws exactly what
/// state_tier_capability throws (the same function decides), for engines that validate
/// the config before they need the capability. Thread-safe.
inline void check_engine_options(const EngineOptions& cfg) { (void)state_tier_capability(cfg); }

}  // namespace kvfuse
