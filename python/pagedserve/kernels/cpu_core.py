"""The Python face of the C++ CPU backend (``pagedserve._core.cpu``): the
only module of the package that names the binding; everything else imports
from here. Grouped as the C++ backend's folders are (csrc/backends/cpu/):

- runtime/: what the CPU is (``cpu_arch``, ``cpu_features``, ``native_bf16``),
  the one ISA registry of every kernel family (``compiled_isas``,
  ``kernel_isa``, ``set_kernel_isa``, ``kernel_tables``: the table each family
  runs with, ``variants_for(family)``: one variant per distinct table; the
  environment variable PAGEDSERVE_CPU_ISA), the kernels' thread pool
  (``set_thread_pool_spin_us``, ``thread_pool_spin_us``), transparent huge
  pages (``advise_huge_pages``, ``huge_pages_available``);
- attention/: ``AttentionPlan`` (the per-step plan), ``reshape_and_cache``,
  ``paged_attention_scratch_bytes``;
- ops/ (fused elementwise ops): ``rms_norm``, ``fused_add_rms_norm``,
  ``rotary_embedding``, ``silu_and_mul``, ``gelu_tanh_and_mul``;
- gemm/: ``QuantizedWeight`` (GGUF blocks and dense tiles, the exact float32
  and int8-activation kernels);
- step/ (the native decode step): ``NativeDecoder``.

Each name is the binding's own object (its docstring gives shapes, dtypes and
errors); the C++ and Python names are the same.
"""

from __future__ import annotations

from .. import _core

_cpu = _core.cpu

# runtime
cpu_arch = _cpu.cpu_arch
cpu_features = _cpu.cpu_features
native_bf16 = _cpu.native_bf16
set_thread_pool_spin_us = _cpu.set_thread_pool_spin_us
thread_pool_spin_us = _cpu.thread_pool_spin_us
advise_huge_pages = _cpu.advise_huge_pages
huge_pages_available = _cpu.huge_pages_available
compiled_isas = _cpu.compiled_isas
kernel_isa = _cpu.kernel_isa
set_kernel_isa = _cpu.set_kernel_isa
kernel_tables = _cpu.kernel_tables
variants_for = _cpu.variants_for
# attention
AttentionPlan = _cpu.AttentionPlan
reshape_and_cache = _cpu.reshape_and_cache
paged_attention_scratch_bytes = _cpu.paged_attention_scratch_bytes
# fused ops
rms_norm = _cpu.rms_norm
fused_add_rms_norm = _cpu.fused_add_rms_norm
rotary_embedding = _cpu.rotary_embedding
silu_and_mul = _cpu.silu_and_mul
gelu_tanh_and_mul = _cpu.gelu_tanh_and_mul
# GEMM
QuantizedWeight = _cpu.QuantizedWeight
# the native decode step
NativeDecoder = _cpu.NativeDecoder
