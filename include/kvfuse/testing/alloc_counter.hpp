// kvfuse/testing/alloc_counter.hpp — TEST-ONLY hook that proves "no allocation on the
// load path" (R12).
//
// This header only declares counters and offers a macro. A test binary that wants to
// count heap allocations expands KVFUSE_DEFINE_COUNTING_OPERATOR_NEW() once, at namespace
// scope in one of its .cpp files: that replaces every global operator new/delete of the
// binary with malloc/free-based versions that bump the counters. Nothing in the library
// expands it, so engines never pay for it.
//
// Usage:
//   KVFUSE_DEFINE_COUNTING_OPERATOR_NEW();   // the semicolon is required
//   ...
//   REQUIRE(kvfuse::detail::AllocationScope::hook_installed());
//   kvfuse::detail::AllocationScope scope;
//   connector.load(request); lane.wait_idle();
//   CHECK(scope.all_threads() == 0);
//
// all_threads() counts allocations made by every thread (the load path runs on lanes),
// so keep other threads of the test quiet inside the scope; this_thread() counts only
// the calling thread's.
//
// Sanitizers: ASan and TSan interpose malloc/free and also define operator new/delete.
// The definitions the macro puts in the executable take precedence over the sanitizer
// runtime's (ordinary symbol interposition), and they call malloc/free, which the
// sanitizer still intercepts: leaks, overflows and use-after-free are still reported;
// only new/delete *mismatch* checks are lost. kvfuse's tests run this way under both.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace kvfuse::detail {

/// Heap allocations by any thread since the program started (while the hook is installed).
inline std::atomic<std::uint64_t> g_allocations{0};
/// Heap allocations by this thread.
inline thread_local std::uint64_t t_allocations = 0;
/// Set during static initialisation by KVFUSE_DEFINE_COUNTING_OPERATOR_NEW().
inline std::atomic<bool> g_alloc_hook_installed{false};
/// While nonzero, each allocation fails (and decrements it): operator new throws
/// std::bad_alloc. Set it through AllocationScope::fail_next.
inline std::atomic<std::uint64_t> g_failing_allocations{0};

/// Whether this allocation is one a test asked to fail. Lock-free.
inline bool take_injected_failure() noexcept {
  std::uint64_t n = g_failing_allocations.load(std::memory_order_relaxed);
  while (n > 0)
    if (g_failing_allocations.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) return true;
  return false;
}

/// Called by the counting operator new. Wait-free.
inline void note_allocation() noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  ++t_allocations;
}

inline void* counted_malloc(std::size_t bytes) noexcept {
  if (take_injected_failure()) return nullptr;
  note_allocation();
  return std::malloc(bytes == 0 ? 1 : bytes);
}

inline void* counted_aligned(std::size_t bytes, std::size_t alignment) noexcept {
  if (take_injected_failure()) return nullptr;
  note_allocation();
  void* p = nullptr;
  if (alignment < sizeof(void*)) alignment = sizeof(void*);
  if (posix_memalign(&p, alignment, bytes == 0 ? 1 : bytes) != 0) return nullptr;
  return p;
}

/// The counting operator delete. Not inlined, so GCC's -Wmismatched-new-delete does not
/// see a free() of memory that (as far as it knows) came from operator new.
[[gnu::noinline]] inline void counted_free(void* p) noexcept { std::free(p); }

/// Counts heap allocations from construction on. Cheap to make; read it any time.
class AllocationScope {
 public:
  AllocationScope() noexcept
      : global_start_(g_allocations.load(std::memory_order_relaxed)), thread_start_(t_allocations) {}

  /// Allocations by any thread since construction. Reading it after joining (or
  /// wait_idle on) the threads of interest sees all of theirs.
  [[nodiscard]] std::uint64_t all_threads() const noexcept {
    return g_allocations.load(std::memory_order_relaxed) - global_start_;
  }
  /// Allocations by the calling thread since construction (call it on the constructing thread).
  [[nodiscard]] std::uint64_t this_thread() const noexcept { return t_allocations - thread_start_; }

  /// Makes the next `n` allocations (by any thread) fail with std::bad_alloc, to prove a
  /// path turns an allocation failure into a reported refusal. Needs the hook installed.
  static void fail_next(std::uint64_t n) noexcept { g_failing_allocations.store(n, std::memory_order_relaxed); }

  /// False if the binary did not expand KVFUSE_DEFINE_COUNTING_OPERATOR_NEW(): the counts
  /// would then be zero whatever happens, so a test must REQUIRE this first.
  [[nodiscard]] static bool hook_installed() noexcept {
    return g_alloc_hook_installed.load(std::memory_order_relaxed);
  }

 private:
  std::uint64_t global_start_;
  std::uint64_t thread_start_;
};

}  // namespace kvfuse::detail

// Replaces every global operator new/delete of the binary with counting versions.
// Expand exactly once per test executable, at global namespace scope, followed by a `;`.
#define KVFUSE_DEFINE_COUNTING_OPERATOR_NEW()                                                                     \
  void* operator new(std::size_t n) {                                                                             \
    if (void* p = ::kvfuse::detail::counted_malloc(n)) return p;                                                  \
    throw std::bad_alloc();                                                                                       \
  }                                                                                                               \
  void* operator new[](std::size_t n) {                                                                           \
    if (void* p = ::kvfuse::detail::counted_malloc(n)) return p;                                                  \
    throw std::bad_alloc();                                                                                       \
  }                                                                                                               \
  void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return ::kvfuse::detail::counted_malloc(n); } \
  void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {                                          \
    return ::kvfuse::detail::counted_malloc(n);                                                                   \
  }                                                                                                               \
  void* operator new(std::size_t n, std::align_val_t a) {                                                         \
    if (void* p = ::kvfuse::detail::counted_aligned(n, static_cast<std::size_t>(a))) return p;                    \
    throw std::bad_alloc();                                                                                       \
  }                                                                                                               \
  void* operator new[](std::size_t n, std::align_val_t a) {                                                       \
    if (void* p = ::kvfuse::detail::counted_aligned(n, static_cast<std::size_t>(a))) return p;                    \
    throw std::bad_alloc();                                                                                       \
  }                                                                                                               \
  void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {                         \
    return ::kvfuse::detail::counted_aligned(n, static_cast<std::size_t>(a));                                     \
  }                                                                                                               \
  void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {                       \
    return ::kvfuse::detail::counted_aligned(n, static_cast<std::size_t>(a));                                     \
  }                                                                                                               \
  void operator delete(void* p) noexcept { ::kvfuse::detail::counted_free(p); }                                                        \
  void operator delete[](void* p) noexcept { ::kvfuse::detail::counted_free(p); }                                                      \
  void operator delete(void* p, std::size_t) noexcept { ::kvfuse::detail::counted_free(p); }                                           \
  void operator delete[](void* p, std::size_t) noexcept { ::kvfuse::detail::counted_free(p); }                                         \
  void operator delete(void* p, const std::nothrow_t&) noexcept { ::kvfuse::detail::counted_free(p); }                                 \
  void operator delete[](void* p, const std::nothrow_t&) noexcept { ::kvfuse::detail::counted_free(p); }                               \
  void operator delete(void* p, std::align_val_t) noexcept { ::kvfuse::detail::counted_free(p); }                                      \
  void operator delete[](void* p, std::align_val_t) noexcept { ::kvfuse::detail::counted_free(p); }                                    \
  void operator delete(void* p, std::size_t, std::align_val_t) noexcept { ::kvfuse::detail::counted_free(p); }                         \
  void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { ::kvfuse::detail::counted_free(p); }                       \
  void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { ::kvfuse::detail::counted_free(p); }               \
  void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { ::kvfuse::detail::counted_free(p); }             \
  [[maybe_unused]] static const bool kvfuse_alloc_hook_installed_ =                                               \
      (::kvfuse::detail::g_alloc_hook_installed.store(true), true)
