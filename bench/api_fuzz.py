"""API fuzzing with a larger budget: tests/python/test_api_fuzz.py (schemathesis
against the server's /openapi.json, on a tiny random Llama with SmolLM2's
tokenizer) with --examples Hypothesis examples per operation instead of the
test's default, then a summary of every request sent, per operation: how many
per phase (coverage: schemathesis' deterministic boundary and invalid cases;
fuzzing: the Hypothesis examples) and mode (positive: schema-valid, negative:
schema-invalid), and how many got each status and media type, with the most
frequent error messages.

It fails (exit 1) when the test fails: a 5xx, an undocumented status or media
type, or a response (any event of a stream included) that does not match the
schema documented for it. The failures are pytest's report, printed above the
summary; the last line is PASS or FAIL.

    python bench/api_fuzz.py [--examples 500] [--seed N] [--log requests.jsonl] [--errors 5] [-- <pytest args>]

Run it as the tests are run (from any directory): with pagedserve installed, or
with PYTHONPATH pointing at python/.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST = "python/test_api_fuzz.py"  # relative to tests/, as `make test-python` runs it


def _counts(counter: collections.Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counter.items()))


def summarise(records: list[dict], top_errors: int) -> str:
    """Per operation: requests per phase/mode, statuses per media type, frequent
    errors, and the requests with another method (the coverage phase's probes
    for 405)."""
    by_op: dict[str, list[dict]] = collections.defaultdict(list)
    for r in records:
        by_op[r["operation"]].append(r)
    lines = []
    for op in sorted(by_op, key=lambda op: (op.split()[1], op)):
        rs = [r for r in by_op[op] if r["method"] == op.split()[0]]
        probes = [r for r in by_op[op] if r["method"] != op.split()[0]]
        lines.append(f"{op}: {len(rs)} requests")
        lines.append("    " + _counts(collections.Counter(f"{r['phase']}/{r['mode']}" for r in rs)))
        lines.append("    " + _counts(collections.Counter(f"{r['status']} {r['media_type'] or '-'}" for r in rs)))
        errors = collections.Counter(re.sub(r"\d+", "N", r["error"]) for r in rs if r.get("error"))
        for message, count in errors.most_common(top_errors):
            lines.append(f"      {count:5d} x {message}")
        if probes:
            lines.append(f"    other methods ({', '.join(sorted({r['method'] for r in probes}))}): "
                         + _counts(collections.Counter(f"{r['status']} {r['media_type'] or '-'}" for r in probes)))
    total = collections.Counter(r["status"] // 100 for r in records)
    lines.append(f"all: {len(records)} requests, " + ", ".join(f"{k}xx {v}" for k, v in sorted(total.items())))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=500, help="Hypothesis examples per operation")
    ap.add_argument("--seed", type=int, help="draw other examples than the test's derandomized ones")
    ap.add_argument("--log", help="keep the per-request JSON lines here (default: a temporary file)")
    ap.add_argument("--errors", type=int, default=5, help="most frequent error messages shown per operation")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.abspath(args.log) if args.log else os.path.join(tmp, "requests.jsonl")
        if os.path.exists(log):
            os.remove(log)
        env = {**os.environ, "PAGEDSERVE_FUZZ_EXAMPLES": str(args.examples), "PAGEDSERVE_FUZZ_LOG": log}
        if args.seed is not None:
            env["PAGEDSERVE_FUZZ_SEED"] = str(args.seed)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "pytest", TEST, "-q", "-rs", "-p", "no:cacheprovider",
                              *args.pytest_args], cwd=os.path.join(ROOT, "tests"), env=env)
        elapsed = time.perf_counter() - t0
        records = []
        if os.path.exists(log):
            with open(log) as f:
                records = [json.loads(line) for line in f if line.strip()]

    seed = f", seed {args.seed}" if args.seed is not None else ""
    print(f"\n{args.examples} examples per operation{seed}, {elapsed:.0f} s")
    print(summarise(records, args.errors))
    server_errors = sum(r["status"] >= 500 for r in records)
    reasons = []
    if rc != 0:
        reasons.append(f"pytest exited {rc}")
    if server_errors:
        reasons.append(f"{server_errors} responses were 5xx")
    if not records:
        reasons.append("no request was sent")
    print("PASS" if not reasons else "FAIL: " + "; ".join(reasons))
    sys.exit(1 if reasons else 0)


if __name__ == "__main__":
    main()
