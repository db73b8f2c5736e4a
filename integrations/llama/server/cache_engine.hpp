// cache_engine.hpp — one SlotCache of the model's family behind one interface, so the backend
// picks the state leg (none, recurrent, slot) at run time from the model's architecture and is
// compiled once, while each SlotCache stays a template over its tier and leg.
//
// Threading: as SlotCache's: llama-server's main loop only.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <llama.h>

#include "slot_cache.hpp"
#include "tier_stack.hpp"

namespace kvfuse::llama_server {

/// A SlotCache over a TierStack, its state leg erased. Every member forwards to the SlotCache
/// member of the same name and promises what it promises.
struct CacheEngine {
  virtual ~CacheEngine() = default;
  virtual Restore begin(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount limit) = 0;
  virtual void refused(std::uint32_t slot) = 0;
  virtual TokenCount held_tokens(std::span<const llama_token> prompt, TokenCount limit) const = 0;
  virtual std::vector<TokenCount> stops(std::uint32_t slot) = 0;
  virtual void checkpoint(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount at,
                          std::span<const std::uint8_t> partial) = 0;
  virtual void finish(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount clean,
                      std::span<const std::uint8_t> full) = 0;
  /// SlotCache::reseed_from_tier.
  virtual std::size_t reseed() = 0;
  /// SlotCache::tamper_state when `state`, else SlotCache::tamper_kv (the tests' controls).
  virtual bool tamper(std::span<const llama_token> prompt, bool state) = 0;
  virtual SlotCacheCounters counters() const = 0;
  virtual IndexStats index_stats() const = 0;
  virtual CoordinatorStats coordinator_stats() const = 0;
  virtual HostAudit audit() const = 0;
  virtual std::optional<CacheLedgerStats> cache_stats() const = 0;
};

/// The CacheEngine of state leg `Leg` (NoState, RecurrentState<TierStack>, SlotState<TierStack>).
template <class Leg>
struct CacheEngineOf final : CacheEngine {
  SlotCache<TierStack, Leg> cache;
  CacheEngineOf(const llama::SequenceCodec& codec, TierStack& tier, const SlotCacheOptions& o) : cache(codec, tier, o) {}
  Restore begin(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount limit) override {
    return cache.begin(slot, prompt, limit);
  }
  void refused(std::uint32_t slot) override { cache.refused(slot); }
  TokenCount held_tokens(std::span<const llama_token> prompt, TokenCount limit) const override {
    return cache.held_tokens(prompt, limit);
  }
  std::vector<TokenCount> stops(std::uint32_t slot) override {
    const auto s = cache.stops(slot);
    return {s.begin(), s.end()};
  }
  void checkpoint(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount at,
                  std::span<const std::uint8_t> partial) override {
    cache.checkpoint(slot, prompt, at, partial);
  }
  void finish(std::uint32_t slot, std::span<const llama_token> prompt, TokenCount clean,
              std::span<const std::uint8_t> full) override {
    cache.finish(slot, prompt, clean, full);
  }
  std::size_t reseed() override { return cache.reseed_from_tier(); }
  bool tamper(std::span<const llama_token> prompt, bool state) override {
    return state ? cache.tamper_state(prompt) : cache.tamper_kv(prompt);
  }
  SlotCacheCounters counters() const override { return cache.counters(); }
  IndexStats index_stats() const override { return cache.index_stats(); }
  CoordinatorStats coordinator_stats() const override { return cache.coordinator_stats(); }
  HostAudit audit() const override { return cache.audit(); }
  std::optional<CacheLedgerStats> cache_stats() const override { return cache.cache_stats(); }
};

}  // namespace kvfuse::llama_server
