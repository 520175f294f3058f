"""The simulator's step-cost model, fitted from real engine steps:

    cost(step) = a + b * num_batched_tokens + c * sum(seq_lens)   (seconds)

a: fixed cost of a step (Python, scheduling, sampling, the per-layer calls);
b: per computed token (the linear layers: weights x tokens); c: per token of
context attended to (attention reads K/V of every position of every scheduled
sequence). The form follows the usual roofline split of a transformer step
(compute linear in tokens, attention linear in context); the constants are
measured here: :func:`record_steps` times LLMEngine.step() over a seeded
workload on this machine and :meth:`StepCost.fit` solves the least-squares fit.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class StepSample:
    """One measured engine step: tokens computed, sum of seq_lens (tokens), wall time (seconds)."""

    num_batched_tokens: int
    sum_seq_lens: int
    seconds: float


@dataclass(frozen=True)
class StepCost:
    """cost = a + b * num_batched_tokens + c * sum_seq_lens, in seconds
    (a: s/step, b: s/token, c: s/context token). ``source`` says where the
    constants come from."""

    a: float
    b: float
    c: float
    source: str = ""

    def predict(self, num_batched_tokens: int, sum_seq_lens: int) -> float:
        """Predicted wall time of one step, seconds."""
        return self.a + self.b * num_batched_tokens + self.c * sum_seq_lens

    @classmethod
    def fit(cls, samples: list[StepSample], source: str = "") -> StepCost:
        """Least squares of the relative error (each step weighted by 1 / its
        time, so the many short decode steps count as much as the few long
        prefills and one slow outlier cannot dominate), with non-negative
        constants (a term whose unconstrained fit is negative is dropped and the
        rest refitted). Raises ValueError with fewer than 3 samples."""
        if len(samples) < 3:
            raise ValueError(f"need at least 3 step samples to fit 3 constants, got {len(samples)}")
        w = np.array([1.0 / s.seconds for s in samples])
        x = np.array([[1.0, s.num_batched_tokens, s.sum_seq_lens] for s in samples]) * w[:, None]
        y = np.array([s.seconds for s in samples]) * w
        keep = [0, 1, 2]
        while True:
            coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(coef)))
        full = [0.0, 0.0, 0.0]
        for k, v in zip(keep, coef):
            full[k] = max(float(v), 0.0)
        return cls(*full, source=source)

    def save(self, path: str) -> None:
        """Writes the constants (and source) as JSON to path, creating parent folders."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    def __post_init__(self) -> None:
        vals = (self.a, self.b, self.c)
        if not all(math.isfinite(v) and v >= 0 for v in vals) or not any(v > 0 for v in vals):
            raise ValueError(f"step-cost constants must be finite, >= 0 and not all 0, got a={self.a}, "
                             f"b={self.b}, c={self.c}")

    @classmethod
    def load(cls, path: str) -> StepCost:
        """Reads a file written by save(). Raises OSError, or ValueError for a
        file that is not such JSON or holds invalid constants."""
        with open(path) as f:
            try:
                d = json.load(f)
                return cls(float(d["a"]), float(d["b"]), float(d["c"]), str(d.get("source", "")))
            except (KeyError, TypeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path} is not a step-cost file ({type(e).__name__}: {e})") from e


def default_path() -> str:
    """Where calibrate writes and the simulator reads by default: one file per
    machine kind (CPU model) under ~/.cache/pagedserve."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    slug = "".join(ch if ch.isalnum() else "-" for ch in cpu).strip("-").lower()[:60] or "cpu"
    return os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", f"step_cost-{slug}.json")


def record_steps(engine, num_requests: int, seed: int, max_prompt: int = 512, max_output: int = 48
                 ) -> list[StepSample]:
    """Runs a seeded mixed workload through an LLMEngine and times every step.

    Requests (token-id prompts of 8..max_prompt tokens, 4..max_output greedy
    output tokens, EOS ignored) arrive in three waves, so steps mix prefill
    chunks and decodes of changing batch sizes. Returns one StepSample per
    engine step (wall time of LLMEngine.step(), which includes scheduling,
    the forward pass, sampling and output handling)."""
    from ..sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    max_prompt = max(8, min(max_prompt, engine.max_model_len - max_output))
    waves = [num_requests // 2, num_requests // 4, num_requests - num_requests // 2 - num_requests // 4]
    samples: list[StepSample] = []
    for wave, count in enumerate(waves):
        for i in range(count):
            ids = [rng.randrange(3, vocab) for _ in range(rng.randint(8, max_prompt))]
            params = SamplingParams(temperature=0, max_tokens=rng.randint(4, max_output), ignore_eos=True)
            engine.add_request(ids, params, request_id=f"calib-{seed}-{wave}-{i}")
        steps = 0
        # the next wave arrives while this one still decodes (the last runs to the end)
        while engine.has_unfinished_requests() and (wave == len(waves) - 1 or steps < max_output // 2):
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            n, ctx = engine.last_step_shape
            samples.append(StepSample(n, ctx, dt))
            steps += 1
    return samples


def prediction_error(cost: StepCost, samples: list[StepSample]) -> dict[str, float]:
    """How well cost predicts measured steps: total measured and predicted
    seconds, their ratio, and the median / mean absolute relative per-step error."""
    pred = np.array([cost.predict(s.num_batched_tokens, s.sum_seq_lens) for s in samples])
    meas = np.array([s.seconds for s in samples])
    rel = np.abs(pred - meas) / meas
    return {"steps": len(samples), "measured_s": float(meas.sum()), "predicted_s": float(pred.sum()),
            "total_ratio": float(pred.sum() / meas.sum()), "median_step_error": float(np.median(rel)),
            "mean_step_error": float(rel.mean())}
