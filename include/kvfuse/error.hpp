// kvfuse/error.hpp — the one exception type kvfuse throws.
//
// Configuration and construction errors throw kvfuse::Error (R19). Hot paths (load,
// save, report, drain, settle) never throw: they report outcomes instead.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace kvfuse {

/// What kind of mistake an Error reports. Stable values: engines may switch on them.
enum class ErrorCode : int {
  invalid_argument = 1,         ///< a value out of its documented range (zero chunk size, bad capacity)
  unknown_connector = 2,        ///< a connector name the registry does not know
  duplicate_offload = 3,        ///< two offload sub-connectors in one composition
  unsupported_parallelism = 4,  ///< pipeline parallelism > 1 with a state tier
  no_device = 5,                ///< a device runtime found no device
  device_failure = 6,           ///< a device call failed while constructing something
  io_failure = 7,               ///< a file or directory could not be used
  corrupt_data = 8,             ///< bytes that fail validation (truncated, bad magic, bad checksum)
};

/// Short, stable name of an ErrorCode ("invalid_argument", ...). Thread-safe, noexcept.
constexpr std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::unknown_connector: return "unknown_connector";
    case ErrorCode::duplicate_offload: return "duplicate_offload";
    case ErrorCode::unsupported_parallelism: return "unsupported_parallelism";
    case ErrorCode::no_device: return "no_device";
    case ErrorCode::device_failure: return "device_failure";
    case ErrorCode::io_failure: return "io_failure";
    case ErrorCode::corrupt_data: return "corrupt_data";
  }
  return "unknown_error";
}

/// The exception kvfuse throws for configuration and construction errors. The message
/// always names the offending value, so an operator can fix the config from the log line.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error("kvfuse: " + std::string(to_string(code)) + ": " + message), code_(code) {}

  /// The kind of error. Thread-safe, noexcept.
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace kvfuse
