"""The GEMM paths the linear layers can take on a CPU, and the start-up chooser
that measures them on this machine (``--linear-impl auto``).

Paths (all compute x @ W.T + b in the model's dtype; they differ only in
summation order):
  torch:  torch's default (``F.linear``: MKL or OpenBLAS sgemm, or oneDNN
          through aten for bfloat16), the weight as loaded.
  onednn: oneDNN with the weight pre-packed once in its blocked layout and
          dense activations (``torch.ops.mkldnn._linear_pointwise``), so no
          call converts layouts (OneDNNLinear).

Which is faster depends on the CPU, the dtype and the row count: on a 2-core
AVX-512 machine oneDNN's packed path beat the default at decode sizes; on an
AVX2-only machine it was slower (the issue that asked for this chooser
measured 67.8 vs 101.8 tok/s). So the chooser times the model's own linear
shapes at 1, 8, 32 and 128 rows on each path that runs here, refuses a path
that raises or computes something else, and keeps the fastest. Timing and
caching are the tuner's (pagedserve.model.tuner): the result is cached per
machine, CPU and library versions in ``$PAGEDSERVE_CACHE/linear_impl.json``,
unless the measurement was noisy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..hardware import onednn_linear_unsupported
from . import tuner
from .linear_method import LinearLayer, LinearMethod, fused_bias

logger = logging.getLogger(__name__)

LINEAR_IMPLS = ("torch", "onednn")
CHOOSER_ROWS = (1, 8, 32, 128)
CACHE_NAME = "linear_impl"  # $PAGEDSERVE_CACHE/linear_impl.json


def padded_rows(m: int) -> int:
    """The row count oneDNN sees for m rows: m rounded up to a ladder of 34 sizes
    up to 2048 (multiples of 8 to 64, of 32 to 512, of 128 beyond). oneDNN keeps
    compiled kernels and descriptors per (rows, in, out) shape; with the rows
    being the step's token count, every new step size used to add state that
    was never freed (about 0.6 MiB per request in a soak); on the ladder the
    set of shapes is bounded, and so is the memory."""
    if m <= 64:
        return (m + 7) // 8 * 8
    if m <= 512:
        return (m + 31) // 32 * 32
    return (m + 127) // 128 * 128


class OneDNNLinear(LinearLayer):
    """nn.Linear computed by oneDNN (torch.ops.mkldnn._linear_pointwise) with its
    weight pre-packed once in oneDNN's blocked layout and dense activations, so
    no call converts layouts (measured on SmolLM2, 32 requests of 64 + 64 tokens,
    2-core AVX-512: 21.7-24.0 s of CPU vs 29.3-29.6 s with aten::mkldnn_linear
    and per-call to_mkldnn / to_dense). x: [..., in_features] dense -> [..., out_features] dense,
    same dtype as the weight (float32, or bfloat16 where the CPU supports
    oneDNN's bf16 path). Rows are padded to padded_rows(m) (zeros, sliced off
    after), so oneDNN only ever sees a bounded set of shapes."""

    row_invariant = False  # LinearLayer.row_invariant: oneDNN blocks by the (padded) row count

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # packed once; the pointwise op takes dense activations (no per-call layout conversions)
        weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", linear.bias.detach() if linear.bias is not None else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        rows = padded_rows(m)
        if rows != m:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, rows - m))  # zero rows below, one allocation
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.weight, self.bias, "none", [], "")
        return y[:m].reshape(*lead, self.out_features)


def is_library_gemm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a torch linear layer a method left as it is: a
    plain ``nn.Linear`` or a subclass (torch's F.linear: MKL, OpenBLAS or
    oneDNN) or transformers' ``Conv1D`` (GPT-2's projections: torch.addmm).
    Their GEMM picks its blocking, and so a row's summation order, by the
    call's row count. (A method's own modules answer LinearLayer.row_invariant.)"""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (torch.nn.Linear, Conv1D))


def make_linear(linear: torch.nn.Linear, impl: str) -> torch.nn.Module:
    """``linear`` on the GEMM path ``impl`` (one of LINEAR_IMPLS): the module
    itself for "torch", a new OneDNNLinear sharing nothing mutable for "onednn".
    Raises ValueError for another name."""
    if impl == "torch":
        return linear
    if impl == "onednn":
        return OneDNNLinear(linear)
    raise ValueError(f"linear_impl must be one of {', '.join(LINEAR_IMPLS)}, got '{impl}'")


def why_unavailable(impl: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the GEMM path ``impl`` cannot run for ``dtype`` on ``device``, or None if it can."""
    if impl == "onednn":
        if device.type != "cpu":
            return "oneDNN linear is CPU-only"
        return onednn_linear_unsupported(dtype)
    return None


@dataclass
class LinearChoice:
    """What the chooser decided and why.

    Attributes:
        impl: the chosen path (one of LINEAR_IMPLS).
        reason: one line for the start-up log.
        ms: per path, the milliseconds one pass over the model's linear layers
            took at each measured row count ({impl: {rows: ms}}); empty when the
            path was forced or the choice came from the cache.
        refused: per path that could not be used, why.
        cached: the choice was read from the per-machine cache.
    """

    impl: str
    reason: str
    ms: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    cached: bool = False


def count_shapes(shapes) -> list[tuple[int, int, bool, int]]:
    """(in_features, out_features, has_bias) triples -> the distinct ones with how
    many times each occurs: [(in, out, bias, count)], sorted."""
    counts: dict[tuple[int, int, bool], int] = {}
    for key in shapes:
        counts[key] = counts.get(key, 0) + 1
    return sorted((i, o, b, c) for (i, o, b), c in counts.items())


def linear_shapes(model: torch.nn.Module) -> list[tuple[int, int, bool, int]]:
    """The distinct (in_features, out_features, has_bias) of the model's plain
    nn.Linear layers, with how many layers have each: [(in, out, bias, count)],
    sorted."""
    return count_shapes((m.in_features, m.out_features, m.bias is not None)
                        for m in model.modules() if type(m) is torch.nn.Linear)


def cache_path() -> Path:
    """Where chosen paths are kept: ``$PAGEDSERVE_CACHE/linear_impl.json``."""
    return tuner.TunerCache(CACHE_NAME).path


@torch.inference_mode()
def path_cases(impl: str, shapes, dtype: torch.dtype, rows=CHOOSER_ROWS,
               generator: torch.Generator | None = None) -> list:
    """The timing cases of path ``impl``: per distinct linear shape of the model,
    (module on that path, input [max(rows), in] of ``dtype``, layers of that
    shape). Each module's output is first checked against a float64 matmul;
    raises RuntimeError if the path computes something else, and whatever the
    path raises if it cannot run here."""
    g = generator or torch.Generator().manual_seed(0)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    cases = []
    for in_f, out_f, has_bias, count in shapes:
        lin = torch.nn.Linear(in_f, out_f, bias=has_bias, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * in_f ** -0.5)
            if has_bias:
                lin.bias.copy_(torch.randn(out_f, generator=g))
        mod = make_linear(lin, impl)
        x = torch.randn(max(rows), in_f, generator=g).to(dtype)
        want = x.double() @ lin.weight.double().T + (lin.bias.double() if has_bias else 0)
        got = mod(x).double()
        err = float((got - want).abs().max() / (1.0 + want.abs().max()))
        if not err <= tol:
            raise RuntimeError(f"the {impl} path's {in_f}->{out_f} output differs from a float64 matmul by "
                               f"{err:.3g} (relative; allowed {tol:g})")
        cases.append((mod, x, count))
    return cases


def choose_linear_impl(model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu",
                       requested: str = "auto", use_cache: bool = True, rounds: int = 3,
                       shapes: list[tuple[int, int, bool, int]] | None = None, clock: tuner.Clock | None = None,
                       probe: tuner.LoadProbe | None = None) -> LinearChoice:
    """Decides the GEMM path of ``model``'s linear layers (does not apply it).

    ``requested`` is "auto" or one of LINEAR_IMPLS. A named path that cannot
    run here raises ValueError (a start-up error, never a silent fallback).
    "auto" measures each available path (path_cases, time_cases) — the model's
    own shapes at 1, 8, 32 and 128 rows, about 10 ms per (shape, row count), best
    of ``rounds`` rounds that alternate the paths — and
    keeps the one with the smallest mean slowdown against the best path at each
    row count; a path that raises or computes something else is refused and
    never chosen. The result is cached per machine (cache_path(); the tuner
    module's rules: a noisy measurement or one taken while other processes ran
    decides this start only). ``shapes``: the (in_features, out_features,
    has_bias, count) the engine will run (linear_shapes' form; default: the
    model's own nn.Linear layers). ``clock``, ``probe``: the tuner's timer and
    load probe (tests inject theirs). Raises RuntimeError when no path runs.
    """
    device = torch.device(device)
    if requested != "auto":
        if requested not in LINEAR_IMPLS:
            raise ValueError(f"linear_impl must be 'auto' or one of {', '.join(LINEAR_IMPLS)}, got '{requested}'")
        why = why_unavailable(requested, dtype, device)
        if why is not None:
            raise ValueError(f"--linear-impl {requested} cannot run here: {why}")
        return LinearChoice(requested, "asked for")
    refused = {}
    candidates = []
    for impl in LINEAR_IMPLS:
        why = why_unavailable(impl, dtype, device)
        if why is None:
            candidates.append(impl)
        else:
            refused[impl] = why
    if device.type != "cpu" or len(candidates) == 1:
        return LinearChoice(candidates[0], "the only path available here" + (
            f" ({'; '.join(f'{k}: {v}' for k, v in refused.items())})" if refused else ""), refused=refused)
    shapes = [list(s) for s in (linear_shapes(model) if shapes is None else shapes)]
    what = {"dtype": str(dtype), "shapes": shapes, "rows": list(CHOOSER_ROWS)}
    cache = tuner.TunerCache(CACHE_NAME)
    if use_cache:
        entry = cache.get(what)
        if entry and entry.get("impl") in candidates:
            return LinearChoice(entry["impl"], f"measured on this machine before ({cache.path})",
                                ms=entry.get("ms", {}), refused=refused, cached=True)
    cases = {}
    for impl in candidates:
        try:
            cases[impl] = path_cases(impl, shapes, dtype)
            tuner.time_cases(cases[impl], CHOOSER_ROWS, seconds_per_case=0.0)  # every row count runs once first
        except Exception as e:  # a path that cannot run or computes something else is never chosen
            refused[impl] = f"{type(e).__name__}: {e}"
            logger.warning("linear path %s refused: %s", impl, refused[impl])
            cases.pop(impl, None)
    if not cases:
        raise RuntimeError(f"no GEMM path works on this machine: {refused}")
    measured = tuner.measure(cases, CHOOSER_ROWS, rounds=rounds, clock=clock, probe=probe)
    ms = measured.ms
    best_at = {r: min(times[r] for times in ms.values()) for r in CHOOSER_ROWS}
    score = {impl: sum(times[r] / best_at[r] for r in CHOOSER_ROWS) / len(CHOOSER_ROWS) for impl, times in ms.items()}
    impl = min(score, key=score.get)
    table = ", ".join(f"{name} " + "/".join(f"{times[r]:.2f}" for r in CHOOSER_ROWS) for name, times in ms.items())
    reason = (f"measured: ms per pass over the linear layers at {'/'.join(map(str, CHOOSER_ROWS))} rows: {table}")
    if not measured.trusted:
        reason += f"; not cached: {measured.why_not}"
    if use_cache:
        cache.put(what, {"impl": impl, "ms": ms}, measured)
    return LinearChoice(impl, reason, ms=ms, refused=refused)


def describe(choice: LinearChoice) -> str:
    """One line naming the path and why, for logs and benchmark tables."""
    return f"{_NAMES.get(choice.impl, choice.impl)} ({choice.reason})"


class DenseMethod(LinearMethod):
    """The linear method of the float weights (a LinearMethod): the parts'
    weights (and biases; a missing bias counts as zeros when another part has
    one) concatenated into one ``nn.Linear`` of the model's dtype, on the GEMM
    path ``choice.impl`` (make_linear). Takes every layer.

    Args:
        choice: the chooser's decision (choose_linear_impl).
    """

    def __init__(self, choice: "LinearChoice") -> None:
        self.choice, self.name = choice, choice.impl

    def build(self, linears: list[torch.nn.Linear], names: list[str]) -> tuple[torch.nn.Module, str]:
        """See LinearMethod.build; never declines."""
        if len(linears) == 1:
            fused = linears[0]
        else:
            weight = torch.cat([lin.weight.detach() for lin in linears])
            fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=any(lin.bias is not None for lin in linears),
                                    dtype=weight.dtype, device=weight.device)
            bias = fused_bias(linears)
            with torch.no_grad():
                fused.weight.copy_(weight)
                if bias is not None:
                    fused.bias.copy_(bias)  # float32 holds every bias value of the model's dtype exactly
        dtype = str(fused.weight.dtype).removeprefix("torch.")
        return make_linear(fused, self.name), f"{dtype} weights, {_NAMES.get(self.name, self.name)}"

    def describe(self) -> str:
        """LinearMethod.describe: the GEMM path and why it was chosen (describe(choice))."""
        return describe(self.choice)


_NAMES = {"torch": "torch's default GEMM", "onednn": "oneDNN with pre-packed weights"}


__all__ = ["LINEAR_IMPLS", "CHOOSER_ROWS", "OneDNNLinear", "LinearChoice", "choose_linear_impl", "describe",
           "count_shapes", "linear_shapes", "make_linear", "path_cases", "padded_rows", "DenseMethod",
           "why_unavailable", "cache_path", "is_library_gemm"]
