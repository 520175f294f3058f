// SHA-256 from the platform crypto library: OpenSSL libcrypto (EVP) on Linux,
// CommonCrypto on macOS. Checked against NIST FIPS 180-2 vectors in gtest.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace pagedserve {

using Sha256Digest = std::array<uint8_t, 32>;

// Incremental hasher: update() any number of times, then digest() once.
// Throws PagedServeError if the crypto library fails.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t n);
  Sha256Digest digest();

 private:
  void* ctx_;
};

// One-shot SHA-256 of a byte string.
Sha256Digest sha256(const void* data, size_t n);

// Lower-case hex of a digest (for tests and debugging).
std::string to_hex(const Sha256Digest& d);

}  // namespace pagedserve
