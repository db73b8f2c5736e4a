// libFuzzer target: every frame decoder on every input the fuzzer makes. It stops (traps) on
// a value that decodes but does not re-encode to its bytes; AddressSanitizer and
// UndefinedBehaviorSanitizer stop it on any out-of-bounds read or undefined behaviour.
// Build and run: CONTRIBUTING.md#fuzzing.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "frame_judge.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // A decoded frame is never longer than max_frame_bytes, so it always re-encodes into this.
  static std::vector<std::byte> scratch(kvfuse::max_frame_bytes);
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  if (kvfuse::testing::judge_frame(in, scratch).misread) __builtin_trap();
  return 0;
}
