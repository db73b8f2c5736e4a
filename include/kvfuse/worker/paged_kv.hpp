// kvfuse/worker/paged_kv.hpp — PagedKv<Tier>: the shipped KV leg.
//
// Loads fill tokens [hbm, end) of a request's paged blocks from whole tier chunks; saves
// gather whole chunks out of blocks into the tier. The leg is ok only if every chunk in
// [hbm, end) arrived: the chunk mask says which did.
#pragma once

#include <algorithm>
#include <cstring>

#include <kvfuse/tier/tier.hpp>
#include <kvfuse/worker/leg.hpp>

namespace kvfuse {

/// Why a KV spec cannot be served on this rank, or Reason::none. Checks every index the
/// copy loop will use, so the loop itself never goes out of bounds (R11: refuse, never clamp).
inline Reason check_kv_spec(const KvSpec& spec, const RankGeometry& geo) noexcept {
  const TokenGrid chunks = geo.chunk_grid();
  const TokenGrid blocks = geo.block_grid();
  if (spec.hbm >= spec.end) return Reason::invalid_spec;
  if (!chunks.aligned(spec.end) || !blocks.aligned(spec.hbm)) return Reason::grid_mismatch;
  const std::uint64_t chunk_count = chunks.cell_of(spec.end) - chunks.cell_of(spec.hbm);
  const std::uint64_t block_count = blocks.cell_of(spec.end) - blocks.cell_of(spec.hbm);
  if (spec.chunk_keys.size() != chunk_count || spec.blocks.size() != block_count) return Reason::invalid_spec;
  if (chunk_count > geo.max_chunks_per_load) return Reason::invalid_spec;
  for (const BlockId b : spec.blocks)
    if (b.value >= geo.num_blocks) return Reason::invalid_spec;
  return Reason::none;
}

/// The same checks for a save of whole chunks.
inline Reason check_kv_save(const KvSave& save, const RankGeometry& geo) noexcept {
  const std::size_t blocks_per_chunk = geo.chunk_tokens / geo.block_tokens;
  if (save.chunk_keys.empty() || save.blocks.size() != save.chunk_keys.size() * blocks_per_chunk)
    return Reason::invalid_spec;
  for (const BlockId b : save.blocks)
    if (b.value >= geo.num_blocks) return Reason::invalid_spec;
  return Reason::none;
}

namespace detail {
/// Calls `copy(device, offset, bytes)` once per run of physically consecutive block ids
/// among `count` logical blocks, `offset` being the run's byte offset in the contiguous
/// host-side buffer; an allocator that hands out contiguous blocks gets one copy per
/// chunk. Stops and returns false at the first copy that fails.
template <class Copy>
bool for_each_block_run(const RankGeometry& geo, std::byte* kv_blocks, const BlockId* ids, std::size_t count,
                        Copy&& copy) noexcept {
  const std::size_t block_bytes = geo.block_bytes();
  std::size_t i = 0;
  while (i < count) {
    std::size_t run = 1;
    while (i + run < count && ids[i + run].value == ids[i].value + run) ++run;
    if (!copy(kv_blocks + std::size_t{ids[i].value} * block_bytes, i * block_bytes, run * block_bytes)) return false;
    i += run;
  }
  return true;
}
}  // namespace detail

/// What one byte of RetrieveResult::mask says about its chunk. Only `arrived` counts; the
/// others say why a chunk did not arrive, as far as the tier answered for it.
enum class ChunkMark : std::uint8_t {
  not_arrived = 0,  ///< not asked for (after the first hole), or its copy did not run or was not confirmed
  arrived = 1,      ///< in its blocks, confirmed by a synchronize
  missed = 2,       ///< the tier does not have it (GetStatus::miss)
  failed = 3,       ///< the tier could not read it, or it has the wrong size (GetStatus::failed)
  timed_out = 4,    ///< the tier did not answer in time (GetStatus::timed_out)
};

/// What a chunked retrieve delivered: one byte per chunk of the spec (a ChunkMark: 1 =
/// arrived), and why the first missing one is missing. An empty mask means the spec was
/// refused.
struct RetrieveResult {
  std::span<const std::uint8_t> mask;
  Reason reason = Reason::none;
  /// Every chunk in [hbm, end) arrived.
  [[nodiscard]] bool complete() const noexcept {
    return reason == Reason::none && std::all_of(mask.begin(), mask.end(), [](std::uint8_t b) { return b == 1; });
  }
  /// The leading run of chunks that arrived: how far the load restored from the HBM floor.
  [[nodiscard]] std::uint32_t restored() const noexcept {
    return static_cast<std::uint32_t>(std::find_if(mask.begin(), mask.end(), [](std::uint8_t b) { return b != 1; }) -
                                      mask.begin());
  }
};

/// The paged KV leg over one tier. Holds a pointer to the tier, nothing else; the tier must
/// outlive the Connector. Calls run on one lane thread at a time; the tier is thread-safe.
template <Tier T>
class PagedKv {
 public:
  using tier_type = T;
  explicit PagedKv(T& tier) noexcept : tier_(&tier) {}

  /// Fills [spec.hbm, spec.end) of the blocks and reports which chunks arrived: mask[i]
  /// is ChunkMark::arrived (1) iff chunk i of spec.chunk_keys reached its blocks. Copying
  /// stops at the first chunk that did not arrive (later chunks of a prefix are useless
  /// without it), so the mask is a run of ones, then the first hole marked with the tier's
  /// answer (missed, failed, timed_out), then chunks that are not_arrived or, when a
  /// batched tier answered for them too, marked with that answer; `reason` says why the
  /// first hole is a hole. The mask lives in the lane's preallocated chunk mask: valid
  /// until the lane's next retrieve.
  ///
  /// A BatchedTier is asked for every chunk at once (one round trip for a remote tier)
  /// when lane.held_views can hold them all; the views are held while their copies run and
  /// one synchronize covers the load. Otherwise copies are synchronized in batches: a view
  /// over the tier's own memory (a memory-tier hit) is held in lane.held_views while its
  /// copies run, and one synchronize covers them all; a view over the lane's staging (a
  /// disk read) is synchronized before the next get reuses staging. Noexcept; no
  /// allocation by the leg (a tier may allocate).
  template <Runtime R>
  RetrieveResult retrieve(const KvSpec& spec, LaneContext<R>& lane) const noexcept {
    const RankGeometry& geo = lane.geometry;
    if (const Reason refused = check_kv_spec(spec, geo); refused != Reason::none) return {{}, refused};
    const std::size_t chunk_count = spec.chunk_keys.size();
    const std::span<std::uint8_t> mask = lane.chunk_mask.first(chunk_count);
    std::fill(mask.begin(), mask.end(), std::uint8_t{0});
    if constexpr (BatchedTier<T>) {
      if (lane.held_views.size() >= chunk_count) return retrieve_batched(spec, lane, mask);
    }

    // Chunks [synced, i) have copies queued and not yet synchronized; their views are the
    // first `held` of held_views. A chunk counts as arrived only after its synchronize.
    std::size_t synced = 0, held = 0;
    auto synchronize_up_to = [&](std::size_t i) noexcept {
      const bool ok = lane.runtime.synchronize(lane.stream);
      // A stream that cannot say whether its copies finished gets a full device
      // synchronize before any view is released: never free bytes a copy may still read.
      if (!ok) (void)lane.runtime.device_synchronize();
      for (std::size_t v = 0; v < held; ++v) lane.held_views[v] = TierView{};
      held = 0;
      if (ok) std::fill(mask.begin() + static_cast<std::ptrdiff_t>(synced), mask.begin() + static_cast<std::ptrdiff_t>(i),
                        std::uint8_t{1});
      synced = i;
      return ok;
    };

    for (std::size_t i = 0; i < chunk_count; ++i) {
      TierView view = tier_->get(key_for(geo, spec.chunk_keys[i]), lane.staging);
      if (!usable(view, geo)) {
        const Reason why = view.status() == GetStatus::miss ? Reason::kv_chunk_missing : Reason::kv_transfer_failed;
        const bool ok = synchronize_up_to(i);
        mask[i] = mark_of(view, geo);
        return {mask, ok ? why : Reason::kv_transfer_failed};
      }
      const bool copied = copy_chunk(spec, lane, i, view);
      // Whatever happens next, the view must outlive the copies just queued from it.
      const bool in_staging = view.bytes().data() >= lane.staging.data() &&
                              view.bytes().data() < lane.staging.data() + lane.staging.size();
      if (!copied) {
        (void)synchronize_up_to(i);
        return {mask, Reason::kv_transfer_failed};
      }
      if (in_staging || held == lane.held_views.size()) {
        if (!synchronize_up_to(i + 1)) return {mask, Reason::kv_transfer_failed};
      } else {
        lane.held_views[held++] = std::move(view);
      }
    }
    if (synced < chunk_count && !synchronize_up_to(chunk_count)) return {mask, Reason::kv_transfer_failed};
    return {mask, Reason::none};
  }

  /// The KV leg: ok only if every chunk in [hbm, end) arrived; `restored` counts the
  /// leading run of chunks that did (salvage). Noexcept, no allocation.
  template <Runtime R>
  KvVerdict load(const KvSpec& spec, LaneContext<R>& lane) const noexcept {
    const RetrieveResult r = retrieve(spec, lane);
    return {r.complete(), r.reason, r.restored()};
  }

  /// Gathers whole chunks out of the blocks through staging and puts them in the tier.
  /// A save that fits lane.staging is gathered whole with one synchronize, and the source
  /// is released (lane.release_source) right then, before the first put: the engine frees
  /// the blocks while the puts run. A save of more chunks than staging holds goes in
  /// batches of what fits, the short one first, so the last batch is full: the source is
  /// released once that last batch's gather is synchronized, after the puts of all the
  /// chunks before it, the fewest that staging allows. On a failure the leg returns at
  /// once and the Connector synchronizes and releases. Noexcept, no allocation.
  template <Runtime R>
  SaveVerdict save(const KvSave& save, LaneContext<R>& lane) const noexcept {
    const RankGeometry& geo = lane.geometry;
    if (const Reason refused = check_kv_save(save, geo); refused != Reason::none) return {false, refused};
    const std::size_t chunk_bytes = geo.chunk_bytes();
    const std::size_t fits = lane.staging.size() / chunk_bytes;
    if (fits == 0) return {false, Reason::kv_transfer_failed};
    const std::size_t blocks_per_chunk = geo.chunk_tokens / geo.block_tokens;
    const std::size_t chunk_count = save.chunk_keys.size();
    bool stored = true;
    // The short batch goes first, so the last one, whose gather frees the source, is full.
    std::size_t batch = (chunk_count - 1) % fits + 1;
    for (std::size_t first = 0; first < chunk_count; first += batch, batch = fits) {
      // One gather for the batch: chunk i of it lands at i * chunk_bytes, and a run of
      // consecutive blocks is one copy even across a chunk boundary.
      const bool copied = detail::for_each_block_run(
          geo, lane.memory.kv_blocks, save.blocks.data() + first * blocks_per_chunk, batch * blocks_per_chunk,
          [&](std::byte* block, std::size_t offset, std::size_t bytes) noexcept {
            return lane.runtime.copy_async(lane.staging.data() + offset, block, bytes, lane.stream);
          });
      // The source is released only once no gather can still be reading it: after a
      // synchronize that succeeded (a failed enqueue may follow earlier ones in flight).
      const bool drained = lane.runtime.synchronize(lane.stream);
      if (!copied || !drained) return {false, Reason::kv_transfer_failed};
      if (first + batch == chunk_count) lane.release_source();
      for (std::size_t i = 0; i < batch; ++i)
        stored = tier_->put(key_for(geo, save.chunk_keys[first + i]), lane.staging.subspan(i * chunk_bytes, chunk_bytes)) &&
                 stored;
    }
    return {stored, stored ? Reason::none : Reason::kv_transfer_failed};
  }

  /// The tier this leg reads and writes.
  [[nodiscard]] T& tier() const noexcept { return *tier_; }

 private:
  // A view whose bytes can be copied as chunk bytes.
  static bool usable(const TierView& view, const RankGeometry& geo) noexcept {
    return view.hit() && view.bytes().size() == geo.chunk_bytes();
  }

  // The mask byte of a chunk whose view is not usable.
  static std::uint8_t mark_of(const TierView& view, const RankGeometry& geo) noexcept {
    ChunkMark m = ChunkMark::failed;
    if (view.status() == GetStatus::miss) m = ChunkMark::missed;
    else if (view.status() == GetStatus::timed_out) m = ChunkMark::timed_out;
    else if (usable(view, geo)) m = ChunkMark::not_arrived;
    return static_cast<std::uint8_t>(m);
  }

  // Queues the copies of the part of chunk i of `spec` inside [hbm, end), in whole blocks
  // (hbm and end are block aligned), from `view` into the blocks.
  template <Runtime R>
  static bool copy_chunk(const KvSpec& spec, LaneContext<R>& lane, std::size_t i, const TierView& view) noexcept {
    const RankGeometry& geo = lane.geometry;
    const std::uint64_t first_chunk = geo.chunk_grid().cell_of(spec.hbm);
    const std::uint64_t first_block = geo.block_grid().cell_of(spec.hbm);
    const TokenCount chunk_start = (first_chunk + i) * geo.chunk_tokens;
    const TokenCount lo = std::max(spec.hbm, chunk_start);
    const TokenCount hi = std::min(spec.end, chunk_start + geo.chunk_tokens);
    const std::size_t block_offset = lo / geo.block_tokens - first_block;
    const std::size_t block_count = (hi - lo) / geo.block_tokens;
    const std::byte* src = view.bytes().data() + (lo - chunk_start) * geo.kv_bytes_per_token;
    return detail::for_each_block_run(geo, lane.memory.kv_blocks, spec.blocks.data() + block_offset, block_count,
                                      [&](std::byte* block, std::size_t offset, std::size_t bytes) noexcept {
                                        return lane.runtime.copy_async(block, src + offset, bytes, lane.stream);
                                      });
  }

  // Where the batched path stands: chunks [0, copied) have their copies queued, and the
  // views of [0, released) are already handed back; `stopped` once a chunk is not usable
  // or its copy could not be queued (`why` says which).
  template <Runtime R>
  struct BatchProgress {
    const KvSpec* spec;
    LaneContext<R>* lane;
    std::span<TierView> views;
    std::size_t copied = 0;
    std::size_t released = 0;
    bool stopped = false;
    Reason why = Reason::none;

    void arrived(std::size_t i, const TierView& view) noexcept {
      if (stopped || i != copied) return;
      if (!usable(view, lane->geometry)) {
        why = view.status() == GetStatus::miss ? Reason::kv_chunk_missing : Reason::kv_transfer_failed;
        stopped = true;
      } else if (!copy_chunk(*spec, *lane, i, view)) {
        why = Reason::kv_transfer_failed;
        stopped = true;
      } else {
        ++copied;
        release_finished();
      }
    }

    // A view goes back to its tier as soon as the runtime says every copy queued from it
    // ran: the tier can then reuse that memory, still hot in cache, for the next answer,
    // rather than hold a whole load's worth of cold buffers until the final synchronize.
    // A runtime that cannot be asked keeps every view until then.
    void release_finished() noexcept {
      if constexpr (QueryableRuntime<R>) {
        if (released == copied || !lane->runtime.query(lane->stream)) return;
        for (; released < copied; ++released) views[released] = TierView{};
      }
    }
    static void on_arrived(void* self, std::size_t i, const TierView& view) noexcept {
      static_cast<BatchProgress*>(self)->arrived(i, view);
    }
  };

  // The batched path: one get_batch for every chunk; each usable chunk of the leading run
  // is copied as its answer lands (the tier's sink), or after the batch for a tier that
  // does not stream; one synchronize; then every view released.
  template <Runtime R>
  RetrieveResult retrieve_batched(const KvSpec& spec, LaneContext<R>& lane, std::span<std::uint8_t> mask) const noexcept {
    const RankGeometry& geo = lane.geometry;
    const std::size_t chunk_count = spec.chunk_keys.size();
    const std::span<TierView> views = lane.held_views.first(chunk_count);
    BatchProgress<R> progress{&spec, &lane, views};
    tier_->get_batch(key_for(geo, PrefixHash{}), spec.chunk_keys, views, BatchSink{&BatchProgress<R>::on_arrived, &progress});
    while (!progress.stopped && progress.copied < chunk_count) progress.arrived(progress.copied, views[progress.copied]);
    // Every view must outlive the copies queued from it; a stream that cannot say whether
    // they finished gets a device synchronize before any view goes.
    const bool synced = lane.runtime.synchronize(lane.stream);
    if (!synced) (void)lane.runtime.device_synchronize();
    for (std::size_t i = 0; i < chunk_count; ++i) {
      if (i < progress.copied) mask[i] = static_cast<std::uint8_t>(synced ? ChunkMark::arrived : ChunkMark::not_arrived);
      else mask[i] = mark_of(views[i], geo);  // a usable view whose copy failed or was not queued: not_arrived
      views[i] = TierView{};
    }
    return {mask, synced ? progress.why : Reason::kv_transfer_failed};
  }

  static TierKey key_for(const RankGeometry& geo, PrefixHash hash) noexcept {
    return TierKey{geo.model, hash, geo.world_size, geo.rank, EntryKind::kv_chunk};
  }
  T* tier_;
};

}  // namespace kvfuse
