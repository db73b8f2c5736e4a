// kvfuse-replay: the rank process's side of ranks as processes (rank_process.hpp): the
// control channel's server and one rank process's life. The model table instantiates
// serve_rank once per connector and tier type (models.cpp), as it instantiates RanksOf for
// ranks as threads (ranks.hpp); RankServer is the same for all (rank_server.cpp). Nothing
// here knows the model table or the engine's side.
#pragma once

#include "child_setup.hpp"
#include "control_channel.hpp"
#include "rank_memory.hpp"
#include "rank_tier.hpp"
#include "ranks.hpp"
#include "tiers.hpp"

#include <kvfuse/device/host_runtime.hpp>
#include <kvfuse/ipc/shm_rank.hpp>
#include <kvfuse/worker/connector.hpp>
#include <kvfuse/worker/paged_kv.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace replay {

/// What a rank process does on its serving thread (the connector's rank thread) when the
/// control channel asks: drain (serve what the frame ring holds, then wait for every lane),
/// and read the connector's and the attachment's counters.
struct ServingThreadWork {
  std::function<void()> drain;
  std::function<void()> settle;  ///< waits for every lane to be idle (the connector's drain)
  std::function<kvfuse::ConnectorStats()> stats;
  std::function<RankCounts()> counts;
};

/// Serves one rank process's control channel on a thread of its own, while the serving
/// thread feeds the connector the segment's frames. What must run on the serving thread
/// (ServingThreadWork) is handed to it and waited for.
class RankServer {
 public:
  RankServer(ControlChannel& channel, RankMemory memory, TierControl& tier, ServingThreadWork work) noexcept
      : channel_(channel), memory_(memory), tier_(tier), work_(std::move(work)) {}

  /// The control thread: answers requests until quit, or until the channel closes.
  void run();
  /// The control thread has stopped (quit, or the engine's end of the channel closed). Any thread.
  bool stopped() const noexcept { return stopped_.load(std::memory_order_acquire); }
  /// Serving thread: whether work waits for it.
  bool work_pending() const noexcept { return pending_.load(std::memory_order_acquire); }
  /// Serving thread: does the waiting work.
  void do_work();
  /// Serving thread, once it stops serving: stops the control thread (its blocked read returns).
  void stop() noexcept;

 private:
  bool answer(const ControlHeader& h, std::span<const std::byte> payload);
  /// Control thread: runs `task` on the serving thread and waits for it.
  void on_serving_thread(const std::function<void()>& task);
  /// Control thread: an operation on device memory (see rank_server.cpp for where it runs).
  void on_memory(const std::function<void()>& op);

  ControlChannel& channel_;
  RankMemory memory_;
  TierControl& tier_;
  ServingThreadWork work_;
  std::atomic<bool> stopped_{false}, pending_{false};
  std::mutex mutex_;
  std::condition_variable done_;
  const std::function<void()>* task_ = nullptr;  // guarded by mutex_
  std::uint64_t verified_ = 0, corrupted_ = 0;   // control thread only
};

/// Tells the engine the rank process is ready (attached, its connector built).
bool send_ready(ControlChannel& channel);

/// One rank process: attaches to the segment, builds its device memory, its tier (entry's
/// make) and its connector `Conn` (a ShmQuorum connector over RankTier<Inner>), says ready,
/// then serves frames and the control channel until quit or the engine is gone. Throws what
/// attaching or building throws (before ready). Returns the exit status.
template <class Conn, class Inner>
int serve_rank(const ChildSetup& s, const TierEntry<Inner>& entry, ControlChannel& channel) {
  using Tier = RankTier<Inner>;
  kvfuse::HostRuntime rt;
  const kvfuse::RankGeometry g = s.ranks.geometry(s.rank);
  kvfuse::ShmRank shm(s.segment, g);
  struct Memory {  // freed however this ends
    kvfuse::HostRuntime& rt;
    RankMemory m;
    ~Memory() {
      rt.free_device(m.blocks);
      rt.free_device(m.slots);
    }
  } memory{rt,
           {static_cast<std::byte*>(rt.allocate_device(std::size_t{g.num_blocks} * g.block_bytes())),
            static_cast<std::byte*>(rt.allocate_device(std::max<std::size_t>(1, std::size_t{g.num_slots} * g.slot_bytes))),
            g.rank, g.slot_bytes}};
  Tier tier([&] { return entry.make(s.tier, g.rank); });
  auto emitters = [&]<std::size_t... L>(std::index_sequence<L...>) {
    return typename Conn::Emitters{shm.emitter(L)...};
  }(std::make_index_sequence<Conn::lane_count>{});
  Conn conn(g, rt, kvfuse::DeviceMemory{memory.m.blocks, memory.m.slots}, kvfuse::PagedKv<Tier>(tier),
            state_leg_of<Conn>(tier), std::move(emitters));
  RankServer server(channel, memory.m, tier,
                    ServingThreadWork{[&] {
                                        while (shm.serve_one(conn, std::chrono::nanoseconds(0)) == kvfuse::Served::frame) {
                                        }
                                        conn.drain();
                                      },
                                      [&] { conn.drain(); }, [&] { return conn.stats(); },
                                      [&] {
                                        const kvfuse::ShmRankStats st = shm.stats();
                                        return RankCounts{st.incarnation, st.loads, st.kv_saves, st.state_saves,
                                                          st.records_emitted, st.records_dropped, 0, 0};
                                      }});
  if (!send_ready(channel)) return 0;  // the engine is gone already
  std::thread control([&] { server.run(); });
  for (;;) {
    const kvfuse::Served got = shm.serve_one(conn, std::chrono::milliseconds(5));
    if (got == kvfuse::Served::engine_gone || got == kvfuse::Served::bad_frame || server.stopped()) break;
    if (server.work_pending()) server.do_work();
  }
  server.stop();
  control.join();
  conn.drain();
  return 0;
}

}  // namespace replay
