// kvfuse/engine/connector_names.hpp — the canonical connector name registry (R15).
//
// Every question about a connector name — is this a multi, is this the offload tier, are
// there two offload tiers — is answered on the canonical name, never on the raw spelling:
// a raw compare is how a configured multi once held two offload subs ("lmcache_offload"
// next to its alias "LMCacheConnectorV1") and how an alias spelling of "multi" once
// skipped unwrapping its subs. The table is constexpr so a compile-time composition
// (Multi<...>) can ask the same questions with the same answers.
//
// Normalisation: trim ASCII whitespace, fold ASCII case, and read '-' as '_'. Then the
// name must equal a canonical name or one of its aliases.
//
// Everything here is thread-safe (pure functions over constant tables).
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <kvfuse/error.hpp>

namespace kvfuse {

/// What a connector is, as far as composition cares.
enum class ConnectorKind : unsigned char {
  offload,  ///< hosts the offload tier (KV chunks, and the state tier where the model has state)
  multi,    ///< composes sub-connectors
  pd,       ///< a prefill/decode transfer connector (moves KV between engines, no tier)
};

/// One known connector: its canonical name and kind.
struct ConnectorInfo {
  std::string_view canonical;
  ConnectorKind kind;
};

/// One alias spelling (already normalised: lower case, '_' not '-') and the canonical
/// name it stands for.
struct ConnectorAlias {
  std::string_view alias;
  std::string_view canonical;
};

/// Every canonical connector name.
inline constexpr std::array<ConnectorInfo, 7> known_connectors{{
    {"offload", ConnectorKind::offload},
    {"multi", ConnectorKind::multi},
    {"mooncake", ConnectorKind::pd},
    {"nixl", ConnectorKind::pd},
    {"p2p_nccl", ConnectorKind::pd},
    {"moriio", ConnectorKind::pd},
    {"loopback_pd", ConnectorKind::pd},  // compose/loopback_pd.hpp: two engines in one process (tests, replay)
}};

/// Every alias. The LMCache spellings (v1 connector, the offload and multi-process
/// variants) all name the one offload tier, so two of them in one multi are two tiers.
inline constexpr std::array<ConnectorAlias, 21> connector_aliases{{
    {"kvfuse", "offload"},
    {"kvfuse_offload", "offload"},
    {"offloadconnector", "offload"},
    {"offloadingconnector", "offload"},
    {"lmcache", "offload"},
    {"lmcacheconnector", "offload"},
    {"lmcacheconnectorv1", "offload"},
    {"lmcache_offload", "offload"},
    {"lmcache_mp", "offload"},
    {"lmcachempconnector", "offload"},
    {"multiconnector", "multi"},
    {"multi_connector", "multi"},
    {"mooncakeconnector", "mooncake"},
    {"mooncake_connector", "mooncake"},
    {"mooncakeconnectorv1", "mooncake"},
    {"nixlconnector", "nixl"},
    {"nixl_connector", "nixl"},
    {"p2pncclconnector", "p2p_nccl"},
    {"p2p_nccl_connector", "p2p_nccl"},
    {"moriioconnector", "moriio"},
    {"mori_io", "moriio"},
}};

namespace detail {
constexpr bool is_space(char c) noexcept { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
constexpr char normalise_char(char c) noexcept {
  if (c >= 'A' && c <= 'Z') return static_cast<char>(c - 'A' + 'a');
  return c == '-' ? '_' : c;
}
constexpr std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}
/// Whether trimmed `raw` spells the normalised `name`.
constexpr bool spells(std::string_view raw, std::string_view name) noexcept {
  if (raw.size() != name.size()) return false;
  for (std::size_t i = 0; i < raw.size(); ++i)
    if (normalise_char(raw[i]) != name[i]) return false;
  return true;
}
// Returned by value, not by pointer: a pointer into the table compared against nullptr is
// not a constant expression under -fsanitize=undefined.
constexpr std::optional<ConnectorInfo> info_of_canonical(std::string_view canonical) noexcept {
  for (const ConnectorInfo& c : known_connectors)
    if (c.canonical == canonical) return c;
  return std::nullopt;
}
}  // namespace detail

/// The registry entry for any spelling of a known connector, or nullopt. Never throws;
/// constexpr, so static compositions can use it.
constexpr std::optional<ConnectorInfo> find_connector(std::string_view name) noexcept {
  const std::string_view raw = detail::trim(name);
  for (const ConnectorInfo& c : known_connectors)
    if (detail::spells(raw, c.canonical)) return c;
  for (const ConnectorAlias& a : connector_aliases)
    if (detail::spells(raw, a.alias)) return detail::info_of_canonical(a.canonical);
  return std::nullopt;
}

/// "offload, multi, mooncake, nixl, p2p_nccl, moriio, loopback_pd" (every canonical name, in
/// registry order) — for error messages. Thread-safe.
inline std::string known_connector_names() {
  std::string out;
  for (const ConnectorInfo& c : known_connectors) {
    if (!out.empty()) out += ", ";
    out += c.canonical;
  }
  return out;
}

/// The canonical name of any spelling of a known connector. An unknown (or empty) name
/// throws Error(unknown_connector) naming it and listing the known names — never a
/// silent "no connector". Thread-safe.
constexpr std::string_view canonical_connector_name(std::string_view name) {
  if (const std::optional<ConnectorInfo> c = find_connector(name)) return c->canonical;
  throw Error(ErrorCode::unknown_connector, "unknown connector name '" + std::string(name) +
                                                "' (known: " + known_connector_names() +
                                                "; matching trims, ignores case and accepts aliases)");
}

/// The kind of any spelling of a known connector; throws like canonical_connector_name.
constexpr ConnectorKind connector_kind(std::string_view name) {
  return detail::info_of_canonical(canonical_connector_name(name))->kind;
}

/// Whether `name` (any spelling) is the offload connector. An unknown name is not a
/// quiet "no": it throws like canonical_connector_name (and so does not compile in a
/// constant expression). constexpr for known names. Thread-safe.
constexpr bool is_offload_connector(std::string_view name) { return connector_kind(name) == ConnectorKind::offload; }

/// Whether `name` (any spelling) is the multi connector; throws for an unknown name like
/// is_offload_connector. constexpr for known names. Thread-safe.
constexpr bool is_multi_connector(std::string_view name) { return connector_kind(name) == ConnectorKind::multi; }

/// How many of `names` (any spellings) are the offload connector. Throws for an unknown
/// name like is_offload_connector. A static Multi<...> requires this to be at most one.
/// constexpr for known names. Thread-safe.
constexpr std::size_t count_offload_connectors(std::span<const std::string_view> names) {
  std::size_t n = 0;
  for (std::string_view s : names) n += is_offload_connector(s) ? 1 : 0;
  return n;
}

/// Resolves a configured multi's sub-connector list to canonical names, refusing at
/// startup what a static composition refuses at compile time: an unknown name
/// (Error(unknown_connector)), an empty list or a nested multi (Error(invalid_argument)),
/// and two offload subs in any spellings (Error(duplicate_offload), naming both). Thread-safe.
template <class String>
std::vector<std::string_view> resolve_multi_subs(std::span<const String> subs) {
  if (subs.empty()) throw Error(ErrorCode::invalid_argument, "a multi connector needs at least one sub-connector, got none");
  std::vector<std::string_view> out;
  out.reserve(subs.size());
  std::size_t offload_at = subs.size();
  for (std::size_t i = 0; i < subs.size(); ++i) {
    const std::string_view raw{subs[i]};
    const std::string_view canonical = canonical_connector_name(raw);
    if (detail::info_of_canonical(canonical)->kind == ConnectorKind::multi)
      throw Error(ErrorCode::invalid_argument, "sub-connector '" + std::string(raw) + "' is a multi; multis do not nest");
    if (canonical == "offload") {
      if (offload_at != subs.size())
        throw Error(ErrorCode::duplicate_offload, "two offload sub-connectors in one multi: '" +
                                                      std::string(std::string_view{subs[offload_at]}) + "' and '" +
                                                      std::string(raw) + "' both name 'offload'");
      offload_at = i;
    }
    out.push_back(canonical);
  }
  return out;
}

}  // namespace kvfuse
