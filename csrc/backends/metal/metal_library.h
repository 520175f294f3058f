// Where the Metal kernels come from, in order (plain C++: the order and its
// messages are tested on Linux; metal_device.cc does the loading):
//
//   1. PAGEDSERVE_METALLIB=<path>: that .metallib and nothing else (a file that
//      does not load is an error naming it: the user asked for it);
//   2. pagedserve.metallib next to the _core module (the build installs it
//      there; a symlinked module is also looked up beside its target);
//   3. the kernel source embedded in the build (metal_source.h), compiled at run
//      time with fast math off.
//
// PAGEDSERVE_METAL_SOURCE=1 skips 1 and 2 (forces the run-time compile: the
// tests use it to check the embedded source). Setting both variables is an error.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace pagedserve {
namespace metal {

constexpr const char* kMetallibEnv = "PAGEDSERVE_METALLIB";
constexpr const char* kForceSourceEnv = "PAGEDSERVE_METAL_SOURCE";
constexpr const char* kMetallibName = "pagedserve.metallib";

struct LibraryCandidate {
  enum class Kind { kMetallib, kEmbeddedSource };
  Kind kind = Kind::kEmbeddedSource;
  std::string path;    // the .metallib (kMetallib)
  std::string origin;  // why it is tried, for messages: "PAGEDSERVE_METALLIB", "installed next to _core", ...
  bool required = false;  // chosen explicitly: its failure is the error, nothing else is tried
  std::string describe() const;  // "metallib <path> (<origin>)" or "embedded source (<origin>)"
};

// The candidates in order for these environment values (nullptr: unset) and
// the directories the _core module was loaded from. Throws InvalidArgumentError
// when both variables are set, or PAGEDSERVE_METAL_SOURCE is neither 0 nor 1.
std::vector<LibraryCandidate> library_candidates(const char* env_metallib, const char* env_force_source,
                                                 const std::vector<std::string>& module_dirs);

// Directories of the shared object this code is linked into (the _core module):
// the path it was loaded by and, if different, the directory of its real path.
std::vector<std::string> module_directories();

// The error when no candidate loaded: each attempt and why it failed.
std::string library_failure_message(const std::vector<std::pair<LibraryCandidate, std::string>>& attempts);

}  // namespace metal
}  // namespace pagedserve
