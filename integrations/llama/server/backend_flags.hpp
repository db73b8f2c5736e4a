// backend_flags.hpp — kvfuse-llama-server's own command-line flags (--kvfuse-*), taken out
// of argv before llama-server's parser sees them (it refuses flags it does not know).
//
// The flags and their values are checked here, before anything loads: a bad value is an
// Error(invalid_argument) whose message names the flag and the value, which main() prints
// before it exits 1. What needs the model (the chunk size against the model's grid) is
// checked later, by the backend's configure(), still before the model loads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <kvfuse/engine/cache_policy.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse::llama_server {

/// What the --kvfuse-* flags asked for. Plain data; empty optionals were not given.
struct BackendFlags {
  std::optional<std::size_t> memory_bytes;     ///< --kvfuse-memory SIZE: the memory tier's budget
  std::optional<std::filesystem::path> disk;   ///< --kvfuse-disk DIR: a disk tier behind the memory tier
  std::optional<std::size_t> disk_bytes;       ///< --kvfuse-disk-size SIZE: the disk tier's budget
  std::optional<std::string> redis;            ///< --kvfuse-redis ADDR: unix:PATH, HOST:PORT or cluster:SEED[,SEED...], behind the rest
  std::optional<std::string> checkpoints;      ///< --kvfuse-checkpoints POLICY: default, last, all, every:N
  std::optional<std::uint32_t> chunk_tokens;   ///< --kvfuse-chunk-tokens N: tokens per tier chunk
  /// --kvfuse-cache-policy lru|cost: a cache ledger owns the memory tier's budget and decides
  /// what it keeps (memory tier only: a disk or Redis tier outlives the process and keeps a
  /// budget of its own).
  std::optional<CachePolicy> cache_policy;

  /// Whether any flag was given: with none the server is the stock one.
  [[nodiscard]] bool any() const noexcept {
    return memory_bytes || disk || disk_bytes || redis || checkpoints || chunk_tokens || cache_policy;
  }
};

/// Reads a size: a whole number of bytes, optionally followed by B, KiB, MiB, GiB (powers of
/// 1024) or K, M, G (the same). Throws Error(invalid_argument) naming `flag` and `text` for
/// anything else, zero, or a size that overflows. Any thread.
inline std::size_t parse_size(std::string_view flag, std::string_view text) {
  auto bad = [&](std::string_view why) {
    return Error(ErrorCode::invalid_argument, std::string(flag) + " " + std::string(text) + ": " + std::string(why) +
                                                  " (a size is a whole number with an optional unit: B, KiB, MiB, GiB)");
  };
  std::size_t digits = 0;
  std::uint64_t value = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') {
    const auto d = static_cast<std::uint64_t>(text[digits] - '0');
    if (value > (std::numeric_limits<std::uint64_t>::max() - d) / 10) throw bad("too large");
    value = value * 10 + d;
    ++digits;
  }
  if (digits == 0) throw bad("not a size");
  const std::string_view unit = text.substr(digits);
  std::uint64_t scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KiB" || unit == "K") scale = std::uint64_t{1} << 10;
  else if (unit == "MiB" || unit == "M") scale = std::uint64_t{1} << 20;
  else if (unit == "GiB" || unit == "G") scale = std::uint64_t{1} << 30;
  else throw bad("unknown unit '" + std::string(unit) + "'");
  if (value == 0) throw bad("must be more than zero");
  if (value > std::numeric_limits<std::uint64_t>::max() / scale) throw bad("too large");
  return static_cast<std::size_t>(value * scale);
}

/// Reads a positive whole number of tokens; throws Error(invalid_argument) naming `flag`
/// and `text` otherwise. Any thread.
inline std::uint32_t parse_tokens(std::string_view flag, std::string_view text) {
  std::uint64_t value = 0;
  bool ok = !text.empty();
  for (const char c : text) {
    if (c < '0' || c > '9' || value > std::numeric_limits<std::uint32_t>::max()) {
      ok = false;
      break;
    }
    value = value * 10 + static_cast<std::uint64_t>(c - '0');
  }
  if (!ok || value == 0 || value > std::numeric_limits<std::uint32_t>::max())
    throw Error(ErrorCode::invalid_argument,
                std::string(flag) + " " + std::string(text) + ": must be a whole number of tokens, more than zero");
  return static_cast<std::uint32_t>(value);
}

/// Takes every --kvfuse-* flag (as `--flag VALUE` or `--flag=VALUE`) out of argv, shifting
/// the rest down and shrinking argc, and returns what they asked for. Throws
/// Error(invalid_argument) naming the flag and the value for an unknown --kvfuse-* flag, a
/// missing value, a flag given twice, or a value that does not parse. Checks only the
/// values' form; the backend checks the rest (a directory it can use, a Redis that answers).
/// Main thread, before anything else reads argv.
inline BackendFlags take_backend_flags(int& argc, char** argv) {
  BackendFlags f;
  std::vector<char*> kept;
  kept.push_back(argv[0]);
  static constexpr std::string_view prefix = "--kvfuse-";
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (!arg.starts_with(prefix)) {
      kept.push_back(argv[i]);
      continue;
    }
    std::string name(arg);
    std::optional<std::string> value;
    if (const std::size_t eq = arg.find('='); eq != std::string_view::npos) {
      name = std::string(arg.substr(0, eq));
      value = std::string(arg.substr(eq + 1));
    } else if (i + 1 < argc) {
      value = std::string(argv[++i]);
    }
    static constexpr std::string_view known[] = {"--kvfuse-memory",      "--kvfuse-disk",         "--kvfuse-disk-size",
                                                 "--kvfuse-redis",       "--kvfuse-checkpoints",  "--kvfuse-chunk-tokens",
                                                 "--kvfuse-cache-policy"};
    bool is_known = false;
    for (const std::string_view k : known) is_known = is_known || name == k;
    if (!is_known)
      throw Error(ErrorCode::invalid_argument, name + ": not a kvfuse flag (they are --kvfuse-memory, --kvfuse-disk, "
                                                      "--kvfuse-disk-size, --kvfuse-redis, --kvfuse-checkpoints, --kvfuse-chunk-tokens, "
                                                      "--kvfuse-cache-policy)");
    if (!value) throw Error(ErrorCode::invalid_argument, name + ": needs a value");
    auto once = [&](bool given) {
      if (given) throw Error(ErrorCode::invalid_argument, name + " " + *value + ": given twice");
    };
    if (name == "--kvfuse-memory") {
      once(f.memory_bytes.has_value());
      f.memory_bytes = parse_size(name, *value);
    } else if (name == "--kvfuse-disk") {
      once(f.disk.has_value());
      if (value->empty()) throw Error(ErrorCode::invalid_argument, name + " '': needs a directory");
      f.disk = *value;
    } else if (name == "--kvfuse-disk-size") {
      once(f.disk_bytes.has_value());
      f.disk_bytes = parse_size(name, *value);
    } else if (name == "--kvfuse-redis") {
      once(f.redis.has_value());
      f.redis = *value;
    } else if (name == "--kvfuse-checkpoints") {
      once(f.checkpoints.has_value());
      f.checkpoints = *value;
    } else if (name == "--kvfuse-cache-policy") {
      once(f.cache_policy.has_value());
      if (*value == "lru") f.cache_policy = CachePolicy::lru;
      else if (*value == "cost") f.cache_policy = CachePolicy::cost;
      else throw Error(ErrorCode::invalid_argument, name + " " + *value + ": not a cache policy (lru or cost)");
    } else {
      once(f.chunk_tokens.has_value());
      f.chunk_tokens = parse_tokens(name, *value);
    }
  }
  if (f.cache_policy && (f.disk || f.redis))
    throw Error(ErrorCode::invalid_argument,
                std::string("--kvfuse-cache-policy ") + std::string(to_string(*f.cache_policy)) + ": owns the memory tier's budget " +
                    "only; a disk or Redis tier outlives the process and keeps its own (--kvfuse-disk-size, Redis maxmemory)");
  if (f.disk_bytes && !f.disk)
    throw Error(ErrorCode::invalid_argument, "--kvfuse-disk-size " + std::to_string(*f.disk_bytes) + ": needs --kvfuse-disk DIR");
  for (std::size_t k = 0; k < kept.size(); ++k) argv[k] = kept[k];
  argc = static_cast<int>(kept.size());
  argv[argc] = nullptr;
  return f;
}

}  // namespace kvfuse::llama_server
