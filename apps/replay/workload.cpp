// kvfuse-replay: reading a Mooncake trace and making the built-in sessions (workload.hpp).
#include "workload.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <random>
#include <unordered_set>
#include <utility>

namespace replay {

namespace {

using kvfuse::mix64;

std::uint64_t count_field(const nlohmann::json& line, const char* name, std::size_t line_no, const std::string& path,
                                 bool allow_zero) {
  const auto it = line.find(name);
  if (it == line.end())
    throw InputError(path + ":" + std::to_string(line_no) + ": missing field \"" + name + "\"");
  if (!it->is_number_integer() || (it->is_number_integer() && it->get<std::int64_t>() < (allow_zero ? 0 : 1)))
    throw InputError(path + ":" + std::to_string(line_no) + ": field \"" + name + "\" must be an integer " +
                     (allow_zero ? ">= 0" : "> 0") + ", got " + it->dump());
  return it->get<std::uint64_t>();
}

void finish_totals(Workload& w) {
  for (const Request& r : w.requests) {
    w.prompt_tokens += r.prompt_tokens;
    w.reuse_bound += r.reuse_bound;
    w.max_request_tokens = std::max<std::size_t>(w.max_request_tokens, r.prompt_tokens + r.output_tokens);
  }
}
}  // namespace

Workload read_trace(const std::string& path, std::size_t limit) {
  std::ifstream in(path);
  if (!in) throw InputError("cannot open trace \"" + path + "\"");
  Workload w;
  w.source = path;
  w.from_trace = true;
  std::unordered_set<std::uint64_t> seen;
  std::string text;
  std::size_t line_no = 0;
  double last_arrival = 0;
  while (std::getline(in, text)) {
    ++line_no;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (limit != 0 && w.requests.size() == limit) break;
    nlohmann::json line;
    try {
      line = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      throw InputError(path + ":" + std::to_string(line_no) + ": not JSON (" + e.what() + ")");
    }
    if (!line.is_object()) throw InputError(path + ":" + std::to_string(line_no) + ": expected a JSON object");
    const auto ts = line.find("timestamp");
    if (ts == line.end() || !ts->is_number() || ts->get<double>() < 0)
      throw InputError(path + ":" + std::to_string(line_no) + ": field \"timestamp\" must be a number >= 0" +
                       (ts == line.end() ? std::string(", missing") : ", got " + ts->dump()));
    Request r;
    r.index = w.requests.size();
    r.arrival_ms = std::max(last_arrival, ts->get<double>());
    last_arrival = r.arrival_ms;
    r.prompt_tokens = count_field(line, "input_length", line_no, path, false);
    r.output_tokens = count_field(line, "output_length", line_no, path, true);
    const auto ids = line.find("hash_ids");
    if (ids == line.end() || !ids->is_array())
      throw InputError(path + ":" + std::to_string(line_no) + ": field \"hash_ids\" must be an array");
    std::vector<std::uint64_t> hash_ids;
    for (const auto& id : *ids) {
      if (!id.is_number_integer() || id.get<std::int64_t>() < 0)
        throw InputError(path + ":" + std::to_string(line_no) + ": hash_ids holds " + id.dump() + ", not an integer >= 0");
      hash_ids.push_back(id.get<std::uint64_t>());
    }
    // One id per 512-token block of the prompt, the partial last block included: more ids
    // would name blocks the prompt does not have, fewer would leave blocks without a name.
    const std::uint64_t blocks = kvfuse::TokenGrid{chunk_tokens}.cells_covering(r.prompt_tokens);
    if (hash_ids.size() != blocks)
      throw InputError(path + ":" + std::to_string(line_no) + ": hash_ids has " + std::to_string(hash_ids.size()) +
                       " ids, expected " + std::to_string(blocks) + " (one per " + std::to_string(chunk_tokens) +
                       "-token block of input_length " + std::to_string(r.prompt_tokens) + ")");
    std::uint64_t run = 0;
    while (run < hash_ids.size() && seen.contains(hash_ids[run])) ++run;
    r.reuse_bound = std::min<std::uint64_t>(run * chunk_tokens, r.prompt_tokens - 1);
    for (const std::uint64_t id : hash_ids) seen.insert(id);
    const std::uint64_t total = r.prompt_tokens + r.output_tokens;
    const std::uint64_t chunks = (total + chunk_tokens - 1) / chunk_tokens;
    for (std::uint64_t i = 0; i < chunks; ++i) {
      const bool whole_prompt_chunk = (i + 1) * chunk_tokens <= r.prompt_tokens && i < hash_ids.size();
      r.chunk_keys.push_back(kvfuse::PrefixHash{whole_prompt_chunk ? mix64(mix64(hash_ids[i] + 0x7472616365ULL) ^ i)
                                                                    : mix64(mix64(r.index ^ (0x7461696cULL << 32)) ^ i)});
    }
    w.requests.push_back(std::move(r));
  }
  if (in.bad()) throw InputError("cannot read trace \"" + path + "\"");
  if (w.requests.empty()) throw InputError("trace \"" + path + "\" holds no requests");
  finish_totals(w);
  return w;
}

Workload make_sessions(std::uint64_t seed, std::size_t sessions, std::size_t turns) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](std::uint64_t lo, std::uint64_t hi) { return lo + rng() % (hi - lo + 1); };
  Workload w;
  w.source = "sessions";
  for (std::size_t s = 0; s < sessions; ++s) {
    double at = static_cast<double>(uniform(0, 4000));
    TokenCount length = 0;
    const std::uint64_t salt = mix64(seed * 0x51ed27ULL + s + 1);
    for (std::size_t t = 0; t < turns; ++t) {
      Request r;
      r.session = s;
      r.arrival_ms = at;
      r.prompt_tokens = length + uniform(t == 0 ? 300 : 40, t == 0 ? 4000 : 1600);
      r.output_tokens = uniform(16, 320);
      const TokenCount total = r.prompt_tokens + r.output_tokens;
      for (std::uint64_t i = 0; i * chunk_tokens < total; ++i) r.chunk_keys.push_back(kvfuse::PrefixHash{mix64(salt ^ mix64(i))});
      length = total;
      at += static_cast<double>(uniform(300, 2500));  // the user reads, thinks, types
      w.requests.push_back(std::move(r));
    }
  }
  std::stable_sort(w.requests.begin(), w.requests.end(),
                   [](const Request& a, const Request& b) { return a.arrival_ms < b.arrival_ms; });
  for (std::size_t i = 0; i < w.requests.size(); ++i) w.requests[i].index = i;
  finish_totals(w);
  return w;
}

}  // namespace replay
