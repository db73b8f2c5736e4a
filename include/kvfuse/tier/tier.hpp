// kvfuse/tier/tier.hpp — the Tier policy: where offloaded bytes live.
//
// Shaped for a remote store from the start (docs/reference.md#tier): a get can miss or fail per
// entry, a put can fail, no call holds a lock across I/O, and keys carry the model, world
// size and rank so ranks never read each other's slices.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <utility>

#include <kvfuse/bridge/ids.hpp>

namespace kvfuse {

/// What an entry holds.
enum class EntryKind : std::uint8_t {
  kv_chunk = 1,  ///< one chunk of KV, one rank's slice
  state = 2,     ///< one state checkpoint (K3 recurrent or DSV4 slot), one rank's slice
};

/// The full identity of an entry in a tier. 32 bytes, trivially copyable.
struct TierKey {
  std::uint64_t model = 0;       ///< the engine's model id: different models never share entries
  PrefixHash hash;               ///< chained prefix hash of the chunk or checkpoint
  std::uint32_t world_size = 1;  ///< TP world size the slice was cut for
  std::uint32_t rank = 0;        ///< the rank whose slice this is
  EntryKind kind = EntryKind::kv_chunk;
  friend constexpr auto operator<=>(const TierKey&, const TierKey&) noexcept = default;
};

/// Result of a tier get.
enum class GetStatus : std::uint8_t {
  hit = 0,     ///< the view holds the whole entry
  miss = 1,    ///< the tier does not have the entry (genuine absence)
  failed = 2,  ///< the tier may have it but could not read it (I/O error, corrupt, too big for staging)
  timed_out = 3,  ///< a remote tier did not answer within its command timeout (it may have the entry)
};

/// Read access to one entry, valid until the view is destroyed. A MemoryTier hands out
/// its own (pinned) bytes and keeps the entry alive while the view lives, so a hit is one
/// copy into the blocks; a DiskTier reads into the caller's staging buffer and the view
/// points there. Move-only. The release hook is a plain function pointer plus two context
/// words, not a std::function, so building a view never allocates on the load path.
class TierView {
 public:
  /// Called once when a view that holds an entry goes away.
  using Release = void (*)(void* owner, void* entry) noexcept;

  TierView() noexcept = default;
  explicit TierView(GetStatus status) noexcept : status_(status) {}
  TierView(std::span<const std::byte> bytes, Release release = nullptr, void* owner = nullptr,
           void* entry = nullptr) noexcept
      : status_(GetStatus::hit), bytes_(bytes), release_(release), owner_(owner), entry_(entry) {}
  TierView(TierView&& other) noexcept { steal(other); }
  TierView& operator=(TierView&& other) noexcept {
    if (this != &other) {
      reset();
      steal(other);
    }
    return *this;
  }
  TierView(const TierView&) = delete;
  TierView& operator=(const TierView&) = delete;
  ~TierView() { reset(); }

  /// What the get found. The accessors are noexcept; a view belongs to one thread.
  [[nodiscard]] GetStatus status() const noexcept { return status_; }
  /// The view holds the whole entry.
  [[nodiscard]] bool hit() const noexcept { return status_ == GetStatus::hit; }
  /// The entry's bytes (empty unless hit); valid while the view lives.
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return bytes_; }

 private:
  void steal(TierView& other) noexcept {
    status_ = other.status_;
    bytes_ = other.bytes_;
    release_ = std::exchange(other.release_, nullptr);
    owner_ = other.owner_;
    entry_ = other.entry_;
  }
  void reset() noexcept {
    if (release_ != nullptr) std::exchange(release_, nullptr)(owner_, entry_);
  }
  GetStatus status_ = GetStatus::miss;
  std::span<const std::byte> bytes_;
  Release release_ = nullptr;
  void* owner_ = nullptr;
  void* entry_ = nullptr;
};

/// Requirements on a tier. One tier object may serve several ranks' lanes at once, so
/// every call is thread-safe and noexcept (failures are statuses, never exceptions).
///   get(key, staging): the entry, read into `staging` if the tier needs a buffer (a
///     disk or remote tier); failed if the entry is larger than `staging`.
///   put(key, bytes): stores a copy; false if it could not.
///   contains(key), erase(key): catalogue queries and removal.
template <class T>
concept Tier = requires(T& tier, const T& ctier, const TierKey& key, std::span<std::byte> staging,
                        std::span<const std::byte> bytes) {
  { tier.get(key, staging) } noexcept -> std::same_as<TierView>;
  { tier.put(key, bytes) } noexcept -> std::same_as<bool>;
  { ctier.contains(key) } noexcept -> std::same_as<bool>;
  { tier.erase(key) } noexcept -> std::same_as<bool>;
};

/// Told by a batched get about each entry as its answer lands, in order, before the next
/// one is read, so the caller can start copying a hit while the rest are still arriving
/// (its bytes are still hot in cache). A function pointer plus a context word: building one
/// never allocates. A default-constructed sink does nothing.
struct BatchSink {
  void (*arrived)(void* context, std::size_t index, const TierView& view) noexcept = nullptr;
  void* context = nullptr;
  void operator()(std::size_t index, const TierView& view) const noexcept {
    if (arrived != nullptr) arrived(context, index, view);
  }
};

/// Optional, on top of Tier: many KV chunks of one rank in one call, so a remote tier
/// answers a whole load in one round trip. PagedKv uses it when a tier has it (and the lane
/// lends enough held views); every other tier keeps the per-chunk get.
///   get_batch(first, hashes, out, sink): for each i < hashes.size(), out[i] becomes what
///     get(key, ...) would return for `first` with `hash = hashes[i]`: hit, miss, failed or
///     timed_out, chunk by chunk; sink(i, out[i]) may be called as each one lands (a tier
///     that cannot stream its answers need not call it). Once sink(i, out[i]) returns the
///     tier never touches out[i] again, so the caller may release it there (PagedKv does,
///     once its copy ran: the tier gets the buffer back mid-load). Precondition: out.size() >=
///     hashes.size(). A hit view owns its bytes (never a caller's staging buffer), so all
///     the views may be held at once. Thread-safe and noexcept like the rest of the concept.
template <class T>
concept BatchedTier = Tier<T> && requires(T& tier, const TierKey& first, std::span<const PrefixHash> hashes,
                                          std::span<TierView> out, BatchSink sink) {
  { tier.get_batch(first, hashes, out, sink) } noexcept -> std::same_as<void>;
};

}  // namespace kvfuse

template <>
struct std::hash<kvfuse::TierKey> {
  std::size_t operator()(const kvfuse::TierKey& k) const noexcept {
    using kvfuse::mix64;
    return mix64(k.model ^ mix64(k.hash.value ^ mix64((std::uint64_t{k.world_size} << 40) ^
                                                       (std::uint64_t{k.rank} << 8) ^
                                                       static_cast<std::uint64_t>(k.kind))));
  }
};
