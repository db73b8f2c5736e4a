// kvfuse-llama: the requests it serves. Two workloads: multi-turn conversations that share
// system prompts, and the first requests of a Mooncake-format trace scaled down to the tiny
// models' context. Token ids are drawn from seeds, so the same options give the same tokens;
// a conversation's later prompts contain the tokens the model generated for its earlier turns,
// so they exist only while the workload runs (Conversation::history).
#pragma once

#include <llama.h>

#include <kvfuse/bridge/ids.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

namespace llama_app {

using kvfuse::TokenCount;

/// One request of a workload. A conversation turn's prompt is the conversation so far
/// (system prompt, earlier user turns and the model's replies) followed by `tokens`; a trace
/// request's prompt is `tokens`.
struct Turn {
  std::optional<std::size_t> conversation;
  std::vector<llama_token> tokens;
  std::size_t output_tokens = 1;
  TokenCount reuse_bound = 0;  ///< trace: prompt tokens an unbounded cache of earlier prompts could serve
  std::string label;           ///< "conversation 2, turn 1" or "trace line 12"
};

/// What to serve, in order.
struct Workload {
  std::string name;  ///< "conversations" or "trace"
  std::vector<Turn> turns;
  std::size_t conversations = 0;
  bool has_reuse_bound = false;
  TokenCount longest = 0;  ///< an upper bound on any request's prompt + output tokens
};

/// Bad input: the message names the file, the line and the value.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A token id for the models' vocabulary, never one of its three specials.
inline llama_token token_from(std::uint64_t bits, std::int32_t vocab) {
  return static_cast<llama_token>(3 + bits % static_cast<std::uint64_t>(vocab - 3));
}

/// Options of the conversation workload.
struct ConversationOptions {
  std::size_t conversations = 4;
  std::size_t system_prompts = 2;  ///< conversation c opens with system prompt c % system_prompts
  std::size_t turns = 3;
  std::size_t min_reply = 16, max_reply = 64;  ///< output tokens per turn
  std::uint64_t seed = 1;
};

/// `conversations` conversations of `turns` turns; conversation c opens with system prompt
/// c % system_prompts (192 to 384 tokens), each turn adds 48 to 224 user tokens and asks for
/// min_reply to max_reply output tokens. Turns are served round-robin (every conversation's first turn,
/// then every second turn, ...), so the prefix cache does not hold a conversation from one
/// turn to the next unless it is large.
inline Workload make_conversations(const ConversationOptions& o, std::int32_t vocab) {
  std::mt19937_64 rng(o.seed * 0x9e3779b97f4a7c15ULL + 0x636f6e76ULL);
  auto uniform = [&](std::uint64_t lo, std::uint64_t hi) { return lo + rng() % (hi - lo + 1); };
  auto draw = [&](std::size_t n) {
    std::vector<llama_token> t(n);
    for (llama_token& x : t) x = token_from(rng(), vocab);
    return t;
  };
  std::vector<std::vector<llama_token>> systems;
  for (std::size_t s = 0; s < o.system_prompts; ++s) systems.push_back(draw(uniform(192, 384)));
  std::vector<std::vector<Turn>> by_conversation(o.conversations);
  std::vector<TokenCount> length(o.conversations, 0);
  Workload w;
  w.name = "conversations";
  w.conversations = o.conversations;
  for (std::size_t c = 0; c < o.conversations; ++c)
    for (std::size_t t = 0; t < o.turns; ++t) {
      Turn turn;
      turn.conversation = c;
      if (t == 0) turn.tokens = systems[c % o.system_prompts];
      const std::vector<llama_token> user = draw(uniform(48, 224));
      turn.tokens.insert(turn.tokens.end(), user.begin(), user.end());
      turn.output_tokens = uniform(o.min_reply, o.max_reply);
      turn.label = "conversation " + std::to_string(c) + ", turn " + std::to_string(t);
      length[c] += turn.tokens.size() + turn.output_tokens;
      w.longest = std::max(w.longest, length[c]);
      by_conversation[c].push_back(std::move(turn));
    }
  for (std::size_t t = 0; t < o.turns; ++t)
    for (std::size_t c = 0; c < o.conversations; ++c) w.turns.push_back(std::move(by_conversation[c][t]));
  return w;
}

/// Options of the trace workload.
struct TraceOptions {
  std::string path;
  std::size_t limit = 60;           ///< the first N requests
  std::uint32_t block_tokens = 16;  ///< tokens that stand for one of the trace's 512-token blocks
  std::size_t max_output = 16;      ///< output tokens are scaled like the prompt, then capped
};

/// The first `limit` requests of a Mooncake-format trace (one JSON object per line with
/// `input_length`, `output_length` and `hash_ids`, one id per 512-token block of the
/// prompt), each 512-token block scaled to `block_tokens` tokens whose ids derive from the
/// block's hash id and the position in the block: requests that share leading hash ids share
/// leading tokens. The prompt gets ceil(input_length * block_tokens / 512) tokens and the
/// output ceil(output_length * block_tokens / 512), at least 1 and at most max_output. The
/// reuse bound follows the trace's README: the leading run of hash ids seen before, in
/// scaled blocks, at most P - 1. Throws InputError naming the line for a malformed one.
inline Workload read_trace(const TraceOptions& o, std::int32_t vocab) {
  std::ifstream in(o.path);
  if (!in) throw InputError("cannot open trace \"" + o.path + "\"");
  Workload w;
  w.name = "trace";
  w.has_reuse_bound = true;
  std::unordered_set<std::uint64_t> seen;
  std::string text;
  std::size_t line_no = 0;
  auto bad = [&](const std::string& what) { throw InputError(o.path + ":" + std::to_string(line_no) + ": " + what); };
  auto count = [&](const nlohmann::json& line, const char* name, std::int64_t least) {
    const auto it = line.find(name);
    if (it == line.end() || !it->is_number_integer() || it->get<std::int64_t>() < least)
      bad("field \"" + std::string(name) + "\" must be an integer >= " + std::to_string(least) +
          (it == line.end() ? std::string(", missing") : ", got " + it->dump()));
    return it->get<std::uint64_t>();
  };
  while (w.turns.size() < o.limit && std::getline(in, text)) {
    ++line_no;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json line;
    try {
      line = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      bad(std::string("not JSON (") + e.what() + ")");
    }
    if (!line.is_object()) bad("expected a JSON object");
    const std::uint64_t input = count(line, "input_length", 1);
    const std::uint64_t output = count(line, "output_length", 0);
    const auto ids = line.find("hash_ids");
    if (ids == line.end() || !ids->is_array()) bad("field \"hash_ids\" must be an array");
    std::vector<std::uint64_t> hash_ids;
    for (const auto& id : *ids) {
      if (!id.is_number_integer() || id.get<std::int64_t>() < 0) bad("hash_ids holds " + id.dump() + ", not an integer >= 0");
      hash_ids.push_back(id.get<std::uint64_t>());
    }
    if (hash_ids.size() != (input + 511) / 512)
      bad("hash_ids has " + std::to_string(hash_ids.size()) + " ids, expected " + std::to_string((input + 511) / 512) +
          " (one per 512-token block of input_length " + std::to_string(input) + ")");
    Turn turn;
    const TokenCount prompt = (input * o.block_tokens + 511) / 512;
    for (TokenCount i = 0; i < prompt; ++i)
      turn.tokens.push_back(token_from(kvfuse::mix64(kvfuse::mix64(hash_ids[i / o.block_tokens] + 0x74726163ULL) ^
                                                             (i % o.block_tokens)),
                                       vocab));
    turn.output_tokens = std::clamp<std::size_t>((output * o.block_tokens + 511) / 512, 1, o.max_output);
    std::size_t run = 0;
    while (run < hash_ids.size() && seen.contains(hash_ids[run])) ++run;
    turn.reuse_bound = std::min<TokenCount>(run * o.block_tokens, prompt - 1);
    seen.insert(hash_ids.begin(), hash_ids.end());
    turn.label = "trace line " + std::to_string(line_no);
    w.longest = std::max<TokenCount>(w.longest, prompt + turn.output_tokens);
    w.turns.push_back(std::move(turn));
  }
  if (in.bad()) throw InputError("cannot read trace \"" + o.path + "\"");
  if (w.turns.empty()) throw InputError("trace \"" + o.path + "\" holds no requests");
  return w;
}

/// A seeded prompt of `n` tokens, for the time-to-first-token measurement.
inline std::vector<llama_token> seeded_prompt(std::size_t n, std::uint64_t seed, std::int32_t vocab) {
  std::mt19937_64 rng(seed);
  std::vector<llama_token> t(n);
  for (llama_token& x : t) x = token_from(rng(), vocab);
  return t;
}

}  // namespace llama_app
