#include "metal_library.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>

#include <string>

#include "core/errors.h"

namespace pagedserve {
namespace metal {

namespace {

std::string dirname_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

bool is_set(const char* v) { return v != nullptr && v[0] != '\0'; }

}  // namespace

std::string LibraryCandidate::describe() const {
  return (kind == Kind::kMetallib ? "metallib " + path : std::string("embedded source")) + " (" + origin + ")";
}

std::vector<LibraryCandidate> library_candidates(const char* env_metallib, const char* env_force_source,
                                                 const std::vector<std::string>& module_dirs) {
  bool force_source = false;
  if (is_set(env_force_source)) {
    const std::string v = env_force_source;
    if (v != "0" && v != "1") {
      throw InvalidArgumentError(std::string(kForceSourceEnv) + " must be 0 or 1, got '" + v + "'");
    }
    force_source = v == "1";
  }
  if (force_source && is_set(env_metallib)) {
    throw InvalidArgumentError(std::string(kForceSourceEnv) + "=1 and " + kMetallibEnv +
                               " ask for different kernel libraries: set one of them");
  }
  std::vector<LibraryCandidate> out;
  LibraryCandidate source;
  source.kind = LibraryCandidate::Kind::kEmbeddedSource;
  if (force_source) {
    source.origin = std::string(kForceSourceEnv) + "=1";
    source.required = true;
    out.push_back(source);
    return out;
  }
  if (is_set(env_metallib)) {
    LibraryCandidate lib;
    lib.kind = LibraryCandidate::Kind::kMetallib;
    lib.path = env_metallib;
    lib.origin = kMetallibEnv;
    lib.required = true;
    out.push_back(lib);
    return out;
  }
  for (const std::string& dir : module_dirs) {
    LibraryCandidate lib;
    lib.kind = LibraryCandidate::Kind::kMetallib;
    lib.path = dir + "/" + kMetallibName;
    lib.origin = "installed next to _core";
    bool seen = false;
    for (const LibraryCandidate& c : out) seen = seen || c.path == lib.path;
    if (!seen) out.push_back(lib);
  }
  source.origin = "run-time compile, fast math off";
  out.push_back(source);
  return out;
}

std::vector<std::string> module_directories() {
  std::vector<std::string> dirs;
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&module_directories), &info) == 0 || info.dli_fname == nullptr) {
    return dirs;
  }
  const std::string loaded = info.dli_fname;
  dirs.push_back(dirname_of(loaded));
  char resolved[PATH_MAX];
  if (realpath(loaded.c_str(), resolved) != nullptr) {
    const std::string real_dir = dirname_of(resolved);
    if (real_dir != dirs.front()) dirs.push_back(real_dir);
  }
  return dirs;
}

std::string library_failure_message(const std::vector<std::pair<LibraryCandidate, std::string>>& attempts) {
  std::string msg = "no Metal kernel library could be loaded:";
  for (const auto& a : attempts) msg += "\n  " + a.first.describe() + ": " + a.second;
  if (attempts.empty()) msg += " nothing to try";
  return msg;
}

}  // namespace metal
}  // namespace pagedserve
