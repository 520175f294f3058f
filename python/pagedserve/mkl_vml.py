"""A guard against a oneMKL race that makes torch's CPU float math silently
inaccurate on its first call.

PyTorch computes contiguous float32/float64 unary ops (exp, log, sqrt, sin,
tanh, erf, ...) on the CPU with oneMKL's vector math library (VML): each
intra-op (OpenMP) thread calls e.g. ``vmsExp`` on its chunk, asking for high
accuracy. oneMKL picks each VML function's kernel lazily, on that function's
first call; when the first call runs on several threads at once, one thread
can run a low-accuracy kernel for its whole chunk of that one call (reported
as pytorch/pytorch#188792, seen with the oneMKL 2024.2 that torch's wheels
bundle). Measured here (torch 2.13, 2 threads, 2-core AVX-512 Xeon, one core
busy): the first ``torch.exp`` of a [1024, 1, 128] float32 tensor in a fresh
process had half its elements off by up to 1.1e-4 (1e-6 expected) in 8 of 40
processes; after this warm-up, 0 of 40. The PyTorch reference attention
backend's online softmax hit it (a flaky parity test), and so could any
model's first forward.

``warm_up_mkl_vml()`` calls every VML function torch uses once, on a single
element on the calling thread, so each dispatch is settled before any
multi-threaded use. It costs well under a millisecond and is a no-op on a
torch built without MKL.
"""

from __future__ import annotations

import functools

import torch

# The torch ops backed by oneMKL VML functions (vms*/vmd* in libtorch_cpu),
# each with an argument inside its domain.
VML_OPS: tuple[tuple[str, float], ...] = (
    ("exp", 0.5), ("log", 0.5), ("log2", 0.5), ("log10", 0.5), ("sqrt", 0.5),
    ("sin", 0.5), ("cos", 0.5), ("tan", 0.5), ("tanh", 0.5), ("asin", 0.5),
    ("acos", 0.5), ("atan", 0.5), ("erf", 0.5), ("erfc", 0.5), ("erfinv", 0.5),
    ("trunc", 0.5),
)


@functools.cache
def warm_up_mkl_vml() -> bool:
    """Calls each op of VML_OPS once on a one-element float32 and float64
    tensor, on this thread (once per process; later calls do nothing).
    Returns True if torch has MKL (the warm-up ran), False otherwise. Raises
    nothing on a torch that lacks one of the ops (skipped)."""
    if not torch.backends.mkl.is_available():
        return False
    with torch.inference_mode():
        for dtype in (torch.float32, torch.float64):
            for name, arg in VML_OPS:
                op = getattr(torch, name, None)
                if op is not None:
                    op(torch.full((1,), arg, dtype=dtype))
    return True
