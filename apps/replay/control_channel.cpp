// kvfuse-replay: the control channel (control_channel.hpp).
#include "control_channel.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <new>

namespace replay {

namespace {
constexpr std::uint64_t max_payload = std::uint64_t{1} << 30;
}  // namespace

ControlChannel& ControlChannel::operator=(ControlChannel&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

bool ControlChannel::put(ControlHeader h, std::span<const std::byte> payload) noexcept {
  if (fd_ < 0) return false;
  h.bytes = payload.size();
  auto send_all = [&](const std::byte* p, std::size_t n) {
    while (n > 0) {
      const ssize_t sent = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (sent < 0 && errno == EINTR) continue;
      if (sent <= 0) return false;
      p += sent;
      n -= static_cast<std::size_t>(sent);
    }
    return true;
  };
  return send_all(reinterpret_cast<const std::byte*>(&h), sizeof h) && send_all(payload.data(), payload.size());
}

bool ControlChannel::get(ControlHeader& h, std::vector<std::byte>& payload) noexcept {
  if (fd_ < 0) return false;
  auto recv_all = [&](std::byte* p, std::size_t n) {
    while (n > 0) {
      const ssize_t got = ::recv(fd_, p, n, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      p += got;
      n -= static_cast<std::size_t>(got);
    }
    return true;
  };
  if (!recv_all(reinterpret_cast<std::byte*>(&h), sizeof h) || h.bytes > max_payload) return false;
  try {
    payload.resize(h.bytes);
  } catch (const std::bad_alloc&) {
    return false;
  }
  return recv_all(payload.data(), payload.size());
}

void ControlChannel::shut_down() noexcept {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void ControlChannel::close() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace replay
