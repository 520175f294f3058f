#include "sha256.h"

#include "errors.h"

#if defined(__APPLE__)
#include <CommonCrypto/CommonDigest.h>
#else
#include <openssl/evp.h>
#endif

namespace pagedserve {

#if defined(__APPLE__)
Sha256::Sha256() : ctx_(new CC_SHA256_CTX) { CC_SHA256_Init(static_cast<CC_SHA256_CTX*>(ctx_)); }
Sha256::~Sha256() { delete static_cast<CC_SHA256_CTX*>(ctx_); }
void Sha256::update(const void* data, size_t n) {
  CC_SHA256_Update(static_cast<CC_SHA256_CTX*>(ctx_), data, static_cast<CC_LONG>(n));
}
Sha256Digest Sha256::digest() {
  Sha256Digest d{};
  CC_SHA256_Final(d.data(), static_cast<CC_SHA256_CTX*>(ctx_));
  return d;
}
#else
Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  if (ctx_ == nullptr || EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) != 1) {
    throw PagedServeError("OpenSSL: cannot initialise SHA-256");
  }
}
Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }
void Sha256::update(const void* data, size_t n) {
  if (EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, n) != 1) {
    throw PagedServeError("OpenSSL: SHA-256 update failed");
  }
}
Sha256Digest Sha256::digest() {
  Sha256Digest d{};
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), d.data(), &len) != 1 || len != d.size()) {
    throw PagedServeError("OpenSSL: SHA-256 final failed");
  }
  return d;
}
#endif

Sha256Digest sha256(const void* data, size_t n) {
  Sha256 h;
  h.update(data, n);
  return h.digest();
}

std::string to_hex(const Sha256Digest& d) {
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) {
    s += hex[b >> 4];
    s += hex[b & 15];
  }
  return s;
}

}  // namespace pagedserve
