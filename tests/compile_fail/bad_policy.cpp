// Compile-fail cases: each KVFUSE_CASE builds a Connector (or a tier/runtime use) from a
// type that does not model the policy concept. The test suite builds each one, expects the
// build to fail, and expects the diagnostic to name the concept.
#include <kvfuse/kvfuse.hpp>

namespace {
struct NotAKvLeg {};  // no load/save
struct NotAStateLeg {
  static constexpr int ordering = 7;  // not a StateOrdering, no load/store
};
struct NotAGroup {};
struct NotARuntime {};
struct Lmcache {
  static constexpr std::string_view connector_name = "lmcache";
  kvfuse::TokenCount matched_tokens(const kvfuse::AdmissionQuery&) noexcept { return 0; }
  void cancel(kvfuse::RequestId) noexcept {}
};
struct Kvfuse : Lmcache {
  static constexpr std::string_view connector_name = "KVFUSE";
};
struct Redis : Lmcache {
  static constexpr std::string_view connector_name = "redis";  // not in the registry
};
using Mem = kvfuse::MemoryTier<>;
/// A tier that answers a whole load in one call, like RedisTier (without hiredis).
struct BatchedMem : Mem {
  using Mem::Mem;
  void get_batch(const kvfuse::TierKey&, std::span<const kvfuse::PrefixHash>, std::span<kvfuse::TierView>,
                 kvfuse::BatchSink = {}) noexcept {}
};
static_assert(kvfuse::BatchedTier<BatchedMem>);
}  // namespace

int main() {
#if KVFUSE_CASE == 1
  using C = kvfuse::Connector<NotAKvLeg, kvfuse::NoState, kvfuse::SingleRank>;
#elif KVFUSE_CASE == 2
  using C = kvfuse::Connector<kvfuse::PagedKv<Mem>, NotAStateLeg, kvfuse::SingleRank>;
#elif KVFUSE_CASE == 3
  using C = kvfuse::Connector<kvfuse::PagedKv<Mem>, kvfuse::NoState, NotAGroup>;
#elif KVFUSE_CASE == 4
  using C = kvfuse::Connector<kvfuse::PagedKv<Mem>, kvfuse::NoState, kvfuse::SingleRank, NotARuntime>;
#elif KVFUSE_CASE == 5
  using C = kvfuse::Connector<kvfuse::PagedKv<int>, kvfuse::NoState, kvfuse::SingleRank>;
#elif KVFUSE_CASE == 6
  using C = kvfuse::Multi<Lmcache, Kvfuse>;  // two spellings of the offload connector (R15)
#elif KVFUSE_CASE == 7
  using C = kvfuse::Multi<Lmcache, Redis>;  // a sub whose name the registry does not know (R15)
#elif KVFUSE_CASE == 8
  using C = kvfuse::TieredTier<Mem, BatchedMem>;  // a batched back would lose its one-round-trip load
#else
  using C = kvfuse::Connector<kvfuse::PagedKv<Mem>, kvfuse::NoState, kvfuse::SingleRank>;  // the control: compiles
#endif
  return sizeof(C) > 0 ? 0 : 1;
}
