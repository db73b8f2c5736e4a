// The Server (kvfuse's Coordinator, index, SingleRank, host kit and connector around llama.cpp
// sequences) gives every request the bits a from-scratch computation gives, at the edges
// of its grids: prompts that end on a chunk or a block boundary or one token past it,
// outputs that cross a block or a chunk boundary (their KV and checkpoint are recomputed as
// a prefill would compute them), the same prompt served again from the tier and from the
// prefix cache. And every load settles, every block and slot comes back.
#include <doctest/doctest.h>

#include <kvfuse/llama/server.hpp>

#include "llama_test_support.hpp"

using namespace kvfuse;
using namespace kvfuse::llama;
using namespace kvfuse::llama::testing;

namespace {

struct Step {
  TokenCount prompt;         ///< the first `prompt` tokens of the shared text; or, with
                             ///< `follow_up`, the previous prompt and its output, then this many new tokens
  std::size_t output;        ///< tokens to decode
  bool drop_cache = false;   ///< forget the prefix cache first, so the tier must serve
  bool follow_up = false;    ///< a chat's next turn: it contains the previous turn's generated tokens
};

template <class E>
void serves_the_bits_of_a_recompute(const std::string& arch) {
  const SequenceRunner& runner = runner_for(arch);
  const std::uint32_t block = runner.options().block_tokens;
  const std::uint32_t chunk = 2 * block;
  const std::vector<llama_token> text = prompt(runner, 11, 900);
  MemoryTier<> tier(std::size_t{256} << 20);
  ServeOptions o;
  o.chunk_tokens = chunk;
  o.model_id = model_id_for(runner, chunk);
  o.max_request_tokens = 1000;
  o.num_blocks = 24;
  E server(runner, tier, o);
  const std::vector<Step> steps = {
      {chunk, 1},                        // ends on the chunk grid: the generation-end checkpoint is P itself
      {chunk + 44, block + 5},           // the output crosses a block and a chunk boundary
      {chunk + 1, 3},                    // one token past the grid
      {3 * block, 8, true},              // ends on the block grid, served from the tier
      {3 * block, 8},                    // the same prompt again, from the prefix cache
      {600, 16, true},
      {600, 16, true},                   // the whole prompt but its last chunk, from the tier
      {chunk, 1, true},
      {2 * chunk - 10, block},           // the output crosses the chunk grid: a checkpoint past the prompt
      {20, 4, true, true},               // the next turn resumes there, on KV of generated tokens
  };
  TokenCount from_tier = 0;
  std::vector<llama_token> previous;
  for (const Step& step : steps) {
    CAPTURE(step.prompt);
    CAPTURE(step.output);
    std::vector<llama_token> p(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(step.prompt));
    if (step.follow_up) {
      p = previous;
      p.insert(p.end(), text.end() - static_cast<std::ptrdiff_t>(step.prompt), text.end());
    }
    const Served reference = compute_from_scratch(runner, p, step.output);
    if (step.drop_cache) server.drop_prefix_cache();
    const Served served = server.serve(p, step.output);
    CHECK_FALSE(served.resume_refused);
    CHECK(served.decoded.tokens == reference.decoded.tokens);
    CHECK(same_bits(served.decoded.first_logits, reference.decoded.first_logits));
    if (step.follow_up) CHECK(served.resumed_at == 2 * chunk);
    from_tier += served.from_tier;
    previous = p;
    previous.insert(previous.end(), served.decoded.tokens.begin(), served.decoded.tokens.end());
  }
  server.drain();
  CHECK(from_tier > 0);
  const ServerAudit audit = server.audit();
  CHECK(audit.invariant_violations == 0);
  CHECK(audit.stranded_parked == 0);
  CHECK(audit.leaked_blocks == 0);
  CHECK(audit.leaked_slots == 0);
  CHECK(server.index_stats().saves_failed == 0);
}

}  // namespace

TEST_CASE("llama server: requests at the grids' edges get the bits of a recompute") {
  serves_the_bits_of_a_recompute<DenseServer<MemoryTier<>>>("llama");
}
TEST_CASE("kimi-k3 server: requests at the grids' edges get the bits of a recompute") {
  serves_the_bits_of_a_recompute<KimiK3Server<MemoryTier<>>>("kimi-k3");
}
TEST_CASE("deepseek4 server: requests at the grids' edges get the bits of a recompute") {
  serves_the_bits_of_a_recompute<DeepSeek4Server<MemoryTier<>>>("deepseek4");
}
