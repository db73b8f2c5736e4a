// kvfuse/detail/npos.hpp — the "no index" value of kvfuse's index-linked structures: the
// OffloadIndex's entry lists and tables, its tickets, the LRU hash set's node links.
//
// Internal: not part of the public API. A constant: any thread.
#pragma once

#include <cstdint>

namespace kvfuse::detail {

/// The "no index" value: an absent entry, the end of a list, an empty link. No structure
/// ever holds this many elements, so it never names a real one.
inline constexpr std::uint32_t npos32 = 0xFFFF'FFFFu;

}  // namespace kvfuse::detail
