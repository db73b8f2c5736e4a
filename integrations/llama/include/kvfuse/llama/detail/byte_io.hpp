// kvfuse/llama/detail/byte_io.hpp — bounds-checked reads and appends of values in host
// byte order (as llama.cpp writes its state), for state_blob.hpp. Knows nothing of the
// blob's layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <kvfuse/error.hpp>

namespace kvfuse::llama::detail {

[[noreturn]] inline void corrupt(const std::string& what) {
  throw Error(ErrorCode::corrupt_data, "llama state blob: " + what);
}

/// Bounds-checked reads; a short blob is corrupt data, never a crash.
class Reader {
 public:
  Reader(std::span<const std::uint8_t> bytes, std::size_t offset = 0) : bytes_(bytes), offset_(offset) {
    if (offset_ > bytes_.size()) corrupt("is " + std::to_string(bytes_.size()) + " bytes, shorter than its header");
  }
  template <class T>
  T get() {
    T value;
    std::memcpy(&value, take(sizeof(T)), sizeof(T));
    return value;
  }
  const std::byte* take(std::size_t n) {
    if (n > bytes_.size() - offset_) corrupt("ends at byte " + std::to_string(bytes_.size()) + ", needed " +
                                             std::to_string(n) + " more at byte " + std::to_string(offset_));
    const auto* p = reinterpret_cast<const std::byte*>(bytes_.data() + offset_);
    offset_ += n;
    return p;
  }
  /// `count` items of `size` bytes; a product that would overflow is corrupt too.
  const std::byte* take_items(std::uint64_t count, std::uint64_t size) {
    if (size != 0 && count > (bytes_.size() - offset_) / size)
      corrupt("claims " + std::to_string(count) + " items of " + std::to_string(size) + " bytes at byte " +
              std::to_string(offset_) + " of " + std::to_string(bytes_.size()));
    return take(static_cast<std::size_t>(count * size));
  }
  void expect(std::uint32_t want, const char* what) {
    const auto got = get<std::uint32_t>();
    if (got != want) corrupt(std::string(what) + " is " + std::to_string(got) + ", expected " + std::to_string(want));
  }
  [[nodiscard]] std::size_t offset() const noexcept { return offset_; }
  [[nodiscard]] bool at_end() const noexcept { return offset_ == bytes_.size(); }

 private:
  std::span<const std::uint8_t> bytes_;
  std::size_t offset_;
};

template <class T>
void put(std::vector<std::uint8_t>& out, T value) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}
inline void put_bytes(std::vector<std::uint8_t>& out, const void* p, std::size_t n) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}
// `n` bytes appended to `out`, to be written through the pointer: one resize where a loop
// of put_bytes would grow the vector a row (or an element) at a time.
inline std::uint8_t* grow(std::vector<std::uint8_t>& out, std::size_t n) {
  const std::size_t at = out.size();
  out.resize(at + n);
  return out.data() + at;
}

}  // namespace kvfuse::llama::detail
