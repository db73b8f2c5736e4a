// kvfuse-replay: what a rank process is built from (ranks as processes, rank_process.hpp).
// The engine sends it as the payload of ControlOp::ready; the rank process decodes it,
// finds its model's entry and serves (rank_process_main.cpp).
#pragma once

#include "ranks.hpp"
#include "tiers.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace replay {

/// What a rank process is built from: the segment, its rank and geometry, its model and
/// its tier.
struct ChildSetup {
  std::string segment;
  std::string model;  ///< the model table's name: the child builds that entry's connector
  std::uint32_t rank = 0;
  RankSetup ranks;    ///< its runtime and group are not used
  TierOptions tier;   ///< this rank's

  /// Its bytes (byte_encoding.hpp). Any thread.
  std::vector<std::byte> encode() const;
  /// Throws InputError on a payload that does not decode, or names a rank or a tier that
  /// does not exist.
  static ChildSetup decode(std::span<const std::byte> bytes);
};

}  // namespace replay
