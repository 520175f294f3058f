"""A GGUF file read in place (model/gguf_load.py): every family the native step
describes, from tiny files the tests write with gguf-py in every GGUF block
type, holds exactly the weights transformers' own GGUF reader de-quantises,
and decodes what the Hugging Face model of those weights decodes; a start
writes only small files; the packaged Qwen2.5-Coder models decode greedily
what transformers' float32 generate() over their weights does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf_files
from pagedserve import LLM, SamplingParams
from pagedserve.model import packaged
from pagedserve.model.gguf_linear import GGUFEmbedding, GGUFFloatLinear
from pagedserve.model.startup_check import check_logits

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _values(module) -> torch.Tensor:
    w = module.weight_blocks
    out = torch.empty((w.out_features, w.in_features), dtype=torch.float32)
    w.dequantize(out, 1)
    return out


def _teacher_forced_gap(ref, prompt: list[int], tokens: list[int]) -> float:
    """Largest (best logit - logit of the engine's token) of the reference
    model fed the prompt and the engine's own tokens: 0 where every greedy
    token is the reference's argmax."""
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logits = ref(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1:-1]
    picked = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return float((logits.max(dim=1).values - picked).max())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_family_read_in_place_holds_transformers_weights_and_decodes_its_tokens(family, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path, types = gguf_files.write(family, tmp_path / f"tiny-{family}.gguf")
    assert set(types) == set(gguf_files.TYPES)  # every block type the kernels read, in one file
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256)
    engine = llm.engine
    assert "read in place" in engine.linear_path and "native C++ step" in engine.model_impl
    ref_params = dict(ref.named_parameters())
    linears = 0
    for name, module in engine.model.named_modules():
        if isinstance(module, GGUFFloatLinear) and name != "lm_head":
            # transformers' reader de-quantises with gguf-py (and un-permutes a llama file's q/k rows); the
            # blocks here expand to those very values
            assert torch.equal(_values(module), ref_params[f"{name}.weight"]), name
            linears += 1
    assert linears == 7 * ref.config.num_hidden_layers
    embed = engine.model.get_input_embeddings()
    assert isinstance(embed, GGUFEmbedding)
    assert torch.equal(_values(embed), ref.get_input_embeddings().weight)
    for name, p in engine.model.named_parameters():  # the norms (Gemma's stored as 1 + w, read back as w)
        assert torch.equal(p, ref_params[name]), name
    prompts = [[5, 6, 7, 8, 9], [100, 3, 4], [200, 17, 33, 90, 1, 5, 77]]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    scale = float(ref(input_ids=torch.tensor([prompts[0]])).logits.abs().max())
    for prompt, tokens in zip(prompts, outs):
        # the same float32 weights summed in another order: every token is the reference's argmax up to rounding
        assert _teacher_forced_gap(ref, prompt, tokens) <= 1e-4 * scale, (prompt, tokens)


def test_a_start_reads_the_file_in_place_and_writes_only_small_files(tmp_path, monkeypatch):
    """The default model (SmolLM2's Q4_1 file) starts without a float32 copy on disk: the cache holds its
    metadata folder (config, tokenizer) and the tensor index, a few MB, not the 517 MB the conversion wrote."""
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    llm = LLM(num_kv_blocks=16, enable_prefix_caching=False)
    assert "read in place" in llm.engine.linear_path
    written = {p.relative_to(tmp_path).parts[0]: 0 for p in tmp_path.rglob("*") if p.is_file()}
    for p in tmp_path.rglob("*"):
        if p.is_file():
            written[p.relative_to(tmp_path).parts[0]] += p.stat().st_size
    assert "models" not in written, written  # no converted folder
    assert sum(written.values()) <= 16 << 20, written
    text = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].text
    assert "Paris" in text


QWEN_PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
                "What does the `yield` keyword do in Python?", "Reverse a string in JavaScript.",
                "Explain what a hash map is in one sentence.", "Write a SQL query counting rows of a table t.",
                "What is the time complexity of binary search?", "Write a bash loop printing 1 to 5.",
                "Name three sorting algorithms."]


@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_packaged_qwen_coder_decodes_what_transformers_generate_does(model):
    """Greedy outputs through the native step equal transformers' float32 generate() over the same model's
    weights (its Hugging Face modules, whose linear layers compute with the blocks' exact float32 values: what
    transformers' GGUF reader de-quantises, as the tiny files above show for every type), on 8 chat prompts."""
    spec = packaged.PACKAGED_MODELS[model]
    if any(importlib.util.find_spec(p.replace("-", "_")) is None for p in spec.packages):
        pytest.skip(f"{model}'s packages are not installed (.ci/run installs the 0.5B): {spec.install}")
    llm = LLM(model=model, num_kv_blocks=256, max_model_len=1024, enable_prefix_caching=False)
    engine = llm.engine
    assert engine.runner.lean.native is not None and "read in place" in engine.linear_path
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in QWEN_PROMPTS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    n = 16
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0,
                                                                                 ignore_eos=True))]
    hf = engine.model
    hf.set_attn_implementation("eager")
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)  # stops at EOS, kept
            want.append(out[0, len(p):].tolist())
    assert [g[:len(w)] for g, w in zip(got, want)] == want
    assert np.mean([len(set(g)) > 3 for g in got]) == 1.0  # real text, not a repeated token
    # the description's other executor (--no-native-step): the same kernels from Python, the same logits bit for bit
    ids = torch.tensor(prompts[0])
    decoder = engine.runner.lean
    native_logits = check_logits(engine.runner, ids)[0]
    native, decoder.native = decoder.native, None
    try:
        assert torch.equal(check_logits(engine.runner, ids)[0], native_logits)
    finally:
        decoder.native = native


@pytest.mark.parametrize("cut", [100, 4000])
def test_a_truncated_file_is_refused_by_name(cut, tmp_path, monkeypatch):
    from pagedserve.errors import ModelLoadError

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path, _ = gguf_files.write("qwen2", tmp_path / "whole.gguf")
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[:-cut])
    LLM(model=str(path), num_kv_blocks=8, max_model_len=64)  # the whole file serves (and its index is cached)
    with pytest.raises(ModelLoadError, match="truncated"):
        LLM(model=str(short), num_kv_blocks=8, max_model_len=64)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_the_tensor_index_read_from_the_header_is_gguf_readers(family, tmp_path):
    """read_tensor_index's fast reader (the tensor table only, transformers' header reader) gives gguf-py's
    GGUFReader's index entry for entry, on files of every tensor type the kernels read (and bf16, which gguf-py
    reads as bytes); a file cut inside its header is left to GGUFReader (None)."""
    from pagedserve.model import gguf_format

    path, types = gguf_files.write(family, tmp_path / "m.gguf")
    assert set(types) >= {"q4_k", "q6_k", "q8_0", "q5_0", "bf16", "f16"}
    fast = gguf_format._index_from_header(path)
    assert fast is not None and fast == gguf_format._index_from_gguf_reader(path)
    short = tmp_path / "short.gguf"
    short.write_bytes(path.read_bytes()[:fast["header_bytes"] // 2])
    assert gguf_format._index_from_header(short) is None


def test_a_file_the_header_walk_reads_loosely_gets_gguf_readers_verdict(tmp_path):
    """An explicit general.alignment (the walk does not keep its type; gguf-py takes a uint32 power of two
    only) and a non-UTF-8 architecture go to GGUFReader: the index it reads, or ModelLoadError by name."""
    import gguf

    from pagedserve.errors import ModelLoadError
    from pagedserve.model import gguf_format

    def write(name: str, alignment: int | None, architecture: bytes) -> Path:
        out = tmp_path / name
        w = gguf.GGUFWriter(str(out), "llama")
        if alignment is not None:
            w.add_custom_alignment(alignment)
        w.add_tensor("a", np.arange(64, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        if architecture != b"llama":  # same length: the header's offsets stay valid
            data = out.read_bytes()
            out.write_bytes(data.replace(b"llama", architecture, 1))
        return out

    aligned = write("aligned.gguf", 64, b"llama")
    assert gguf_format._index_from_header(aligned) is None
    index = gguf_format.read_tensor_index(aligned)
    assert index == gguf_format._index_from_gguf_reader(aligned) and index["header_bytes"] % 64 == 0
    with pytest.raises(ModelLoadError, match="not UTF-8"):
        gguf_format.read_tensor_index(write("latin.gguf", None, b"ll\xe9ma"))
    text = tmp_path / "text.gguf"
    text.write_text("hi\n")
    with pytest.raises(ModelLoadError, match="does not start with the GGUF magic"):
        gguf_format.read_tensor_index(text)


def _set_field(path, key: str, value: int) -> None:
    """Edits an integer metadata field in place, as gguf-py's gguf_set_metadata does."""
    from gguf import GGUFReader

    field = GGUFReader(str(path), "r+").fields[key]
    field.parts[field.data[0]][0] = value


def test_metadata_edited_in_place_or_a_damaged_metadata_folder_is_read_again(tmp_path, monkeypatch):
    """The metadata folder is keyed by the SHA-256 of the file's whole header: an EOS id changed in place
    (past the edges the content fingerprint reads, in a real file) makes a new folder; a folder missing a file
    its manifest lists is made again rather than served (an empty tokenizer)."""
    from pagedserve.model.source import metadata_dir

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path, _ = gguf_files.write("qwen2", tmp_path / "m.gguf")
    first = metadata_dir(path)
    eos = LLM(model=str(path), num_kv_blocks=8, max_model_len=64).engine.eos_token_ids
    assert 2 in eos and 13 not in eos
    _set_field(path, "tokenizer.ggml.eos_token_id", 13)
    second = metadata_dir(path)
    assert second != first
    assert 13 in LLM(model=str(path), num_kv_blocks=8, max_model_len=64).engine.eos_token_ids
    (second / "tokenizer.json").unlink()
    assert metadata_dir(path) == second and (second / "tokenizer.json").exists()
    tokenizer = LLM(model=str(path), num_kv_blocks=8, max_model_len=64).engine.tokenizer
    assert len(tokenizer) >= 256 and tokenizer("abc")["input_ids"]


def test_broken_files_are_refused_by_name(tmp_path, monkeypatch):
    from gguf import GGUFReader

    from pagedserve.errors import ModelLoadError

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    no_embedding, _ = gguf_files.write("qwen2", tmp_path / "no-embd.gguf", drop=("token_embd.weight",))
    with pytest.raises(ModelLoadError, match="holds no tensor for .*lm_head"):
        LLM(model=str(no_embedding), num_kv_blocks=8, max_model_len=64)
    nan, _ = gguf_files.write("qwen2", tmp_path / "nan.gguf")
    norm = next(t for t in GGUFReader(str(nan), "r+").tensors if t.name == "blk.0.attn_norm.weight")
    norm.data[:] = np.nan
    norm.data.flush() if hasattr(norm.data, "flush") else None
    with pytest.raises(ModelLoadError, match="non-finite"):
        LLM(model=str(nan), num_kv_blocks=8, max_model_len=64)
    upper = tmp_path / "UPPER.GGUF"
    upper.write_bytes(gguf_files.write("qwen2", tmp_path / "u.gguf")[0].read_bytes())
    assert "read in place" in LLM(model=str(upper), num_kv_blocks=8, max_model_len=64).engine.linear_path
