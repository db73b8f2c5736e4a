// kvfuse/detail/spin.hpp — busy-wait helpers: one polite iteration (cpu_relax) and a
// bounded poll (poll_for) for the opt-in spins of lanes and emulated streams.
//
// Internal: not part of the public API. Any thread; never blocks, never allocates.
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvfuse::detail {

/// The CPU's spin-wait hint (x86 `pause`, AArch64 `yield`): a spinning hyperthread gives
/// way to its sibling and the loop does not flood the memory system. Nothing elsewhere.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

/// Polls `ready()` until it returns true or `budget` has passed; returns its last value.
/// Pauses between polls and, every 64 polls, checks the clock and yields the CPU
/// (std::this_thread::yield), so a thread that wants this CPU gets it. Hold no lock while
/// calling it.
template <class Ready>
bool poll_for(std::chrono::nanoseconds budget, Ready&& ready) noexcept {
  using SpinClock = std::chrono::steady_clock;
  const SpinClock::time_point until = SpinClock::now() + budget;
  for (std::uint32_t i = 1;; ++i) {
    if (ready()) return true;
    cpu_relax();
    if (i % 64 == 0) {
      if (SpinClock::now() >= until) return ready();
      std::this_thread::yield();
    }
  }
}

}  // namespace kvfuse::detail
