"""Prints the metal-cpp header folder shipped by the build Python's mlx-metal
(the macOS wheel has it under mlx/include/metal_cpp; pyproject.toml lists
mlx-metal as a Darwin build requirement), or nothing. Run by
csrc/backends/metal/CMakeLists.txt with the build's Python."""

import importlib.util
import os
import sysconfig


def candidates():
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        yield from spec.submodule_search_locations or []
        if spec.origin:
            yield os.path.dirname(spec.origin)
    paths = sysconfig.get_paths()
    for key in ("purelib", "platlib"):
        if key in paths:
            yield os.path.join(paths[key], "mlx")


for root in candidates():
    folder = os.path.join(root, "include", "metal_cpp")
    if os.path.isfile(os.path.join(folder, "Metal", "Metal.hpp")):
        print(os.path.realpath(folder))
        break
