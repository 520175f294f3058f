"""The short soak: bench/soak.py against a server on a tiny KV pool (SmolLM2,
float32, 24 blocks of 16 tokens for up to 8 sequences, so requests are
preempted), a few hundred requests of which a fifth are abandoned by the
client. Every completed answer must equal its solo reference, no answer may be
a 5xx, and the server must end idle with its KV cache empty. The RSS bound is
left out (--bound-mib 0): this run is far too short for one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def test_short_soak(smollm2_dir, tmp_path):
    out = tmp_path / "summary.json"
    server_args = (f"--model {smollm2_dir} --dtype float32 --num-kv-blocks 24 --max-num-seqs 8 "
                   "--max-model-len 512")
    run = subprocess.run([sys.executable, str(SOAK), "--requests", "200", "--distinct", "24", "--max-tokens", "12",
                          "--abandon", "0.2", "--abandon-delay", "1.0", "--concurrency", "10", "--warmup", "50",
                          "--sample-every", "50", "--bound-mib", "0", "--seed", "1", "--json", str(out),
                          "--server-args", server_args],
                         capture_output=True, text=True, timeout=600)
    report = run.stdout[-6000:] + run.stderr[-2000:]
    assert out.exists(), report
    s = json.loads(out.read_text())
    assert s["completed"] + s["abandoned"] == 200 and s["unexpected"] == 0, report
    assert s["abandoned"] > 20, report  # the disconnects happened
    assert s["mismatches"] == 0 and s["recheck_changed"] == 0, report
    assert not any(int(code) >= 500 for code in s["statuses"]), report
    assert s["running"] == 0 and s["waiting"] == 0 and s["kv_usage_end"] == 0, report
    assert s["preemptions"] > 0, report  # the pool is small enough to preempt under this load
    assert s["prefix_cache_hit_tokens"] > 0, report
    assert s["failures"] == [] and run.returncode == 0, report
