// kvfuse/compose/prometheus.hpp — every kvfuse counter in the Prometheus text exposition
// format (version 0.0.4), for an engine's /metrics endpoint.
//
//   PrometheusText text({{"model", "k3"}});        // labels on every sample
//   text.add(coordinator.stats());
//   text.add(pump.stats());                         // the pump's, its group's and the summed queues'
//   for (std::uint32_t r = 0; r < ranks; ++r) {
//     const std::string rank = std::to_string(r);
//     text.add(connector[r].stats(), {{"rank", rank}});
//     text.add(memory_tier[r].stats(), {{"rank", rank}});   // adds tier="memory" itself
//   }
//   response.body = text.str();                     // Content-Type: PrometheusText::content_type
//
// Each add() writes one sample per field of the struct (the fields and their names, types
// and help texts are listed once, in compose/detail/metric_fields.hpp). Samples group by
// family, so a family's # HELP and # TYPE lines appear once, however many sources add to it;
// two sources are told apart by their labels. Families come out sorted by name, each
// family's samples in the order they were added.
//
// Not for hot paths: it allocates on every call. The caller reads each stats() on the
// thread that call names (index, coordinator and pump: the scheduler thread) and hands the
// copies here, on any thread.
#pragma once

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kvfuse/compose/detail/metric_fields.hpp>
#include <kvfuse/error.hpp>

namespace kvfuse {

/// One label of a sample, `name="value"`. The name must match [a-zA-Z_][a-zA-Z0-9_]* and
/// not start with "__" (reserved by Prometheus); the value is any bytes (UTF-8 expected),
/// escaped on output.
struct MetricLabel {
  std::string_view name;
  std::string_view value;
};

/// A borrowed list of labels, valid for the call it is passed to: a braced list
/// (`{{"rank", "3"}, {"leg", "kv"}}`), anything a `std::span<const MetricLabel>` can view
/// (an array, a vector), or nothing. Constexpr, noexcept; copies no strings.
class MetricLabels {
 public:
  /// No labels.
  constexpr MetricLabels() noexcept = default;
  /// The labels of a braced list; the list must outlive the call this is passed to.
  constexpr MetricLabels(std::initializer_list<MetricLabel> labels) noexcept : labels_(labels.begin(), labels.size()) {}
  /// The labels of an array, vector or span.
  template <class R>
    requires std::constructible_from<std::span<const MetricLabel>, const R&>
  constexpr MetricLabels(const R& labels) noexcept : labels_(labels) {}

  /// The labels, in the order given.
  [[nodiscard]] constexpr std::span<const MetricLabel> span() const noexcept { return labels_; }

 private:
  std::span<const MetricLabel> labels_;
};

/// Builds one Prometheus text exposition from any number of stats snapshots.
///
/// Families: `kvfuse_<source>_<field>`, counters (monotonic event counts) with `_total`,
/// gauges (current sizes and levels) without; bytes in bytes, times in seconds. Sources:
/// index, coordinator, pump, group, group_queue (a group's lane queues, summed over ranks),
/// rank_queue (one RankQueue), connector, save_fence, tier, loopback_pd.
///
/// Labels: the common labels given at construction go on every sample; each add() adds its
/// own, and the tier overloads add `tier="memory"`, `tier="disk"`, `tier="redis"` or `tier="redis-cluster"`. A sample's labels are
/// written sorted by name. One series (family plus label set) may be added once.
///
/// Thread-safety: none inside; one object per thread, any thread. Every member but the
/// counts allocates and may throw std::bad_alloc; add() and the constructor throw
/// kvfuse::Error as documented. Copyable and movable.
class PrometheusText {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  /// The HTTP Content-Type of str()'s text.
  static constexpr std::string_view content_type = "text/plain; version=0.0.4; charset=utf-8";

  /// An empty exposition. `common` labels go on every sample (the engine-wide ones, e.g.
  /// `{{"model", "k3"}}`); they are copied. `now` is the instant the group's "oldest
  /// pending" ages are measured at: the clock the pump's step(now) was given (steady_clock
  /// in an engine). Throws Error(invalid_argument) naming a bad or repeated label name.
  explicit PrometheusText(MetricLabels common = {}, TimePoint now = std::chrono::steady_clock::now()) : now_(now) {
    for (const MetricLabel& l : common.span()) common_.emplace_back(std::string(l.name), std::string(l.value));
    (void)render_labels({}, {});  // validates the names now, not at the first add
  }

  // Every add(): writes one sample per field of `stats`, labelled with the common labels,
  // `labels` and the source's own. Thread: this object's owner; allocates. Throws
  // Error(invalid_argument), having added nothing, for a label name that is not
  // [a-zA-Z_][a-zA-Z0-9_]* or starts with "__", a name given twice (common labels and the
  // tier's own included), or a series (family and label set) already added; the message
  // names the label or the series.

  /// OffloadIndex::stats(): families `kvfuse_index_*`. Owner thread; allocates.
  void add(const IndexStats& stats, MetricLabels labels = {}) {
    add_table(labels, {}, detail::metrics::index_prefix, detail::metrics::index_fields, stats);
  }
  /// Coordinator::stats(): families `kvfuse_coordinator_*`. Owner thread; allocates.
  void add(const CoordinatorStats& stats, MetricLabels labels = {}) {
    add_table(labels, {}, detail::metrics::coordinator_prefix, detail::metrics::coordinator_fields, stats);
  }
  /// SettlementPump::stats(): families `kvfuse_pump_*`, and its `group` as add(GroupStats)
  /// writes it. Add a pump's stats or its group's, not both under the same labels.
  /// Owner thread; allocates.
  void add(const PumpStats& stats, MetricLabels labels = {}) {
    Batch b{render_labels(labels, {}), {}};
    collect(b, detail::metrics::pump_prefix, detail::metrics::pump_fields, stats);
    collect_group(b, stats.group);
    commit(std::move(b));
  }
  /// A group's stats() (TpQuorum, SingleRank): families `kvfuse_group_*`, and its lane
  /// queues summed over ranks as `kvfuse_group_queue_*`. The oldest-pending time points
  /// become ages in seconds at the constructor's `now` (0 when nothing is pending). Owner
  /// thread; allocates.
  void add(const GroupStats& stats, MetricLabels labels = {}) {
    Batch b{render_labels(labels, {}), {}};
    collect_group(b, stats);
    commit(std::move(b));
  }
  /// One RankQueue::stats(): families `kvfuse_rank_queue_*`; `wait_ns` as
  /// `kvfuse_rank_queue_wait_seconds_total`. Label it, e.g. `{{"rank", "3"}}`.
  /// Owner thread; allocates.
  void add(const RankQueueStats& stats, MetricLabels labels = {}) {
    add_table(labels, {}, detail::metrics::rank_queue_prefix, detail::metrics::queue_fields, stats);
  }
  /// One rank's Connector::stats(): families `kvfuse_connector_*`. Label it by rank.
  /// Owner thread; allocates.
  void add(const ConnectorStats& stats, MetricLabels labels = {}) {
    add_table(labels, {}, detail::metrics::connector_prefix, detail::metrics::connector_fields, stats);
  }
  /// One SaveFence::stats(): families `kvfuse_save_fence_*`. Label it by rank.
  /// Owner thread; allocates.
  void add(const SaveFenceStats& stats, MetricLabels labels = {}) {
    add_table(labels, {}, detail::metrics::save_fence_prefix, detail::metrics::save_fence_fields, stats);
  }
  /// One MemoryTier::stats(): families `kvfuse_tier_*` with `tier="memory"` added (so
  /// `labels` may not name `tier`). Label it by rank, and by leg when a rank has two.
  /// Owner thread; allocates.
  void add(const MemoryTierStats& stats, MetricLabels labels = {}) {
    add_table(labels, {"tier", "memory"}, detail::metrics::tier_prefix, detail::metrics::memory_tier_fields, stats);
  }
  /// One DiskTier::stats(): families `kvfuse_tier_*` with `tier="disk"` added; the families
  /// both tiers have (entries, bytes, hits, misses, puts, put_failures) are shared.
  /// Owner thread; allocates.
  void add(const DiskTierStats& stats, MetricLabels labels = {}) {
    add_table(labels, {"tier", "disk"}, detail::metrics::tier_prefix, detail::metrics::disk_tier_fields, stats);
  }
  /// RedisTier::stats(): the `kvfuse_tier_*` families with `tier="redis"` (hits, misses,
  /// get_failures, puts and put_failures shared with the other tiers; rejected, timeouts,
  /// round_trips, connects, connect_failures, connect_timeouts and dropped_connections its own). Needs only
  /// <kvfuse/tier/redis_tier_stats.hpp>, not hiredis. Owner thread; allocates.
  void add(const RedisTierStats& stats, MetricLabels labels = {}) {
    add_table(labels, {"tier", "redis"}, detail::metrics::tier_prefix, detail::metrics::redis_tier_fields, stats);
  }

  /// RedisClusterTier::stats(): its totals in the `kvfuse_tier_*` families RedisTier writes,
  /// with `tier="redis-cluster"`; its cluster counters (`moved`, `asks`, `tryagain`,
  /// `clusterdown`, `redirect_failures`, `map_refreshes`, `map_refresh_failures`) as
  /// `kvfuse_tier_*` families of their own; and per primary, labelled `node="HOST:PORT"`,
  /// `kvfuse_tier_node_{requests,round_trips,redirections,timeouts,failures}_total`. Needs
  /// only <kvfuse/tier/redis_cluster_tier_stats.hpp>, not hiredis. `labels` may name
  /// neither `tier` nor `node`. All or nothing. Owner thread; allocates.
  void add(const RedisClusterTierStats& stats, MetricLabels labels = {}) {
    const MetricLabel tier{"tier", "redis-cluster"};
    std::vector<Batch> batches;
    batches.push_back(Batch{render_labels(labels, tier), {}});
    collect(batches.back(), detail::metrics::tier_prefix, detail::metrics::redis_tier_fields, stats.totals);
    collect(batches.back(), detail::metrics::tier_prefix, detail::metrics::redis_cluster_fields, stats.cluster);
    std::vector<MetricLabel> with_node(labels.span().begin(), labels.span().end());
    with_node.push_back(tier);
    for (const RedisClusterNodeStats& node : stats.nodes) {
      with_node.push_back({"node", node.address});
      batches.push_back(Batch{render_labels(with_node, {}), {}});
      collect(batches.back(), detail::metrics::tier_node_prefix, detail::metrics::redis_cluster_node_fields, node);
      with_node.pop_back();
    }
    commit(std::move(batches));
  }

  /// One TieredTier::stats(): families `kvfuse_tiered_tier_*` (add the front's and the
  /// back's own stats beside it). Owner thread; allocates.
  void add(const TieredTierStats& stats, MetricLabels labels = {}) {
    add_table(labels, {}, detail::metrics::tiered_tier_prefix, detail::metrics::tiered_tier_fields, stats);
  }
  /// LoopbackPd::stats(): families `kvfuse_loopback_pd_*`. Owner thread; allocates.
  void add(const LoopbackPd::Stats& stats, MetricLabels labels = {}) {
    add_table(labels, {}, detail::metrics::loopback_pd_prefix, detail::metrics::loopback_pd_fields, stats);
  }
  /// The exposition: per family, sorted by name, `# HELP`, `# TYPE`, then its samples
  /// (`name{labels} value`), every line ending in '\n'. Empty when nothing was added.
  /// Owner thread (const: any number of threads at once while none adds); allocates.
  [[nodiscard]] std::string str() const {
    std::string out;
    for (const auto& [name, family] : families_) {
      out += "# HELP ";
      out += name;
      out += ' ';
      append_escaped(out, family.help, false);
      out += "\n# TYPE ";
      out += name;
      out += ' ';
      out += to_string(family.type);
      out += '\n';
      for (const Sample& s : family.samples) {
        out += name;
        out += s.labels;
        out += ' ';
        out += s.value;
        out += '\n';
      }
    }
    return out;
  }

  /// Writes str() to `os` (a failed write sets the stream's state, as ostream::write does).
  /// Like str(): allocates.
  void write(std::ostream& os) const {
    const std::string text = str();
    os.write(text.data(), static_cast<std::streamsize>(text.size()));
  }

  /// Families with at least one sample. Like str()'s thread rule; noexcept, O(1).
  [[nodiscard]] std::size_t family_count() const noexcept { return families_.size(); }

  /// Samples in all families. Like str()'s thread rule; noexcept, O(families).
  [[nodiscard]] std::size_t sample_count() const noexcept {
    std::size_t n = 0;
    for (const auto& entry : families_) n += entry.second.samples.size();
    return n;
  }

 private:
  struct Sample {
    std::string labels;  // rendered: "" or {a="x",b="y"}
    std::string value;
  };
  struct Family {
    MetricType type;
    std::string_view help;  // a table's, static
    std::vector<Sample> samples;
  };
  struct Pending {
    std::string name;
    MetricType type;
    std::string_view help;
    std::string value;
  };
  struct Batch {
    std::string labels;
    std::vector<Pending> samples;
  };

  static constexpr bool valid_label_name(std::string_view n) noexcept {
    if (n.empty() || n.starts_with("__")) return false;
    for (std::size_t i = 0; i < n.size(); ++i) {
      const char c = n[i];
      const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
      if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
    }
    return true;
  }

  // Escapes per the exposition format: backslash and newline always, '"' in label values.
  static void append_escaped(std::string& out, std::string_view text, bool label_value) {
    for (const char c : text) {
      if (c == '\\') out += "\\\\";
      else if (c == '\n') out += "\\n";
      else if (c == '"' && label_value) out += "\\\"";
      else out += c;
    }
  }

  // The label set of one add(): common, given and the source's own, validated, sorted by
  // name and rendered once for all of its samples.
  std::string render_labels(MetricLabels given, MetricLabel own) const {
    std::vector<MetricLabel> all;
    all.reserve(common_.size() + given.span().size() + 1);
    for (const auto& [name, value] : common_) all.push_back({name, value});
    all.insert(all.end(), given.span().begin(), given.span().end());
    if (!own.name.empty()) all.push_back(own);
    for (const MetricLabel& l : all)
      if (!valid_label_name(l.name))
        throw Error(ErrorCode::invalid_argument,
                    "PrometheusText: label name \"" + std::string(l.name) + "\" is not [a-zA-Z_][a-zA-Z0-9_]* or starts with __");
    std::stable_sort(all.begin(), all.end(), [](const MetricLabel& a, const MetricLabel& b) { return a.name < b.name; });
    std::string out;
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (i > 0 && all[i].name == all[i - 1].name)
        throw Error(ErrorCode::invalid_argument, "PrometheusText: label \"" + std::string(all[i].name) +
                                                     "\" given twice (common labels and the tier's own count)");
      out += i == 0 ? "{" : ",";
      out += all[i].name;
      out += "=\"";
      append_escaped(out, all[i].value, true);
      out += '"';
    }
    if (!all.empty()) out += '}';
    return out;
  }

  static std::string format(const detail::metrics::Value& v) {
    char buf[64];
    if (!v.integral && !std::isfinite(v.real)) return std::isnan(v.real) ? "NaN" : v.real > 0 ? "+Inf" : "-Inf";
    const std::to_chars_result r = v.integral ? std::to_chars(buf, buf + sizeof buf, v.count) : std::to_chars(buf, buf + sizeof buf, v.real);
    return std::string(buf, r.ptr);
  }

  /// One stats struct written through one table: the body of most add() overloads.
  template <class S, std::size_t N>
  void add_table(MetricLabels labels, MetricLabel own, std::string_view prefix, const detail::metrics::Field<S> (&fields)[N],
                 const S& stats) {
    Batch b{render_labels(labels, own), {}};
    collect(b, prefix, fields, stats);
    commit(std::move(b));
  }

  template <class S, std::size_t N>
  void collect(Batch& b, std::string_view prefix, const detail::metrics::Field<S> (&fields)[N], const S& stats) const {
    for (const detail::metrics::Field<S>& f : fields) {
      std::string name;
      name.reserve(prefix.size() + f.name.size() + 7);
      name += prefix;
      name += '_';
      name += f.name;
      if (f.type == MetricType::counter) name += "_total";
      b.samples.push_back(Pending{std::move(name), f.type, f.help, format(f.read(stats, now_))});
    }
  }

  void collect_group(Batch& b, const GroupStats& stats) const {
    collect(b, detail::metrics::group_prefix, detail::metrics::group_fields, stats);
    collect(b, detail::metrics::group_queue_prefix, detail::metrics::queue_fields, stats.queues);
  }

  // All or nothing for a repeated series; then appends every sample.
  void commit(Batch&& b) {
    check_new(b);
    append(std::move(b));
  }
  // The same for several label sets at once (a cluster tier's total and its nodes): all
  // checked before any is added.
  void commit(std::vector<Batch>&& batches) {
    for (const Batch& b : batches) check_new(b);
    for (Batch& b : batches) append(std::move(b));
  }
  void check_new(const Batch& b) const {
    for (const Pending& p : b.samples) {
      const auto it = families_.find(p.name);
      if (it == families_.end()) continue;
      for (const Sample& s : it->second.samples)
        if (s.labels == b.labels)
          throw Error(ErrorCode::invalid_argument, "PrometheusText: series " + p.name + b.labels + " was already added");
    }
  }
  void append(Batch&& b) {
    for (Pending& p : b.samples) {
      Family& family = families_.try_emplace(std::move(p.name), Family{p.type, p.help, {}}).first->second;
      family.samples.push_back(Sample{b.labels, std::move(p.value)});
    }
  }

  TimePoint now_;
  std::vector<std::pair<std::string, std::string>> common_;
  std::map<std::string, Family, std::less<>> families_;
};

}  // namespace kvfuse
