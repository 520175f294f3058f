"""What this machine can do, read once, and the choices that follow from it:
the default dtype (``--dtype auto``: float32, the exact path) and whether the linear layers may run
through oneDNN in a given dtype. CPU features come from the C++ core's own
detection (CPUID/XGETBV on x86-64, getauxval/sysctl on arm64), the same one
that picks the attention kernel's ISA variant; whether torch's oneDNN bf16
path works comes from torch itself, since it is torch's path.

Tests replace ``cpu_capabilities`` (monkeypatch) to play a CPU without a feature.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class CpuCapabilities:
    """Facts about this CPU that choose dtypes and GEMM paths.

    Attributes:
        arch: "x86_64", "arm64" or "other".
        features: names from the C++ detector, e.g. ("avx2", "fma", "avx512_bf16").
        native_bf16: bfloat16 arithmetic in hardware (avx512_bf16, AMX-BF16 or Arm BF16).
        onednn_bf16: torch's oneDNN bf16 linear path runs here (it needs
            avx512bw/vl/dq or avx_ne_convert on x86-64, BF16 on arm64).
    """

    arch: str
    features: tuple[str, ...]
    native_bf16: bool
    onednn_bf16: bool


@functools.lru_cache(maxsize=1)
def cpu_capabilities() -> CpuCapabilities:
    """This CPU's capabilities (detected once per process)."""
    from .kernels import cpu_core  # here: the kernels package settles oneMKL on import, not needed before

    onednn_bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return CpuCapabilities(arch=cpu_core.cpu_arch(), features=tuple(cpu_core.cpu_features()),
                           native_bf16=cpu_core.native_bf16(), onednn_bf16=onednn_bf16)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str, device: str = "cpu") -> tuple[torch.dtype, str]:
    """Maps ``--dtype`` to a torch dtype and the reason for the choice.

    "auto" on CPU: float32, always. It is the exact path (a token's logits are
    the model's own up to float32 summation order), and the fastest one for
    few users: with a GGUF model its decode calls read the file's own blocks
    (the gguf GEMM path), where bfloat16 reads a de-quantised copy twice the
    size of a 4-bit file (about 2.5x the time per token for one user:
    docs/benchmarks.md, "Behind the code"). bfloat16 rounds every weight and activation,
    so answers depend on what shares the batch: it is opt-in (``--dtype
    bfloat16``), as --quantization is. On a GPU device: bfloat16. Raises
    ValueError for an unknown name.
    """
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got '{dtype}'")
        return DTYPES[dtype], "asked for"
    if torch.device(device).type != "cpu":
        return torch.bfloat16, f"auto: {device} device"
    caps = cpu_capabilities()
    have = [f for f in caps.features if f in ("avx512_bf16", "amx_bf16", "bf16")]
    opt_in = (f"this CPU has native bfloat16 ({', '.join(have)}): --dtype bfloat16 trades exactness for "
              "speed at large batches" if caps.native_bf16 else "this CPU has no native bfloat16 arithmetic")
    return torch.float32, f"auto: float32, the exact path ({opt_in})"


def onednn_linear_unsupported(dtype: torch.dtype) -> str | None:
    """Why the oneDNN linear path cannot run in ``dtype`` on this CPU, or None if it can."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if dtype == torch.bfloat16 and not cpu_capabilities().onednn_bf16:
        return ("oneDNN's bfloat16 linear needs avx512bw/avx512vl/avx512dq or avx_ne_convert "
                "(x86-64) or BF16 (arm64), which this CPU lacks")
    return None


def release_free_memory() -> bool:
    """Returns the C heap's free pages to the OS (glibc's ``malloc_trim``),
    where the C library has it; a no-op elsewhere. Loading a model frees far
    more than it keeps (a float32 checkpoint read, checked and dropped for its
    GGUF blocks): without this the freed pages stay in the process's RSS
    (measured with SmolLM2 on the gguf path: 1265 -> 591 MiB). Returns whether
    it ran."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # TypeError: Windows' CDLL(None)
        return False
    trim(0)
    return True
