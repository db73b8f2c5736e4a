// kvfuse-llama-server's own flags (backend_flags.hpp): taken out of argv, every other
// argument left for llama-server in order, and each bad value refused with a message that
// names the flag and the value; and the tiers they build (tier_stack.hpp).
#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "../backend_flags.hpp"
#include "../tier_stack.hpp"
#include "test_support.hpp"  // tests/: TempDir

using kvfuse::Error;
using kvfuse::llama_server::BackendFlags;
using kvfuse::llama_server::parse_size;
using kvfuse::llama_server::take_backend_flags;

namespace {

struct Argv {
  std::vector<std::string> words;
  std::vector<char*> ptrs;
  int argc = 0;
  explicit Argv(std::vector<std::string> w) : words(std::move(w)) {
    for (std::string& s : words) ptrs.push_back(s.data());
    ptrs.push_back(nullptr);
    argc = static_cast<int>(words.size());
  }
  std::vector<std::string> rest() const {
    std::vector<std::string> out;
    for (int i = 0; i < argc; ++i) out.emplace_back(ptrs[static_cast<std::size_t>(i)]);
    return out;
  }
};

std::string refusal(std::vector<std::string> words) {
  Argv a(std::move(words));
  try {
    (void)take_backend_flags(a.argc, a.ptrs.data());
  } catch (const Error& e) {
    return e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("the kvfuse flags leave argv, every other argument stays in order") {
  Argv a({"server", "-m", "m.gguf", "--kvfuse-memory", "4MiB", "-np", "2", "--kvfuse-disk=/tmp/d",
          "--kvfuse-chunk-tokens", "128", "--kvfuse-checkpoints", "every:2", "--kvfuse-redis", "unix:/s"});
  const BackendFlags f = take_backend_flags(a.argc, a.ptrs.data());
  CHECK(a.rest() == std::vector<std::string>{"server", "-m", "m.gguf", "-np", "2"});
  CHECK(a.ptrs[static_cast<std::size_t>(a.argc)] == nullptr);
  CHECK(f.memory_bytes == std::size_t{4} << 20);
  CHECK(f.disk->string() == "/tmp/d");
  CHECK(f.chunk_tokens == 128u);
  CHECK(*f.checkpoints == "every:2");
  CHECK(*f.redis == "unix:/s");
  CHECK(f.any());
}

TEST_CASE("no kvfuse flag: argv untouched, the server is the stock one") {
  Argv a({"server", "-m", "m.gguf", "--cache-ram", "0"});
  CHECK_FALSE(take_backend_flags(a.argc, a.ptrs.data()).any());
  CHECK(a.rest() == std::vector<std::string>{"server", "-m", "m.gguf", "--cache-ram", "0"});
}

TEST_CASE("sizes: units of 1024, and each bad one named") {
  CHECK(parse_size("--kvfuse-memory", "1MiB") == std::size_t{1} << 20);
  CHECK(parse_size("--kvfuse-memory", "64M") == std::size_t{64} << 20);
  CHECK(parse_size("--kvfuse-memory", "2GiB") == std::size_t{2} << 30);
  CHECK(parse_size("--kvfuse-memory", "4096") == 4096u);
  for (const char* bad : {"-5MiB", "0", "5XB", "MiB", "", "99999999999999999999", "18446744073709551615GiB"}) {
    const std::string m = refusal({"server", "--kvfuse-memory", bad});
    CHECK_MESSAGE(m.find(std::string("--kvfuse-memory ") + bad + ":") != std::string::npos, m);
  }
}

TEST_CASE("bad flags are refused naming the flag and the value") {
  CHECK(refusal({"server", "--kvfuse-chunk-tokens", "0"}).find("--kvfuse-chunk-tokens 0") != std::string::npos);
  CHECK(refusal({"server", "--kvfuse-chunk-tokens", "12x"}).find("--kvfuse-chunk-tokens 12x") != std::string::npos);
  CHECK(refusal({"server", "--kvfuse-frob", "1"}).find("--kvfuse-frob") != std::string::npos);
  CHECK(refusal({"server", "--kvfuse-memory"}).find("--kvfuse-memory: needs a value") != std::string::npos);
  CHECK(refusal({"server", "--kvfuse-memory", "1M", "--kvfuse-memory", "2M"}).find("--kvfuse-memory 2M: given twice") != std::string::npos);
  CHECK(refusal({"server", "--kvfuse-disk-size", "1G"}).find("needs --kvfuse-disk") != std::string::npos);
}

TEST_CASE("--kvfuse-disk-size is the disk tier's capacity: beyond it the least recently used files go") {
  const kvfuse::testing::TempDir temp("kvfuse-tier-stack");
  const auto& dir = temp.path;
  Argv a({"server", "--kvfuse-memory", "1MiB", "--kvfuse-disk", dir.string(), "--kvfuse-disk-size", "8KiB"});
  const BackendFlags f = take_backend_flags(a.argc, a.ptrs.data());
  kvfuse::llama_server::TierStackOptions o;
  o.memory_bytes = *f.memory_bytes;
  o.disk = f.disk;
  o.disk_bytes = f.disk_bytes;
  {
    kvfuse::llama_server::TierStack tiers(o);
    const std::vector<std::byte> chunk(3000, std::byte{7});
    for (std::uint64_t h = 1; h <= 4; ++h) {
      kvfuse::TierKey k;
      k.hash = kvfuse::PrefixHash{h};
      REQUIRE(tiers.put(k, chunk));  // written through to the disk, which keeps two
    }
    const auto s = tiers.stats();
    CHECK(s.has_disk);
    CHECK(s.disk_entries == 2);
    CHECK(s.disk_bytes == 6000);
    CHECK(s.disk_evictions == 2);
    CHECK(s.memory.entries == 4);  // the memory tier has its own budget
  }
  kvfuse::DiskTierOptions reopened_options;
  reopened_options.capacity_bytes = 8192;
  CHECK(kvfuse::DiskTier(dir, reopened_options).stats().entries == 2);  // what a restart finds
}

TEST_CASE("--kvfuse-cache-policy names a policy and owns the memory tier's budget only") {
  {
    Argv a({"server", "--kvfuse-cache-policy", "cost", "-np", "2"});
    const BackendFlags f = take_backend_flags(a.argc, a.ptrs.data());
    REQUIRE(f.cache_policy);
    CHECK(*f.cache_policy == kvfuse::CachePolicy::cost);
    CHECK(f.any());
    CHECK(a.rest() == std::vector<std::string>{"server", "-np", "2"});
  }
  {
    Argv a({"server", "--kvfuse-cache-policy=lru"});
    CHECK(*take_backend_flags(a.argc, a.ptrs.data()).cache_policy == kvfuse::CachePolicy::lru);
  }
  CHECK(refusal({"server", "--kvfuse-cache-policy", "fifo"}).find("--kvfuse-cache-policy fifo: not a cache policy") !=
        std::string::npos);
  CHECK(refusal({"server", "--kvfuse-cache-policy", "lru", "--kvfuse-cache-policy", "cost"})
            .find("--kvfuse-cache-policy cost: given twice") != std::string::npos);
  // A disk or Redis tier outlives the process and keeps a budget of its own.
  CHECK(refusal({"server", "--kvfuse-cache-policy", "cost", "--kvfuse-disk", "/tmp/d"})
            .find("--kvfuse-cache-policy cost: owns the memory tier's budget only") != std::string::npos);
  CHECK(refusal({"server", "--kvfuse-redis", "unix:/s", "--kvfuse-cache-policy", "lru"})
            .find("--kvfuse-cache-policy lru: owns the memory tier's budget only") != std::string::npos);
}
