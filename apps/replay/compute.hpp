// kvfuse-replay: the simulated compute of one admission. Prefill and decode take simulated
// time; the compute runs as a list of stops, each a token the forward runs up to when the
// clock reaches it: the prefill checkpoints its admit decision planned and the
// generation-end checkpoint above the resume point (the engine captures the state there),
// then the end of the request. Pure functions: any thread.
#pragma once

#include "workload.hpp"

#include <kvfuse/engine/checkpoint_policy.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace replay {

inline constexpr double prefill_tokens_per_ms = 50.0;  ///< simulated prefill speed
inline constexpr double decode_ms_per_token = 1.0;     ///< simulated decode speed

/// Where an admission's compute pauses: token `at`, reached at simulated time `due_ms`.
struct Stop {
  TokenCount at = 0;
  double due_ms = 0;
};

/// Simulated milliseconds to compute tokens [from, to) of `q`: prefill below P, decode above.
inline double compute_ms(const Request& q, TokenCount from, TokenCount to) {
  const TokenCount p = q.prompt_tokens;
  const double prefill = static_cast<double>(std::min(to, p) - std::min(from, p)) / prefill_tokens_per_ms;
  return prefill + decode_ms_per_token * static_cast<double>(std::max(to, p) - std::max(from, p));
}

/// The stops of a request that computes from `resume` at simulated time `now_ms`.
struct Schedule {
  std::vector<Stop> stops;          ///< ascending; the last one finishes the request
  TokenCount generation_end = 0;    ///< the stop whose state finish() saves (0: none)
};

/// The schedule of `q` resuming at `resume`: with `checkpointing` (a stateful model with
/// offload on), a stop at every planned prefill checkpoint above `resume` and at the
/// generation-end checkpoint `policy` places above it; then the end.
inline Schedule schedule(const Request& q, TokenCount resume, double now_ms, bool checkpointing,
                         const std::vector<TokenCount>& planned, const kvfuse::PlanGrids& grids,
                         const kvfuse::CheckpointPolicy& policy) {
  Schedule s;
  const TokenCount total = q.prompt_tokens + q.output_tokens;
  if (checkpointing) {
    std::vector<TokenCount> at;
    for (const TokenCount b : planned)
      if (b > resume) at.push_back(b);
    if (const std::optional<TokenCount> end = kvfuse::generation_end_checkpoint(total, grids, policy); end && *end > resume) {
      s.generation_end = *end;
      at.push_back(*end);
    }
    std::sort(at.begin(), at.end());
    at.erase(std::unique(at.begin(), at.end()), at.end());
    for (const TokenCount b : at) s.stops.push_back(Stop{b, now_ms + compute_ms(q, resume, b)});
  }
  const double prefill = static_cast<double>(q.prompt_tokens - std::min(resume, q.prompt_tokens)) / prefill_tokens_per_ms;
  s.stops.push_back(Stop{total, now_ms + prefill + decode_ms_per_token * static_cast<double>(q.output_tokens)});
  return s;
}

}  // namespace replay
