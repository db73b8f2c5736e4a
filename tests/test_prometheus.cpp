// PrometheusText: every stats field comes out under its kvfuse_ name with its exact value,
// and the text is valid exposition format. The checks parse the text back with a small
// parser of the format's line grammar (below) rather than comparing strings, so they hold
// for any valid spelling of the same exposition.
#include <doctest/doctest.h>

#include <kvfuse/kvfuse.hpp>

#include <charconv>
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

using namespace kvfuse;

namespace {

// ---- a parser of the text exposition format, version 0.0.4 ----------------------------
//
//   line     = help | type | comment | sample, each ending in '\n'
//   help     = "# HELP " name " " escaped-text        (escapes: \\ and \n)
//   type     = "# TYPE " name " " ("counter" | "gauge" | "histogram" | "summary" | "untyped")
//   sample   = name [ "{" label { "," label } [","] "}" ] " " value
//   label    = label-name "=" '"' escaped-value '"'  (escapes: \\ \" and \n)
//
// Besides the grammar it checks what a scraper relies on: one HELP and one TYPE per family,
// both before the family's first sample; a family's lines in one group; a label name once
// per sample. Every breach goes to `errors`.

using Labels = std::map<std::string, std::string>;

struct ParsedSample {
  Labels labels;
  std::string value;
};

struct ParsedFamily {
  int helps = 0;
  int types = 0;
  std::string help;
  std::string type;
  std::vector<ParsedSample> samples;
};

struct Parsed {
  std::map<std::string, ParsedFamily> families;
  std::vector<std::string> errors;
};

bool is_metric_name(std::string_view n) {
  if (n.empty()) return false;
  for (std::size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool first = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!first && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool is_label_name(std::string_view n) {
  if (n.empty()) return false;
  for (std::size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool first = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!first && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

/// Reads an escaped string up to `end` (not consumed); false on a bad escape or no end.
bool unescape(std::string_view& in, char end, bool quotes, std::string& out) {
  while (!in.empty() && in.front() != end) {
    if (in.front() == '\\') {
      if (in.size() < 2) return false;
      const char e = in[1];
      if (e == '\\') out += '\\';
      else if (e == 'n') out += '\n';
      else if (e == '"' && quotes) out += '"';
      else return false;
      in.remove_prefix(2);
    } else {
      if (quotes && in.front() == '\n') return false;
      out += in.front();
      in.remove_prefix(1);
    }
  }
  return end == '\0' || !in.empty();
}

std::string_view take_name(std::string_view& in) {
  std::size_t n = 0;
  while (n < in.size() && in[n] != ' ' && in[n] != '{' && in[n] != '=') ++n;
  const std::string_view name = in.substr(0, n);
  in.remove_prefix(n);
  return name;
}

Parsed parse(std::string_view text) {
  Parsed p;
  if (!text.empty() && text.back() != '\n') p.errors.push_back("the text does not end in a newline");
  std::set<std::string> closed;  // families whose group of lines has ended
  std::string current;
  auto enter = [&](const std::string& name, std::size_t line) {
    if (name == current) return;
    if (closed.contains(name)) p.errors.push_back("line " + std::to_string(line) + ": family " + name + " is split");
    if (!current.empty()) closed.insert(current);
    current = name;
  };
  std::size_t line_no = 0;
  while (!text.empty()) {
    const std::size_t eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    text.remove_prefix(eol == std::string_view::npos ? text.size() : eol + 1);
    ++line_no;
    const std::string where = "line " + std::to_string(line_no) + ": ";
    if (line.starts_with("# HELP ") || line.starts_with("# TYPE ")) {
      const bool help = line.starts_with("# HELP ");
      line.remove_prefix(7);
      const std::string name(take_name(line));
      if (!is_metric_name(name) || !line.starts_with(' ')) {
        p.errors.push_back(where + "bad HELP or TYPE line");
        continue;
      }
      line.remove_prefix(1);
      enter(name, line_no);
      ParsedFamily& f = p.families[name];
      if (!f.samples.empty()) p.errors.push_back(where + name + ": HELP or TYPE after its samples");
      if (help) {
        ++f.helps;
        f.help.clear();
        if (!unescape(line, '\0', false, f.help)) p.errors.push_back(where + "bad escape in HELP");
      } else {
        ++f.types;
        f.type = std::string(line);
        static const std::set<std::string> types{"counter", "gauge", "histogram", "summary", "untyped"};
        if (!types.contains(f.type)) p.errors.push_back(where + "unknown type " + f.type);
      }
      continue;
    }
    if (line.starts_with('#')) continue;  // a plain comment
    if (line.empty()) {
      p.errors.push_back(where + "empty line");
      continue;
    }
    const std::string name(take_name(line));
    if (!is_metric_name(name)) {
      p.errors.push_back(where + "bad metric name " + name);
      continue;
    }
    ParsedSample s;
    bool ok = true;
    if (line.starts_with('{')) {
      line.remove_prefix(1);
      while (ok && !line.starts_with('}')) {
        const std::string label(take_name(line));
        std::string value;
        ok = is_label_name(label) && line.starts_with("=\"");
        if (ok) {
          line.remove_prefix(2);
          ok = unescape(line, '"', true, value) && line.starts_with('"');
        }
        if (ok) {
          line.remove_prefix(1);
          if (!s.labels.emplace(label, value).second) p.errors.push_back(where + "label " + label + " twice");
          if (line.starts_with(',')) line.remove_prefix(1);
          else ok = line.starts_with('}');
        }
      }
      if (ok) line.remove_prefix(1);
    }
    if (!ok || !line.starts_with(' ') || line.size() < 2 || line.substr(1).find(' ') != std::string_view::npos) {
      p.errors.push_back(where + "bad sample line");
      continue;
    }
    s.value = std::string(line.substr(1));
    enter(name, line_no);
    ParsedFamily& f = p.families[name];
    if (f.helps != 1 || f.types != 1) p.errors.push_back(where + name + ": a sample before its HELP and TYPE");
    f.samples.push_back(std::move(s));
  }
  return p;
}

/// Our own names: kvfuse_[a-z0-9_]+.
bool is_kvfuse_name(std::string_view n) {
  if (!n.starts_with("kvfuse_") || n.size() == 7) return false;
  for (const char c : n.substr(7))
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

std::uint64_t as_u64(const std::string& v) {
  std::uint64_t x = 0;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  REQUIRE_MESSAGE((r.ec == std::errc{} && r.ptr == v.data() + v.size()), "not an unsigned integer: " << v);
  return x;
}

double as_double(const std::string& v) {
  double x = 0;
  const auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  REQUIRE_MESSAGE((r.ec == std::errc{} && r.ptr == v.data() + v.size()), "not a number: " << v);
  return x;
}

const ParsedSample* find_sample(const Parsed& p, const std::string& family, const Labels& labels) {
  const auto it = p.families.find(family);
  if (it == p.families.end()) return nullptr;
  for (const ParsedSample& s : it->second.samples)
    if (s.labels == labels) return &s;
  return nullptr;
}

// ---- every stats struct, filled with distinct values -----------------------------------

using Clock = std::chrono::steady_clock;
const Clock::time_point kNow = Clock::time_point{} + std::chrono::hours(1);
constexpr std::uint64_t kHuge = std::numeric_limits<std::uint64_t>::max() - 7;  // not exact as a double
constexpr std::uint64_t kWaitNs = 1'234'567'891;

struct Expected {
  std::string family;
  std::string tier;  // "" for none: the sample's labels are model, plus rank for per-rank sources, plus tier
  bool per_rank;
  std::variant<std::uint64_t, double> value;
};

IndexStats index_stats() {
  IndexStats s;
  s.issued = kHuge;
  s.in_flight = 1002;
  s.completed = 1003;
  s.failed = 1004;
  s.abandoned = 1005;
  s.reclaimed = 1006;
  s.outstanding = 1007;
  s.orphaned = 1008;
  s.late_reports = 1009;
  s.refused = 1010;
  s.indexed = 1011;
  s.hashes_evicted = 1012;
  s.hashes_retracted = 1013;
  s.slots_freed = 1015;
  s.slot_free_errors = 1016;
  s.invariant_violations = 1017;
  s.overdue = 1018;
  s.saves_issued = 1019;
  s.saves_released = 1020;
  s.saves_stored = 1021;
  s.saves_failed = 1022;
  s.saves_abandoned = 1023;
  s.saves_outstanding = 1024;
  s.saves_refused = 1025;
  return s;
}

CoordinatorStats coordinator_stats() {
  CoordinatorStats s;
  s.admitted = 2001;
  s.parked = 2002;
  s.computed = 2003;
  s.unparked = 2004;
  s.unparked_with_tokens = 2005;
  s.transport_drops = 2006;
  s.torn_down = 2007;
  s.freed = 2008;
  s.saves_submitted = 2009;
  s.saves_skipped = 2010;
  s.waiting_now = 2011;
  s.holding_now = 2012;
  s.overdue = 2013;
  s.sources_pinned = 2014;
  s.state_legs_waived = 2015;
  s.invariant_violations = 2016;
  s.checkpoints_planned = 2017;
  s.checkpoints_saved = 2018;
  s.checkpoints_deduplicated = 2019;
  s.progress_saves = 2020;
  s.snapshots_returned = 2021;
  s.snapshots_held = 2022;
  s.finish_without_admission = 2023;
  s.salvaged_loads = 2024;
  s.salvaged_tokens = 2025;
  s.second_loads = 2026;
  s.slower_than_recompute = 2027;
  s.loads_timed = 2028;
  return s;
}

PumpStats pump_stats() {
  PumpStats s;
  s.late_reports = 3001;
  s.late_settlements = 3002;
  s.steps = 3003;
  s.forgotten = 3004;
  s.dropped_saves = 3005;
  GroupStats& g = s.group;
  g.records = 4001;
  g.settled = 4002;
  g.save_settled = 4003;
  g.late_reports = 4004;
  g.duplicate_reports = 4005;
  g.invalid_reports = 4006;
  g.dead_rank_reports = 4007;
  g.forgotten = 4008;
  g.pending = 4009;
  g.pending_saves = 4010;
  g.tombstones = 4011;
  g.world_size = 4012;
  g.live_ranks = 4013;
  g.oldest_pending_since = kNow - std::chrono::milliseconds(2500);
  g.oldest_pending_save_since = kNow - std::chrono::microseconds(125);
  g.queues.drained = 5001;
  g.queues.full_waits = 5002;
  g.queues.sleeps = 5003;
  g.queues.wait_ns = 5'000'000'004;
  g.queues.dropped_after_close = 5005;
  return s;
}

RankQueueStats rank_queue_stats() { return RankQueueStats{6001, 6002, 6003, kWaitNs, 6005}; }

ConnectorStats connector_stats() {
  ConnectorStats s;
  s.lanes = 7001;
  s.standing_staging_bytes = 7002;
  s.loads = 7003;
  s.saves = 7004;
  s.fence_fallbacks = 7005;
  s.staging_fallbacks = 7006;
  return s;
}

SaveFenceStats save_fence_stats() {
  SaveFenceStats s;
  s.steps = 8001;
  s.event_steps = 8002;
  s.fallback_steps = 8003;
  s.create_failures = 8004;
  s.record_failures = 8005;
  s.fences = 8006;
  s.wait_fallbacks = 8007;
  s.failed_fences = 8008;
  s.sync_failures = 8009;
  return s;
}

MemoryTierStats memory_tier_stats() {
  MemoryTierStats s;
  s.entries = 9001;
  s.bytes = 9002;
  s.capacity = 9003;
  s.retired_bytes = 9004;
  s.hits = 9005;
  s.misses = 9006;
  s.evictions = 9007;
  s.puts = 9008;
  s.put_failures = 9009;
  return s;
}

DiskTierStats disk_tier_stats() {
  DiskTierStats s;
  s.entries = 10001;
  s.bytes = 10002;
  s.hits = 10003;
  s.misses = 10004;
  s.get_failures = 10005;
  s.quarantined = 10006;
  s.puts = 10007;
  s.put_failures = 10008;
  s.io_errors = 10009;
  s.capacity = 10010;
  s.evictions = 10011;
  return s;
}

RedisTierStats redis_tier_stats() {
  return RedisTierStats{13001, 13002, 13003, 13004, 13005, 13006, 13007, 13008, 13009, 13010, 13011, 13012};
}

LoopbackPd::Stats loopback_pd_stats() { return LoopbackPd::Stats{11001, 11002, 11003, 11004}; }
TieredTierStats tiered_tier_stats() { return TieredTierStats{12001, 12002, 12003, 12004, 12005, 12006, 12007, 12008}; }

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

/// Every sample the full exposition must hold: written here by hand, independently of the
/// library's tables.
std::vector<Expected> expected_samples() {
  using std::uint64_t;
  return {
      {"kvfuse_index_issued_total", "", false, kHuge},
      {"kvfuse_index_in_flight", "", false, uint64_t{1002}},
      {"kvfuse_index_completed_total", "", false, uint64_t{1003}},
      {"kvfuse_index_failed_total", "", false, uint64_t{1004}},
      {"kvfuse_index_abandoned_total", "", false, uint64_t{1005}},
      {"kvfuse_index_reclaimed_total", "", false, uint64_t{1006}},
      {"kvfuse_index_outstanding", "", false, uint64_t{1007}},
      {"kvfuse_index_orphaned", "", false, uint64_t{1008}},
      {"kvfuse_index_late_reports_total", "", false, uint64_t{1009}},
      {"kvfuse_index_refused_total", "", false, uint64_t{1010}},
      {"kvfuse_index_indexed_hashes", "", false, uint64_t{1011}},
      {"kvfuse_index_hashes_evicted_total", "", false, uint64_t{1012}},
      {"kvfuse_index_hashes_retracted_total", "", false, uint64_t{1013}},
      {"kvfuse_index_slots_freed_total", "", false, uint64_t{1015}},
      {"kvfuse_index_slot_free_errors_total", "", false, uint64_t{1016}},
      {"kvfuse_index_invariant_violations_total", "", false, uint64_t{1017}},
      {"kvfuse_index_overdue", "", false, uint64_t{1018}},
      {"kvfuse_index_saves_issued_total", "", false, uint64_t{1019}},
      {"kvfuse_index_saves_released_total", "", false, uint64_t{1020}},
      {"kvfuse_index_saves_stored_total", "", false, uint64_t{1021}},
      {"kvfuse_index_saves_failed_total", "", false, uint64_t{1022}},
      {"kvfuse_index_saves_abandoned_total", "", false, uint64_t{1023}},
      {"kvfuse_index_saves_outstanding", "", false, uint64_t{1024}},
      {"kvfuse_index_saves_refused_total", "", false, uint64_t{1025}},

      {"kvfuse_coordinator_admitted_total", "", false, uint64_t{2001}},
      {"kvfuse_coordinator_parked_total", "", false, uint64_t{2002}},
      {"kvfuse_coordinator_computed_total", "", false, uint64_t{2003}},
      {"kvfuse_coordinator_unparked_total", "", false, uint64_t{2004}},
      {"kvfuse_coordinator_unparked_with_tokens_total", "", false, uint64_t{2005}},
      {"kvfuse_coordinator_transport_drops_total", "", false, uint64_t{2006}},
      {"kvfuse_coordinator_torn_down_total", "", false, uint64_t{2007}},
      {"kvfuse_coordinator_freed_total", "", false, uint64_t{2008}},
      {"kvfuse_coordinator_saves_submitted_total", "", false, uint64_t{2009}},
      {"kvfuse_coordinator_saves_skipped_total", "", false, uint64_t{2010}},
      {"kvfuse_coordinator_waiting", "", false, uint64_t{2011}},
      {"kvfuse_coordinator_holding", "", false, uint64_t{2012}},
      {"kvfuse_coordinator_overdue", "", false, uint64_t{2013}},
      {"kvfuse_coordinator_sources_pinned_total", "", false, uint64_t{2014}},
      {"kvfuse_coordinator_state_legs_waived_total", "", false, uint64_t{2015}},
      {"kvfuse_coordinator_invariant_violations_total", "", false, uint64_t{2016}},
      {"kvfuse_coordinator_checkpoints_planned_total", "", false, uint64_t{2017}},
      {"kvfuse_coordinator_checkpoints_saved_total", "", false, uint64_t{2018}},
      {"kvfuse_coordinator_checkpoints_deduplicated_total", "", false, uint64_t{2019}},
      {"kvfuse_coordinator_progress_saves_total", "", false, uint64_t{2020}},
      {"kvfuse_coordinator_snapshots_returned_total", "", false, uint64_t{2021}},
      {"kvfuse_coordinator_snapshots_held", "", false, uint64_t{2022}},
      {"kvfuse_coordinator_finish_without_admission_total", "", false, uint64_t{2023}},
      {"kvfuse_coordinator_salvaged_loads_total", "", false, uint64_t{2024}},
      {"kvfuse_coordinator_salvaged_tokens_total", "", false, uint64_t{2025}},
      {"kvfuse_coordinator_second_loads_total", "", false, uint64_t{2026}},
      {"kvfuse_coordinator_slower_than_recompute_total", "", false, uint64_t{2027}},
      {"kvfuse_coordinator_loads_timed_total", "", false, uint64_t{2028}},

      {"kvfuse_pump_late_reports_total", "", false, uint64_t{3001}},
      {"kvfuse_pump_late_settlements_total", "", false, uint64_t{3002}},
      {"kvfuse_pump_steps_total", "", false, uint64_t{3003}},
      {"kvfuse_pump_forgotten_total", "", false, uint64_t{3004}},
      {"kvfuse_pump_dropped_saves_total", "", false, uint64_t{3005}},

      {"kvfuse_group_records_total", "", false, uint64_t{4001}},
      {"kvfuse_group_settled_total", "", false, uint64_t{4002}},
      {"kvfuse_group_save_settled_total", "", false, uint64_t{4003}},
      {"kvfuse_group_late_reports_total", "", false, uint64_t{4004}},
      {"kvfuse_group_duplicate_reports_total", "", false, uint64_t{4005}},
      {"kvfuse_group_invalid_reports_total", "", false, uint64_t{4006}},
      {"kvfuse_group_dead_rank_reports_total", "", false, uint64_t{4007}},
      {"kvfuse_group_forgotten_total", "", false, uint64_t{4008}},
      {"kvfuse_group_pending", "", false, uint64_t{4009}},
      {"kvfuse_group_pending_saves", "", false, uint64_t{4010}},
      {"kvfuse_group_tombstones", "", false, uint64_t{4011}},
      {"kvfuse_group_world_size", "", false, uint64_t{4012}},
      {"kvfuse_group_live_ranks", "", false, uint64_t{4013}},
      {"kvfuse_group_oldest_pending_age_seconds", "", false, 2.5},
      {"kvfuse_group_oldest_pending_save_age_seconds", "", false, seconds(std::chrono::microseconds(125))},
      {"kvfuse_group_queue_drained_total", "", false, uint64_t{5001}},
      {"kvfuse_group_queue_full_waits_total", "", false, uint64_t{5002}},
      {"kvfuse_group_queue_sleeps_total", "", false, uint64_t{5003}},
      {"kvfuse_group_queue_wait_seconds_total", "", false, 5.000000004},
      {"kvfuse_group_queue_dropped_after_close_total", "", false, uint64_t{5005}},

      {"kvfuse_rank_queue_drained_total", "", true, uint64_t{6001}},
      {"kvfuse_rank_queue_full_waits_total", "", true, uint64_t{6002}},
      {"kvfuse_rank_queue_sleeps_total", "", true, uint64_t{6003}},
      {"kvfuse_rank_queue_wait_seconds_total", "", true, static_cast<double>(kWaitNs) / 1e9},
      {"kvfuse_rank_queue_dropped_after_close_total", "", true, uint64_t{6005}},

      {"kvfuse_connector_lanes", "", true, uint64_t{7001}},
      {"kvfuse_connector_staging_bytes", "", true, uint64_t{7002}},
      {"kvfuse_connector_loads_total", "", true, uint64_t{7003}},
      {"kvfuse_connector_saves_total", "", true, uint64_t{7004}},
      {"kvfuse_connector_fence_fallbacks_total", "", true, uint64_t{7005}},
      {"kvfuse_connector_staging_fallbacks_total", "", true, uint64_t{7006}},

      {"kvfuse_save_fence_steps_total", "", true, uint64_t{8001}},
      {"kvfuse_save_fence_event_steps_total", "", true, uint64_t{8002}},
      {"kvfuse_save_fence_fallback_steps_total", "", true, uint64_t{8003}},
      {"kvfuse_save_fence_create_failures_total", "", true, uint64_t{8004}},
      {"kvfuse_save_fence_record_failures_total", "", true, uint64_t{8005}},
      {"kvfuse_save_fence_fences_total", "", true, uint64_t{8006}},
      {"kvfuse_save_fence_wait_fallbacks_total", "", true, uint64_t{8007}},
      {"kvfuse_save_fence_failed_fences_total", "", true, uint64_t{8008}},
      {"kvfuse_save_fence_sync_failures_total", "", true, uint64_t{8009}},

      {"kvfuse_tier_entries", "memory", true, uint64_t{9001}},
      {"kvfuse_tier_bytes", "memory", true, uint64_t{9002}},
      {"kvfuse_tier_capacity_bytes", "memory", true, uint64_t{9003}},
      {"kvfuse_tier_retired_bytes", "memory", true, uint64_t{9004}},
      {"kvfuse_tier_hits_total", "memory", true, uint64_t{9005}},
      {"kvfuse_tier_misses_total", "memory", true, uint64_t{9006}},
      {"kvfuse_tier_evictions_total", "memory", true, uint64_t{9007}},
      {"kvfuse_tier_puts_total", "memory", true, uint64_t{9008}},
      {"kvfuse_tier_put_failures_total", "memory", true, uint64_t{9009}},

      {"kvfuse_tier_entries", "disk", true, uint64_t{10001}},
      {"kvfuse_tier_bytes", "disk", true, uint64_t{10002}},
      {"kvfuse_tier_hits_total", "disk", true, uint64_t{10003}},
      {"kvfuse_tier_misses_total", "disk", true, uint64_t{10004}},
      {"kvfuse_tier_get_failures_total", "disk", true, uint64_t{10005}},
      {"kvfuse_tier_quarantined_total", "disk", true, uint64_t{10006}},
      {"kvfuse_tier_puts_total", "disk", true, uint64_t{10007}},
      {"kvfuse_tier_put_failures_total", "disk", true, uint64_t{10008}},
      {"kvfuse_tier_io_errors_total", "disk", true, uint64_t{10009}},
      {"kvfuse_tier_capacity_bytes", "disk", true, uint64_t{10010}},
      {"kvfuse_tier_evictions_total", "disk", true, uint64_t{10011}},

      {"kvfuse_tier_hits_total", "redis", true, uint64_t{13001}},
      {"kvfuse_tier_misses_total", "redis", true, uint64_t{13002}},
      {"kvfuse_tier_rejected_total", "redis", true, uint64_t{13003}},
      {"kvfuse_tier_get_failures_total", "redis", true, uint64_t{13004}},
      {"kvfuse_tier_timeouts_total", "redis", true, uint64_t{13005}},
      {"kvfuse_tier_puts_total", "redis", true, uint64_t{13006}},
      {"kvfuse_tier_put_failures_total", "redis", true, uint64_t{13007}},
      {"kvfuse_tier_round_trips_total", "redis", true, uint64_t{13008}},
      {"kvfuse_tier_connects_total", "redis", true, uint64_t{13009}},
      {"kvfuse_tier_connect_failures_total", "redis", true, uint64_t{13010}},
      {"kvfuse_tier_connect_timeouts_total", "redis", true, uint64_t{13011}},
      {"kvfuse_tier_dropped_connections_total", "redis", true, uint64_t{13012}},

      {"kvfuse_loopback_pd_offered_total", "", false, uint64_t{11001}},
      {"kvfuse_loopback_pd_cancelled_total", "", false, uint64_t{11002}},
      {"kvfuse_loopback_pd_transfers_total", "", false, uint64_t{11003}},
      {"kvfuse_loopback_pd_bytes_total", "", false, uint64_t{11004}},

      {"kvfuse_tiered_tier_front_hits_total", "", true, uint64_t{12001}},
      {"kvfuse_tiered_tier_back_hits_total", "", true, uint64_t{12002}},
      {"kvfuse_tiered_tier_misses_total", "", true, uint64_t{12003}},
      {"kvfuse_tiered_tier_failures_total", "", true, uint64_t{12004}},
      {"kvfuse_tiered_tier_promotions_total", "", true, uint64_t{12005}},
      {"kvfuse_tiered_tier_promote_failures_total", "", true, uint64_t{12006}},
      {"kvfuse_tiered_tier_put_failures_total", "", true, uint64_t{12007}},
      {"kvfuse_tiered_tier_front_put_failures_total", "", true, uint64_t{12008}},
  };
}

/// The whole exposition: engine-wide sources unlabelled, per-rank ones with rank="3", all
/// with the engine-wide model="k3".
PrometheusText full_exposition() {
  PrometheusText text({{"model", "k3"}}, kNow);
  text.add(index_stats());
  text.add(coordinator_stats());
  text.add(pump_stats());
  text.add(rank_queue_stats(), {{"rank", "3"}});
  text.add(connector_stats(), {{"rank", "3"}});
  text.add(save_fence_stats(), {{"rank", "3"}});
  text.add(memory_tier_stats(), {{"rank", "3"}});
  text.add(disk_tier_stats(), {{"rank", "3"}});
  text.add(redis_tier_stats(), {{"rank", "3"}});
  text.add(tiered_tier_stats(), {{"rank", "3"}});
  text.add(loopback_pd_stats());
  return text;
}

}  // namespace

TEST_CASE("prometheus: every field of every stats struct comes back exactly under its kvfuse_ name") {
  const PrometheusText text = full_exposition();
  const std::string out = text.str();
  const Parsed parsed = parse(out);
  for (const std::string& e : parsed.errors) FAIL_CHECK(e);

  const std::vector<Expected> expected = expected_samples();
  std::set<std::string> expected_families;
  for (const Expected& e : expected) expected_families.insert(e.family);
  CHECK(expected_families.size() == 128);
  CHECK(parsed.families.size() == expected_families.size());
  CHECK(text.family_count() == expected_families.size());
  CHECK(text.sample_count() == expected.size());

  std::size_t parsed_samples = 0;
  for (const auto& [name, family] : parsed.families) parsed_samples += family.samples.size();
  CHECK(parsed_samples == expected.size());

  for (const Expected& e : expected) {
    Labels labels{{"model", "k3"}};
    if (e.per_rank) labels["rank"] = "3";
    if (!e.tier.empty()) labels["tier"] = e.tier;
    const ParsedSample* s = find_sample(parsed, e.family, labels);
    INFO(e.family, " tier=", e.tier);
    REQUIRE(s != nullptr);
    if (const auto* u = std::get_if<std::uint64_t>(&e.value)) {
      CHECK(as_u64(s->value) == *u);
    } else {
      CHECK(as_double(s->value) == std::get<double>(e.value));
    }
  }
}

TEST_CASE("prometheus: each family has one HELP and one TYPE before its samples and counters end in _total") {
  const Parsed parsed = parse(full_exposition().str());
  for (const std::string& e : parsed.errors) FAIL_CHECK(e);
  for (const auto& entry : parsed.families) {
    const std::string& name = entry.first;  // not a structured binding: INFO captures it
    const ParsedFamily& family = entry.second;
    INFO(name);
    CHECK(is_kvfuse_name(name));
    CHECK(family.helps == 1);
    CHECK(family.types == 1);
    CHECK_FALSE(family.help.empty());
    CHECK(!family.samples.empty());
    CHECK((family.type == "counter" || family.type == "gauge"));
    CHECK((family.type == "counter") == name.ends_with("_total"));
  }
  const std::map<std::string, std::string> types{
      {"kvfuse_index_issued_total", "counter"},       {"kvfuse_index_in_flight", "gauge"},
      {"kvfuse_index_indexed_hashes", "gauge"},           {"kvfuse_index_saves_outstanding", "gauge"},
      {"kvfuse_coordinator_waiting", "gauge"},            {"kvfuse_coordinator_admitted_total", "counter"},
      {"kvfuse_group_pending", "gauge"},                  {"kvfuse_group_settled_total", "counter"},
      {"kvfuse_group_oldest_pending_age_seconds", "gauge"}, {"kvfuse_rank_queue_wait_seconds_total", "counter"},
      {"kvfuse_connector_lanes", "gauge"},                {"kvfuse_connector_staging_bytes", "gauge"},
      {"kvfuse_connector_loads_total", "counter"},        {"kvfuse_tier_bytes", "gauge"},
      {"kvfuse_tier_capacity_bytes", "gauge"},            {"kvfuse_tier_hits_total", "counter"},
      {"kvfuse_save_fence_fences_total", "counter"},      {"kvfuse_loopback_pd_bytes_total", "counter"},
  };
  for (const auto& entry : types) {
    const std::string& name = entry.first;
    const std::string& type = entry.second;
    INFO(name);
    const auto it = parsed.families.find(name);
    REQUIRE(it != parsed.families.end());
    CHECK(it->second.type == type);
  }
}

TEST_CASE("prometheus: two sources with different labels are two samples under one family") {
  PrometheusText text;
  ConnectorStats a;
  a.loads = 11;
  ConnectorStats b;
  b.loads = 12;
  text.add(a, {{"rank", "0"}});
  text.add(b, {{"rank", "3"}});
  MemoryTierStats m;
  m.hits = 21;
  DiskTierStats d;
  d.hits = 22;
  text.add(m, {{"rank", "0"}});
  text.add(d, {{"rank", "0"}});

  const std::string out = text.str();
  const Parsed parsed = parse(out);
  for (const std::string& e : parsed.errors) FAIL_CHECK(e);
  const ParsedFamily& loads = parsed.families.at("kvfuse_connector_loads_total");
  CHECK(loads.helps == 1);
  CHECK(loads.types == 1);
  REQUIRE(loads.samples.size() == 2);
  CHECK(loads.samples[0].labels == Labels{{"rank", "0"}});  // in the order added
  CHECK(loads.samples[0].value == "11");
  CHECK(loads.samples[1].labels == Labels{{"rank", "3"}});
  CHECK(loads.samples[1].value == "12");

  const ParsedFamily& hits = parsed.families.at("kvfuse_tier_hits_total");
  REQUIRE(hits.samples.size() == 2);
  CHECK(hits.samples[0].labels == Labels{{"rank", "0"}, {"tier", "memory"}});
  CHECK(hits.samples[0].value == "21");
  CHECK(hits.samples[1].labels == Labels{{"rank", "0"}, {"tier", "disk"}});
  CHECK(hits.samples[1].value == "22");
  CHECK(parsed.families.at("kvfuse_tier_capacity_bytes").samples.size() == 2);  // both tiers have one
  CHECK(parsed.families.at("kvfuse_tier_retired_bytes").samples.size() == 1);   // memory only
  CHECK(parsed.families.at("kvfuse_tier_io_errors_total").samples.size() == 1);  // disk only
  // The literal spelling of one sample: labels sorted by name.
  CHECK(out.find("\nkvfuse_tier_hits_total{rank=\"0\",tier=\"disk\"} 22\n") != std::string::npos);
}

TEST_CASE("prometheus: label values round-trip with backslash and quote and newline escaped") {
  const std::string nasty = "a\\b\"c\nd{e}=f,g h \xc3\xa9";
  const std::string model = "k3 \"v2\"\\";
  PrometheusText text({{"model", model}});
  const std::vector<MetricLabel> labels{{"leg", nasty}, {"rank", ""}, {"Z_9", "}"}};
  text.add(loopback_pd_stats(), labels);
  const std::string out = text.str();
  CHECK(out.find("leg=\"a\\\\b\\\"c\\nd{e}=f,g h \xc3\xa9\"") != std::string::npos);
  CHECK(out.find("model=\"k3 \\\"v2\\\"\\\\\"") != std::string::npos);

  const Parsed parsed = parse(out);
  for (const std::string& e : parsed.errors) FAIL_CHECK(e);
  const Labels want{{"model", model}, {"leg", nasty}, {"rank", ""}, {"Z_9", "}"}};
  REQUIRE(parsed.families.size() == 4);
  for (const auto& entry : parsed.families) {
    const std::string& name = entry.first;  // not a structured binding: INFO captures it
    const ParsedFamily& family = entry.second;
    INFO(name);
    REQUIRE(family.samples.size() == 1);
    CHECK(family.samples[0].labels == want);
  }
  CHECK(parsed.families.at("kvfuse_loopback_pd_bytes_total").samples[0].value == "11004");
}

TEST_CASE("prometheus: bad label names and repeated labels and repeated series are refused and add nothing") {
  PrometheusText text({{"model", "k3"}});
  text.add(connector_stats(), {{"rank", "0"}});
  const std::string before = text.str();
  auto refused = [&](auto&& add) {
    try {
      add();
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::invalid_argument);
      return true;
    }
    return false;
  };
  CHECK(refused([&] { text.add(connector_stats(), {{"rank", "0"}}); }));             // the same series again
  CHECK(refused([&] { text.add(connector_stats(), {{"rank", "1"}, {"rank", "2"}}); })); // a name twice
  CHECK(refused([&] { text.add(connector_stats(), {{"model", "other"}}); }));        // a common name again
  CHECK(refused([&] { text.add(memory_tier_stats(), {{"tier", "kv"}}); }));          // the tier's own label
  CHECK(refused([&] { text.add(connector_stats(), {{"__rank", "1"}}); }));           // reserved
  CHECK(refused([&] { text.add(connector_stats(), {{"9rank", "1"}}); }));            // starts with a digit
  CHECK(refused([&] { text.add(connector_stats(), {{"ra-nk", "1"}}); }));            // not [a-zA-Z0-9_]
  CHECK(refused([&] { text.add(connector_stats(), {{"", "1"}}); }));                 // empty
  CHECK(refused([] { PrometheusText bad({{"model", "a"}, {"model", "b"}}); }));
  CHECK(refused([] { PrometheusText bad({{"mo.del", "a"}}); }));
  CHECK(text.str() == before);

  // A pump's stats hold its group's: adding both under one label set repeats the group's
  // series, and is refused whole (not one pump family was added either).
  text.add(pump_stats());
  const std::size_t families = text.family_count();
  CHECK(refused([&] { text.add(pump_stats().group); }));
  CHECK(text.family_count() == families);
  text.add(pump_stats().group, {{"group", "second"}});  // a second group, labelled apart
  CHECK(text.family_count() == families);
  CHECK(text.sample_count() == 6 + 5 + 2 * (15 + 5));  // connector, pump, two groups
}

TEST_CASE("prometheus: an empty exposition is empty and write matches str and the content type names version 0.0.4") {
  PrometheusText empty;
  CHECK(empty.str().empty());
  CHECK(empty.family_count() == 0);
  CHECK(empty.sample_count() == 0);

  const PrometheusText text = full_exposition();
  std::ostringstream os;
  text.write(os);
  CHECK(os.str() == text.str());
  CHECK(PrometheusText::content_type == "text/plain; version=0.0.4; charset=utf-8");
  CHECK(to_string(MetricType::counter) == "counter");
  CHECK(to_string(MetricType::gauge) == "gauge");
}

TEST_CASE("prometheus: group ages are zero when nothing is pending or the stamp is not in the past") {
  PrometheusText text({}, kNow);
  GroupStats g;
  g.oldest_pending_save_since = kNow + std::chrono::seconds(1);
  text.add(g);
  const Parsed parsed = parse(text.str());
  for (const std::string& e : parsed.errors) FAIL_CHECK(e);
  CHECK(as_double(parsed.families.at("kvfuse_group_oldest_pending_age_seconds").samples.at(0).value) == 0.0);
  CHECK(as_double(parsed.families.at("kvfuse_group_oldest_pending_save_age_seconds").samples.at(0).value) == 0.0);
}

TEST_CASE("prometheus: the parser in this test refuses what the format forbids") {
  CHECK(parse("# HELP a_total x\n# TYPE a_total counter\na_total 1\n").errors.empty());
  CHECK(!parse("a_total 1\n").errors.empty());                                             // no HELP or TYPE
  CHECK(!parse("# HELP a x\n# TYPE a gauge\na 1\n# HELP a y\n").errors.empty());           // HELP after samples
  CHECK(!parse("# HELP a x\n# TYPE a gauge\n# TYPE a gauge\na 1\n").errors.empty());       // TYPE twice
  CHECK(!parse("# HELP a x\n# TYPE a gauge\na{l=\"1\",l=\"2\"} 1\n").errors.empty());     // a label twice
  CHECK(!parse("# HELP a x\n# TYPE a gauge\na{l=\"\\q\"} 1\n").errors.empty());           // a bad escape
  CHECK(!parse("# HELP a x\n# TYPE a gauge\na 1").errors.empty());                         // no final newline
  CHECK(!parse("# HELP a x\n# TYPE a gauge\na 1\n# HELP b x\n# TYPE b gauge\nb 1\na 2\n").errors.empty());  // split
}

TEST_CASE("prometheus: a cluster tier writes its totals, its cluster counters and one labelled set per node, or nothing") {
  RedisClusterTierStats s;
  s.totals = RedisTierStats{14001, 14002, 14003, 14004, 14005, 14006, 14007, 14008, 14009, 14010, 14011, 14012};
  s.cluster = RedisClusterCounters{15001, 15002, 15003, 15004, 15005, 15006, 15007};
  s.nodes.push_back(RedisClusterNodeStats{"127.0.0.1:7000", 16001, 16002, 16003, 16004, 16005});
  s.nodes.push_back(RedisClusterNodeStats{"127.0.0.1:7001", 17001, 17002, 17003, 17004, 17005});
  PrometheusText text({{"model", "k3"}}, kNow);
  text.add(s, {{"rank", "3"}});
  const Parsed parsed = parse(text.str());
  for (const std::string& e : parsed.errors) FAIL_CHECK(e);
  const Labels tier{{"model", "k3"}, {"rank", "3"}, {"tier", "redis-cluster"}};
  const std::pair<const char*, std::uint64_t> totals[] = {
      {"kvfuse_tier_hits_total", 14001}, {"kvfuse_tier_round_trips_total", 14008}, {"kvfuse_tier_dropped_connections_total", 14012},
      {"kvfuse_tier_moved_total", 15001}, {"kvfuse_tier_asks_total", 15002}, {"kvfuse_tier_tryagain_total", 15003},
      {"kvfuse_tier_clusterdown_total", 15004}, {"kvfuse_tier_redirect_failures_total", 15005},
      {"kvfuse_tier_map_refreshes_total", 15006}, {"kvfuse_tier_map_refresh_failures_total", 15007}};
  for (const auto& [family, value] : totals) {
    INFO(family);
    const ParsedSample* sample = find_sample(parsed, family, tier);
    REQUIRE(sample != nullptr);
    CHECK(as_u64(sample->value) == value);
  }
  const char* node_families[] = {"kvfuse_tier_node_requests_total", "kvfuse_tier_node_round_trips_total",
                                 "kvfuse_tier_node_redirections_total", "kvfuse_tier_node_timeouts_total",
                                 "kvfuse_tier_node_failures_total"};
  for (std::size_t n = 0; n < 2; ++n)
    for (std::size_t f = 0; f < 5; ++f) {
      Labels labels = tier;
      labels["node"] = s.nodes[n].address;
      INFO(node_families[f], " ", s.nodes[n].address);
      const ParsedSample* sample = find_sample(parsed, node_families[f], labels);
      REQUIRE(sample != nullptr);
      CHECK(as_u64(sample->value) == (n == 0 ? 16001u : 17001u) + f);
    }
  CHECK(text.sample_count() == 12 + 7 + 2 * 5);
  // The same series again, or a node label of the caller's: refused, nothing added.
  const std::size_t before = text.sample_count();
  CHECK_THROWS_AS(text.add(s, {{"rank", "3"}}), Error);
  CHECK_THROWS_AS(text.add(s, {{"node", "x"}}), Error);
  CHECK(text.sample_count() == before);
}
