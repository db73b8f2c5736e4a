// kvfuse/detail/enum_sentinel.hpp — a compile-time check that a `last_...` constant really
// names an enum's last value.
//
// Decoders and validators refuse anything above such a constant, so a value added after it
// without moving the constant would be refused as corrupt by every peer; a comment saying
// "keep it last" cannot stop that. The check below can: static_assert it beside the
// constant. Internal; constexpr and thread-safe.
#pragma once

#include <limits>
#include <string_view>
#include <type_traits>

namespace kvfuse::detail {

/// Whether `last` is the highest value of an enum whose `to_string` names each of its
/// values and answers one fallback string for any other (the one it gives the largest
/// underlying value, which no enum here names): every value from 0 up to `last` has a name
/// and `last + 1` has none. The enum's values must run from 0 without gaps.
template <class E>
  requires std::is_enum_v<E>
constexpr bool is_last_named(E last) noexcept {
  using U = std::underlying_type_t<E>;
  const std::string_view fallback = to_string(static_cast<E>(std::numeric_limits<U>::max()));
  const auto named = [fallback](U v) { return std::string_view(to_string(static_cast<E>(v))) != fallback; };
  for (U v = 0; v < static_cast<U>(last); ++v)
    if (!named(v)) return false;
  return named(static_cast<U>(last)) && !named(static_cast<U>(static_cast<U>(last) + 1));
}

}  // namespace kvfuse::detail
