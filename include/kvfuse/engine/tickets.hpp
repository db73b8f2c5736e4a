// kvfuse/engine/tickets.hpp — the move-only claims a grant holds (R6): LoadTicket,
// SaveTicket, and the Grant that holds one or says why there is none.
//
// A ticket is consumed by exactly one of dispatch() (which yields the plain data to ship
// to every rank) or abandon(); destroyed unconsumed, it abandons itself. So a path that
// forgot a load still produces the resolution the scheduler waits for, and a save cannot
// reach a rank unannounced. Tickets call back into the OffloadIndex that issued them.
//
// Threading: not thread-safe. Scheduler thread only, like the index.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

#include <kvfuse/bridge/ids.hpp>
#include <kvfuse/bridge/load_request.hpp>
#include <kvfuse/bridge/save_request.hpp>
#include <kvfuse/detail/npos.hpp>

namespace kvfuse {

/// Why request_load refused. A refusal changes no counter but `refused`, no slot and no
/// LRU order. Checked in this order; the first that applies is reported.
enum class LoadRefusal : std::uint8_t {
  none = 0,           ///< not refused (a grant)
  empty_load,         ///< neither a KV spec nor a state leg: nothing to load
  role_cannot_load,   ///< the configured role never loads (OffloadIndexOptions::role_loads is false)
  no_state_tier,      ///< a state leg, but there is no state tier (OffloadIndexOptions::state_tier)
  invalid_slot,       ///< the state leg's slot is outside [0, slot_count)
  invalid_state_leg,  ///< zero block_tokens or chunk_tokens, or a boundary off the checkpoint grid
  load_in_flight,     ///< this request already has a live (non-orphaned) load outstanding
  slot_in_use,        ///< another outstanding load (live or orphaned) holds the slot
  hash_not_servable,  ///< the state hash is not indexed (never stored, retracted or evicted)
  out_of_memory,      ///< the index could not grow its tables; nothing changed
};

/// Short, stable name of a LoadRefusal ("hash_not_servable", ...). Thread-safe, noexcept.
constexpr std::string_view to_string(LoadRefusal r) noexcept {
  switch (r) {
    case LoadRefusal::none: return "none";
    case LoadRefusal::empty_load: return "empty_load";
    case LoadRefusal::role_cannot_load: return "role_cannot_load";
    case LoadRefusal::no_state_tier: return "no_state_tier";
    case LoadRefusal::invalid_slot: return "invalid_slot";
    case LoadRefusal::invalid_state_leg: return "invalid_state_leg";
    case LoadRefusal::load_in_flight: return "load_in_flight";
    case LoadRefusal::slot_in_use: return "slot_in_use";
    case LoadRefusal::hash_not_servable: return "hash_not_servable";
    case LoadRefusal::out_of_memory: return "out_of_memory";
  }
  return "unknown_refusal";
}

/// Why request_save refused. A refusal changes no counter but `saves_refused`.
enum class SaveRefusal : std::uint8_t {
  none = 0,        ///< not refused (a grant)
  out_of_memory,   ///< the index could not grow its save table; nothing changed
};

/// Short, stable name of a SaveRefusal. Thread-safe, noexcept.
constexpr std::string_view to_string(SaveRefusal r) noexcept {
  switch (r) {
    case SaveRefusal::none: return "none";
    case SaveRefusal::out_of_memory: return "out_of_memory";
  }
  return "unknown_refusal";
}

template <class Clock>
class OffloadIndex;


namespace detail {
/// The index side of a ticket. Private to OffloadIndex; a ticket calls back through it.
class TicketSink {
 public:
  virtual std::optional<StateSpec> ticket_dispatch(std::uint32_t entry, LoadKey key) noexcept = 0;
  virtual void ticket_abandon(std::uint32_t entry, LoadKey key) noexcept = 0;
  virtual bool save_ticket_dispatch(SaveKey key) noexcept = 0;
  virtual void save_ticket_abandon(SaveKey key) noexcept = 0;

 protected:
  TicketSink() = default;
  TicketSink(const TicketSink&) = default;
  TicketSink& operator=(const TicketSink&) = default;
  ~TicketSink() = default;
};
}  // namespace detail

/// A move-only claim on one admitted load (R6). Consumed by exactly one of dispatch() or
/// abandon(); destroyed unconsumed, it abandons itself, so a path that forgot the load
/// still produces a resolution the scheduler drains. While a ticket is alive its load is
/// counted in `dispatched` and `outstanding`, so the R5 identity holds at every instant.
///
/// Not thread-safe: scheduler thread only. The OffloadIndex that issued it must outlive it.
class LoadTicket {
 public:
  /// An empty ticket (holds no load). noexcept.
  LoadTicket() noexcept = default;
  LoadTicket(const LoadTicket&) = delete;
  LoadTicket& operator=(const LoadTicket&) = delete;
  /// Moves the claim; `other` becomes empty. Scheduler thread only; noexcept.
  LoadTicket(LoadTicket&& other) noexcept
      : sink_(std::exchange(other.sink_, nullptr)), entry_(other.entry_), key_(other.key_), kv_(std::move(other.kv_)) {
    other.kv_.reset();
  }
  /// Abandons the load this ticket holds (if any), then takes `other`'s claim.
  /// Scheduler thread only; noexcept.
  LoadTicket& operator=(LoadTicket&& other) noexcept {
    if (this != &other) {
      abandon();
      sink_ = std::exchange(other.sink_, nullptr);
      entry_ = other.entry_;
      key_ = other.key_;
      kv_ = std::move(other.kv_);
      other.kv_.reset();
    }
    return *this;
  }
  /// Abandons the load if the ticket was never consumed (R6). Scheduler thread only.
  ~LoadTicket() { abandon(); }

  /// Whether the ticket still holds an unconsumed load. Scheduler thread only; noexcept.
  [[nodiscard]] bool valid() const noexcept { return sink_ != nullptr; }
  explicit operator bool() const noexcept { return valid(); }

  /// The key of the load this ticket was issued for; still readable after it is consumed.
  /// LoadKey{} for a default-constructed ticket. Scheduler thread only; noexcept.
  [[nodiscard]] LoadKey key() const noexcept { return key_; }

  /// Consumes the ticket: the load becomes in flight (the index now accepts reports for
  /// its key) and the plain-data LoadRequest to ship to every rank is returned. The KV
  /// spec is moved, never copied. On an empty ticket it returns a LoadRequest with no leg
  /// and an unissued key, which every rank refuses and the index treats as late.
  /// Scheduler thread only; noexcept; O(1), never allocates.
  [[nodiscard]] LoadRequest dispatch() noexcept {
    LoadRequest req;
    if (sink_ == nullptr) return req;
    req.key = key_;
    req.state = std::exchange(sink_, nullptr)->ticket_dispatch(entry_, key_);
    req.kv = std::move(kv_);
    kv_.reset();
    return req;
  }

  /// Consumes the ticket without dispatching: the load resolves as abandoned (never a
  /// miss, R7) and the resolution is queued for the scheduler. No-op on an empty ticket.
  /// Scheduler thread only; noexcept; O(1).
  void abandon() noexcept {
    if (sink_ == nullptr) return;
    kv_.reset();
    std::exchange(sink_, nullptr)->ticket_abandon(entry_, key_);
  }

 private:
  template <class Clock>
  friend class OffloadIndex;

  LoadTicket(detail::TicketSink* sink, std::uint32_t entry, LoadKey key, std::optional<KvSpec>&& kv) noexcept
      : sink_(sink), entry_(entry), key_(key), kv_(std::move(kv)) {}

  detail::TicketSink* sink_ = nullptr;
  std::uint32_t entry_ = detail::npos32;
  LoadKey key_{};
  std::optional<KvSpec> kv_;
};

/// A move-only claim on one admitted save (docs/reference.md#save-path): the save a rank will run,
/// with the key the index issued. Consumed by exactly one of dispatch() (which yields the
/// save to ship to every rank; from then on the index accepts its records) or abandon();
/// destroyed unconsumed, it abandons itself. A save cannot reach a rank unannounced: its
/// key exists only through a ticket. `Save` is KvSave or StateSave.
///
/// Not thread-safe: scheduler thread only. The OffloadIndex that issued it must outlive it.
template <class Save>
class SaveTicket {
 public:
  /// An empty ticket. noexcept.
  SaveTicket() noexcept = default;
  SaveTicket(const SaveTicket&) = delete;
  SaveTicket& operator=(const SaveTicket&) = delete;
  /// Moves the claim; `other` becomes empty. noexcept.
  SaveTicket(SaveTicket&& other) noexcept : sink_(std::exchange(other.sink_, nullptr)), save_(std::move(other.save_)) {}
  /// Abandons the save this ticket holds (if any), then takes `other`'s claim. noexcept.
  SaveTicket& operator=(SaveTicket&& other) noexcept {
    if (this != &other) {
      abandon();
      sink_ = std::exchange(other.sink_, nullptr);
      save_ = std::move(other.save_);
    }
    return *this;
  }
  /// Abandons the save if it was never consumed. Scheduler thread only.
  ~SaveTicket() { abandon(); }

  /// Whether the ticket still holds an unconsumed save. noexcept.
  [[nodiscard]] bool valid() const noexcept { return sink_ != nullptr; }
  explicit operator bool() const noexcept { return valid(); }

  /// The key the index issued (readable after consumption); SaveKey{} when empty. noexcept.
  [[nodiscard]] SaveKey key() const noexcept { return save_.key; }

  /// Consumes the ticket: the save becomes in flight and is returned (moved) for every
  /// rank. On an empty ticket it returns a default Save whose key no index accepts.
  /// Scheduler thread only; noexcept; O(1).
  [[nodiscard]] Save dispatch() noexcept {
    if (sink_ == nullptr) return Save{};
    (void)std::exchange(sink_, nullptr)->save_ticket_dispatch(save_.key);
    return std::move(save_);
  }

  /// Consumes the ticket without dispatching: counted in saves_abandoned; nothing is
  /// indexed. No-op on an empty ticket. Scheduler thread only; noexcept; O(1).
  void abandon() noexcept {
    if (sink_ == nullptr) return;
    std::exchange(sink_, nullptr)->save_ticket_abandon(save_.key);
  }

 private:
  template <class Clock>
  friend class OffloadIndex;
  SaveTicket(detail::TicketSink* sink, Save&& save) noexcept : sink_(sink), save_(std::move(save)) {}

  detail::TicketSink* sink_ = nullptr;
  Save save_{};
};

/// What request_load / request_save return: a grant of a ticket, or the reason there is
/// none. (A grant is the index's answer to one request for a ticket; an admission, in the
/// Coordinator's words, is one admit..finish life of a request.) Move-only. Dropping a
/// grant whose ticket was not taken drops (and so abandons) the ticket. Not thread-safe:
/// scheduler thread only, like the ticket it holds.
template <class Ticket, class Refusal>
class [[nodiscard]] Grant {
 public:
  /// A refusal. noexcept.
  explicit Grant(Refusal refusal) noexcept : refusal_(refusal) {}
  /// A ticket granted. noexcept.
  explicit Grant(Ticket&& ticket) noexcept : ticket_(std::move(ticket)) {}

  /// Whether a ticket was granted. noexcept.
  [[nodiscard]] bool granted() const noexcept { return refusal_ == Refusal::none; }
  explicit operator bool() const noexcept { return granted(); }
  /// The refusal reason; Refusal::none when granted. noexcept.
  [[nodiscard]] Refusal refusal() const noexcept { return refusal_; }
  /// The ticket (empty when refused, or once taken). noexcept.
  [[nodiscard]] Ticket& ticket() noexcept { return ticket_; }
  /// Moves the ticket out. noexcept.
  [[nodiscard]] Ticket take_ticket() noexcept { return std::move(ticket_); }

 private:
  Ticket ticket_;
  Refusal refusal_ = Refusal::none;
};

/// What request_load returns.
using LoadGrant = Grant<LoadTicket, LoadRefusal>;
/// What request_save returns.
template <class Save>
using SaveGrant = Grant<SaveTicket<Save>, SaveRefusal>;

}  // namespace kvfuse
