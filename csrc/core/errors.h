// Typed errors raised by the PagedServe core. bindings.cc maps each one to a
// Python exception class of the same name (pagedserve.errors re-exports them).
#pragma once

#include <stdexcept>
#include <string>

namespace pagedserve {

// Base class of every error the core raises on purpose.
class PagedServeError : public std::runtime_error {
 public:
  explicit PagedServeError(const std::string& msg) : std::runtime_error(msg) {}
};

// A block id out of range, freed twice, or used after it was freed.
class BlockPoolError : public PagedServeError {
 public:
  using PagedServeError::PagedServeError;
};

// allocate/append found no free block: called without a successful
// can_allocate/can_append first (never used for other preconditions).
class OutOfBlocksError : public PagedServeError {
 public:
  using PagedServeError::PagedServeError;
};

// A request that can never be served (empty prompt, longer than the context,
// more KV blocks than the whole pool, duplicate id, bad parameters).
class RequestRejectedError : public PagedServeError {
 public:
  using PagedServeError::PagedServeError;
};

// An argument that breaks a documented precondition: a bad config value, a
// position outside a block table, a sampled-token count that does not match
// the last schedule(). Maps to a Python class that is also a ValueError.
class InvalidArgumentError : public PagedServeError {
 public:
  using PagedServeError::PagedServeError;
};

// A request or sequence id that the scheduler / KV cache manager does not hold.
class UnknownRequestError : public PagedServeError {
 public:
  using PagedServeError::PagedServeError;
};

// A kernel argument with the wrong shape, dtype, layout or an index out of range.
class KernelArgumentError : public PagedServeError {
 public:
  using PagedServeError::PagedServeError;
};

}  // namespace pagedserve
