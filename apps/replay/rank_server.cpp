// kvfuse-replay: the control channel's server in a rank process (rank_server.hpp).
#include "rank_server.hpp"

#include "byte_encoding.hpp"

#include <cstring>
#include <optional>

namespace replay {

using namespace kvfuse;

bool send_ready(ControlChannel& channel) { return channel.put({ControlOp::ready, 0, 1}); }

void RankServer::on_serving_thread(const std::function<void()>& task) {
  std::unique_lock<std::mutex> lock(mutex_);
  task_ = &task;
  pending_.store(true, std::memory_order_release);
  done_.wait(lock, [&] { return task_ == nullptr || stopped_.load(std::memory_order_acquire); });
  task_ = nullptr;
  pending_.store(false, std::memory_order_release);
}

#if defined(__SANITIZE_THREAD__)
#define KVFUSE_REPLAY_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVFUSE_REPLAY_TSAN 1
#endif
#endif

void RankServer::on_memory(const std::function<void()>& op) {
#if KVFUSE_REPLAY_TSAN
  // What orders a lane's writes before this request (its record, read by the engine, which
  // then asks) and this request's writes before a later save (the engine's reply, then its
  // frame) crosses the engine's process, where ThreadSanitizer cannot see it. Under it the
  // op runs on the serving thread after the lanes settle: an order within this process.
  on_serving_thread([&] {
    work_.settle();
    op();
  });
#else
  op();
#endif
}

void RankServer::do_work() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (task_ != nullptr) (*task_)();
  task_ = nullptr;
  pending_.store(false, std::memory_order_release);
  done_.notify_all();
}

void RankServer::stop() noexcept {
  channel_.shut_down();
  std::lock_guard<std::mutex> lock(mutex_);
  stopped_.store(true, std::memory_order_release);
  done_.notify_all();
}

void RankServer::run() {
  ControlHeader h;
  std::vector<std::byte> payload;
  while (!stopped() && channel_.get(h, payload) && answer(h, payload)) {
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stopped_.store(true, std::memory_order_release);
}

bool RankServer::answer(const ControlHeader& h, std::span<const std::byte> payload) {
  ControlHeader reply{h.op};
  std::vector<std::byte> out;
  const auto spans = as_items<BlockSpan>(payload, h.count);
  const auto keys = as_items<TierKey>(payload, h.count);
  if ((h.op == ControlOp::write_kv || h.op == ControlOp::fold_kv || h.op == ControlOp::check) && spans.size() != h.count)
    return false;  // not what this binary sends: stop
  if ((h.op == ControlOp::tier_leading || h.op == ControlOp::tier_erase || h.op == ControlOp::tier_erase_from_memory ||
       h.op == ControlOp::tier_disk_path) &&
      (keys.size() != h.count || (h.op != ControlOp::tier_leading && h.count != 1)))
    return false;
  switch (h.op) {
    case ControlOp::write_kv: on_memory([&] { memory_.write_kv(spans); }); break;
    case ControlOp::write_state: on_memory([&] { memory_.write_state(SlotId{static_cast<std::uint32_t>(h.a)}, h.b); }); break;
    case ControlOp::read_state: on_memory([&] { reply.a = memory_.read_state(SlotId{static_cast<std::uint32_t>(h.a)}); }); break;
    case ControlOp::fold_kv: on_memory([&] { reply.a = memory_.fold_kv(spans); }); break;
    case ControlOp::check: {
      const std::optional<SlotId> slot = h.a == 0 ? std::nullopt : std::optional<SlotId>(SlotId{static_cast<std::uint32_t>(h.a - 1)});
      Checked c;
      on_memory([&] { c = memory_.check(spans, slot, h.b); });
      verified_ += c.verified;
      corrupted_ += c.corrupted;
      reply.a = c.verified;
      reply.b = c.corrupted;
      break;
    }
    case ControlOp::put_blocks: {
      const std::size_t ids = std::size_t{h.count} * sizeof(BlockId);
      if (payload.size() != ids + std::size_t{h.count} * block_bytes) return false;
      on_memory([&] {
        for (std::uint32_t i = 0; i < h.count; ++i) {
          BlockId b;
          std::memcpy(&b, payload.data() + i * sizeof(BlockId), sizeof b);
          std::memcpy(memory_.block(b.value), payload.data() + ids + std::size_t{i} * block_bytes, block_bytes);
        }
      });
      break;
    }
    case ControlOp::tier_leading: reply.a = tier_.leading(keys); break;
    case ControlOp::tier_erase: reply.a = tier_.erase(keys[0]); break;
    case ControlOp::tier_set_delay: tier_.set_delay(std::chrono::microseconds(h.a)); break;
    case ControlOp::tier_reopen_disk: {
      const auto [before, after] = tier_.reopen_disk();
      reply.a = before;
      reply.b = after;
      break;
    }
    case ControlOp::tier_erase_from_memory: reply.a = tier_.erase_from_memory(keys[0]); break;
    case ControlOp::tier_disk_path: {
      const std::string p = tier_.disk_path(keys[0]).string();
      const auto* b = reinterpret_cast<const std::byte*>(p.data());
      out.assign(b, b + p.size());
      break;
    }
    case ControlOp::tier_snapshot: {
      const TierSnapshotWire w = to_wire(tier_.snapshot());
      const auto b = bytes_of(w);
      out.assign(b.begin(), b.end());
      break;
    }
    case ControlOp::connector_stats: {
      ConnectorStats s{};
      on_serving_thread([&] { s = work_.stats(); });
      const auto b = bytes_of(s);
      out.assign(b.begin(), b.end());
      break;
    }
    case ControlOp::counts: {
      RankCounts c{};
      on_serving_thread([&] { c = work_.counts(); });
      c.bytes_checked = verified_;
      c.bytes_corrupted = corrupted_;
      const auto b = bytes_of(c);
      out.assign(b.begin(), b.end());
      break;
    }
    case ControlOp::drain: on_serving_thread(work_.drain); break;
    case ControlOp::quit: (void)channel_.put(reply); return false;
    case ControlOp::ready: return false;
  }
  return channel_.put(reply, out);
}

}  // namespace replay
