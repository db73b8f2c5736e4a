// in_process_engine.hpp — the kvfuse side of an engine loop whose one rank is a connector in
// its own process: everything kvfuse::llama::Server and kvfuse-llama-server's SlotCache
// build alike, and the pumping both do while they wait for the rank.
//
// Engine side: the Coordinator over an OffloadIndex, a SingleRank group and its pump, and the
// host kit (the block pool, the request and snapshot slot pools, the admission book that
// routes the Coordinator's events onto them), and the cache keeper when a cache ledger owns
// the tier's budget. Rank side: one Connector with the stock PagedKv
// and the model's state leg over the tier, its device memory in host pools. What each loop
// does with it (a fresh context per request, or llama-server's slots) is its own.
//
// Threading: one thread, the loop's (kvfuse's scheduler thread); the connector's lanes are
// its only other threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <thread>

#include <kvfuse/host/admission_book.hpp>
#include <kvfuse/host/audit.hpp>
#include <kvfuse/host/block_pool.hpp>
#include <kvfuse/host/cache_keeper.hpp>
#include <kvfuse/host/slot_pool.hpp>
#include <kvfuse/kvfuse.hpp>
#include <kvfuse/llama/detail/in_process.hpp>
#include <kvfuse/llama/detail/server_setup.hpp>

namespace kvfuse::llama::detail {

/// How an InProcessEngine is built, besides its tier and geometry. Plain data.
struct InProcessEngineOptions {
  CheckpointPolicy checkpoints{};                 ///< where stateful prompts take state checkpoints
  std::uint32_t request_slots = 1;                ///< state slots for requests (stateful models), first in the pool
  std::chrono::milliseconds rank_timeout{10000};  ///< how long pump_until waits before it gives up
  HostRuntimeOptions runtime{};                   ///< the rank's emulated device
  /// Sees each LoadRequest before the connector does (tests tamper with the tier there);
  /// must outlive the engine. Null: none.
  const std::function<void(const LoadRequest&)>* on_load = nullptr;
  /// A cache ledger owns `cache_budget` bytes of the tier under this policy (CacheKeeper:
  /// the loop offers every save to it and the tier keeps what it keeps); empty: the tier's
  /// own capacity decides.
  std::optional<CachePolicy> cache_policy;
  std::uint64_t cache_budget = 0;
};

/// The Coordinator, the host kit and the one in-process rank, built together over `T` with
/// state leg `StateLeg` (NoState, RecurrentState<T>, SlotState<T>). Its members are the
/// owner's to drive; it adds only the waits. Geometry: num_slots is the request slots plus
/// the snapshot slots. Not copyable or movable (the members point at each other).
template <Tier T, class StateLeg>
struct InProcessEngine {
  using Conn = Connector<PagedKv<T>, StateLeg, SingleRank, HostRuntime>;
  using Transport = InProcessTransport<Conn>;
  using Lookup = LeadingChunks<T>;
  using Book = AdmissionBook<>;
  using Entry = typename Book::Entry;
  static constexpr bool stateful = Conn::has_state;
  static constexpr StateLayout layout = Conn::layout;

  /// Builds it all over `tier` (which outlives it) for `g`. Throws what the parts throw for
  /// a geometry they refuse (Error naming the value).
  InProcessEngine(T& tier, const RankGeometry& g, const InProcessEngineOptions& o)
      : rank_timeout(o.rank_timeout),
        runtime(o.runtime),
        geometry(g),
        pools(runtime, geometry),
        group(SingleRankOptions{Conn::lane_count, 4096, {}}),
        index(OffloadIndexOptions{.hash_capacity = std::size_t{1} << 16, .slot_count = geometry.num_slots}),
        pump(group, index),
        transport{&connector, o.on_load},
        lookup{&tier, &geometry},
        coordinator(CoordinatorOptions{.layout = layout,
                                       .grids = PlanGrids{geometry.block_tokens, geometry.chunk_tokens},
                                       .expected_requests = 64,
                                       .checkpoints = o.checkpoints},
                    index, pump, transport, lookup),
        connector(geometry, runtime, DeviceMemory{pools.blocks, pools.slots}, PagedKv<T>(tier), make_state_leg(tier), group),
        blocks(geometry.num_blocks),
        request_slots(stateful ? o.request_slots : 0, 0),
        snapshots(stateful ? geometry.num_slots - o.request_slots : 0, stateful ? o.request_slots : 0),
        compute(runtime.make_stream(HostStreamMode::inline_calls)),
        cache(cache_options(o, geometry), LedgerTier<T>{&tier, &geometry, &index}) {}
  ~InProcessEngine() { connector.drain(); }
  InProcessEngine(const InProcessEngine&) = delete;
  InProcessEngine& operator=(const InProcessEngine&) = delete;

  /// Steps until `id`'s Unpark comes (returned) or rank_timeout passes (nullopt).
  std::optional<Unpark> wait_for_unpark(RequestId id) {
    unpark_watch_ = id;
    unparked_.reset();
    (void)pump_until([&] { return unparked_.has_value(); });
    const std::optional<Unpark> got = unparked_;
    unparked_.reset();
    unpark_watch_.reset();
    return got;
  }

  /// Steps until done() holds (true) or rank_timeout passes (false), sleeping 50 µs after a
  /// step that brought nothing.
  template <class Done>
  bool pump_until(Done done) {
    const auto deadline = std::chrono::steady_clock::now() + rank_timeout;
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      if (!step_once()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
  }

  /// One coordinator step, routed by the book: an Unpark resumes the one request
  /// wait_for_unpark waits for (the book counts any other), a Freed hands blocks and the
  /// request slot back, snapshots return. True when it brought anything.
  bool step_once() {
    const CoordinatorStep r = coordinator.step();
    (void)book.apply(r, blocks, request_slots, snapshots, [this](const Entry& e, const Unpark& u) {
      if (unpark_watch_ && e.request == *unpark_watch_) unparked_ = u;
    });
    return r.records > 0 || !r.unparked.empty() || !r.freed.empty() || !r.snapshots.empty();
  }

  /// After the engine waited for its saves: none is in flight, so a victim whose save
  /// landed after its eviction is erased again now (CacheKeeper::sweep).
  void sweep_if_quiet() {
    if (cache.stats().unswept > 0 && index.stats().saves_outstanding == 0) (void)cache.sweep();
  }

  /// The numbers that must be zero (the host kit's audit); walks the index: not per request.
  [[nodiscard]] HostAudit audit() const {
    return audit_host(index, coordinator.stats(), book, blocks, request_slots, snapshots);
  }

  std::chrono::milliseconds rank_timeout;
  HostRuntime runtime;
  RankGeometry geometry;
  DevicePools pools;
  SingleRank group;
  OffloadIndex<> index;
  SettlementPump<SingleRank, OffloadIndex<>> pump;
  Transport transport;
  Lookup lookup;
  Coordinator<SingleRank, Transport, Lookup> coordinator;
  Conn connector;
  PrefixBlockPool blocks;
  SlotPool request_slots;  // the first request_slots of the state pool
  SlotPool snapshots;      // the rest: mid-prefill checkpoints while the ranks save them
  Book book;
  HostRuntime::Stream compute;  // the engine's compute stream (inline: llama.cpp has run when a step begins)
  CacheKeeper<LedgerTier<T>> cache;  // off unless a cache policy was given

 private:
  // A checkpoint counts its tier entry (DSV4's sidecar included); a light state (at most
  // two chunks' KV) is let in on first sight; a dense model's KV comes in on second sight.
  static CacheKeeperOptions cache_options(const InProcessEngineOptions& o, const RankGeometry& g) {
    CacheKeeperOptions c;
    c.chunk_tokens = g.chunk_tokens;
    c.kv_chunk_bytes = g.chunk_bytes();
    if constexpr (stateful) c.state_bytes = StateLeg::entry_bytes(g);
    c.stateful = stateful;
    if (o.cache_policy)
      c.ledger = CacheLedgerOptions{*o.cache_policy, o.cache_budget, std::size_t{1} << 16, 2 * c.kv_chunk_bytes, !stateful};
    return c;
  }

  static StateLeg make_state_leg(T& tier) {
    if constexpr (stateful) return StateLeg(tier);
    else return StateLeg{};
  }

  std::optional<RequestId> unpark_watch_;
  std::optional<Unpark> unparked_;
};

}  // namespace kvfuse::llama::detail
