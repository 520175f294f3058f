"""The Python face of the C++ CPU backend (``pagedserve._core.cpu``): the
only module of the package that names the binding; everything else imports
from here. Grouped as the C++ backend is (csrc/backends/cpu/):

- runtime: what the CPU is (``cpu_arch``, ``cpu_features``, ``native_bf16``),
  the kernels' thread pool (``set_thread_pool_spin_us``, ``thread_pool_spin_us``),
  transparent huge pages (``advise_huge_pages``, ``huge_pages_available``);
- attention: ``AttentionPlan`` (the per-step plan), ``reshape_and_cache``,
  ``paged_attention_scratch_bytes``; its kernel variants (``compiled_isas``,
  ``kernel_isa``, ``set_kernel_isa``);
- fused ops: ``rms_norm``, ``fused_add_rms_norm``, ``rotary_embedding``,
  ``silu_and_mul``, ``gelu_tanh_and_mul`` (``fused_ops_isa``);
- GEMM: ``QuantizedWeight`` (GGUF blocks and dense tiles, the exact float32
  and int8-activation kernels; ``quant_compiled_isas``, ``quant_kernel_isa``,
  ``set_quant_kernel_isa``);
- the native decode step: ``NativeDecoder``.

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
# attention
AttentionPlan = _cpu.AttentionPlan
reshape_and_cache = _cpu.reshape_and_cache
paged_attention_scratch_bytes = _cpu.paged_attention_scratch_bytes
compiled_isas = _cpu.compiled_isas
kernel_isa = _cpu.kernel_isa
set_kernel_isa = _cpu.set_kernel_isa
# fused ops
rms_norm = _cpu.rms_norm
fused_add_rms_norm = _cpu.fused_add_rms_norm
rotary_embedding = _cpu.rotary_embedding
silu_and_mul = _cpu.silu_and_mul
gelu_tanh_and_mul = _cpu.gelu_tanh_and_mul
fused_ops_isa = _cpu.fused_ops_isa
# GEMM
QuantizedWeight = _cpu.QuantizedWeight
quant_compiled_isas = _cpu.quant_compiled_isas
quant_kernel_isa = _cpu.quant_kernel_isa
set_quant_kernel_isa = _cpu.set_quant_kernel_isa
# the native decode step
NativeDecoder = _cpu.NativeDecoder
