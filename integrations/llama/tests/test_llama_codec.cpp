// The codec against llama.cpp's real blobs: the layout it learns is the one the models'
// hyperparameters imply, blocks hold tokens where the block layout says, a blob rebuilt
// from blocks and a slot is llama.cpp's own blob byte for byte, and whatever does not fit
// is refused naming why.
#include <doctest/doctest.h>

#include <cstring>

#include "llama_test_support.hpp"

using namespace kvfuse;
using namespace kvfuse::llama;
using namespace kvfuse::llama::testing;

namespace {

// The sequence's own blob at each boundary against two rebuilds: from the blocks stored at
// the end of the prompt, and from blocks stored a range at a time as the sequence grew
// (each range from the blob of its own end), as an engine saves chunk after chunk.
void rebuilds_llamas_own_blob(const std::string& arch) {
  const SequenceRunner& runner = runner_for(arch);
  const SequenceCodec& codec = runner.codec();
  const Reference ref = reference_pass(runner);
  const ModelCase& c = model_case(arch);
  Blocks grown(codec, c.boundaries.back());
  Sequence sequence = runner.start();
  TokenCount stored = 0;
  for (const TokenCount boundary : c.boundaries) {
    CAPTURE(boundary);
    sequence.prefill(std::span(ref.prompt).subspan(sequence.position(), boundary - sequence.position()), false);
    const std::vector<std::uint8_t> own = sequence.full_blob();
    codec.store_kv(own, stored, boundary, grown.pool.data(), std::span(grown.table).subspan(stored / codec.block_tokens()));
    stored = boundary;
    const std::span<const std::byte> slot =
        codec.slot_bytes() == 0 ? std::span<const std::byte>{} : std::span<const std::byte>(ref.slots.at(boundary));
    std::vector<std::uint8_t> rebuilt;
    codec.rebuild(boundary, ref.blocks.pool.data(), ref.blocks.table, slot, rebuilt);
    CHECK(rebuilt.size() == own.size());
    CHECK(rebuilt == own);
    codec.rebuild(boundary, grown.pool.data(), grown.table, slot, rebuilt);
    CHECK(rebuilt == own);
  }
}

}  // namespace

TEST_CASE("llama: the learned layout is two layers of f16 K rows and V by dimension, 512 bytes a token, no state") {
  const SequenceCodec& codec = runner_for("llama").codec();
  const BlobLayout& layout = codec.layout();
  CHECK(layout.family == BlobFamily::attention);
  CHECK(layout.granule_tokens == 1);
  CHECK(layout.v_trans == 1);  // flash attention off
  REQUIRE(layout.runs.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    CHECK(layout.runs[i].kind == (i < 2 ? RowRun::Kind::key : RowRun::Kind::value));
    CHECK(layout.runs[i].type == 1);
    CHECK(layout.runs[i].row_bytes == 2 * 32 * 2);  // 2 KV heads of 32, f16
    CHECK(layout.runs[i].transposed == (i >= 2));
  }
  CHECK(codec.kv_bytes_per_token() == 512);
  CHECK(codec.slot_bytes() == 0);
}

TEST_CASE("kimi-k3: the learned layout is two MLA layers of latent plus rope K rows, 192 bytes a token, and a KDA state") {
  const SequenceCodec& codec = runner_for("kimi-k3").codec();
  const BlobLayout& layout = codec.layout();
  CHECK(layout.family == BlobFamily::hybrid);
  REQUIRE(layout.runs.size() == 2);  // MLA keeps no V
  for (const RowRun& r : layout.runs) CHECK(r.row_bytes == (32 + 16) * 2);
  CHECK(codec.kv_bytes_per_token() == 192);
  CHECK(layout.state_bytes > 0);
  CHECK(codec.slot_bytes() == SequenceCodec::slot_header_bytes + layout.state_bytes);
}

TEST_CASE("deepseek4: the learned layout is compressed rows in 128-token granules, 130 bytes a token, and a window state") {
  const SequenceCodec& codec = runner_for("deepseek4").codec();
  const BlobLayout& layout = codec.layout();
  CHECK(layout.family == BlobFamily::deepseek4);
  CHECK(layout.granule_tokens == 128);
  // Compress ratios 0 4 128 4 128: CSA on layers 1 and 3, HCA on 2 and 4, the indexer
  // beside CSA; every row 64 f16 elements.
  const std::vector<std::pair<std::uint32_t, std::uint32_t>> expected = {{1, 4}, {3, 4}, {2, 128}, {4, 128}, {1, 4}, {3, 4}};
  REQUIRE(layout.runs.size() == expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    CAPTURE(i);
    CHECK(layout.runs[i].layer == expected[i].first);
    CHECK(layout.runs[i].tokens_per_row == expected[i].second);
    CHECK(layout.runs[i].row_bytes == 128);
  }
  CHECK(layout.granule_bytes() == 2 * 32 * 128 + 2 * 128 + 2 * 32 * 128);
  CHECK(codec.kv_bytes_per_token() == 130);
  CHECK(layout.state_bytes > 128 * 5 * 128);  // at least the raw window: 128 cells of 5 layers
}

TEST_CASE("llama: token t lies in the block the table names for t over block_tokens at t mod block_tokens times kv_bytes_per_token") {
  const SequenceRunner& runner = runner_for("llama");
  const SequenceCodec& codec = runner.codec();
  const Reference ref = reference_pass(runner);
  Sequence sequence = runner.start();
  sequence.prefill(ref.prompt, false);
  const std::vector<std::uint8_t> blob = sequence.full_blob();
  const BlobRows rows = locate_rows(codec.layout(), blob);
  CHECK(rows.tokens == prompt_tokens);
  std::vector<std::byte> row(codec.kv_bytes_per_token());
  for (const TokenCount t : {TokenCount{0}, TokenCount{1}, TokenCount{63}, TokenCount{64}, TokenCount{200}, TokenCount{255}}) {
    CAPTURE(t);
    const std::byte* token = ref.blocks.pool.data() + std::size_t{ref.blocks.table[t / codec.block_tokens()].value} * codec.block_bytes() +
                             (t % codec.block_tokens()) * codec.kv_bytes_per_token();
    for (std::size_t run = 0; run < codec.layout().runs.size(); ++run) {
      CAPTURE(run);
      copy_row(codec.layout(), rows, run, t, row.data());
      CHECK(std::memcmp(token + codec.run_offset(run), row.data(), codec.layout().runs[run].row_bytes) == 0);
    }
  }
  // A transposed V row is the token's element in each dimension, gathered.
  const RowRun& v = codec.layout().runs[2];
  copy_row(codec.layout(), rows, 2, 5, row.data());
  CHECK(std::memcmp(row.data() + v.element_bytes, rows.data[2] + (1 * rows.rows[2] + 5) * v.element_bytes, v.element_bytes) == 0);
}

TEST_CASE("llama: a blob rebuilt from blocks stored at once or range by range is llama.cpp's own blob byte for byte at every boundary") {
  rebuilds_llamas_own_blob("llama");
}
TEST_CASE("kimi-k3: a blob rebuilt from blocks stored at once or range by range and the slot is llama.cpp's own blob byte for byte at every boundary") {
  rebuilds_llamas_own_blob("kimi-k3");
}
// Also proves that a compressed row does not change once written: the blocks come from the
// blob at the prompt's end, the comparison from the blob at the boundary.
TEST_CASE("deepseek4: a blob rebuilt from blocks stored at once or range by range and the slot is llama.cpp's own blob byte for byte at every boundary") {
  rebuilds_llamas_own_blob("deepseek4");
}

TEST_CASE("the codec refuses a blob that does not fit and a range off the grid and a corrupt slot naming why") {
  const SequenceRunner& runner = runner_for("kimi-k3");
  const SequenceCodec& codec = runner.codec();
  const Reference ref = reference_pass(runner);
  Sequence sequence = runner.start();
  sequence.prefill(std::span(ref.prompt).first(128), false);
  std::vector<std::uint8_t> blob = sequence.full_blob();
  Blocks blocks(codec, 128);

  SUBCASE("a blob cut short") {
    blob.resize(1000);  // inside the KV section (the recurrent section after it is not read)
    CHECK_THROWS_WITH_AS(codec.store_kv(blob, 0, 128, blocks.pool.data(), blocks.table), doctest::Contains("corrupt_data"), Error);
  }
  SUBCASE("another model's blob") {
    const SequenceRunner& other = runner_for("llama");
    Sequence s = other.start();
    s.prefill(std::span(ref.prompt).first(128), false);
    CHECK_THROWS_WITH_AS(codec.store_kv(s.full_blob(), 0, 128, blocks.pool.data(), blocks.table),
                         doctest::Contains("corrupt_data"), Error);
  }
  SUBCASE("cells that are not the positions in order") {
    const std::size_t second_cell_pos = 8 + 8 + 12;  // header, stream count and cell count, then cell 0
    const std::int32_t five = 5;
    std::memcpy(blob.data() + second_cell_pos, &five, sizeof five);
    CHECK_THROWS_WITH_AS(codec.store_kv(blob, 0, 128, blocks.pool.data(), blocks.table),
                         doctest::Contains("cell 1 holds position 5"), Error);
  }
  SUBCASE("a range off the block grid, past the sequence, or with too few blocks") {
    CHECK_THROWS_WITH_AS(codec.store_kv(blob, 0, 100, blocks.pool.data(), blocks.table), doctest::Contains("[0, 100)"), Error);
    CHECK_THROWS_WITH_AS(codec.store_kv(blob, 0, 192, blocks.pool.data(), blocks.table), doctest::Contains("holds 128"), Error);
    CHECK_THROWS_WITH_AS(codec.store_kv(blob, 0, 128, blocks.pool.data(), std::span(blocks.table).first(1)),
                         doctest::Contains("1 blocks cannot hold"), Error);
  }
  SUBCASE("a slot whose length is not a state") {
    std::vector<std::byte> slot(ref.slots.at(128));
    const std::uint64_t too_long = codec.layout().state_bytes + 1;
    std::memcpy(slot.data(), &too_long, sizeof too_long);
    std::vector<std::uint8_t> rebuilt;
    CHECK_THROWS_WITH_AS(codec.rebuild(128, ref.blocks.pool.data(), ref.blocks.table, slot, rebuilt),
                         doctest::Contains("corrupt_data"), Error);
    CHECK_THROWS_WITH_AS(codec.rebuild(128, ref.blocks.pool.data(), ref.blocks.table, std::span(slot).first(8), rebuilt),
                         doctest::Contains("a slot must be"), Error);
  }
}

TEST_CASE("a runner refuses options that cannot resume bit for bit and an architecture the codec does not know") {
  CHECK_THROWS_WITH_AS((void)family_of_architecture("mamba"), doctest::Contains("'mamba'"), Error);
  const Model& deepseek = runner_for("deepseek4").model();
  RunnerOptions options;
  options.ubatch_tokens = 64;
  options.block_tokens = 64;  // splits deepseek4's 128-token HCA rows
  CHECK_THROWS_WITH_AS(SequenceRunner(deepseek, options), doctest::Contains("granule (128 tokens)"), Error);
  options.block_tokens = 96;  // not a multiple of the ubatch
  CHECK_THROWS_WITH_AS(SequenceRunner(deepseek, options), doctest::Contains("multiple of ubatch_tokens (64)"), Error);
}
