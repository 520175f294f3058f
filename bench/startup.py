"""Start-up cost of serving a model: PagedServe with its defaults (and, with
--llama-server, llama.cpp's server on the same GGUF file), each started alone.

For each model and server it prints: seconds to a healthy /health, seconds to
the first token of a one-token completion after that, peak resident memory
(VmHWM of the server process), the KV store's resident share of it (llama-server
clears its f16 store at start, so all of it; PagedServe's store is resident
only once written, so none of it at start), the peak outside
the KV store, and (PagedServe) the bytes written under its cache folder. The
first PagedServe start runs on an empty cache folder (metadata read, tuner
measuring); the later ones (--starts) on the folder the first one filled.

    python bench/startup.py                                  # the four packaged models, PagedServe only
    python bench/startup.py --compare --llama-server build/llama.cpp/bin/llama-server
    python bench/startup.py --models smollm2-135m qwen2.5-coder-1.5b --starts 3

llama-server runs as bench/serving.py runs it (-np 32 -c 8192 -t NPROC); its
KV store is computed from the file's shapes (f16 K and V of every layer for
8192 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm(pid: int) -> int:
    """Peak resident bytes of a live process (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_server(cmd: list[str], port: int, env: dict, log: Path, timeout: float = 900) -> dict:
    """Starts ``cmd``, waits for /health, asks one token; returns the times and VmHWM, then stops it."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}: see {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"{cmd[0]} not healthy after {timeout} s: see {log}")
            time.sleep(0.05)
        healthy = time.perf_counter() - t0
        post(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "def fib(n):", "max_tokens": 1,
                                                         "temperature": 0})
        first = time.perf_counter() - t0
        return {"healthy_s": healthy, "first_token_s": first, "peak_rss": vm_hwm(proc.pid)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def gguf_of(model: str) -> Path:
    from pagedserve.model.packaged import PACKAGED_MODELS

    return Path(PACKAGED_MODELS[model].locate())


def llama_kv_bytes(gguf: Path, ctx: int) -> int:
    """f16 K and V of every layer for ctx tokens (llama-server's default KV type)."""
    from transformers import AutoConfig

    from pagedserve.model.source import metadata_dir

    c = AutoConfig.from_pretrained(metadata_dir(gguf)).get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * ctx * 2


def pagedserve(gguf: Path, cache: Path, log: Path) -> dict:
    port = free_port()
    env = {**os.environ, "PAGEDSERVE_CACHE": str(cache)}
    before = tree_bytes(cache) if cache.exists() else 0
    r = run_server([sys.executable, "-m", "pagedserve.server", "--model", str(gguf), "--port", str(port)], port, env,
                   log)
    r["written"] = tree_bytes(cache) - before
    # the store is an anonymous mapping resident only where written (kernels/cpu.py: zero_store): at start the
    # start-up check's few blocks, so none of its size is taken off the peak
    r["kv"] = 0
    m = re.search(r"KV cache \d+ blocks x \d+ tokens \(([\d.]+) MiB\)", log.read_text())
    r["kv_allocated"] = int(float(m.group(1)) * 2**20) if m else 0
    return r


def llama(server: str, gguf: Path, log: Path, ctx: int = 8192) -> dict:
    port = free_port()
    r = run_server([server, "-m", str(gguf), "--port", str(port), "-np", "32", "-c", str(ctx), "-t",
                    str(os.cpu_count() or 1)], port, dict(os.environ), log)
    r["kv"], r["written"] = llama_kv_bytes(gguf, ctx), 0
    return r


def row(name: str, r: dict) -> str:
    outside = r["peak_rss"] - r["kv"]
    return (f"  {name:<28} healthy {r['healthy_s']:6.1f} s  first token {r['first_token_s']:6.1f} s  peak RSS "
            f"{r['peak_rss'] / 2**30:5.2f} GiB  KV {r['kv'] / 2**30:5.2f} GiB  outside KV {outside / 2**30:5.2f} GiB"
            f"  wrote {r['written'] / 2**20:7.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--starts", type=int, default=2, help="PagedServe starts per model (the first on an empty cache)")
    ap.add_argument("--compare", action="store_true", help="also start llama-server on the same file")
    ap.add_argument("--llama-server", default="build/llama.cpp/bin/llama-server")
    args = ap.parse_args()
    if args.compare and not Path(args.llama_server).exists():
        sys.exit(f"no llama-server at {args.llama_server}: bench/build_llama_server.sh builds it")
    logs = Path(tempfile.mkdtemp(prefix="pagedserve-startup-"))
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0] if os.path.exists("/proc/cpuinfo") else ""
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f" {f}" in flags]
    print(f"CPU: {os.cpu_count()} cores, {' '.join(isa)}; PAGEDSERVE_CPU_ISA={os.environ.get('PAGEDSERVE_CPU_ISA', '')}"
          f"; logs in {logs}")
    for model in args.models:
        gguf = gguf_of(model)  # a chunked file assembled once into the user's cache, outside the measured starts
        print(f"{model}: {gguf.name}, {gguf.stat().st_size / 2**20:.0f} MiB")
        cache = Path(tempfile.mkdtemp(prefix="cache-", dir=logs))
        ours = []
        for i in range(args.starts):
            r = pagedserve(gguf, cache, logs / f"{model}-pagedserve-{i}.log")
            ours.append(r)
            print(row(f"PagedServe start {i + 1}{' (empty cache)' if i == 0 else ''}", r), flush=True)
        if args.compare:
            theirs = llama(args.llama_server, gguf, logs / f"{model}-llama.log")
            print(row("llama-server", theirs), flush=True)
            later = ours[1:] or ours
            best = min(later, key=lambda r: r["healthy_s"])
            print(f"  ratios (PagedServe later start / llama-server): healthy {best['healthy_s'] / theirs['healthy_s']:.2f}x"
                  f", first token {best['first_token_s'] / theirs['first_token_s']:.2f}x, peak outside KV "
                  f"{(best['peak_rss'] - best['kv']) / (theirs['peak_rss'] - theirs['kv']):.2f}x", flush=True)
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
