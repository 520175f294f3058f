"""pagedserve.mkl_vml: importing pagedserve's torch side settles oneMKL's
lazy VML dispatch, so the first multi-threaded exp/log/sin/... of a process
is as accurate as the others (pytorch/pytorch#188792).

The race itself cannot be triggered on demand: on a 2-core AVX-512 Xeon with
torch 2.13, a fresh process's first multi-threaded torch.exp of a masked
softmax tile was wrong (half the elements off by ~1e-4) in 2 of 24 processes
started four at a time, 8 of 40 started one at a time next to a busy core,
and in 0 of 64 after the warm-up. So one test checks the warm-up is wired in
(deterministic), and one runs a small storm of such processes (it catches a
lost warm-up only some of the time; it never fails with the warm-up)."""

import ast
import subprocess
import sys

import pytest
import torch

from pagedserve.mkl_vml import VML_OPS

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(),
                               reason="this torch has no MKL (its float ops do not use VML)")

WIRING = r"""
import threading
import torch
seen = []
main = threading.get_ident()
for name in %r:
    def spy(x, *a, _op=getattr(torch, name), _name=name, **k):
        seen.append((_name, str(x.dtype), x.numel(), threading.get_ident() == main))
        return _op(x, *a, **k)
    setattr(torch, name, spy)
import pagedserve.kernels  # noqa: F401
print(sorted(set(seen)))
"""

STORM = r"""
import torch
import pagedserve.kernels  # noqa: F401  (the warm-up under test)
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
q, k = torch.randn(1024, 1, 64, generator=g), torch.randn(1024, 128, 64, generator=g)
s = torch.bmm(q, k.transpose(1, 2)) * 0.125
s = s.masked_fill(torch.arange(128) >= torch.randint(1, 129, (1024, 1, 1), generator=g), float("-inf"))
x = s - s.amax(-1, keepdim=True)
p = torch.exp(x)  # this process's first torch.exp: on both threads at once
print((p.double() - x.double().exp()).abs().max().item())
"""


@needs_mkl
def test_importing_the_kernels_calls_every_vml_op_once_on_one_element_on_this_thread():
    names = [name for name, _ in VML_OPS if hasattr(torch, name)]
    out = subprocess.run([sys.executable, "-c", WIRING % (names,)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    want = sorted((name, dtype, 1, True) for name in names for dtype in ("torch.float32", "torch.float64"))
    assert seen == want


@needs_mkl
def test_first_multithreaded_exp_of_fresh_processes_is_accurate():
    errors = []
    for _wave in range(2):
        procs = [subprocess.Popen([sys.executable, "-c", STORM], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(4)]
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
            errors.append(float(out.strip().splitlines()[-1]))
    assert max(errors) < 1e-6, errors


def test_warm_up_reports_whether_torch_has_mkl():
    from pagedserve.mkl_vml import warm_up_mkl_vml

    assert warm_up_mkl_vml() is torch.backends.mkl.is_available()
