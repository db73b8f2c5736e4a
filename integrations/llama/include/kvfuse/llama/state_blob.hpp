// kvfuse/llama/state_blob.hpp — the byte layout of llama.cpp's sequence state blob, at the
// one llama.cpp commit this integration is written against.
//
// Everything this integration assumes about llama.cpp's saved state lives in this header;
// nothing else parses or writes a blob. The integration cuts the blob of the public API
// (llama_state_seq_get_data / set_data, and the LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY blob)
// rather than reading the cache tensors through llama.cpp's internal headers, because the
// blob is what llama.cpp itself promises to read back: a restore goes through the same
// checks (types, row sizes, cell placement) as any saved session, on any backend, and the
// grammar below is all that ties the integration to one commit. The cost is one extra copy
// of the sequence per save and per load (docs/llama.md says what a GPU build would do).
//
// The layout at that commit (llama-context.cpp, llama-kv-cache.cpp,
// llama-memory-hybrid.cpp, llama-kv-cache-iswa.cpp, llama-kv-cache-dsv4.cpp), in host byte
// order, no padding:
//
//   blob        := u32 0xaf143cd8, i32 seq_id, memory
//   kv_section  := u32 n_stream (1 here), u32 cells, cells x (i32 pos, u32 n_seq_id = 1,
//                  i32 seq_id), u32 v_trans, u32 n_layer,
//                  n_layer x (i32 type, u64 row_bytes, cells x row),
//                  then per layer that stores V (the count is not written):
//                    v_trans = 0: i32 type, u64 row_bytes, cells x row
//                    v_trans = 1: i32 type, u32 element_bytes, u32 elements,
//                                 elements x (cells x element)      (V by dimension)
//   llama (plain KV cache):          memory := kv_section
//   kimi-k3 (hybrid):                memory := kv_section (MLA, K only), recurrent_section
//                                    PARTIAL_ONLY: memory := recurrent_section
//   deepseek4 (llama_kv_cache_dsv4): memory := u32 0x34565344, u32 1, u32 mode (0 full,
//                                    1 partial), [full: kv_section of the raw cache's base
//                                    half: every cell, no layers], kv_section of the raw
//                                    sliding window (the last cells only), [full: the CSA,
//                                    HCA and indexer compressed caches], the CSA, HCA and
//                                    indexer compressor states
//   compressed  := u32 2, u32 rows, u32 n_stream (1), u32 n_layer,
//                  n_layer x (u32 layer, tensor)       row r covers tokens [r*ratio, (r+1)*ratio)
//   compressor  := u32 1, u32 ratio, u32 state_rows, u32 width, u32 n_stream (1), u32 n_layer,
//                  n_layer x (u32 layer, tensor kv, tensor score)
//   tensor      := i32 type, u64 ne0, u64 rows, u64 row_bytes, rows x row
//
// The recurrent section is never parsed: it is state, kept and given back whole.
//
// What is per-token KV (cut into blocks) and what is state (kept in a slot):
//   - llama: every K and V row, per token. No state.
//   - kimi-k3: the MLA K rows per token; the KDA recurrent section is the state.
//   - deepseek4: the compressed rows (CSA and indexer: one per 4 tokens; HCA: one per 128)
//     are KV, cut in granules of 128 tokens, the least common multiple of the ratios, so a
//     cut never splits a row. The raw sliding window (the last cells of raw K) and the
//     three compressor states change with every token: they are the state. The base
//     half's cells carry no data (positions only) and are rebuilt from the token count.
// A blob whose bytes do not fit this grammar is refused with Error(corrupt_data), never
// guessed at.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/error.hpp>
#include <kvfuse/llama/detail/byte_io.hpp>

namespace kvfuse::llama {

/// The llama.cpp commit whose blob layout this header describes.
inline constexpr std::string_view pinned_llama_commit = "80fb11ac73e66d89eae2c6a91d8a77428fa733ed";

/// Which memory class writes a model's sequence blob.
enum class BlobFamily : std::uint8_t {
  attention,  ///< a plain KV cache (llama)
  hybrid,     ///< a KV cache, then a recurrent section (kimi-k3)
  deepseek4,  ///< llama_kv_cache_dsv4 (deepseek4)
};

/// The blob family of a GGUF `general.architecture`; throws Error(invalid_argument) naming
/// an architecture this header does not know. Any thread.
inline BlobFamily family_of_architecture(std::string_view arch) {
  if (arch == "llama") return BlobFamily::attention;
  if (arch == "kimi-k3") return BlobFamily::hybrid;
  if (arch == "deepseek4") return BlobFamily::deepseek4;
  throw Error(ErrorCode::invalid_argument,
              "the llama integration knows the state blob of llama, kimi-k3 and deepseek4 only, got architecture '" +
                  std::string(arch) + "'");
}

/// One run of per-token rows in the blob: one layer's K, one layer's V, or one layer of a
/// compressed cache. In a block a row is `row_bytes` contiguous bytes; a transposed V row
/// is gathered from `elements` places of the blob.
struct RowRun {
  enum class Kind : std::uint8_t { key, value, compressed };
  Kind kind = Kind::key;
  std::uint32_t tokens_per_row = 1;  ///< 1, or the compress ratio
  std::int32_t type = 0;             ///< ggml type id, written back as read
  std::size_t row_bytes = 0;         ///< bytes of one row
  bool transposed = false;           ///< V stored by dimension (v_trans = 1)
  std::uint32_t element_bytes = 0;   ///< transposed: bytes of one element
  std::uint32_t elements = 0;        ///< transposed: elements per token
  std::uint32_t layer = 0;           ///< compressed: the layer id the blob names
  std::uint64_t ne0 = 0;             ///< compressed: elements per row
  std::uint32_t cache = 0;           ///< compressed: 0 CSA, 1 HCA, 2 indexer
  friend bool operator==(const RowRun&, const RowRun&) = default;
};

/// What one model's blobs look like, learned once from a real blob (learn_layout) and then
/// used to read and write every blob of that model and context configuration. Plain data.
struct BlobLayout {
  BlobFamily family = BlobFamily::attention;
  std::uint32_t v_trans = 0;           ///< of the KV section (deepseek4: of the base half)
  std::uint32_t key_layers = 0;        ///< layers the KV section declares (deepseek4: base half, 0)
  std::uint32_t window_value_runs = 0; ///< deepseek4: V runs of the window section
  std::vector<RowRun> runs;            ///< in block order: K runs, V runs; or compressed runs
  std::uint32_t granule_tokens = 1;    ///< a cut point must be a multiple of this
  std::size_t state_bytes = 0;         ///< bytes of the state part at the learned length
  /// Bytes all runs take for one granule.
  [[nodiscard]] std::size_t granule_bytes() const noexcept {
    std::size_t sum = 0;
    for (const RowRun& r : runs) sum += std::size_t{granule_tokens / r.tokens_per_row} * r.row_bytes;
    return sum;
  }
};

/// Where one blob's runs start: run i's row j is at data[i] + j * row_bytes, or (transposed)
/// element e of token j is at data[i] + (e * rows[i] + j) * element_bytes.
struct BlobRows {
  TokenCount tokens = 0;
  std::vector<const std::byte*> data;
  std::vector<std::uint64_t> rows;
};

namespace detail {

inline constexpr std::uint32_t sequence_magic = 0xaf143cd8u;
inline constexpr std::uint32_t dsv4_magic = 0x34565344u;
inline constexpr std::uint32_t dsv4_version = 1;
inline constexpr std::uint32_t dsv4_mode_full = 0;
inline constexpr std::uint32_t dsv4_mode_partial = 1;
inline constexpr std::uint32_t compressed_version = 2;
inline constexpr std::uint32_t compressor_version = 1;
inline constexpr std::array<std::uint32_t, 3> dsv4_ratios = {4, 128, 4};  // CSA, HCA, indexer
inline constexpr std::size_t cell_meta_bytes = 12;                      // pos, n_seq_id = 1, seq_id
inline constexpr std::size_t sequence_header_bytes = 8;

/// One parsed kv_section. With `sequence_cells` the cells must be positions 0..cells-1 of
/// one sequence (the per-token sections); the window section holds the last cells only.
struct KvSection {
  std::uint32_t cells = 0, v_trans = 0, n_layer = 0;
  std::vector<RowRun> runs;
  std::vector<const std::byte*> data;
};

// One stream's part of a KV section, from its cell count on (a blob of several streams has
// one per stream after the section's stream count).
inline KvSection read_kv_stream(Reader& r, std::uint32_t value_runs, bool sequence_cells) {
  KvSection s;
  s.cells = r.get<std::uint32_t>();
  if (s.cells == 0) return s;  // an empty stream writes nothing more
  for (std::uint32_t i = 0; i < s.cells; ++i) {
    const auto pos = r.get<std::int32_t>();
    r.expect(1, "a cell's sequence count");
    (void)r.get<std::int32_t>();  // the source sequence; a restore names its own
    if (sequence_cells && pos != static_cast<std::int32_t>(i))
      corrupt("cell " + std::to_string(i) + " holds position " + std::to_string(pos) +
              "; a sequence's cells must be its positions in order (fresh context, one sequence)");
  }
  s.v_trans = r.get<std::uint32_t>();
  s.n_layer = r.get<std::uint32_t>();
  if (s.v_trans > 1) corrupt("v_trans is " + std::to_string(s.v_trans));
  if (value_runs > s.n_layer) corrupt("more V runs than layers");
  for (std::uint32_t l = 0; l < s.n_layer; ++l) {
    RowRun k{.kind = RowRun::Kind::key, .type = r.get<std::int32_t>()};
    k.row_bytes = r.get<std::uint64_t>();
    s.data.push_back(r.take_items(s.cells, k.row_bytes));
    s.runs.push_back(k);
  }
  for (std::uint32_t l = 0; l < value_runs; ++l) {
    RowRun v{.kind = RowRun::Kind::value, .type = r.get<std::int32_t>()};
    if (s.v_trans == 0) {
      v.row_bytes = r.get<std::uint64_t>();
    } else {
      v.transposed = true;
      v.element_bytes = r.get<std::uint32_t>();
      v.elements = r.get<std::uint32_t>();
      v.row_bytes = std::size_t{v.element_bytes} * v.elements;
    }
    s.data.push_back(r.take_items(s.cells, v.row_bytes));
    s.runs.push_back(v);
  }
  return s;
}

inline KvSection read_kv_section(Reader& r, std::uint32_t value_runs, bool sequence_cells) {
  r.expect(1, "the KV section's stream count");
  return read_kv_stream(r, value_runs, sequence_cells);
}

/// One dsv4 tensor record; returns its data.
inline const std::byte* read_tensor(Reader& r, std::int32_t& type, std::uint64_t& ne0, std::uint64_t& rows,
                                    std::uint64_t& row_bytes) {
  type = r.get<std::int32_t>();
  ne0 = r.get<std::uint64_t>();
  rows = r.get<std::uint64_t>();
  row_bytes = r.get<std::uint64_t>();
  return r.take_items(rows, row_bytes);
}

/// One compressed cache; appends its runs (rows `rows` each) to `runs`/`data`.
inline std::uint64_t read_compressed(Reader& r, std::uint32_t cache, std::vector<RowRun>& runs,
                                     std::vector<const std::byte*>& data) {
  r.expect(compressed_version, "a compressed cache's version");
  const auto rows = r.get<std::uint32_t>();
  r.expect(1, "a compressed cache's stream count");
  const auto n_layer = r.get<std::uint32_t>();
  for (std::uint32_t l = 0; l < n_layer; ++l) {
    RowRun run{.kind = RowRun::Kind::compressed, .tokens_per_row = dsv4_ratios[cache], .cache = cache};
    run.layer = r.get<std::uint32_t>();
    std::uint64_t tensor_rows = 0, row_bytes = 0;
    data.push_back(read_tensor(r, run.type, run.ne0, tensor_rows, row_bytes));
    if (tensor_rows != rows) corrupt("a compressed layer holds " + std::to_string(tensor_rows) + " rows of " + std::to_string(rows));
    run.row_bytes = row_bytes;
    runs.push_back(run);
  }
  return rows;
}

/// One compressor state, skipped over (it is state); checks its ratio.
inline void skip_compressor(Reader& r, std::uint32_t cache) {
  r.expect(compressor_version, "a compressor state's version");
  r.expect(dsv4_ratios[cache], "a compressor state's ratio");
  (void)r.get<std::uint32_t>();
  (void)r.get<std::uint32_t>();
  r.expect(1, "a compressor state's stream count");
  const auto n_layer = r.get<std::uint32_t>();
  for (std::uint32_t l = 0; l < n_layer; ++l) {
    (void)r.get<std::uint32_t>();
    for (int t = 0; t < 2; ++t) {
      std::int32_t type = 0;
      std::uint64_t ne0 = 0, rows = 0, row_bytes = 0;
      (void)read_tensor(r, type, ne0, rows, row_bytes);
    }
  }
}

/// The whole blob of a sequence, read against `layout` (whose counts it trusts) or, while
/// learning, with the counts given. Fills the runs and their data; returns the token count.
struct ParsedBlob {
  TokenCount tokens = 0;
  std::uint32_t v_trans = 0, key_layers = 0;
  std::vector<RowRun> runs;
  std::vector<const std::byte*> data;
  std::vector<std::uint64_t> rows;
};

inline ParsedBlob read_full(BlobFamily family, std::span<const std::uint8_t> blob, std::uint32_t value_runs,
                            std::size_t section_end) {
  Reader r(blob.first(section_end));
  r.expect(sequence_magic, "the sequence magic");
  (void)r.get<std::int32_t>();
  ParsedBlob p;
  if (family != BlobFamily::deepseek4) {
    KvSection s = read_kv_section(r, value_runs, true);
    if (s.cells == 0) corrupt("the sequence has no cells");
    p = {s.cells, s.v_trans, s.n_layer, std::move(s.runs), std::move(s.data), {}};
    p.rows.assign(p.runs.size(), s.cells);
  } else {
    r.expect(dsv4_magic, "the deepseek4 magic");
    r.expect(dsv4_version, "the deepseek4 state version");
    r.expect(dsv4_mode_full, "the deepseek4 state mode");
    const KvSection base = read_kv_section(r, 0, true);
    if (base.cells == 0 || base.n_layer != 0) corrupt("the raw cache's base half must hold cells and no layers");
    p.tokens = base.cells;
    p.v_trans = base.v_trans;
    (void)read_kv_section(r, value_runs, false);  // the window: state
    for (std::uint32_t cache = 0; cache < 3; ++cache) {
      const std::uint64_t rows = read_compressed(r, cache, p.runs, p.data);
      if (rows != p.tokens / dsv4_ratios[cache])
        corrupt("compressed cache " + std::to_string(cache) + " holds " + std::to_string(rows) + " rows for " +
                std::to_string(p.tokens) + " tokens");
      p.rows.resize(p.runs.size(), rows);
    }
    for (std::uint32_t cache = 0; cache < 3; ++cache) skip_compressor(r, cache);
  }
  if (!r.at_end()) corrupt("the sequence section ends at byte " + std::to_string(r.offset()) + " of " + std::to_string(section_end));
  return p;
}

/// Where the deepseek4 window section ends inside a state part (after the mode header).
inline std::size_t dsv4_window_end(std::span<const std::uint8_t> state, std::uint32_t value_runs) {
  Reader r(state);
  r.expect(dsv4_magic, "the deepseek4 magic");
  r.expect(dsv4_version, "the deepseek4 state version");
  r.expect(dsv4_mode_partial, "the deepseek4 state mode");
  (void)read_kv_section(r, value_runs, false);
  return r.offset();
}

/// Checks that a deepseek4 state part parses to its end with `value_runs` window V runs.
inline bool dsv4_state_parses(std::span<const std::uint8_t> state, std::uint32_t value_runs) {
  try {
    Reader r(state, dsv4_window_end(state, value_runs));
    for (std::uint32_t cache = 0; cache < 3; ++cache) skip_compressor(r, cache);
    return r.at_end();
  } catch (const Error&) {
    return false;
  }
}

}  // namespace detail

/// The state part of a PARTIAL_ONLY blob: what a slot keeps. Empty for the attention
/// family (its partial blob is the whole cache). Throws Error(corrupt_data) on a bad header.
inline std::span<const std::uint8_t> state_part(BlobFamily family, std::span<const std::uint8_t> partial) {
  detail::Reader r(partial);
  r.expect(detail::sequence_magic, "the sequence magic");
  if (family == BlobFamily::attention) return {};
  return partial.subspan(detail::sequence_header_bytes);
}

/// Learns a model's layout from the FULL and PARTIAL_ONLY blobs of one sequence taken at
/// the same point, in a fresh context holding only that sequence. The count of V runs is
/// not in the blob; it is the one count at which the blob parses to its exact end. Throws
/// Error(corrupt_data) when no count, or more than one, fits. Any thread.
inline BlobLayout learn_layout(BlobFamily family, std::span<const std::uint8_t> full,
                               std::span<const std::uint8_t> partial) {
  const std::span<const std::uint8_t> state = state_part(family, partial);
  std::size_t section_end = full.size();
  if (family == BlobFamily::hybrid) {
    if (state.size() >= full.size()) detail::corrupt("the partial blob is not smaller than the full one");
    section_end = full.size() - state.size();  // the recurrent section closes the blob
  }
  // The section whose V runs are counted declares its layer count, an upper bound.
  std::uint32_t most_runs = 0;
  {
    detail::Reader r = family == BlobFamily::deepseek4 ? detail::Reader(state, 12) : detail::Reader(full, 8);
    (void)r.get<std::uint32_t>();
    const auto cells = r.get<std::uint32_t>();
    (void)r.take_items(cells, detail::cell_meta_bytes);
    (void)r.get<std::uint32_t>();  // v_trans
    most_runs = r.get<std::uint32_t>();
  }
  std::vector<BlobLayout> fits;
  for (std::uint32_t value_runs = 0; value_runs <= most_runs; ++value_runs) {
    if (family == BlobFamily::deepseek4 && !detail::dsv4_state_parses(state, value_runs)) continue;
    try {
      detail::ParsedBlob p = detail::read_full(family, full, value_runs, section_end);
      BlobLayout layout{family, p.v_trans, p.key_layers, family == BlobFamily::deepseek4 ? value_runs : 0,
                        std::move(p.runs), 1, state.size()};
      for (const RowRun& run : layout.runs) layout.granule_tokens = std::lcm(layout.granule_tokens, run.tokens_per_row);
      fits.push_back(std::move(layout));
    } catch (const Error&) {
      // this count does not fit; the next may
    }
  }
  if (fits.size() != 1)
    detail::corrupt(std::to_string(fits.size()) + " V-run counts fit the blob of " + std::to_string(full.size()) +
                    " bytes; expected exactly one");
  if (fits[0].runs.empty()) detail::corrupt("the blob holds no per-token rows");
  return fits[0];
}

/// Locates the rows of a FULL blob of this layout's model. Throws Error(corrupt_data) if
/// the blob does not match the layout (another model, other types, a torn blob).
inline BlobRows locate_rows(const BlobLayout& layout, std::span<const std::uint8_t> full) {
  std::size_t section_end = full.size();
  if (layout.family == BlobFamily::hybrid) {
    // The recurrent section is not parsed; the KV section's own sizes say where it ends.
    detail::Reader r(full);
    r.expect(detail::sequence_magic, "the sequence magic");
    (void)r.get<std::int32_t>();
    (void)detail::read_kv_section(r, static_cast<std::uint32_t>(layout.runs.size()) - layout.key_layers, true);
    section_end = r.offset();
  }
  const std::uint32_t value_runs = layout.family == BlobFamily::deepseek4
                                       ? layout.window_value_runs
                                       : static_cast<std::uint32_t>(layout.runs.size()) - layout.key_layers;
  detail::ParsedBlob p = detail::read_full(layout.family, full, value_runs, section_end);
  if (p.runs != layout.runs || p.v_trans != layout.v_trans)
    detail::corrupt("the blob's rows (types, sizes, layers) differ from the model's layout");
  return BlobRows{p.tokens, std::move(p.data), std::move(p.rows)};
}

/// Copies row `index` of run `run` of a located blob into `dst` (row_bytes long),
/// gathering a transposed V row from its elements. Any thread; no allocation.
inline void copy_row(const BlobLayout& layout, const BlobRows& rows, std::size_t run, std::uint64_t index,
                     std::byte* dst) noexcept {
  const RowRun& r = layout.runs[run];
  if (!r.transposed) {
    std::memcpy(dst, rows.data[run] + index * r.row_bytes, r.row_bytes);
    return;
  }
  for (std::uint32_t e = 0; e < r.elements; ++e)
    std::memcpy(dst + std::size_t{e} * r.element_bytes, rows.data[run] + (e * rows.rows[run] + index) * r.element_bytes,
                r.element_bytes);
}

namespace detail {

// dst[e][t] = row(t)[e] for `cells` rows of `elements` elements of `eb` bytes: the
// element-major V section of a blob from row-major block rows. Tiles of 32 rows keep the
// reads in L1 and make each element's writes one contiguous run; the element size is a
// template argument for the common sizes so each copy is a plain load and store, not a call.
template <std::size_t EB, class RowOf>
void transpose_tiles(std::uint8_t* dst, std::uint32_t cells, std::uint32_t elements, std::size_t eb, RowOf& row) {
  constexpr std::uint32_t tile = 32;
  const std::size_t size = EB != 0 ? EB : eb, column = std::size_t{cells} * size;
  const std::byte* src[tile];
  for (std::uint32_t t0 = 0; t0 < cells; t0 += tile) {
    const std::uint32_t n = std::min(tile, cells - t0);
    for (std::uint32_t k = 0; k < n; ++k) src[k] = row(t0 + k);
    for (std::uint32_t e = 0; e < elements; ++e) {
      std::uint8_t* to = dst + e * column + std::size_t{t0} * size;
      for (std::uint32_t k = 0; k < n; ++k) std::memcpy(to + k * size, src[k] + e * size, EB != 0 ? EB : size);
    }
  }
}

template <class RowOf>
void transpose_rows(std::uint8_t* dst, std::uint32_t cells, std::uint32_t elements, std::size_t eb, RowOf&& row) {
  switch (eb) {
    case 2: transpose_tiles<2>(dst, cells, elements, eb, row); break;
    case 4: transpose_tiles<4>(dst, cells, elements, eb, row); break;
    default: transpose_tiles<0>(dst, cells, elements, eb, row); break;
  }
}

}  // namespace detail

/// Writes into `out` (replacing its contents) the FULL blob of a sequence of `tokens`
/// tokens (a multiple of the granule) that llama_state_seq_set_data accepts: its rows
/// from `row(run, index)` (a pointer to row_bytes in block form), its state from `state`
/// (a state_part of a PARTIAL_ONLY blob; empty for the attention family). Throws
/// Error(corrupt_data) if `state` does not fit the layout. Any thread; allocates.
template <class RowOf>
void write_full_blob(const BlobLayout& layout, TokenCount tokens, std::span<const std::uint8_t> state, RowOf&& row,
                     std::vector<std::uint8_t>& out) {
  using detail::put;
  if (tokens == 0 || tokens % layout.granule_tokens != 0)
    throw Error(ErrorCode::invalid_argument, "a blob's token count must be a positive multiple of " +
                                                 std::to_string(layout.granule_tokens) + ", got " + std::to_string(tokens));
  if ((layout.family == BlobFamily::attention) != state.empty())
    detail::corrupt("a state part of " + std::to_string(state.size()) + " bytes for this model");
  out.clear();
  std::size_t row_bytes = 0;  // an upper bound of the rows' bytes: one reservation, no regrowth
  for (const RowRun& r : layout.runs) row_bytes += r.row_bytes * (tokens / r.tokens_per_row + 1);
  out.reserve(64 + 12 * tokens + row_bytes + state.size() + 16 * layout.runs.size());
  put(out, detail::sequence_magic);
  put(out, std::int32_t{0});
  const auto cells = static_cast<std::uint32_t>(tokens);
  auto cell_meta = [&] {
    put(out, std::uint32_t{1});
    put(out, cells);
    for (std::uint32_t i = 0; i < cells; ++i) {
      put(out, static_cast<std::int32_t>(i));
      put(out, std::uint32_t{1});
      put(out, std::int32_t{0});
    }
  };
  if (layout.family != BlobFamily::deepseek4) {
    cell_meta();
    put(out, layout.v_trans);
    put(out, layout.key_layers);
    for (std::size_t i = 0; i < layout.runs.size(); ++i) {
      const RowRun& r = layout.runs[i];
      put(out, r.type);
      if (!r.transposed) {
        put(out, std::uint64_t{r.row_bytes});
        std::uint8_t* dst = detail::grow(out, std::size_t{cells} * r.row_bytes);
        for (std::uint32_t t = 0; t < cells; ++t, dst += r.row_bytes) std::memcpy(dst, row(i, t), r.row_bytes);
      } else {
        // Element-major in the blob, row-major in blocks: each row is read once and its
        // elements scattered a column apart.
        put(out, r.element_bytes);
        put(out, r.elements);
        std::uint8_t* dst = detail::grow(out, std::size_t{r.elements} * cells * r.element_bytes);
        detail::transpose_rows(dst, cells, r.elements, r.element_bytes, [&](std::uint32_t t) { return row(i, t); });
      }
    }
    detail::put_bytes(out, state.data(), state.size());  // hybrid: the recurrent section
    return;
  }
  const std::size_t window_end = detail::dsv4_window_end(state, layout.window_value_runs);
  put(out, detail::dsv4_magic);
  put(out, detail::dsv4_version);
  put(out, detail::dsv4_mode_full);
  cell_meta();
  put(out, layout.v_trans);
  put(out, std::uint32_t{0});
  const std::size_t mode_header = 12;
  detail::put_bytes(out, state.data() + mode_header, window_end - mode_header);
  std::size_t i = 0;
  for (std::uint32_t cache = 0; cache < 3; ++cache) {
    const auto rows = static_cast<std::uint32_t>(tokens / detail::dsv4_ratios[cache]);
    std::uint32_t layers = 0;
    for (const RowRun& r : layout.runs) layers += r.cache == cache ? 1 : 0;
    put(out, detail::compressed_version);
    put(out, rows);
    put(out, std::uint32_t{1});
    put(out, layers);
    for (std::uint32_t l = 0; l < layers; ++l, ++i) {
      const RowRun& r = layout.runs[i];
      put(out, r.layer);
      put(out, r.type);
      put(out, r.ne0);
      put(out, std::uint64_t{rows});
      put(out, std::uint64_t{r.row_bytes});
      std::uint8_t* dst = detail::grow(out, std::size_t{rows} * r.row_bytes);
      for (std::uint32_t j = 0; j < rows; ++j, dst += r.row_bytes) std::memcpy(dst, row(i, j), r.row_bytes);
    }
  }
  detail::put_bytes(out, state.data() + window_end, state.size() - window_end);
}

}  // namespace kvfuse::llama
