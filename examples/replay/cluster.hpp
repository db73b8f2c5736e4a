// kvfuse-replay: one engine and its ranks, replaying a workload. The engine side is what
// an engine would write around kvfuse: a scheduler with a paged block pool shared by its
// ranks (with vLLM-style prefix caching: finished requests' blocks stay cached, LRU), a
// state slot pool, and the Coordinator over an OffloadIndex, a TpQuorum and its pump. The
// ranks are threads: each rank's Connector runs on its own lanes, against its own tier.
//
// Time is simulated: requests arrive at their trace times, prefill and decode take
// simulated time, and the clock jumps from event to event (or follows the wall clock at
// --speed). Loads and saves run for real on the rank threads; while any load is in flight
// or any save has not landed, the simulated clock stands still, so loads and saves cost no
// simulated time and the replay measures the tier, not the model.
#pragma once

#include "content.hpp"
#include "rank_tier.hpp"
#include "workload.hpp"

#include <kvfuse/compose/loopback_pd.hpp>
#include <kvfuse/compose/multi.hpp>
#include <kvfuse/compose/presets.hpp>
#include <kvfuse/compose/prometheus.hpp>
#include <kvfuse/kvfuse.hpp>
#include <kvfuse/testing/index_consistency.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <list>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace replay {

using namespace kvfuse;
using WallClock = std::chrono::steady_clock;

/// The seeded faults. Each can be turned on alone (--faults).
struct Faults {
  bool evict = false;       ///< ranks' tiers evict differently (different capacities, and entries dropped on one rank)
  bool slow = false;        ///< one rank's tier answers slowly
  bool state_miss = false;  ///< one rank loses state entries after they were stored
  bool death = false;       ///< a rank dies and comes back
  bool abort = false;       ///< requests aborted while their load is in flight
  bool preempt = false;     ///< requests preempted while their load is in flight, admitted again later
  bool reopen = false;      ///< every rank's disk tier closed and reopened mid-run (a restart)
  bool corrupt = false;     ///< a file on disk corrupted: quarantined, a miss, never served
  static constexpr const char* names[] = {"evict", "slow", "state-miss", "death", "abort", "preempt", "reopen", "corrupt"};
  bool* flag(std::size_t i) {
    bool* f[] = {&evict, &slow, &state_miss, &death, &abort, &preempt, &reopen, &corrupt};
    return f[i];
  }
  bool any() const { return evict || slow || state_miss || death || abort || preempt || reopen || corrupt; }
};

/// How one engine is built and driven.
struct RunOptions {
  std::uint32_t world = 8;
  std::size_t memory_bytes = std::size_t{1} << 20;  ///< each rank's memory tier (rank-divergent with the evict fault)
  bool disk = true;                                 ///< a DiskTier behind the memory tier
  std::filesystem::path dir;                        ///< where the ranks' disk tiers live
#if KVFUSE_REPLAY_WITH_REDIS
  std::optional<RedisTierOptions> redis;            ///< --tier redis: every rank's tier is a RedisTier
#endif
  std::uint32_t num_blocks = 1024;                  ///< the device block pool (all ranks alike)
  std::uint32_t num_slots = 16;                     ///< the device state slot pool
  bool offload = true;                              ///< false: the first pass of --two-pass (no loads, no saves)
  bool sync_saves = false;                          ///< each request's saves land before the next arrives
  double speed = 0;                                 ///< 0: as fast as possible; else simulated ms per wall ms
  Faults faults;
  std::uint64_t seed = 1;
  std::function<void(std::size_t done, std::size_t total, std::size_t loads_in_flight)> progress;
};

/// Percentiles of a latency sample, in microseconds.
struct Latency {
  std::size_t count = 0;
  double p50 = 0, p99 = 0;
  static Latency of(std::vector<double> v) {
    Latency l;
    l.count = v.size();
    if (v.empty()) return l;
    std::sort(v.begin(), v.end());
    auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))]; };
    l.p50 = at(0.50);
    l.p99 = at(0.99);
    return l;
  }
};

/// Everything one pass measured. Every number is read from the objects after the run.
struct RunResult {
  std::string model;
  bool offload = true;
  std::size_t requests = 0, completed = 0, aborted = 0, preempted = 0;
  std::size_t admitted_compute = 0;  ///< admissions told to compute (no load)
  std::size_t loads_kv_only = 0, loads_joint = 0, loads_state_only = 0, loads_pd = 0;
  std::size_t outcome_completed = 0, outcome_failed = 0, outcome_abandoned = 0, outcome_state_missed = 0;
  std::size_t resumed_from_load = 0;
  std::uint64_t prompt_tokens = 0, reused_hbm = 0, reused_tier = 0, reuse_bound = 0;
  std::uint64_t hashes_retracted = 0, late_reports = 0, orphans_reclaimed = 0, saves_stored = 0, saves_failed = 0;
  Latency joint, kv_only, state_only;
  std::uint64_t staging_bytes = 0, verified_bytes = 0;
  double wall_seconds = 0;
  // the numbers that must be zero
  std::uint64_t invariant_violations = 0, corrupted_bytes = 0, stranded_parked = 0, leaked_slots = 0;
  // faults, as injected
  std::uint64_t f_evicted = 0, f_state_removed = 0, f_deaths = 0, f_reopens = 0, f_corrupted = 0, f_quarantined = 0,
                f_aborts = 0, f_preempts = 0;
  std::vector<std::uint64_t> outputs;  ///< per request: its output checksum, 0 = no output (aborted)
  /// Every stats counter after the run, for the Prometheus text (one family per counter
  /// across models, so main() formats all models' snapshots together).
  struct Snapshot {
    IndexStats index;
    PumpStats pump;
    CoordinatorStats coordinator;
    std::vector<ConnectorStats> connectors;
    std::vector<MemoryTierStats> memory_tiers;
    std::vector<std::optional<DiskTierStats>> disk_tiers;
    std::vector<std::optional<TieredTierStats>> tiered_tiers;
    std::vector<std::optional<RedisTierStats>> redis_tiers;
    std::optional<LoopbackPd::Stats> pd;
  } snapshot;
};

/// Adds one pass's counters to `text`, every sample labelled with its model (and rank).
inline void add_metrics(PrometheusText& text, const RunResult& r) {
  const RunResult::Snapshot& s = r.snapshot;
  text.add(s.index, {{"model", r.model}});
  text.add(s.pump, {{"model", r.model}});
  text.add(s.coordinator, {{"model", r.model}});
  for (std::size_t i = 0; i < s.connectors.size(); ++i) {
    const std::string rank = std::to_string(i);
    text.add(s.connectors[i], {{"model", r.model}, {"rank", rank}});
    text.add(s.memory_tiers[i], {{"model", r.model}, {"rank", rank}});
    if (s.disk_tiers[i]) text.add(*s.disk_tiers[i], {{"model", r.model}, {"rank", rank}});
    if (s.tiered_tiers[i]) text.add(*s.tiered_tiers[i], {{"model", r.model}, {"rank", rank}});
    if (s.redis_tiers[i]) text.add(*s.redis_tiers[i], {{"model", r.model}, {"rank", rank}});
  }
  if (s.pd) text.add(*s.pd, {{"model", r.model}});
}

/// Block pool with prefix caching. Block ids are the same on every rank (TP shares the
/// table). Scheduler thread only.
class BlockCache {
 public:
  explicit BlockCache(std::uint32_t n) : entries_(n) {
    for (std::uint32_t i = n; i-- > 0;) free_.push_back(i);
  }
  /// Pins the leading cached blocks of `ids` (at most `limit`); appends them to `out`.
  std::size_t match(const std::vector<std::uint64_t>& ids, std::size_t limit, std::vector<BlockId>& out) {
    std::size_t n = 0;
    for (; n < limit && n < ids.size(); ++n) {
      const auto it = by_identity_.find(ids[n]);
      if (it == by_identity_.end()) break;
      Entry& e = entries_[it->second];
      if (e.refs++ == 0) lru_.erase(e.lru);
      out.push_back(BlockId{it->second});
    }
    return n;
  }
  /// Appends `n` fresh blocks to `out`, evicting cached ones as needed; false (nothing taken) if it cannot.
  bool allocate(std::size_t n, std::vector<BlockId>& out) {
    if (free_.size() + lru_.size() < n) return false;
    for (std::size_t i = 0; i < n; ++i) {
      if (free_.empty()) {
        const std::uint32_t victim = lru_.front();
        lru_.pop_front();
        by_identity_.erase(entries_[victim].identity);
        entries_[victim].cached = false;
        free_.push_back(victim);
      }
      const std::uint32_t b = free_.back();
      free_.pop_back();
      entries_[b].refs = 1;
      out.push_back(BlockId{b});
    }
    return true;
  }
  /// `b` (pinned) now holds the tokens `identity` names, whole: later requests may share it.
  void publish(BlockId b, std::uint64_t identity) {
    Entry& e = entries_[b.value];
    if (e.cached || by_identity_.contains(identity)) return;
    e.cached = true;
    e.identity = identity;
    by_identity_.emplace(identity, b.value);
  }
  /// Unpins `b`; a published block stays cached (LRU) once nobody pins it.
  void release(BlockId b) {
    Entry& e = entries_[b.value];
    if (--e.refs > 0) return;
    if (e.cached) e.lru = lru_.insert(lru_.end(), b.value);
    else free_.push_back(b.value);
  }
  std::size_t pinned() const {
    return static_cast<std::size_t>(std::count_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.refs > 0; }));
  }

 private:
  struct Entry {
    std::uint32_t refs = 0;
    bool cached = false;
    std::uint64_t identity = 0;
    std::list<std::uint32_t>::iterator lru;
  };
  std::vector<Entry> entries_;
  std::vector<std::uint32_t> free_;
  std::list<std::uint32_t> lru_;  // cached and unpinned, least recently used first
  std::unordered_map<std::uint64_t, std::uint32_t> by_identity_;
};

inline constexpr std::uint32_t block_tokens = 64;
inline constexpr std::size_t kv_bytes_per_token = 8;  // one word per token per rank
inline constexpr std::size_t slot_bytes = 4096;

/// Deterministic per-request coin: the same request gets the same answer in both passes.
inline bool coin(std::uint64_t seed, std::uint64_t request, std::uint64_t salt, std::uint32_t per_mille) {
  return mix64(seed ^ mix64(request * 0x100000001b3ULL + salt)) % 1000 < per_mille;
}

/// One engine with `Conn` on every rank. `Composed`: admit through [P/D loopback, offload].
template <class Conn, bool Composed = false>
class Cluster {
 public:
  static constexpr bool stateful = Conn::has_state;
  static constexpr StateLayout layout =
      Conn::layout;  // the state leg names it: the serial K3 connector plans as K3

  Cluster(std::string model, std::uint64_t model_id, const Workload& w, RunOptions o)
      : o_(std::move(o)),
        w_(w),
        model_id_(model_id),
        group_(TpQuorumOptions{o_.world, Conn::lane_count, 8192, 8192, 4096}),
        // No slot-free callback: an orphan's slot comes back to the pool through the
        // coordinator's Release event for its torn-down admission, the one signal.
        index_(OffloadIndexOptions{.hash_capacity = std::size_t{1} << 18, .slot_count = stateful ? o_.num_slots : 0}),
        pump_(group_, index_),
        blocks_(o_.num_blocks),
        transport_{this},
        lookup_{this},
        coord_(CoordinatorOptions{layout, PlanGrids{block_tokens, chunk_tokens}, 0, 4096}, index_, pump_, transport_, lookup_),
        rng_(o_.seed) {
    result_.model = std::move(model);
    result_.offload = o_.offload;
    for (std::uint32_t s = o_.num_slots; stateful && s-- > 0;) free_slots_.push_back(SlotId{s});
    for (std::uint32_t r = 0; r < o_.world; ++r) {
      std::size_t memory = o_.memory_bytes;
      if (o_.faults.evict && memory < (std::size_t{1} << 60)) memory = memory / 4 * (4 + r % 3);  // ranks evict differently
      TierSpec spec;
      spec.memory_bytes = memory;
      if (o_.disk) spec.disk = o_.dir / ("rank" + std::to_string(r));
#if KVFUSE_REPLAY_WITH_REDIS
      spec.redis = o_.redis;
#endif
      ranks_.push_back(std::make_unique<Rank>(geometry(r), rt_, spec, group_));
      alive_.push_back(true);
    }
    if (o_.faults.slow) ranks_.back()->tier.set_delay(std::chrono::microseconds(200));
    if constexpr (Composed) {
      std::vector<LoopbackRank> pairs;
      for (auto& rank : ranks_) {
        producer_.push_back(static_cast<std::byte*>(rt_.allocate_device(std::size_t{o_.num_blocks} * block_bytes())));
        pairs.push_back(LoopbackRank{producer_.back(), rank->blocks});
      }
      pd_ = std::make_unique<LoopbackPd>(std::move(pairs), block_tokens, block_bytes());
      multi_ = std::make_unique<Multi<LoopbackPd, OffloadSub>>(*pd_, offload_sub_);
    }
  }
  ~Cluster() {
    for (auto& rank : ranks_) rank->conn.drain();
    for (std::byte* p : producer_) rt_.free_device(p);
  }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  /// Replays the whole workload and drains; returns what it measured.
  RunResult run() {
    const auto started = WallClock::now();
    const auto& reqs = w_.requests;
    result_.requests = reqs.size();
    result_.outputs.assign(reqs.size(), 0);
    result_.reuse_bound = w_.reuse_bound;
    std::size_t next = 0;
    auto last_tick = WallClock::now();
    auto last_progress = WallClock::now();
    while (ended_ < reqs.size()) {
      const bool blocked_by_saves = sync_blocked();
      while (next < reqs.size() && reqs[next].arrival_ms <= now_ms_ && !blocked_by_saves) {
        queue_.push_back(&reqs[next++]);
        on_arrival(next, reqs.size());
        if (o_.sync_saves) break;
      }
      admit_queued();
      step();
      complete_computed();
      maybe_break_state();
      if (WallClock::now() - last_tick > std::chrono::milliseconds(50)) {
        last_tick = WallClock::now();
        if (o_.offload) {
          const auto t = coord_.tick(last_tick, std::chrono::seconds(30), std::chrono::seconds(5));
          result_.orphans_reclaimed += t.reclaimed;
        }
      }
      if (o_.progress && WallClock::now() - last_progress > std::chrono::milliseconds(100)) {
        last_progress = WallClock::now();
        o_.progress(ended_, reqs.size(), parked_);
      }
      advance_clock(next < reqs.size() ? std::optional<double>(reqs[next].arrival_ms) : std::nullopt);
    }
    drain();
    result_.wall_seconds = std::chrono::duration<double>(WallClock::now() - started).count();
    collect();
    return result_;
  }

 private:
  struct Rank {
    RankGeometry geo;
    HostRuntime& rt;
    std::byte* blocks;
    std::byte* slots;
    RankTier tier;
    Conn conn;
    Rank(const RankGeometry& g, HostRuntime& runtime, const TierSpec& spec, TpQuorum& group)
        : geo(g),
          rt(runtime),
          blocks(static_cast<std::byte*>(runtime.allocate_device(std::size_t{g.num_blocks} * g.block_bytes()))),
          slots(static_cast<std::byte*>(runtime.allocate_device(std::max<std::size_t>(1, std::size_t{g.num_slots} * g.slot_bytes)))),
          tier(spec),
          conn(g, runtime, DeviceMemory{blocks, slots}, PagedKv<RankTier>(tier), make_state_leg(tier), group) {}
    ~Rank() {
      conn.drain();
      rt.free_device(blocks);
      rt.free_device(slots);
    }
    static auto make_state_leg(RankTier& tier) {
      using S = typename Conn::state_leg_type;
      if constexpr (!stateful) return S{};
      else if constexpr (std::is_constructible_v<S, RankTier&>) return S(tier);
      else return S(typename S::inner_type(tier));
    }
    std::byte* block(BlockId b) const { return blocks + std::size_t{b.value} * geo.block_bytes(); }
    std::byte* slot(SlotId s) const { return slots + std::size_t{s.value} * geo.slot_bytes; }
  };

  struct Transport {
    Cluster* c;
    bool send(const LoadRequest& r) {
      for (std::uint32_t i = 0; i < c->ranks_.size(); ++i)
        if (c->alive_[i]) c->ranks_[i]->conn.load(r);
      return true;
    }
    bool send(const KvSave& s) {
      for (std::uint32_t i = 0; i < c->ranks_.size(); ++i)
        if (c->alive_[i]) c->ranks_[i]->conn.save_kv(s);
      return true;
    }
    bool send(const StateSave& s) {
      if constexpr (stateful)
        for (std::uint32_t i = 0; i < c->ranks_.size(); ++i)
          if (c->alive_[i]) c->ranks_[i]->conn.save_state(s);
      return true;
    }
  };
  /// The tier's answer: the leading chunks every live rank holds. (LMCache asks its first
  /// worker only; with saves still landing on the other ranks that answer races them, and
  /// the quorum turns the race into a failed load and a recompute. Ranks as threads can
  /// afford to ask all.) The evict fault strikes here, between the lookup and the load: one
  /// rank drops a chunk the lookup just counted, so that rank's miss fails the load (R4).
  struct Lookup {
    Cluster* c;
    std::size_t operator()(std::span<const PrefixHash> keys) {
      std::size_t n = keys.size();
      for (std::uint32_t r = 0; r < c->ranks_.size(); ++r) {
        if (!c->alive_[r]) continue;
        std::size_t held = 0;
        while (held < n && c->ranks_[r]->tier.contains(c->kv_key(keys[held], r))) ++held;
        n = held;
      }
      if (n > 0 && c->o_.faults.evict && c->rng_() % 8 == 0) {
        const std::uint32_t r = static_cast<std::uint32_t>(c->rng_() % c->ranks_.size());
        c->result_.f_evicted += c->ranks_[r]->tier.erase(c->kv_key(keys[c->rng_() % n], r));
      }
      return n;
    }
  };

  enum class Phase { parked, computing, finishing, torn_down };
  struct Attempt {
    const Request* req = nullptr;
    Phase phase = Phase::computing;
    std::vector<BlockId> blocks;
    std::size_t shared = 0;  // leading blocks pinned from the prefix cache
    std::optional<SlotId> slot;
    TokenCount hbm = 0, resume = 0;
    LoadPlan plan = NoLoad{};
    bool pd = false;
    WallClock::time_point parked_at{};
    double done_at = 0;
  };

  RankGeometry geometry(std::uint32_t r) const {
    RankGeometry g;
    g.model = model_id_;
    g.rank = r;
    g.world_size = o_.world;
    g.block_tokens = block_tokens;
    g.chunk_tokens = chunk_tokens;
    g.kv_bytes_per_token = kv_bytes_per_token;
    g.num_blocks = o_.num_blocks;
    g.num_slots = stateful ? o_.num_slots : 0;
    g.slot_bytes = stateful ? slot_bytes : 0;
    g.max_chunks_per_load = static_cast<std::uint32_t>(w_.max_request_tokens / chunk_tokens + 2);
    return g;
  }
  static constexpr std::size_t block_bytes() { return block_tokens * kv_bytes_per_token; }
  TierKey kv_key(PrefixHash h, std::uint32_t r) const { return TierKey{model_id_, h, o_.world, r, EntryKind::kv_chunk}; }
  TierKey state_key(PrefixHash h, std::uint32_t r) const { return TierKey{model_id_, h, o_.world, r, EntryKind::state}; }

  // ---- the model: what each position holds --------------------------------------------
  static std::uint64_t block_id(const Request& q, std::size_t b) {
    return block_identity(q.chunk_keys[b * block_tokens / chunk_tokens].value, b);
  }
  /// The state hash the index keys the checkpoint at boundary B by: the prompt's chunk keys
  /// before B, chained (chain_start, then chain_next per chunk), so equal hashes mean equal
  /// prefixes.
  std::uint64_t chain_start() const noexcept { return mix64(model_id_ ^ 0x5354415445ULL); }
  static std::uint64_t chain_next(std::uint64_t chain, PrefixHash key) noexcept { return mix64(chain ^ key.value); }
  static PrefixHash state_hash_at(std::uint64_t chain, TokenCount boundary) noexcept { return PrefixHash{mix64(chain + boundary)}; }
  PrefixHash state_hash(const Request& q, TokenCount boundary) const {
    std::uint64_t chain = chain_start();
    for (std::size_t c = 0; c < boundary / chunk_tokens; ++c) chain = chain_next(chain, q.chunk_keys[c]);
    return state_hash_at(chain, boundary);
  }
  static std::uint64_t state_at(const Request& q, TokenCount boundary, std::uint64_t from_state = initial_state, TokenCount from = 0) {
    std::uint64_t s = from_state;
    for (std::size_t b = from / block_tokens; b < boundary / block_tokens; ++b) s = advance_state(s, block_id(q, b));
    return s;
  }

  // ---- admission ---------------------------------------------------------------------------
  void admit_queued() {
    while (!queue_.empty()) {
      if (!admit(*queue_.front())) return;  // FIFO: wait for blocks or a slot
      queue_.pop_front();
    }
  }

  bool admit(const Request& q) {
    Attempt a;
    a.req = &q;
    const TokenCount total = q.prompt_tokens + q.output_tokens;
    const std::size_t nblocks = (total + block_tokens - 1) / block_tokens;
    std::vector<std::uint64_t> ids(nblocks);
    for (std::size_t b = 0; b < nblocks; ++b) ids[b] = block_id(q, b);
    a.shared = blocks_.match(ids, (q.prompt_tokens - 1) / block_tokens, a.blocks);
    if (!blocks_.allocate(nblocks - a.shared, a.blocks) || (stateful && free_slots_.empty())) {
      for (const BlockId b : a.blocks) blocks_.release(b);
      return false;
    }
    if (stateful) {
      a.slot = free_slots_.back();
      free_slots_.pop_back();
    }
    a.hbm = static_cast<TokenCount>(a.shared) * block_tokens;
    const RequestId id{next_id_++};
    const bool first_attempt = !attempted_.contains(q.index);
    attempted_.insert(q.index);
    if (!o_.offload) {
      start_compute(a, q, stateful ? 0 : a.hbm);
      attempts_.emplace(id, std::move(a));
      return true;
    }
    std::vector<Checkpoint> checkpoints;  // every chunk boundary below P, one chain walk
    std::uint64_t chain = chain_start();
    for (TokenCount b = chunk_tokens; stateful && b <= q.prompt_tokens - 1; b += chunk_tokens) {
      chain = chain_next(chain, q.chunk_keys[b / chunk_tokens - 1]);
      checkpoints.push_back(Checkpoint{b, state_hash_at(chain, b)});
    }
    const AdmitRequest ar{id, q.prompt_tokens, a.hbm, q.chunk_keys, a.blocks, checkpoints, a.slot};
    AdmitDecision d;
    if constexpr (Composed) {
      if (coin(o_.seed, q.index, 11, 250)) publish_on_producer(id, q);
      d = coord_.admit(ar, *multi_, offload_sub_);
    } else {
      d = coord_.admit(ar);
    }
    if (!d.parked) {
      ++result_.admitted_compute;
      start_compute(a, q, stateful ? 0 : a.hbm);
      attempts_.emplace(id, std::move(a));
      return true;
    }
    a.phase = Phase::parked;
    a.plan = d.plan;
    a.pd = d.sub && *d.sub == 0;
    a.parked_at = WallClock::now();
    ++parked_;
    if (a.pd) ++result_.loads_pd;
    else if (std::holds_alternative<KvOnlyLoad>(d.plan)) ++result_.loads_kv_only;
    else if (std::holds_alternative<JointLoad>(d.plan)) ++result_.loads_joint;
    else if (std::holds_alternative<StateOnlyLoad>(d.plan)) ++result_.loads_state_only;
    attempts_.emplace(id, std::move(a));
    // Faults: the request goes away while its load is in flight.
    if (first_attempt && o_.faults.abort && coin(o_.seed, q.index, 1, 40)) {
      tear_down(id, false);
    } else if (first_attempt && o_.faults.preempt && coin(o_.seed, q.index, 2, 40)) {
      tear_down(id, true);
    }
    return true;
  }

  void publish_on_producer(RequestId id, const Request& q) {
    const TokenCount tokens = q.prompt_tokens - q.prompt_tokens % block_tokens;
    std::vector<BlockId> table;
    for (std::uint32_t b = 0; b < tokens / block_tokens; ++b) table.push_back(BlockId{b});
    for (std::size_t r = 0; r < ranks_.size(); ++r)
      for (std::size_t b = 0; b < table.size(); ++b) write_block(producer_[r] + b * block_bytes(), q, b, static_cast<std::uint32_t>(r), 0, block_tokens);
    pd_->publish(id, tokens, std::move(table));
  }

  void tear_down(RequestId id, bool preempt) {
    Attempt& a = attempts_.at(id);
    if (a.phase == Phase::parked) --parked_;
    a.phase = Phase::torn_down;
    coord_.teardown(id);
    if (preempt) {
      ++result_.f_preempts;
      ++result_.preempted;
      queue_.push_back(a.req);  // admitted again later, as a new attempt
    } else {
      ++result_.f_aborts;
      ++result_.aborted;
      ++ended_;
    }
  }

  // ---- the compute side -----------------------------------------------------------------
  void start_compute(Attempt& a, const Request& q, TokenCount resume) {
    a.phase = Phase::computing;
    a.resume = resume;
    const TokenCount hbm_used = std::min(resume, a.hbm);
    result_.reused_hbm += hbm_used;
    result_.reused_tier += resume - hbm_used;
    const double prefill = static_cast<double>(q.prompt_tokens - std::min(resume, q.prompt_tokens)) / 50.0;  // 50 tokens per ms
    a.done_at = now_ms_ + prefill + 1.0 * static_cast<double>(q.output_tokens);                            // 1 ms per output token
  }

  void write_block(std::byte* at, const Request& q, std::size_t b, std::uint32_t rank, TokenCount from_in_block, TokenCount to_in_block) {
    const std::uint64_t bid = block_id(q, b);
    for (TokenCount t = from_in_block; t < to_in_block; ++t)
      store_word(at + t * kv_bytes_per_token, kv_word(bid, b * block_tokens + t, rank, 0));
  }

  /// The forward, the output checksum and finish() of every request whose compute ended.
  void complete_computed() {
    done_now_.clear();
    for (auto& [id, a] : attempts_)
      if (a.phase == Phase::computing && a.done_at <= now_ms_) done_now_.push_back(id);
    std::sort(done_now_.begin(), done_now_.end(), [](RequestId x, RequestId y) { return x.value < y.value; });
    for (const RequestId id : done_now_) finish(id, attempts_.at(id));
  }

  void finish(RequestId id, Attempt& a) {
    const Request& q = *a.req;
    const TokenCount total = q.prompt_tokens + q.output_tokens;
    // KV of [resume, total) into the request's own blocks (cached blocks already hold theirs).
    const TokenCount from = std::max(a.resume, static_cast<TokenCount>(a.shared) * block_tokens);
    for (std::size_t r = 0; r < ranks_.size(); ++r)
      for (TokenCount b = from / block_tokens; b * block_tokens < total; ++b) {
        const TokenCount lo = std::max(from, b * block_tokens) - b * block_tokens;
        const TokenCount hi = std::min(total, (b + 1) * block_tokens) - b * block_tokens;
        write_block(ranks_[r]->block(a.blocks[b]), q, b, static_cast<std::uint32_t>(r), lo, hi);
      }
    // The state: continue from what the load restored (read from the slot), or from the start.
    // (A dense model has no state to restore: its digest always runs from the start.)
    const TokenCount state_from = stateful ? a.resume : 0;
    std::uint64_t state = initial_state;
    if (state_from > 0) state = load_word(ranks_[0]->slot(*a.slot));
    const TokenCount save_at = total > 1 ? ((total - 1) / chunk_tokens) * chunk_tokens : 0;
    std::uint64_t checkpoint_state = 0;
    if (save_at > state_from) {
      checkpoint_state = state_at(q, save_at, state, state_from);
      state = state_at(q, total - total % block_tokens, checkpoint_state, save_at);
    } else {
      state = state_at(q, total - total % block_tokens, state, state_from);
    }
    if (total % block_tokens != 0) state = advance_state(state, block_id(q, total / block_tokens) ^ (total % block_tokens));
    // What the model's output depends on: the final state and the prompt's KV, as read back.
    std::uint64_t kv = 0;
    for (std::size_t r = 0; r < ranks_.size(); ++r)
      for (TokenCount t = 0; t < q.prompt_tokens; ++t)
        kv = mix64(kv ^ load_word(ranks_[r]->block(a.blocks[t / block_tokens]) + (t % block_tokens) * kv_bytes_per_token));
    result_.outputs[q.index] = mix64(state ^ kv) | 1;
    for (std::size_t b = 0; (b + 1) * block_tokens <= total; ++b) blocks_.publish(a.blocks[b], block_id(q, b));
    ++result_.completed;
    ++ended_;
    a.phase = Phase::finishing;
    if (!o_.offload) {
      release(a);
      attempts_.erase(id);
      return;
    }
    std::optional<Checkpoint> checkpoint;
    if (stateful && save_at > 0 && save_at > a.resume) {
      for (std::size_t r = 0; r < ranks_.size(); ++r)
        for (std::size_t j = 0; j < slot_bytes / 8; ++j)
          store_word(ranks_[r]->slot(*a.slot) + j * 8, state_word(checkpoint_state, static_cast<std::uint32_t>(r), j));
      checkpoint = Checkpoint{save_at, state_hash(q, save_at)};
      if (o_.faults.state_miss && coin(o_.seed, q.index, 3, 150)) to_break_.push_back(checkpoint->hash);
    }
    (void)coord_.finish(FinishRequest{id, total, q.chunk_keys, a.blocks, checkpoint, a.slot});
    for (std::size_t c = 0; c < total / chunk_tokens; ++c) saved_.push_back(q.chunk_keys[c]);
    if (saved_.size() > 4096) saved_.erase(saved_.begin(), saved_.begin() + 2048);
  }

  /// Blocks and slot back to the pools (published blocks stay cached).
  void release(Attempt& a) {
    for (const BlockId b : a.blocks) blocks_.release(b);
    if (a.slot) free_slots_.push_back(*a.slot);
  }

  // ---- the coordinator's events ------------------------------------------------------------
  void step() {
    if (!o_.offload) return;
    typename Coord::StepResult s;
    if constexpr (Composed) s = coord_.step(*multi_);
    else s = coord_.step();
    for (const Unpark& u : s.unparked) on_unpark(u);
    for (const Freed& rel : s.freed) {
      const auto it = attempts_.find(rel.request);
      if (it == attempts_.end() || (it->second.phase != Phase::finishing && it->second.phase != Phase::torn_down)) {
        ++sim_violations_;  // a release for a request that still computes, or twice
        continue;
      }
      release(it->second);
      attempts_.erase(it);
    }
    if (s.records == 0 && s.unparked.empty() && s.freed.empty() && (parked_ > 0 || waiting_for_ranks()))
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }

  bool waiting_for_ranks() const {
    return std::any_of(attempts_.begin(), attempts_.end(),
                       [](const auto& kv) { return kv.second.phase == Phase::finishing || kv.second.phase == Phase::torn_down; });
  }

  void on_unpark(const Unpark& u) {
    const auto it = attempts_.find(u.request);
    if (it == attempts_.end() || it->second.phase != Phase::parked) {
      ++sim_violations_;  // an unpark nobody waits for, or a second one
      return;
    }
    Attempt& a = it->second;
    --parked_;
    const double us = std::chrono::duration<double, std::micro>(WallClock::now() - a.parked_at).count();
    switch (u.kind) {
      case Resolution::completed: ++result_.outcome_completed; break;
      case Resolution::failed: ++result_.outcome_failed; break;
      default: ++result_.outcome_abandoned; break;
    }
    result_.outcome_state_missed += u.state_missed;
    if (u.tokens > 0) {
      ++result_.resumed_from_load;
      verify(a);
      if (std::holds_alternative<JointLoad>(a.plan)) joint_us_.push_back(us);
      else if (std::holds_alternative<KvOnlyLoad>(a.plan)) kv_only_us_.push_back(us);
      else if (std::holds_alternative<StateOnlyLoad>(a.plan)) state_only_us_.push_back(us);
    }
    start_compute(a, *a.req, stateful ? u.tokens : std::max(u.tokens, a.hbm));
  }

  /// Every byte the load wrote, on every rank, against what the model would have written.
  void verify(const Attempt& a) {
    const Request& q = *a.req;
    const std::optional<IndexRange> range = kv_tokens(a.plan);
    const std::optional<TokenCount> boundary = state_boundary(a.plan);
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      if (range)
        for (TokenCount t = range->first; t < range->last; ++t) {
          const std::size_t b = t / block_tokens;
          const std::uint64_t got = load_word(ranks_[r]->block(a.blocks[b]) + (t % block_tokens) * kv_bytes_per_token);
          result_.corrupted_bytes += differing_bytes(got, kv_word(block_id(q, b), t, static_cast<std::uint32_t>(r), 0));
          result_.verified_bytes += kv_bytes_per_token;
        }
      if (boundary) {
        const std::uint64_t expect = state_at(q, *boundary);
        for (std::size_t j = 0; j < slot_bytes / 8; ++j)
          result_.corrupted_bytes += differing_bytes(load_word(ranks_[r]->slot(*a.slot) + j * 8),
                                                     state_word(expect, static_cast<std::uint32_t>(r), j));
        result_.verified_bytes += slot_bytes;
      }
    }
  }

  // ---- faults --------------------------------------------------------------------------------
  void on_arrival(std::size_t arrived, std::size_t total) {
    if (!o_.offload) return;
    auto at = [&](std::size_t percent) { return arrived == std::max<std::size_t>(1, total * percent / 100); };
    const std::uint32_t victim = o_.world > 2 ? o_.world - 2 : 0;
    if (o_.faults.death && o_.world > 1 && at(35) && alive_[victim]) {
      alive_[victim] = false;
      pump_.mark_rank_dead(victim);
      ++result_.f_deaths;
    }
    if (o_.faults.death && o_.world > 1 && at(42) && !alive_[victim]) {
      alive_[victim] = true;
      pump_.mark_rank_alive(victim);
    }
    if (o_.faults.corrupt && o_.disk && (at(50) || at(75))) corrupt_a_file();
    if (o_.faults.reopen && o_.disk && at(60))
      for (auto& rank : ranks_) {
        const auto [before, after] = rank->tier.reopen_disk();
        if (before != after) ++sim_violations_;  // a restart lost stored entries
        ++result_.f_reopens;
      }
  }

  void corrupt_a_file() {
    const std::uint32_t r = o_.world / 2;
    for (std::size_t tries = 0; tries < saved_.size(); ++tries) {
      const PrefixHash h = saved_[rng_() % saved_.size()];
      const std::filesystem::path p = ranks_[r]->tier.disk_path(kv_key(h, r));
      std::error_code ec;
      const auto size = std::filesystem::file_size(p, ec);
      if (ec || size < 200) continue;
      std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
      if (!f) continue;
      f.seekp(static_cast<std::streamoff>(size - 100));
      const char garbage[8] = {'k', 'v', 'f', 'u', 's', 'e', '!', '!'};
      f.write(garbage, sizeof garbage);
      f.close();
      ranks_[r]->tier.erase_from_memory(kv_key(h, r));  // the next get reads the file
      ++result_.f_corrupted;
      return;
    }
  }

  /// Removes stored checkpoints from one rank (the index still lists them: its loads miss).
  void maybe_break_state() {
    if (to_break_.empty() || o_.world < 2) return;
    for (std::size_t i = 0; i < to_break_.size();) {
      if (ranks_[1]->tier.erase(state_key(to_break_[i], 1))) {
        ++result_.f_state_removed;
        to_break_[i] = to_break_.back();
        to_break_.pop_back();
      } else {
        ++i;
      }
    }
    if (to_break_.size() > 64) to_break_.erase(to_break_.begin(), to_break_.begin() + 32);
  }

  // ---- the clock -------------------------------------------------------------------------------
  /// --sync-saves: the next request arrives only once the last one's saves landed.
  bool sync_blocked() {
    return o_.sync_saves && o_.offload && (!attempts_.empty() || !queue_.empty() || index_.stats().saves_outstanding > 0);
  }

  void advance_clock(std::optional<double> next_arrival) {
    if (parked_ > 0 || index_.stats().saves_outstanding > 0) return;  // loads and saves take no simulated time
    constexpr double never = std::numeric_limits<double>::infinity();
    double next = next_arrival && !sync_blocked() ? *next_arrival : never;
    for (const auto& [id, a] : attempts_)
      if (a.phase == Phase::computing) next = std::min(next, a.done_at);
    if (next == never || next <= now_ms_) return;
    if (o_.speed > 0) {
      const auto due = wall_start_ + std::chrono::duration_cast<WallClock::duration>(std::chrono::duration<double, std::milli>(next / o_.speed));
      if (WallClock::now() < due) {
        std::this_thread::sleep_until(std::min(due, WallClock::now() + std::chrono::milliseconds(2)));
        return;
      }
    }
    now_ms_ = next;
  }

  /// Every load and save settles, every request's resources come back.
  void drain() {
    if (!o_.offload) return;
    const auto deadline = WallClock::now() + std::chrono::seconds(60);
    while (WallClock::now() < deadline &&
           (!attempts_.empty() || index_.stats().outstanding > 0 || index_.stats().saves_outstanding > 0)) {
      step();
      if (WallClock::now() > deadline - std::chrono::seconds(30)) {
        // A load lost on its way is reclaimed after its timeout, as an engine's tick would.
        result_.orphans_reclaimed += coord_.tick(WallClock::now() + std::chrono::hours(1), std::chrono::seconds(30), std::chrono::seconds(5)).reclaimed;
      }
    }
    for (auto& rank : ranks_) rank->conn.drain();
    step();
  }

  void collect() {
    result_.joint = Latency::of(joint_us_);
    result_.kv_only = Latency::of(kv_only_us_);
    result_.state_only = Latency::of(state_only_us_);
    result_.prompt_tokens = w_.prompt_tokens;
    const IndexStats is = index_.stats();
    const PumpStats ps = pump_.stats();
    const CoordinatorStats cs = coord_.stats();
    result_.hashes_retracted = is.hashes_retracted;
    result_.late_reports = ps.late_reports;
    result_.saves_stored = is.saves_stored;
    result_.saves_failed = is.saves_failed;
    const auto consistency = kvfuse::testing::check_consistency(index_);
    result_.invariant_violations = is.invariant_violations + cs.invariant_violations + sim_violations_ + (consistency.ok ? 0 : 1);
    if (std::getenv("KVFUSE_REPLAY_DEBUG"))
      std::fprintf(stderr, "%s: index %llu coordinator %llu replay %llu consistency %s\n", result_.model.c_str(),
                   (unsigned long long)is.invariant_violations, (unsigned long long)cs.invariant_violations,
                   (unsigned long long)sim_violations_, consistency.ok ? "ok" : consistency.problem.c_str());
    result_.stranded_parked = static_cast<std::uint64_t>(parked_) + cs.waiting_now;
    result_.leaked_slots = (stateful ? o_.num_slots - free_slots_.size() : 0) + blocks_.pinned() + attempts_.size() + cs.holding_now;
    for (auto& rank : ranks_) {
      result_.staging_bytes += rank->conn.stats().standing_staging_bytes;
      if (const auto d = rank->tier.disk_stats()) result_.f_quarantined += d->quarantined;
      result_.f_quarantined += rank->tier.closed_disk_stats().quarantined;
    }
    RunResult::Snapshot& snap = result_.snapshot;
    snap.index = is;
    snap.pump = ps;
    snap.coordinator = cs;
    for (auto& rank : ranks_) {
      snap.connectors.push_back(rank->conn.stats());
      snap.memory_tiers.push_back(rank->tier.memory_stats());
      snap.disk_tiers.push_back(rank->tier.disk_stats());
      snap.tiered_tiers.push_back(rank->tier.stack_stats());
      snap.redis_tiers.push_back(rank->tier.redis_stats());
    }
    if constexpr (Composed) snap.pd = pd_->stats();
  }

  using Coord = Coordinator<TpQuorum, Transport, Lookup>;

  RunOptions o_;
  const Workload& w_;
  std::uint64_t model_id_;
  HostRuntime rt_;
  TpQuorum group_;
  OffloadIndex<> index_;
  SettlementPump<TpQuorum, OffloadIndex<>> pump_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<bool> alive_;
  BlockCache blocks_;
  std::vector<SlotId> free_slots_;
  Transport transport_;
  Lookup lookup_;
  Coord coord_;
  std::vector<std::byte*> producer_;
  std::unique_ptr<LoopbackPd> pd_;
  OffloadSub offload_sub_;
  std::unique_ptr<Multi<LoopbackPd, OffloadSub>> multi_;

  std::mt19937_64 rng_;
  RunResult result_;
  std::unordered_map<RequestId, Attempt> attempts_;
  std::unordered_set<std::uint64_t> attempted_;
  std::deque<const Request*> queue_;
  std::vector<RequestId> done_now_;
  std::vector<PrefixHash> saved_, to_break_;
  std::vector<double> joint_us_, kv_only_us_, state_only_us_;
  std::uint64_t next_id_ = 1, sim_violations_ = 0;
  std::size_t parked_ = 0, ended_ = 0;
  double now_ms_ = 0;
  WallClock::time_point wall_start_ = WallClock::now();
};

}  // namespace replay
