// kvfuse-replay: the requests to replay. Two sources: built-in agentic sessions (each turn
// extends its session's conversation), or a trace in the Mooncake JSONL format, parsed with
// nlohmann::json (workload.cpp). Each request carries one chunk key per chunk of its prompt
// and output: equal keys mean equal tokens, which is what lets the tier share KV between
// requests.
#pragma once

#include <kvfuse/bridge/ids.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace replay {

using kvfuse::TokenCount;

/// Tokens per tier chunk: the trace's hash_ids are 512-token blocks, one chunk each.
inline constexpr std::uint32_t chunk_tokens = 512;

/// One request of the workload.
struct Request {
  std::uint64_t index = 0;       ///< position in the workload (arrival order)
  double arrival_ms = 0;         ///< simulated arrival time
  TokenCount prompt_tokens = 0;  ///< P
  TokenCount output_tokens = 0;  ///< tokens decoded after the prompt
  std::vector<kvfuse::PrefixHash> chunk_keys;  ///< one per chunk of [0, P + output)
  std::uint64_t reuse_bound = 0; ///< trace: tokens an unlimited cache could reuse (see read_trace)
  std::uint64_t session = 0;     ///< sessions: which conversation
};

/// What to replay.
struct Workload {
  std::string source;                 ///< "sessions" or the trace's path
  bool from_trace = false;
  std::vector<Request> requests;
  std::uint64_t prompt_tokens = 0;    ///< sum of P
  std::uint64_t reuse_bound = 0;      ///< trace: sum of the per-request bounds
  std::size_t max_request_tokens = 0; ///< the longest P + output
};

/// Bad input: the message names the file, line and value.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Reads the first `limit` requests (0: all) of a Mooncake-format trace: one JSON object per
/// line with `timestamp` (ms), `input_length`, `output_length` and `hash_ids` (one id per
/// 512-token prompt block; equal ids at the same position share KV). Chunk i of the prompt
/// gets key f(hash_ids[i], i) when the prompt covers it whole; a chunk that holds the
/// prompt's tail or any output token gets a key of its own (those tokens are this request's).
/// The reuse bound follows the trace's README: the leading run of already-seen ids, in
/// whole 512-token blocks, capped at input_length - 1. Throws InputError naming the line
/// and what was expected for a malformed line, hash_ids of another length than
/// ceil(input_length / 512) included.
Workload read_trace(const std::string& path, std::size_t limit);

/// Built-in agentic sessions: `sessions` conversations of `turns` turns each. Every turn's
/// prompt is the conversation so far (the previous prompt and its output) plus new user
/// tokens, so turn t+1 can reuse all of turn t. Seeded: the same seed gives the same workload.
Workload make_sessions(std::uint64_t seed, std::size_t sessions, std::size_t turns);

}  // namespace replay
