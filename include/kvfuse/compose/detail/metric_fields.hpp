// kvfuse/compose/detail/metric_fields.hpp — the one list of every stats field kvfuse
// exports as a metric: for each stats struct, one line per field with its metric name, its
// type and its help text. PrometheusText (compose/prometheus.hpp) writes from these
// tables; nothing else names a metric.
//
// Adding a field to a stats struct: add one line to its table below. The static_asserts
// at the end refuse a table whose line count differs from its struct's field count, a
// name outside [a-z0-9_], a counter or gauge spelled with "_total" (counters get it
// appended), and two tables that spell one family with a different type or help text.
//
// Naming: a family is `<prefix>_<name>`, plus `_total` for a counter. A counter is a
// monotonic event count; a gauge is a current size or level, which may go down. Sizes
// are in bytes, times in seconds (the exposition format's base units).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

#include <kvfuse/compose/loopback_pd.hpp>
#include <kvfuse/completion/group.hpp>
#include <kvfuse/completion/rank_queue.hpp>
#include <kvfuse/completion/settlement_pump.hpp>
#include <kvfuse/device/save_fence.hpp>
#include <kvfuse/engine/coordinator_types.hpp>
#include <kvfuse/engine/index_options.hpp>
#include <kvfuse/tier/disk_tier.hpp>
#include <kvfuse/tier/memory_tier.hpp>
#include <kvfuse/tier/redis_cluster_tier_stats.hpp>
#include <kvfuse/tier/redis_tier_stats.hpp>
#include <kvfuse/tier/tiered_tier.hpp>
#include <kvfuse/worker/connector.hpp>

namespace kvfuse {

/// The two metric types kvfuse exports. Stable values and names.
enum class MetricType : std::uint8_t {
  counter = 0,  ///< a monotonic event count since the source was built; its name ends in `_total`
  gauge = 1,    ///< a current size or level; it may go down
};

/// "counter" or "gauge", as the exposition format's `# TYPE` line spells it.
/// Thread-safe, constexpr, noexcept.
constexpr std::string_view to_string(MetricType type) noexcept {
  return type == MetricType::counter ? "counter" : "gauge";
}

namespace detail::metrics {

/// One sample's value: an exact unsigned integer, or a real (seconds).
struct Value {
  bool integral = true;
  std::uint64_t count = 0;
  double real = 0.0;
};

/// What a read function gets besides the struct: the instant ages are measured at.
using TimePoint = std::chrono::steady_clock::time_point;

/// One line of a table: the family name without prefix and without `_total`, its type, its
/// help text, and how to read the value from the struct.
template <class S>
struct Field {
  std::string_view name;
  MetricType type;
  std::string_view help;
  Value (*read)(const S&, TimePoint now) noexcept;
};

template <class M>
struct member_traits;
template <class S, class T>
struct member_traits<T S::*> {
  using owner = S;
  using type = T;
};

/// A field read as it is: an unsigned integer member, exact.
template <auto Member>
  requires std::unsigned_integral<typename member_traits<decltype(Member)>::type>
constexpr Field<typename member_traits<decltype(Member)>::owner> field(std::string_view name, MetricType type,
                                                                      std::string_view help) {
  using S = typename member_traits<decltype(Member)>::owner;
  return {name, type, help, [](const S& s, TimePoint) noexcept { return Value{true, static_cast<std::uint64_t>(s.*Member), 0.0}; }};
}
template <auto Member>
constexpr auto counter(std::string_view name, std::string_view help) { return field<Member>(name, MetricType::counter, help); }
template <auto Member>
constexpr auto gauge(std::string_view name, std::string_view help) { return field<Member>(name, MetricType::gauge, help); }

/// A nanosecond count written in seconds.
template <auto Member>
constexpr auto counter_ns_as_seconds(std::string_view name, std::string_view help) {
  using S = typename member_traits<decltype(Member)>::owner;
  return Field<S>{name, MetricType::counter, help, [](const S& s, TimePoint) noexcept {
                    return Value{false, 0, static_cast<double>(s.*Member) / 1e9};
                  }};
}

/// Seconds from an optional time point to `now`; 0 when empty or not in the past.
template <auto Member>
constexpr auto age_seconds(std::string_view name, std::string_view help) {
  using S = typename member_traits<decltype(Member)>::owner;
  return Field<S>{name, MetricType::gauge, help, [](const S& s, TimePoint now) noexcept {
                    const std::optional<TimePoint>& since = s.*Member;
                    const double age = since && now > *since ? std::chrono::duration<double>(now - *since).count() : 0.0;
                    return Value{false, 0, age};
                  }};
}

// ---- the tables: one line per field -------------------------------------------------

inline constexpr std::string_view index_prefix = "kvfuse_index";
inline constexpr Field<IndexStats> index_fields[] = {
    counter<&IndexStats::issued>("issued", "Load tickets issued by request_load (admissions)."),
    gauge<&IndexStats::in_flight>("in_flight", "Outstanding loads whose ticket was dispatched."),
    counter<&IndexStats::completed>("completed", "Loads settled as completed."),
    counter<&IndexStats::failed>("failed", "Loads settled as failed."),
    counter<&IndexStats::abandoned>("abandoned", "Loads abandoned, ticket drops and reclaims included."),
    counter<&IndexStats::reclaimed>("reclaimed", "Orphaned loads reclaimed after the timeout (also counted as abandoned)."),
    gauge<&IndexStats::outstanding>("outstanding", "Loads admitted and not yet resolved."),
    gauge<&IndexStats::orphaned>("orphaned", "Outstanding loads whose request was torn down."),
    counter<&IndexStats::late_reports>("late_reports", "Load or save settlements for unknown, settled or reclaimed keys."),
    counter<&IndexStats::refused>("refused", "request_load refusals."),
    gauge<&IndexStats::indexed>("indexed_hashes", "State hashes indexed now."),
    counter<&IndexStats::hashes_evicted>("hashes_evicted", "State hashes evicted by the LRU cap."),
    counter<&IndexStats::hashes_retracted>("hashes_retracted", "State hashes forgotten because a load reported a genuine miss."),
    counter<&IndexStats::slots_freed>("slots_freed", "Orphan slots let go (through the slot-free callback, when the index has one)."),
    counter<&IndexStats::slot_free_errors>("slot_free_errors", "Slot-free callbacks that threw."),
    counter<&IndexStats::invariant_violations>("invariant_violations", "Index stats reads whose audit failed."),
    gauge<&IndexStats::overdue>("overdue", "Loads the last report_overdue found in flight past its threshold."),
    counter<&IndexStats::saves_issued>("saves_issued", "Save tickets issued by request_save."),
    counter<&IndexStats::saves_released>("saves_released", "Saves whose source every rank released."),
    counter<&IndexStats::saves_stored>("saves_stored", "Saves every rank stored."),
    counter<&IndexStats::saves_failed>("saves_failed", "Saves some rank did not store."),
    counter<&IndexStats::saves_abandoned>("saves_abandoned", "Save tickets dropped or abandoned undispatched."),
    gauge<&IndexStats::saves_outstanding>("saves_outstanding", "Save tickets alive or saves in flight."),
    counter<&IndexStats::saves_refused>("saves_refused", "request_save refusals."),
};

inline constexpr std::string_view coordinator_prefix = "kvfuse_coordinator";
inline constexpr Field<CoordinatorStats> coordinator_fields[] = {
    counter<&CoordinatorStats::admitted>("admitted", "admit calls."),
    counter<&CoordinatorStats::parked>("parked", "Admissions that parked on a load."),
    counter<&CoordinatorStats::computed>("computed", "Admissions told to compute now."),
    counter<&CoordinatorStats::unparked>("unparked", "Unpark events handed out."),
    counter<&CoordinatorStats::unparked_with_tokens>("unparked_with_tokens", "Unpark events that resumed from a load."),
    counter<&CoordinatorStats::transport_drops>("transport_drops", "Loads and saves the transport dropped."),
    counter<&CoordinatorStats::torn_down>("torn_down", "teardown calls on a parked request."),
    counter<&CoordinatorStats::freed>("freed", "Freed events handed out, one per admission (blocks and slot free)."),
    counter<&CoordinatorStats::saves_submitted>("saves_submitted", "KV and state saves sent."),
    counter<&CoordinatorStats::saves_skipped>("saves_skipped", "finish calls that saved nothing."),
    counter<&CoordinatorStats::finish_without_admission>("finish_without_admission", "finish calls on a request with no live admission, left alone."),
    gauge<&CoordinatorStats::waiting_now>("waiting", "Requests parked now."),
    gauge<&CoordinatorStats::holding_now>("holding", "Requests whose resources wait for their ranks now."),
    gauge<&CoordinatorStats::overdue>("overdue", "Loads the last tick found in flight past the threshold."),
    counter<&CoordinatorStats::sources_pinned>("sources_pinned", "Saves whose source some rank could not confirm free, kept pinned."),
    counter<&CoordinatorStats::state_legs_waived>("state_legs_waived", "Admissions where a P/D sub won and a servable state leg was waived."),
    counter<&CoordinatorStats::checkpoints_planned>("checkpoints_planned", "Prefill checkpoints handed out in admit decisions."),
    counter<&CoordinatorStats::checkpoints_saved>("checkpoints_saved", "State checkpoints sent to the ranks."),
    counter<&CoordinatorStats::checkpoints_deduplicated>("checkpoints_deduplicated", "Checkpoints not sent: their hash was served or being saved."),
    counter<&CoordinatorStats::progress_saves>("progress_saves", "save_progress calls that sent something."),
    counter<&CoordinatorStats::snapshots_returned>("snapshots_returned", "Snapshot slots handed back in a step."),
    gauge<&CoordinatorStats::snapshots_held>("snapshots_held", "Snapshot slots some rank may still read now."),
    counter<&CoordinatorStats::salvaged_loads>("salvaged_loads", "Failed loads that resumed above 0 anyway (salvage)."),
    counter<&CoordinatorStats::salvaged_tokens>("salvaged_tokens", "Tokens above the HBM floor that salvaged resumes kept."),
    counter<&CoordinatorStats::second_loads>("second_loads", "State-only loads sent after a stateful load failed part way."),
    counter<&CoordinatorStats::slower_than_recompute>("slower_than_recompute", "Admissions that computed because every servable load cost more time than the prefill it spares."),
    counter<&CoordinatorStats::loads_timed>("loads_timed", "Completed loads the load-cost meter learnt the tier's speed from."),
    counter<&CoordinatorStats::invariant_violations>("invariant_violations", "Coordinator stats audits that failed, plus double unparks."),
};

inline constexpr std::string_view pump_prefix = "kvfuse_pump";
inline constexpr Field<PumpStats> pump_fields[] = {  // + PumpStats::group, written as GroupStats
    counter<&PumpStats::late_reports>("late_reports", "Records and settlements dropped as late anywhere on the path."),
    counter<&PumpStats::late_settlements>("late_settlements", "Merged settlements the index no longer held."),
    counter<&PumpStats::steps>("steps", "Pump step calls."),
    counter<&PumpStats::forgotten>("forgotten", "Keys dropped from the group because the index resolved them."),
    counter<&PumpStats::dropped_saves>("dropped_saves", "Save settlements the output could not hold; their sources stay pinned."),
};

inline constexpr std::string_view group_prefix = "kvfuse_group";
inline constexpr Field<GroupStats> group_fields[] = {  // + GroupStats::queues, written as RankQueueStats
    counter<&GroupStats::records>("records", "Records offered to the merger, loads and stores."),
    counter<&GroupStats::settled>("settled", "Load settlements produced."),
    counter<&GroupStats::save_settled>("save_settled", "Save settlements produced, one per phase."),
    counter<&GroupStats::late_reports>("late_reports", "Records for settled, unknown or reclaimed keys, dropped."),
    counter<&GroupStats::duplicate_reports>("duplicate_reports", "Second reports of a rank for a still-pending key."),
    counter<&GroupStats::invalid_reports>("invalid_reports", "Records with a rank out of range or from the wrong source."),
    counter<&GroupStats::dead_rank_reports>("dead_rank_reports", "Records from ranks dead for their key, dropped."),
    counter<&GroupStats::forgotten>("forgotten", "Pending load keys dropped because the index resolved them."),
    gauge<&GroupStats::pending>("pending", "Load keys heard from some rank but not yet all."),
    gauge<&GroupStats::pending_saves>("pending_saves", "Save keys heard from some rank but not yet settled in both phases."),
    gauge<&GroupStats::tombstones>("tombstones", "Settled keys held in the bounded tombstone FIFOs now."),
    gauge<&GroupStats::world_size>("world_size", "Ranks in the group."),
    gauge<&GroupStats::live_ranks>("live_ranks", "Ranks not marked dead."),
    age_seconds<&GroupStats::oldest_pending_since>("oldest_pending_age_seconds", "Age of the oldest pending load key; 0 when none."),
    age_seconds<&GroupStats::oldest_pending_save_since>("oldest_pending_save_age_seconds", "Age of the oldest pending save key; 0 when none."),
};

/// RankQueueStats goes out under one of two prefixes: a RankQueue's own (per rank), or a
/// group's sum over its ranks. Two families, so a sum never sits next to its parts.
inline constexpr std::string_view rank_queue_prefix = "kvfuse_rank_queue";
inline constexpr std::string_view group_queue_prefix = "kvfuse_group_queue";
inline constexpr Field<RankQueueStats> queue_fields[] = {
    counter<&RankQueueStats::drained>("drained", "Records handed to the consumer."),
    counter<&RankQueueStats::full_waits>("full_waits", "Emits that found their lane queue full and had to wait."),
    counter<&RankQueueStats::sleeps>("sleeps", "Sleeps taken inside full-queue waits."),
    counter_ns_as_seconds<&RankQueueStats::wait_ns>("wait_seconds", "Time producers spent waiting on full queues."),
    counter<&RankQueueStats::dropped_after_close>("dropped_after_close", "Records refused by a full queue after close."),
};

inline constexpr std::string_view connector_prefix = "kvfuse_connector";
inline constexpr Field<ConnectorStats> connector_fields[] = {
    gauge<&ConnectorStats::lanes>("lanes", "Lanes the connector runs."),
    gauge<&ConnectorStats::standing_staging_bytes>("staging_bytes", "Standing staging memory: every lane's buffer, the save lane's included."),
    counter<&ConnectorStats::loads>("loads", "Loads accepted."),
    counter<&ConnectorStats::saves>("saves", "KV and state saves accepted."),
    counter<&ConnectorStats::fence_fallbacks>("fence_fallbacks", "Steps whose save fence degraded to a device synchronize."),
    counter<&ConnectorStats::staging_fallbacks>("staging_fallbacks",
                                                "KV saves larger than the save lane's staging, gathered and put in batches."),
};

inline constexpr std::string_view save_fence_prefix = "kvfuse_save_fence";
inline constexpr Field<SaveFenceStats> save_fence_fields[] = {
    counter<&SaveFenceStats::steps>("steps", "begin_step calls."),
    counter<&SaveFenceStats::event_steps>("event_steps", "Steps fenced by the event."),
    counter<&SaveFenceStats::fallback_steps>("fallback_steps", "Steps that fell back to a device synchronize."),
    counter<&SaveFenceStats::create_failures>("create_failures", "Event creations that failed."),
    counter<&SaveFenceStats::record_failures>("record_failures", "Event records that failed."),
    counter<&SaveFenceStats::fences>("fences", "fence calls."),
    counter<&SaveFenceStats::wait_fallbacks>("wait_fallbacks", "fence calls whose device-side wait failed; the host waited."),
    counter<&SaveFenceStats::failed_fences>("failed_fences", "fence calls that could not order the copy."),
    counter<&SaveFenceStats::sync_failures>("sync_failures", "Fallback device synchronizes that failed."),
};

/// The tiers share the families they have in common, told apart by a `tier` label.
inline constexpr std::string_view tier_prefix = "kvfuse_tier";
inline constexpr Field<MemoryTierStats> memory_tier_fields[] = {
    gauge<&MemoryTierStats::entries>("entries", "Entries in the tier's catalogue."),
    gauge<&MemoryTierStats::bytes>("bytes", "Payload bytes in the tier's catalogue."),
    gauge<&MemoryTierStats::capacity>("capacity_bytes", "The tier's byte capacity (disk: 0 when it has none)."),
    gauge<&MemoryTierStats::retired_bytes>("retired_bytes", "Bytes unlinked from the catalogue but still pinned by live views."),
    counter<&MemoryTierStats::hits>("hits", "Gets that found their entry."),
    counter<&MemoryTierStats::misses>("misses", "Gets that found no entry."),
    counter<&MemoryTierStats::evictions>("evictions", "Entries evicted to make room."),
    counter<&MemoryTierStats::puts>("puts", "Successful puts."),
    counter<&MemoryTierStats::put_failures>("put_failures", "Puts that failed."),
};
inline constexpr Field<DiskTierStats> disk_tier_fields[] = {
    gauge<&DiskTierStats::entries>("entries", "Entries in the tier's catalogue."),
    gauge<&DiskTierStats::bytes>("bytes", "Payload bytes in the tier's catalogue."),
    gauge<&DiskTierStats::capacity>("capacity_bytes", "The tier's byte capacity (disk: 0 when it has none)."),
    counter<&DiskTierStats::hits>("hits", "Gets that found their entry."),
    counter<&DiskTierStats::misses>("misses", "Gets that found no entry."),
    counter<&DiskTierStats::get_failures>("get_failures", "Gets that failed (disk: too big for staging, I/O error or corrupt file; redis: I/O or server error, no connection)."),
    counter<&DiskTierStats::evictions>("evictions", "Entries evicted to make room."),
    counter<&DiskTierStats::quarantined>("quarantined", "Files moved to quarantine."),
    counter<&DiskTierStats::puts>("puts", "Successful puts."),
    counter<&DiskTierStats::put_failures>("put_failures", "Puts that failed."),
    counter<&DiskTierStats::io_errors>("io_errors", "Failed system calls."),
};

inline constexpr Field<RedisTierStats> redis_tier_fields[] = {
    counter<&RedisTierStats::hits>("hits", "Gets that found their entry."),
    counter<&RedisTierStats::misses>("misses", "Gets that found no entry."),
    counter<&RedisTierStats::rejected>("rejected", "Values that failed the entry check (foreign, truncated, corrupt): served as misses."),
    counter<&RedisTierStats::get_failures>("get_failures", "Gets that failed (disk: too big for staging, I/O error or corrupt file; redis: I/O or server error, no connection)."),
    counter<&RedisTierStats::timeouts>("timeouts", "Gets the server did not answer within the command timeout."),
    counter<&RedisTierStats::puts>("puts", "Successful puts."),
    counter<&RedisTierStats::put_failures>("put_failures", "Puts that failed."),
    counter<&RedisTierStats::round_trips>("round_trips", "Exchanges with the server: one per get, batched get, put, contains, erase or SCAN page."),
    counter<&RedisTierStats::connects>("connects", "Connections opened."),
    counter<&RedisTierStats::connect_failures>("connect_failures", "Connection attempts that were refused or failed."),
    counter<&RedisTierStats::connect_timeouts>("connect_timeouts", "Connection attempts the server did not answer in time (a stopped server)."),
    counter<&RedisTierStats::dropped_connections>("dropped_connections", "Connections closed after a failure or timeout, or retired as stale."),
};

inline constexpr Field<RedisClusterCounters> redis_cluster_fields[] = {
    counter<&RedisClusterCounters::moved>("moved", "MOVED replies: the slot map was patched and the key retried at the named node."),
    counter<&RedisClusterCounters::asks>("asks", "ASK replies: the key was retried with ASKING at the named node."),
    counter<&RedisClusterCounters::tryagain>("tryagain", "TRYAGAIN replies (a slot mid-migration): failed gets and puts."),
    counter<&RedisClusterCounters::clusterdown>("clusterdown", "CLUSTERDOWN replies and keys whose slot no primary served: failed."),
    counter<&RedisClusterCounters::redirect_failures>("redirect_failures", "Keys redirected again on their one retry: failed."),
    counter<&RedisClusterCounters::map_refreshes>("map_refreshes", "Slot maps learnt from CLUSTER SLOTS."),
    counter<&RedisClusterCounters::map_refresh_failures>("map_refresh_failures", "Slot map refreshes no node could answer."),
};

/// A cluster tier's per-primary families, labelled by `node`.
inline constexpr std::string_view tier_node_prefix = "kvfuse_tier_node";
inline constexpr Field<RedisClusterNodeStats> redis_cluster_node_fields[] = {
    counter<&RedisClusterNodeStats::requests>("requests", "Commands sent to the node, one per key."),
    counter<&RedisClusterNodeStats::round_trips>("round_trips", "Exchanges with the node: at most one per batch and round."),
    counter<&RedisClusterNodeStats::redirections>("redirections", "MOVED and ASK replies the node gave."),
    counter<&RedisClusterNodeStats::timeouts>("timeouts", "Exchanges or connection attempts the node did not answer in time."),
    counter<&RedisClusterNodeStats::failures>("failures", "Exchanges or connection attempts the node refused or lost, and its cluster error replies."),
};

inline constexpr std::string_view tiered_tier_prefix = "kvfuse_tiered_tier";
inline constexpr Field<TieredTierStats> tiered_tier_fields[] = {
    counter<&TieredTierStats::front_hits>("front_hits", "Gets the front tier served."),
    counter<&TieredTierStats::back_hits>("back_hits", "Gets the back tier served after the front missed or failed."),
    counter<&TieredTierStats::misses>("misses", "Gets neither tier could serve: a miss."),
    counter<&TieredTierStats::failures>("failures", "Gets that failed: the back failed, or the front failed and the back missed."),
    counter<&TieredTierStats::promotions>("promotions", "Back hits copied into the front."),
    counter<&TieredTierStats::promote_failures>("promote_failures", "Back hits whose copy the front refused."),
    counter<&TieredTierStats::put_failures>("put_failures", "Puts the back refused (put returned false)."),
    counter<&TieredTierStats::front_put_failures>("front_put_failures", "Puts the back stored and the front refused."),
};

inline constexpr std::string_view loopback_pd_prefix = "kvfuse_loopback_pd";
inline constexpr Field<LoopbackPd::Stats> loopback_pd_fields[] = {
    counter<&LoopbackPd::Stats::offered>("offered", "matched_tokens calls that offered tokens."),
    counter<&LoopbackPd::Stats::cancelled>("cancelled", "Offers withdrawn because another sub won."),
    counter<&LoopbackPd::Stats::transfers>("transfers", "Transfers started."),
    counter<&LoopbackPd::Stats::bytes>("bytes", "Bytes copied, all ranks."),
};

// ---- compile-time checks ------------------------------------------------------------

/// How many fields the aggregate S has: the most initializers `S{...}` accepts.
struct AnyField {
  template <class T>
  operator T() const;  // never defined: only named in unevaluated requires-expressions
};
template <class S, std::size_t... I>
consteval bool initializable_with(std::index_sequence<I...>) {
  return requires { S{((void)I, AnyField{})...}; };
}
template <class S, std::size_t N = 0>
consteval std::size_t field_count() {
  if constexpr (initializable_with<S>(std::make_index_sequence<N + 1>{}))
    return field_count<S, N + 1>();
  else
    return N;
}

consteval bool valid_part(std::string_view s) {
  if (s.empty() || s.front() == '_' || s.back() == '_') return false;
  for (const char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

template <class S, std::size_t N>
consteval bool valid_table(std::string_view prefix, const Field<S> (&fields)[N]) {
  if (!valid_part(prefix) || !prefix.starts_with("kvfuse_")) return false;
  for (std::size_t i = 0; i < N; ++i) {
    const Field<S>& f = fields[i];
    if (!valid_part(f.name) || f.name.ends_with("_total") || f.help.empty()) return false;
    for (std::size_t j = 0; j < i; ++j)
      if (fields[j].name == f.name) return false;
  }
  return true;
}

static_assert(valid_table(index_prefix, index_fields) && valid_table(coordinator_prefix, coordinator_fields) &&
              valid_table(pump_prefix, pump_fields) && valid_table(group_prefix, group_fields) &&
              valid_table(rank_queue_prefix, queue_fields) && valid_table(group_queue_prefix, queue_fields) &&
              valid_table(connector_prefix, connector_fields) && valid_table(save_fence_prefix, save_fence_fields) &&
              valid_table(tier_prefix, memory_tier_fields) && valid_table(tier_prefix, disk_tier_fields) &&
              valid_table(tier_prefix, redis_tier_fields) && valid_table(tier_prefix, redis_cluster_fields) &&
              valid_table(tier_node_prefix, redis_cluster_node_fields) &&
              valid_table(tiered_tier_prefix, tiered_tier_fields) && valid_table(loopback_pd_prefix, loopback_pd_fields),
              "a metric table has a bad prefix or name, a name spelled with _total, an empty help, or a repeated name");

// Every field has its line (the nested PumpStats::group and GroupStats::queues are written
// through their own tables).
static_assert(field_count<IndexStats>() == std::size(index_fields), "IndexStats: a field has no line in index_fields");
static_assert(field_count<CoordinatorStats>() == std::size(coordinator_fields), "CoordinatorStats: a field has no line");
static_assert(field_count<PumpStats>() == std::size(pump_fields) + 1, "PumpStats: a field has no line in pump_fields");
static_assert(field_count<GroupStats>() == std::size(group_fields) + 1, "GroupStats: a field has no line in group_fields");
static_assert(field_count<RankQueueStats>() == std::size(queue_fields), "RankQueueStats: a field has no line");
static_assert(field_count<ConnectorStats>() == std::size(connector_fields), "ConnectorStats: a field has no line");
static_assert(field_count<SaveFenceStats>() == std::size(save_fence_fields), "SaveFenceStats: a field has no line");
static_assert(field_count<MemoryTierStats>() == std::size(memory_tier_fields), "MemoryTierStats: a field has no line");
static_assert(field_count<DiskTierStats>() == std::size(disk_tier_fields), "DiskTierStats: a field has no line");
static_assert(field_count<RedisTierStats>() == std::size(redis_tier_fields), "RedisTierStats: a field has no line");
static_assert(field_count<RedisClusterCounters>() == std::size(redis_cluster_fields), "RedisClusterCounters: a field has no line");
static_assert(field_count<RedisClusterNodeStats>() == std::size(redis_cluster_node_fields) + 1,
              "RedisClusterNodeStats: a field has no line (its address is the node label)");
static_assert(field_count<RedisClusterTierStats>() == 3, "RedisClusterTierStats: totals, cluster and nodes, each a table");
static_assert(field_count<TieredTierStats>() == std::size(tiered_tier_fields), "TieredTierStats: a field has no line");
static_assert(field_count<LoopbackPd::Stats>() == std::size(loopback_pd_fields), "LoopbackPd::Stats: a field has no line");

/// One family as spelled by a table line: `<prefix>_<name>[_total]`.
struct Spelling {
  std::string_view prefix, name;
  MetricType type;
  std::string_view help;
  [[nodiscard]] constexpr std::size_t size() const noexcept {
    return prefix.size() + 1 + name.size() + (type == MetricType::counter ? 6 : 0);
  }
  [[nodiscard]] constexpr char at(std::size_t i) const noexcept {
    if (i < prefix.size()) return prefix[i];
    if (i == prefix.size()) return '_';
    i -= prefix.size() + 1;
    return i < name.size() ? name[i] : std::string_view("_total")[i - name.size()];
  }
  [[nodiscard]] constexpr bool same_name(const Spelling& o) const noexcept {
    if (size() != o.size()) return false;
    for (std::size_t i = 0; i < size(); ++i)
      if (at(i) != o.at(i)) return false;
    return true;
  }
};

template <class S, std::size_t N>
constexpr std::size_t spell(Spelling* out, std::string_view prefix, const Field<S> (&fields)[N]) {
  for (std::size_t i = 0; i < N; ++i) out[i] = Spelling{prefix, fields[i].name, fields[i].type, fields[i].help};
  return N;
}

/// Two tables may write one family (the tiers' shared families) only if they agree on its
/// type and help; any other collision of spellings is a mistake.
consteval bool families_agree() {
  Spelling all[std::size(index_fields) + std::size(coordinator_fields) + std::size(pump_fields) + std::size(group_fields) +
               2 * std::size(queue_fields) + std::size(connector_fields) + std::size(save_fence_fields) +
               std::size(memory_tier_fields) + std::size(disk_tier_fields) + std::size(redis_tier_fields) +
               std::size(redis_cluster_fields) + std::size(redis_cluster_node_fields) +
               std::size(tiered_tier_fields) +
               std::size(loopback_pd_fields)]{};
  std::size_t n = 0;
  n += spell(all + n, index_prefix, index_fields);
  n += spell(all + n, coordinator_prefix, coordinator_fields);
  n += spell(all + n, pump_prefix, pump_fields);
  n += spell(all + n, group_prefix, group_fields);
  n += spell(all + n, rank_queue_prefix, queue_fields);
  n += spell(all + n, group_queue_prefix, queue_fields);
  n += spell(all + n, connector_prefix, connector_fields);
  n += spell(all + n, save_fence_prefix, save_fence_fields);
  n += spell(all + n, tier_prefix, memory_tier_fields);
  n += spell(all + n, tier_prefix, disk_tier_fields);
  n += spell(all + n, tier_prefix, redis_tier_fields);
  n += spell(all + n, tier_prefix, redis_cluster_fields);
  n += spell(all + n, tier_node_prefix, redis_cluster_node_fields);
  n += spell(all + n, tiered_tier_prefix, tiered_tier_fields);
  n += spell(all + n, loopback_pd_prefix, loopback_pd_fields);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (all[i].same_name(all[j]) && (all[i].type != all[j].type || all[i].help != all[j].help)) return false;
  return true;
}
static_assert(families_agree(), "two metric tables spell one family with a different type or help");

}  // namespace detail::metrics
}  // namespace kvfuse
