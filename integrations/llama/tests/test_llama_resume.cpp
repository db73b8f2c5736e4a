// A llama.cpp sequence rebuilt from its KV blocks [0, B) and the state slot snapshotted at
// B continues exactly as the sequence that never stopped: the same greedy tokens and the
// same first-step logits, bit for bit, for every model and every boundary. And the check
// is able to fail: a flipped byte in one block, or the slot of another boundary, each
// changes the logits.
#include <doctest/doctest.h>

#include <cstring>

#include "llama_test_support.hpp"

using namespace kvfuse;
using namespace kvfuse::llama;
using namespace kvfuse::llama::testing;

namespace {

std::span<const std::byte> slot_at(const Reference& ref, TokenCount boundary) {
  const auto it = ref.slots.find(boundary);
  return it == ref.slots.end() ? std::span<const std::byte>{} : std::span<const std::byte>(it->second);
}

void resumes_bitwise_at_every_boundary(const std::string& arch) {
  const SequenceRunner& runner = runner_for(arch);
  const Reference ref = reference_pass(runner);

  // Stopping at the boundaries to snapshot changes nothing: a prefill that never stops
  // gives the same bits.
  Sequence straight = runner.start();
  straight.prefill(ref.prompt, true);
  const Decoded unstopped = straight.decode(decode_tokens);
  CHECK(unstopped.tokens == ref.decoded.tokens);
  CHECK(same_bits(unstopped.first_logits, ref.decoded.first_logits));

  for (const TokenCount boundary : model_case(arch).boundaries) {
    CAPTURE(boundary);
    const Decoded resumed = resumed_pass(runner, ref, boundary, ref.blocks, slot_at(ref, boundary));
    CHECK(resumed.tokens == ref.decoded.tokens);
    CHECK(same_bits(resumed.first_logits, ref.decoded.first_logits));
  }
}

// Why the runner never lets an ubatch cross a multiple of the ubatch size, and a resume
// start on the block grid: the cuts then are those of a prefill that never stopped, so
// stops on the grid keep the bits. That is kvfuse's promise, asserted on every build. A
// stop one token past the grid leaves a one-token ubatch, which llama.cpp's CPU backend may
// run with other kernels (matrix-vector) that sum in another order; whether the bits move
// then depends on llama.cpp's kernels for this CPU and build type (on some CPUs the dense
// model's do not), so it is reported, not asserted. The controls below (a flipped byte,
// another boundary's or prompt's slot) are what shows the comparison can fail.
void stops_on_the_grid_keep_the_bits(const std::string& arch) {
  const SequenceRunner& runner = runner_for(arch);
  const Reference ref = reference_pass(runner);
  auto stopped_at = [&](std::initializer_list<TokenCount> stops) {
    Sequence sequence = runner.start();
    for (const TokenCount stop : stops)
      sequence.prefill(std::span(ref.prompt).subspan(sequence.position(), stop - sequence.position()), false);
    sequence.prefill(std::span(ref.prompt).subspan(sequence.position()), true);
    return sequence.decode(decode_tokens);
  };
  const Decoded on_grid = stopped_at({64, 192, 256});
  CHECK(on_grid.tokens == ref.decoded.tokens);
  CHECK(same_bits(on_grid.first_logits, ref.decoded.first_logits));
  const Decoded one_token_ubatch = stopped_at({129});
  MESSAGE(arch << ": measured, not asserted: a one-token ubatch at 128 "
               << (same_bits(one_token_ubatch.first_logits, ref.decoded.first_logits) ? "keeps" : "changes")
               << " the first logits' bits (largest difference "
               << largest_difference(one_token_ubatch.first_logits, ref.decoded.first_logits) << ")");
}

// Flips one bit of the exponent of the first element of the longest-reaching row in the
// block that holds token 0 (a K row of token 0, which every later token attends to; for
// deepseek4 the HCA row that summarises tokens 0..127).
void flipped_block_byte_changes_logits(const std::string& arch) {
  const SequenceRunner& runner = runner_for(arch);
  const SequenceCodec& codec = runner.codec();
  const Reference ref = reference_pass(runner);
  std::size_t run = 0;
  for (std::size_t i = 0; i < codec.layout().runs.size(); ++i)
    if (codec.layout().runs[i].tokens_per_row > codec.layout().runs[run].tokens_per_row) run = i;
  REQUIRE(codec.layout().runs[run].type == 1);  // f16: byte 1 holds the exponent

  const TokenCount boundary = model_case(arch).boundaries.back();
  Blocks flipped = ref.blocks;
  std::byte& target = flipped.pool[std::size_t{flipped.table[0].value} * codec.block_bytes() + codec.run_offset(run) + 1];
  target ^= std::byte{0x04};

  const Decoded intact = resumed_pass(runner, ref, boundary, ref.blocks, slot_at(ref, boundary));
  REQUIRE(same_bits(intact.first_logits, ref.decoded.first_logits));
  const Decoded damaged = resumed_pass(runner, ref, boundary, flipped, slot_at(ref, boundary));
  MESSAGE(arch << ": a flipped byte in block 0 moves the first logits by up to "
               << largest_difference(damaged.first_logits, ref.decoded.first_logits));
  CHECK_FALSE(same_bits(damaged.first_logits, ref.decoded.first_logits));
}

// The blocks of [0, first boundary) with the slot snapshotted at the last boundary. A
// kimi-k3 KDA state carries nothing llama.cpp checks: the sequence runs on, wrongly.
void wrong_boundary_slot_changes_logits(const std::string& arch) {
  const SequenceRunner& runner = runner_for(arch);
  const Reference ref = reference_pass(runner);
  const ModelCase& c = model_case(arch);
  const TokenCount boundary = c.boundaries.front();
  const Decoded wrong = resumed_pass(runner, ref, boundary, ref.blocks, slot_at(ref, c.boundaries.back()));
  MESSAGE(arch << ": the slot of boundary " << c.boundaries.back() << " at boundary " << boundary
               << " moves the first logits by up to " << largest_difference(wrong.first_logits, ref.decoded.first_logits));
  CHECK_FALSE(same_bits(wrong.first_logits, ref.decoded.first_logits));
}

// The slot snapshotted at the right boundary of another prompt: nothing but its bytes
// differ, so only the logits can tell.
void other_prompt_slot_changes_logits(const std::string& arch) {
  const SequenceRunner& runner = runner_for(arch);
  const Reference ref = reference_pass(runner);
  const Reference other = reference_pass(runner, 8);
  REQUIRE(other.prompt != ref.prompt);
  for (const TokenCount boundary : model_case(arch).boundaries) {
    CAPTURE(boundary);
    const Decoded wrong = resumed_pass(runner, ref, boundary, ref.blocks, slot_at(other, boundary));
    MESSAGE(arch << ": another prompt's slot at boundary " << boundary << " moves the first logits by up to "
                 << largest_difference(wrong.first_logits, ref.decoded.first_logits));
    CHECK_FALSE(same_bits(wrong.first_logits, ref.decoded.first_logits));
  }
}

}  // namespace

TEST_CASE("llama: rebuilt from its KV blocks at every block boundary it decodes the same tokens and logits bit for bit") {
  resumes_bitwise_at_every_boundary("llama");
}
TEST_CASE("kimi-k3: rebuilt from its KV blocks and KDA state slot at every boundary it decodes the same tokens and logits bit for bit") {
  resumes_bitwise_at_every_boundary("kimi-k3");
}
TEST_CASE("deepseek4: rebuilt from its compressed-KV blocks and window state slot at every boundary it decodes the same tokens and logits bit for bit") {
  resumes_bitwise_at_every_boundary("deepseek4");
}

TEST_CASE("llama: stops on the ubatch grid keep the bits") {
  stops_on_the_grid_keep_the_bits("llama");
}
TEST_CASE("kimi-k3: stops on the ubatch grid keep the bits") {
  stops_on_the_grid_keep_the_bits("kimi-k3");
}
TEST_CASE("deepseek4: stops on the ubatch grid keep the bits") {
  stops_on_the_grid_keep_the_bits("deepseek4");
}

TEST_CASE("llama control: one flipped byte in one KV block changes the first logits") {
  flipped_block_byte_changes_logits("llama");
}
TEST_CASE("kimi-k3 control: one flipped byte in one KV block changes the first logits") {
  flipped_block_byte_changes_logits("kimi-k3");
}
TEST_CASE("deepseek4 control: one flipped byte in one KV block changes the first logits") {
  flipped_block_byte_changes_logits("deepseek4");
}

TEST_CASE("kimi-k3 control: the state slot of another boundary changes the first logits") {
  wrong_boundary_slot_changes_logits("kimi-k3");
}
// deepseek4's window state holds the positions of its cells, so llama.cpp sees that the
// sequence would not join up; the runner refuses the resume rather than run on.
TEST_CASE("deepseek4 control: the state slot of another boundary is refused since its window ends elsewhere") {
  const SequenceRunner& runner = runner_for("deepseek4");
  const Reference ref = reference_pass(runner);
  const ModelCase& c = model_case("deepseek4");
  CHECK_THROWS_WITH_AS((void)runner.resume(c.boundaries.front(), ref.blocks.pool.data(), ref.blocks.table,
                                           slot_at(ref, c.boundaries.back())),
                       doctest::Contains("belongs to another boundary"), Error);
}

TEST_CASE("kimi-k3 control: the state slot of another prompt at the same boundary changes the first logits") {
  other_prompt_slot_changes_logits("kimi-k3");
}
TEST_CASE("deepseek4 control: the state slot of another prompt at the same boundary changes the first logits") {
  other_prompt_slot_changes_logits("deepseek4");
}
