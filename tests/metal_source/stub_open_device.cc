// open_metal_device() of the Linux test build of the _core module
// (metal_stub_core in CMakeLists.txt): the process's "Metal device" is a
// RecordingDevice that executes the kernel contract on the CPU, and its kernel
// library is chosen by metal_library.h's search order as metal_device.cc
// chooses it (a .metallib candidate "loads" when its file is readable, the
// embedded source when the build embeds one). So the bindings, the Python
// backend and the engine run end to end on Linux; only metal_device.cc and the
// kernels themselves are not in the loop.
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/metal/metal_device.h"
#include "backends/metal/metal_library.h"
#include "backends/metal/metal_source.h"
#include "core/errors.h"
#include "recording_device.h"

namespace pagedserve {
namespace metal {

std::shared_ptr<MetalDevice> open_metal_device() {
  static std::mutex mu;
  static auto* device = new std::shared_ptr<MetalDevice>();
  static auto* failure = new std::string();
  std::lock_guard<std::mutex> lock(mu);
  if (*device) return *device;
  if (!failure->empty()) throw PagedServeError(*failure);
  try {
    std::vector<std::pair<LibraryCandidate, std::string>> failures;
    std::string chosen;
    for (const LibraryCandidate& c :
         library_candidates(std::getenv(kMetallibEnv), std::getenv(kForceSourceEnv), module_directories())) {
      const bool ok = c.kind == LibraryCandidate::Kind::kMetallib ? access(c.path.c_str(), R_OK) == 0
                                                                  : kMetalKernelSource[0] != '\0';
      if (ok) {
        chosen = c.describe();
        break;
      }
      failures.emplace_back(c, c.kind == LibraryCandidate::Kind::kMetallib ? "no such readable file"
                                                                            : "this build embeds no kernel source");
      if (c.required) break;
    }
    if (chosen.empty()) throw PagedServeError(library_failure_message(failures));
    auto recording = std::make_shared<testing::RecordingDevice>();
    recording->record = false;
    recording->library = chosen;
    *device = recording;
  } catch (const std::exception& e) {
    *failure = std::string("Metal backend unavailable: ") + e.what();
    throw PagedServeError(*failure);
  }
  return *device;
}

}  // namespace metal
}  // namespace pagedserve
