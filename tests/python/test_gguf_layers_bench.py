"""bench/gguf_layers.py on a tiny GGUF (tests/python/gguf_files.py): it loads
every 2-d weight but the embedding in file order with its GGUF type, a Q6_K
weight is held at one byte a weight (the i6f tiles: gemm/kernel_table.h) and a
Q4_K one at 0.59 (u4k), and a run prints a pass's total and one line per kind and
type for both kernel paths."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import gguf_files
from pagedserve import _core

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def gguf_layers():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("gguf_layers", BENCH / "gguf_layers.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_weights_load_in_file_order_with_their_types_and_held_bytes(gguf_layers, tmp_path):
    path, types = gguf_files.write("qwen2", tmp_path / "tiny.gguf")
    weights = gguf_layers.load_weights(str(path), _core.cpu)
    kinds = [kind for kind, _, _ in weights]
    assert "token_embd" not in kinds and kinds.count("attn_q") == 2 and kinds.count("ffn_down") == 2
    seen = {qtype.lower() for _, qtype, _ in weights}
    assert {"q6_k", "q4_k"} <= seen and seen <= set(types) | {"q8_0"}
    for kind, qtype, w in weights:
        rows = -(-w.out_features // 16) * 16  # row groups of 16
        if qtype == "Q6_K":
            assert w.nbytes == rows * w.in_features, kind  # 1.0 byte a weight (Q6_K's file: 0.82)
        if qtype == "Q4_K":  # 288 bytes a tile of 16 x 32, 128 of super-block scales per 16 x 256: 0.59 a weight
            assert w.nbytes == rows * w.in_features * 288 // 512 + rows // 16 * (w.in_features // 256) * 128, kind


def test_a_run_prints_both_paths_per_kind_and_type(gguf_layers, tmp_path, capsys, monkeypatch):
    path, _ = gguf_files.write("qwen2", tmp_path / "tiny.gguf")
    monkeypatch.setattr(sys, "argv", ["gguf_layers.py", "--gguf", str(path), "--rows", "2", "--threads", "1",
                                      "--rounds", "2"])
    gguf_layers.main()
    out = capsys.readouterr().out
    assert "linear_f32: a pass" in out and "\nlinear: a pass" in out
    assert out.count("ffn_down") == 2 * len({q for k, q, _ in gguf_layers.load_weights(str(path), _core.cpu)
                                             if k == "ffn_down"})
