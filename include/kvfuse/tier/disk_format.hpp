// kvfuse/tier/disk_format.hpp — what a DiskTier directory holds, byte by byte: the entry
// file header and the file names. A compatibility promise: a directory written by one build
// is read by the next (R18), so a change here is a new format version, never an edit.
//
// Entry file: an 80-byte header, then the payload. All integers are little-endian, written
// byte by byte (detail/little_endian.hpp), so the bytes are the same on every host. Every
// version has the same layout; what a version changes is the checksum algorithm:
//
//   [0,8)    magic "KVFUSEDT" (4B 56 46 55 53 45 44 54)
//   [8,12)   format version (1 or 2, below)
//   [12,16)  header size in bytes (80)
//   [16,24)  key.model
//   [24,32)  key.hash
//   [32,36)  key.world_size
//   [36,40)  key.rank
//   [40]     key.kind (1 = kv_chunk, 2 = state)
//   [41,48)  zero
//   [48,56)  payload length in bytes
//   [56,64)  checksum of the payload (the version's algorithm, seed 0)
//   [64,72)  reserved: written as zero; not checked on read (the header checksum covers it)
//   [72,80)  checksum of header bytes [0,72) (the version's algorithm, seed 0)
//   [80,…)   payload: exactly `payload length` bytes, nothing after it
//
//   version  checksum [56,64) and [72,80)   written by
//   1        XXH64, seed 0                  kvfuse 0.2.0; still read, never written
//   2        XXH3-64 (XXH3_64bits), seed 0  this build
//
// Version 2 exists because XXH3 is faster than XXH64 on the payloads a load checks
// (bench/README.md); the algorithm is chosen from the version field in one place
// (entry_checksum, EntryChecksum), so every reader accepts both.
//
// Readers refuse (never misread) a wrong magic, version or header size, a header checksum
// that does not match, an unknown kind, nonzero padding, and a file whose size is not
// header + payload length (truncated, or trailing bytes). The payload checksum is checked
// by whoever reads the payload (DiskTier::get, and the opening scan unless told not to).
//
// The same entry layout is a RedisTier value (tier/redis_tier.hpp): header + payload, one
// string. Both tiers build it with encode_entry_header and check it with check_header
// (a header against the key it must hold and the entry's total size); check_entry adds the
// payload checksum for an entry that is whole in memory. One algorithm, one place.
//
// File names spell the whole key, fixed-width lowercase hex, so a directory listing alone
// rebuilds the catalogue and a file can never be served under another key:
//
//   kv-<model:16>-<hash:16>-<world_size:8>-<rank:8>.kvt     a kv_chunk entry (58 chars)
//   st-<model:16>-<hash:16>-<world_size:8>-<rank:8>.kvt     a state entry
//   .tmp-<entry name>-<16 hex>                              a put not yet published
//   quarantine/<name cut to 200>.q<16 hex>                  a file that failed validation
//
// Internal: not part of the public API (DiskTier is). Pure functions: any thread, noexcept,
// no allocation.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>

#include <kvfuse/detail/checksum.hpp>
#include <kvfuse/detail/little_endian.hpp>
#include <kvfuse/tier/tier.hpp>

namespace kvfuse::detail::disk {

/// Bytes of the entry header; the payload starts here.
inline constexpr std::size_t header_bytes = 80;
/// The format version this build writes (see the table above).
inline constexpr std::uint32_t format_version = 2;
/// The oldest format version this build still reads: every version from it to
/// format_version is read (R18).
inline constexpr std::uint32_t oldest_format_version = 1;
/// The first eight bytes of every entry file.
inline constexpr char magic[8] = {'K', 'V', 'F', 'U', 'S', 'E', 'D', 'T'};
/// Characters in an entry file name: "kv-" 16 "-" 16 "-" 8 "-" 8 ".kvt".
inline constexpr std::size_t name_length = 58;
/// The name without ".kvt": what spells the key (a RedisTier key is its prefix + this stem).
inline constexpr std::size_t stem_length = name_length - 4;
/// What follows the stem in a file name.
inline constexpr std::string_view name_suffix = ".kvt";
/// The subdirectory files that fail validation are moved to.
inline constexpr std::string_view quarantine_dir = "quarantine";
/// How the name of an unpublished put begins.
inline constexpr std::string_view temp_prefix = ".tmp-";

/// The encoded form of one header.
using HeaderBytes = std::array<std::byte, header_bytes>;

/// Whether this build reads entries of format `version`. Any thread; noexcept.
[[nodiscard]] constexpr bool readable_version(std::uint32_t version) noexcept {
  return version >= oldest_format_version && version <= format_version;
}

/// Whether format `version` (a readable_version) checksums with XXH64 (version 1) rather
/// than XXH3-64 (version 2). The one place the algorithm is chosen: entry_checksum and
/// EntryChecksum both ask it. Any thread; noexcept.
[[nodiscard]] constexpr bool checksum_is_xxh64(std::uint32_t version) noexcept { return version == 1; }

/// The checksum format `version` (a readable_version) uses for the payload and the header
/// (seed 0). Any thread; noexcept; no allocation; reads every byte of `bytes` once.
[[nodiscard]] inline std::uint64_t entry_checksum(std::uint32_t version, std::span<const std::byte> bytes) noexcept {
  return checksum_is_xxh64(version) ? xxh64(bytes) : xxh3_64(bytes);
}

/// entry_checksum(version, ·) fed in pieces: digest() after update()s over any split of
/// `bytes` equals entry_checksum(version, bytes). For a payload read in parts (DiskTier's
/// opening scan). One object per computation, one thread; noexcept; never allocates (holds
/// both states, ~700 bytes, 64-byte aligned: keep it on the stack or as a member).
class EntryChecksum {
 public:
  explicit EntryChecksum(std::uint32_t version) noexcept : xxh64_(checksum_is_xxh64(version)) {}

  void update(std::span<const std::byte> bytes) noexcept {
    if (xxh64_) v1_.update(bytes);
    else v2_.update(bytes);
  }

  [[nodiscard]] std::uint64_t digest() const noexcept { return xxh64_ ? v1_.digest() : v2_.digest(); }

 private:
  bool xxh64_;
  Xxh64 v1_;
  Xxh3 v2_;
};

/// What a header says about its file.
struct Header {
  TierKey key;
  std::uint64_t payload_bytes = 0;
  std::uint64_t payload_checksum = 0;  ///< entry_checksum(version, payload)
  /// The format version the header was read in (decode sets it; 1 or 2). encode ignores it
  /// and always writes format_version, so payload_checksum must then be version 2's.
  std::uint32_t version = format_version;
};

/// Why decode refused a header. Checked in this order; the first failure is reported.
enum class HeaderError : std::uint8_t {
  none = 0,
  bad_magic = 1,        ///< bytes [0,8) are not "KVFUSEDT": not an entry file
  bad_version = 2,      ///< bytes [8,12) are no readable_version (neither 1 nor 2)
  bad_header_size = 3,  ///< bytes [12,16) are not header_bytes
  bad_checksum = 4,     ///< bytes [72,80) are not the version's checksum of bytes [0,72): a torn or corrupt header
  bad_kind = 5,         ///< byte 40 is neither kv_chunk nor state
  bad_padding = 6,      ///< bytes [41,48) are not zero
};

/// The result of decode: `header` is meaningful only when `error == HeaderError::none`.
struct DecodedHeader {
  Header header;
  HeaderError error = HeaderError::none;
  [[nodiscard]] bool ok() const noexcept { return error == HeaderError::none; }
  explicit operator bool() const noexcept { return ok(); }
};

/// Encodes `h` in format_version (2: see the table above), header checksum included;
/// `h.version` is not used (a build writes one version) and `h.payload_checksum` must be
/// entry_checksum(format_version, payload). Any thread; noexcept; no allocation.
[[nodiscard]] inline HeaderBytes encode(const Header& h) noexcept {
  HeaderBytes out{};
  std::memcpy(out.data(), magic, sizeof magic);
  put_le(out.data() + 8, format_version, 4);
  put_le(out.data() + 12, header_bytes, 4);
  put_le(out.data() + 16, h.key.model, 8);
  put_le(out.data() + 24, h.key.hash.value, 8);
  put_le(out.data() + 32, h.key.world_size, 4);
  put_le(out.data() + 36, h.key.rank, 4);
  put_le(out.data() + 40, static_cast<std::uint8_t>(h.key.kind), 1);
  put_le(out.data() + 48, h.payload_bytes, 8);
  put_le(out.data() + 56, h.payload_checksum, 8);
  put_le(out.data() + 72, entry_checksum(format_version, std::span<const std::byte>(out.data(), 72)), 8);
  return out;
}

/// Decodes and validates a header of any readable version: magic, version, header size,
/// checksum (the version's algorithm), kind, padding, in that order. Does not see the file,
/// so the length check is file_size_matches. Any thread; noexcept; no allocation.
[[nodiscard]] inline DecodedHeader decode(std::span<const std::byte, header_bytes> in) noexcept {
  DecodedHeader d;
  const auto kind = get_le(in.data() + 40, 1);
  const auto version = static_cast<std::uint32_t>(get_le(in.data() + 8, 4));
  if (std::memcmp(in.data(), magic, sizeof magic) != 0) d.error = HeaderError::bad_magic;
  else if (!readable_version(version)) d.error = HeaderError::bad_version;
  else if (get_le(in.data() + 12, 4) != header_bytes) d.error = HeaderError::bad_header_size;
  else if (get_le(in.data() + 72, 8) != entry_checksum(version, in.first<72>())) d.error = HeaderError::bad_checksum;
  else if (kind != static_cast<std::uint8_t>(EntryKind::kv_chunk) && kind != static_cast<std::uint8_t>(EntryKind::state))
    d.error = HeaderError::bad_kind;
  else
    for (std::size_t i = 41; i < 48; ++i)
      if (in[i] != std::byte{0}) d.error = HeaderError::bad_padding;
  if (!d.ok()) return d;
  d.header.key.model = get_le(in.data() + 16, 8);
  d.header.key.hash.value = get_le(in.data() + 24, 8);
  d.header.key.world_size = static_cast<std::uint32_t>(get_le(in.data() + 32, 4));
  d.header.key.rank = static_cast<std::uint32_t>(get_le(in.data() + 36, 4));
  d.header.key.kind = static_cast<EntryKind>(kind);
  d.header.payload_bytes = get_le(in.data() + 48, 8);
  d.header.payload_checksum = get_le(in.data() + 56, 8);
  d.header.version = version;
  return d;
}

/// Whether a file of `file_size` bytes is exactly this header plus the payload it declares
/// (false for a truncated file or one with trailing bytes). Any thread; noexcept.
[[nodiscard]] inline bool file_size_matches(const Header& h, std::uint64_t file_size) noexcept {
  return file_size >= header_bytes && file_size - header_bytes == h.payload_bytes;
}

/// The format_version header of an entry holding `payload` under `key` (its payload
/// checksum computed here). What DiskTier writes in front of a file and RedisTier in front
/// of a value. Any thread; noexcept; no allocation; reads every payload byte once.
[[nodiscard]] inline HeaderBytes encode_entry_header(const TierKey& key, std::span<const std::byte> payload) noexcept {
  return encode(Header{key, payload.size(), entry_checksum(format_version, payload), format_version});
}

/// Why an entry (a file, a remote value) was refused; `none` when it may be served.
enum class EntryError : std::uint8_t {
  none = 0,
  too_short = 1,         ///< fewer bytes than a header: truncated, or not an entry at all
  bad_header = 2,        ///< decode refused the header (see DecodedHeader::error)
  wrong_key = 3,         ///< a valid header for another key: never served under this one
  bad_length = 4,        ///< the entry is not exactly header + declared payload (truncated or trailing bytes)
  bad_payload_checksum = 5,
};

/// Checks the header `raw` of an entry of `entry_bytes` bytes in all (header included)
/// that must hold `expected`: decode, key, length. On success `out` is the header. Any
/// thread; noexcept; no allocation.
[[nodiscard]] inline EntryError check_header(std::span<const std::byte, header_bytes> raw, const TierKey& expected,
                                             std::uint64_t entry_bytes, Header& out) noexcept {
  const DecodedHeader decoded = decode(raw);
  if (!decoded) return EntryError::bad_header;
  if (decoded.header.key != expected) return EntryError::wrong_key;
  if (!file_size_matches(decoded.header, entry_bytes)) return EntryError::bad_length;
  out = decoded.header;
  return EntryError::none;
}

/// The result of check_entry: `payload` (inside the entry) is meaningful only when
/// `error == EntryError::none`.
struct CheckedEntry {
  std::span<const std::byte> payload;
  EntryError error = EntryError::none;
  [[nodiscard]] bool ok() const noexcept { return error == EntryError::none; }
};

/// Checks a whole entry held in memory (header then payload) that must hold `expected`:
/// check_header, then the payload checksum of the header's version. Any thread; noexcept; no
/// allocation; reads every payload byte once.
[[nodiscard]] inline CheckedEntry check_entry(std::span<const std::byte> entry, const TierKey& expected) noexcept {
  if (entry.size() < header_bytes) return {{}, EntryError::too_short};
  Header header;
  if (const EntryError e = check_header(entry.first<header_bytes>(), expected, entry.size(), header); e != EntryError::none)
    return {{}, e};
  const std::span<const std::byte> payload = entry.subspan(header_bytes);
  if (entry_checksum(header.version, payload) != header.payload_checksum) return {{}, EntryError::bad_payload_checksum};
  return {payload, EntryError::none};
}

/// Writes `v` as `digits` lowercase hex digits at `out`; returns the end. Any thread; noexcept.
inline char* put_hex(char* out, std::uint64_t v, int digits) noexcept {
  constexpr char hex[] = "0123456789abcdef";
  for (int i = digits - 1; i >= 0; --i, v >>= 4) out[i] = hex[v & 0xf];
  return out + digits;
}

/// Writes the entry file name of `key` (NUL-terminated) into `out`. False for a kind that
/// has no file name (not kv_chunk or state). Any thread; noexcept; no allocation.
inline bool format_name(const TierKey& key, char (&out)[64]) noexcept {
  char* p = out;
  if (key.kind == EntryKind::kv_chunk) {
    *p++ = 'k';
    *p++ = 'v';
  } else if (key.kind == EntryKind::state) {
    *p++ = 's';
    *p++ = 't';
  } else {
    return false;
  }
  *p++ = '-';
  p = put_hex(p, key.model, 16);
  *p++ = '-';
  p = put_hex(p, key.hash.value, 16);
  *p++ = '-';
  p = put_hex(p, key.world_size, 8);
  *p++ = '-';
  p = put_hex(p, key.rank, 8);
  std::memcpy(p, ".kvt", 5);
  return true;
}

/// Writes the name a put of an entry writes before it renames — temp_prefix, the entry name
/// `entry` (from format_name), '-', `nonce` in 16 hex digits, NUL — into `out`. Any thread;
/// noexcept.
inline void format_temp_name(const char (&entry)[64], std::uint64_t nonce, char (&out)[96]) noexcept {
  std::memcpy(out, temp_prefix.data(), temp_prefix.size());
  char* p = out + temp_prefix.size();
  std::memcpy(p, entry, name_length);
  p += name_length;
  *p++ = '-';
  p = put_hex(p, nonce, 16);
  *p = '\0';
}

/// Writes the name a file that failed validation gets in quarantine/ — `name` cut to 200
/// characters, ".q", `nonce` in 16 hex digits, NUL — into `out`. Any thread; noexcept.
inline void format_quarantine_name(std::string_view name, std::uint64_t nonce, char (&out)[256]) noexcept {
  const std::size_t keep = name.size() < 200 ? name.size() : 200;
  std::memcpy(out, name.data(), keep);
  char* p = out + keep;
  *p++ = '.';
  *p++ = 'q';
  p = put_hex(p, nonce, 16);
  *p = '\0';
}

/// The key an entry file name spells, or nothing if `name` is not exactly an entry name
/// (the canonical spelling: parse and format round-trip). Any thread; noexcept.
inline std::optional<TierKey> parse_name(std::string_view name) noexcept {
  if (name.size() != name_length) return std::nullopt;
  TierKey key;
  if (name.starts_with("kv-")) {
    key.kind = EntryKind::kv_chunk;
  } else if (name.starts_with("st-")) {
    key.kind = EntryKind::state;
  } else {
    return std::nullopt;
  }
  auto field = [&](std::size_t at, int digits, std::uint64_t& v) {
    v = 0;
    for (int i = 0; i < digits; ++i) {
      const char c = name[at + static_cast<std::size_t>(i)];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) return false;
      v = v << 4 | static_cast<std::uint64_t>(d);
    }
    return true;
  };
  std::uint64_t world = 0, rank = 0;
  if (!field(3, 16, key.model) || name[19] != '-' || !field(20, 16, key.hash.value) || name[36] != '-' ||
      !field(37, 8, world) || name[45] != '-' || !field(46, 8, rank) || name.substr(54) != ".kvt")
    return std::nullopt;
  key.world_size = static_cast<std::uint32_t>(world);
  key.rank = static_cast<std::uint32_t>(rank);
  return key;
}

}  // namespace kvfuse::detail::disk
