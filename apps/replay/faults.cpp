// kvfuse-replay: the fault table (faults.hpp). To add a fault, add one entry here: its name,
// what it does, its report rows, and the hooks it arms.
#include "faults.hpp"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <system_error>

namespace replay {

namespace {

/// Overwrites 8 bytes in the middle of one recently saved chunk's file on rank world/2 and
/// drops the chunk from that rank's memory front, so the next get reads the file. True if a
/// file was hit.
bool corrupt_a_file(FaultSite& site) {
  const std::uint32_t r = site.world() / 2;
  const auto saved = site.saved_chunks();
  for (std::size_t tries = 0; tries < saved.size(); ++tries) {
    const kvfuse::PrefixHash h = saved[site.random() % saved.size()];
    const std::filesystem::path p = site.tier(r).disk_path(site.kv_key(h, r));
    std::error_code ec;
    const auto size = std::filesystem::file_size(p, ec);
    if (ec || size < 200) continue;
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    if (!f) continue;
    f.seekp(static_cast<std::streamoff>(size - 100));
    const char garbage[8] = {'k', 'v', 'f', 'u', 's', 'e', '!', '!'};
    f.write(garbage, sizeof garbage);
    f.close();
    site.tier(r).erase_from_memory(site.kv_key(h, r));
    return true;
  }
  return false;
}

}  // namespace

const std::vector<Fault>& fault_table() {
  static const std::vector<Fault> table = {
      {"evict",
       "ranks' memory tiers get different capacities; one lookup in eight, a rank drops a chunk the lookup just counted",
       {{"tier_entries_evicted", "tier entries evicted"}},
       [](FaultSite& site, std::span<std::uint64_t> counts) {
         FaultHooks h;
         h.set_up_tier = [](std::uint32_t rank, TierOptions& o) {
           if (o.memory_bytes < (std::size_t{1} << 60)) o.memory_bytes = o.memory_bytes / 4 * (4 + rank % 3);
         };
         h.lookup = [&site, counts](std::span<const kvfuse::PrefixHash> keys, std::size_t held) {
           if (site.random() % 8 != 0) return;
           const auto r = static_cast<std::uint32_t>(site.random() % site.world());
           counts[0] += site.tier(r).erase(site.kv_key(keys[site.random() % held], r));
         };
         return h;
       }},
      {"lose-chunks",
       "one lookup in four that counted two or more chunks, one rank loses a chunk in the middle of them: the load "
       "fails part way there, and the request resumes from what every rank restored (salvage)",
       {{"chunks_lost_mid_prefix", "chunks lost mid-prefix"}},
       [](FaultSite& site, std::span<std::uint64_t> counts) {
         FaultHooks h;
         h.lookup = [&site, counts](std::span<const kvfuse::PrefixHash> keys, std::size_t held) {
           if (held < 2 || site.random() % 4 != 0) return;
           const auto r = static_cast<std::uint32_t>(site.random() % site.world());
           const std::size_t i = 1 + site.random() % (held - 1);  // never the first: something to salvage
           counts[0] += site.tier(r).erase(site.kv_key(keys[i], r));
         };
         return h;
       }},
      {"slow", "the last rank's tier sleeps 200 us per get", {}, [](FaultSite& site, std::span<std::uint64_t>) {
         FaultHooks h;
         h.ranks_built = [&site] { site.tier(site.world() - 1).set_delay(std::chrono::microseconds(200)); };
         return h;
       }},
      {"state-miss", "rank 1 loses some stored checkpoints", {{"state_entries_removed", "state entries removed"}},
       [](FaultSite& site, std::span<std::uint64_t> counts) {
         // Checkpoints to remove from rank 1 once stored there (the index still lists them).
         auto doomed = std::make_shared<std::vector<kvfuse::PrefixHash>>();
         FaultHooks h;
         h.checkpoint_saved = [&site, doomed](const Request& q, kvfuse::PrefixHash hash) {
           if (site.coin(q, 3, 150)) doomed->push_back(hash);
         };
         h.step = [&site, doomed, counts] {
           if (doomed->empty() || site.world() < 2) return;
           auto& d = *doomed;
           for (std::size_t i = 0; i < d.size();) {
             if (site.tier(1).erase(site.state_key(d[i], 1))) {
               ++counts[0];
               d[i] = d.back();
               d.pop_back();
             } else {
               ++i;
             }
           }
           if (d.size() > 64) d.erase(d.begin(), d.begin() + 32);
         };
         return h;
       }},
      {"death", "a rank is marked dead at 35% of arrivals and alive at 42%", {{"rank_deaths", "rank deaths"}},
       [](FaultSite& site, std::span<std::uint64_t> counts) {
         FaultHooks h;
         h.arrival = [&site, counts](std::size_t arrived, std::size_t total) {
           const std::uint32_t victim = site.world() > 2 ? site.world() - 2 : 0;
           if (site.world() < 2) return;
           if (arrival_at(arrived, total, 35) && site.alive(victim)) {
             site.set_alive(victim, false);
             ++counts[0];
           }
           if (arrival_at(arrived, total, 42) && !site.alive(victim)) site.set_alive(victim, true);
         };
         return h;
       }},
      {"kill",
       "ranks as processes: from 55% of arrivals, the last rank's process is SIGKILLed while loads are in flight, "
       "and restarted once the engine saw it die (ranks as threads: not applicable, nothing happens)",
       {{"rank_processes_killed", "rank processes killed"}, {"rank_processes_restarted", "rank processes restarted"}},
       [](FaultSite& site, std::span<std::uint64_t> counts) {
         struct Plan {
           bool armed = false, killed = false, restarted = false;
         };
         auto plan = std::make_shared<Plan>();
         FaultHooks h;
         h.arrival = [plan](std::size_t arrived, std::size_t total) {
           if (arrival_at(arrived, total, 55)) plan->armed = true;
         };
         h.step = [&site, plan, counts] {
           if (!site.processes_mode() || site.world() < 2) return;
           const std::uint32_t victim = site.world() - 1;
           if (plan->armed && !plan->killed && site.loads_in_flight() > 0 && site.kill_rank(victim)) {
             plan->killed = true;
             ++counts[0];
           } else if (plan->killed && !plan->restarted && site.rank_lost(victim) && site.restart_rank(victim)) {
             plan->restarted = true;
             ++counts[1];
           }
         };
         return h;
       }},
      {"abort", "4% of requests are torn down while their load is in flight", {{"aborts", "aborted mid-load"}},
       [](FaultSite& site, std::span<std::uint64_t> counts) {
         FaultHooks h;
         h.parked = [&site, counts](const Request& q, bool first) {
           if (!first || !site.coin(q, 1, 40)) return TearDown::none;
           ++counts[0];
           return TearDown::abort;
         };
         return h;
       }},
      {"preempt", "4% are torn down mid-load and admitted again later", {{"preemptions", "preempted mid-load"}},
       [](FaultSite& site, std::span<std::uint64_t> counts) {
         FaultHooks h;
         h.parked = [&site, counts](const Request& q, bool first) {
           if (!first || !site.coin(q, 2, 40)) return TearDown::none;
           ++counts[0];
           return TearDown::preempt;
         };
         return h;
       }},
      {"corrupt", "at 50% and 75% of arrivals a chunk file is overwritten in the middle",
       {{"files_corrupted", "files corrupted"}, {"files_quarantined", "files quarantined"}},
       [](FaultSite& site, std::span<std::uint64_t> counts) {
         FaultHooks h;
         h.arrival = [&site, counts](std::size_t arrived, std::size_t total) {
           if (site.disk() && (arrival_at(arrived, total, 50) || arrival_at(arrived, total, 75)))
             counts[0] += corrupt_a_file(site);
         };
         h.collect = [&site, counts] {
           for (std::uint32_t r = 0; r < site.world(); ++r) counts[1] += site.tier(r).snapshot().quarantined;
         };
         return h;
       }},
      {"reopen", "at 60% of arrivals every rank's disk tier is closed and reopened", {{"disk_reopens", "disk tiers reopened"}},
       [](FaultSite& site, std::span<std::uint64_t> counts) {
         FaultHooks h;
         h.arrival = [&site, counts](std::size_t arrived, std::size_t total) {
           if (!site.disk() || !arrival_at(arrived, total, 60)) return;
           for (std::uint32_t r = 0; r < site.world(); ++r) {
             const auto [before, after] = site.tier(r).reopen_disk();
             if (before != after) site.violation();  // a restart lost stored entries
             ++counts[0];
           }
         };
         return h;
       }},
  };
  return table;
}

std::vector<FaultRow> fault_rows() {
  std::vector<FaultRow> rows;
  for (const Fault& f : fault_table()) rows.insert(rows.end(), f.rows.begin(), f.rows.end());
  return rows;
}

FaultSet parse_faults(const std::string& list) {
  const auto& table = fault_table();
  FaultSet chosen(table.size(), false);
  if (list == "none") return chosen;
  std::stringstream names(list);
  std::string name;
  while (std::getline(names, name, ',')) {
    bool known = false;
    for (std::size_t i = 0; i < table.size(); ++i)
      if (name == "all" || name == table[i].name) {
        chosen[i] = true;
        known = true;
      }
    if (!known) throw InputError("--faults: unknown fault \"" + name + "\"");
  }
  return chosen;
}

ArmedFaults::ArmedFaults(const FaultSet& chosen, FaultSite& site, std::span<std::uint64_t> counts) {
  const auto& table = fault_table();
  std::size_t offset = 0;
  for (std::size_t i = 0; i < table.size(); ++i) {
    if (chosen[i]) hooks_.push_back(table[i].arm(site, counts.subspan(offset, table[i].rows.size())));
    offset += table[i].rows.size();
  }
}

void ArmedFaults::set_up_tier(std::uint32_t rank, TierOptions& options) const {
  for (const FaultHooks& h : hooks_)
    if (h.set_up_tier) h.set_up_tier(rank, options);
}
void ArmedFaults::ranks_built() const {
  for (const FaultHooks& h : hooks_)
    if (h.ranks_built) h.ranks_built();
}
void ArmedFaults::arrival(std::size_t arrived, std::size_t total) const {
  for (const FaultHooks& h : hooks_)
    if (h.arrival) h.arrival(arrived, total);
}
void ArmedFaults::lookup(std::span<const kvfuse::PrefixHash> keys, std::size_t held) const {
  for (const FaultHooks& h : hooks_)
    if (h.lookup) h.lookup(keys, held);
}
TearDown ArmedFaults::parked(const Request& q, bool first) const {
  for (const FaultHooks& h : hooks_)
    if (h.parked)
      if (const TearDown t = h.parked(q, first); t != TearDown::none) return t;
  return TearDown::none;
}
void ArmedFaults::checkpoint_saved(const Request& q, kvfuse::PrefixHash hash) const {
  for (const FaultHooks& h : hooks_)
    if (h.checkpoint_saved) h.checkpoint_saved(q, hash);
}
void ArmedFaults::step() const {
  for (const FaultHooks& h : hooks_)
    if (h.step) h.step();
}
void ArmedFaults::collect() const {
  for (const FaultHooks& h : hooks_)
    if (h.collect) h.collect();
}

}  // namespace replay
