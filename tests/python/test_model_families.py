"""Every decoder family through the unchanged engine: greedy token ids of 8
prompts of different lengths (past the sliding window, past the 64-token
chunk) submitted together equal Hugging Face generate() run one prompt at a
time, with and without preemption; a sliding-window decode reads only the
blocks inside its window."""

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.baseline.hf_generate import generate_sequential
from families import FAMILIES, WINDOW, available, build, windowed
from test_engine_greedy import make_prompts

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=available())
def family(request, tmp_path_factory):
    """(name, folder, prompts, Hugging Face's greedy tokens) of one family."""
    from transformers import AutoModelForCausalLM

    name = request.param
    path = build(name, tmp_path_factory.mktemp(name))
    prompts = make_prompts(256, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return name, path, prompts, generate_sequential(model, prompts, MAX_TOKENS, ignore_eos=True)


def run(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    return [o.outputs[0].token_ids for o in outs]


def test_batched_and_chunked_equals_hf(family):
    name, path, prompts, want = family
    assert max(map(len, prompts)) > 64 and max(map(len, prompts)) > WINDOW
    llm = LLM(model=path, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=64)
    assert run(llm, prompts) == want, name


def test_preempted_equals_hf(family):
    name, path, prompts, want = family
    # 224 token slots: the longest request (200 + 12) fits, all 8 at once do not
    llm = LLM(model=path, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=64, num_kv_blocks=14)
    assert run(llm, prompts) == want, name
    assert llm.engine.num_preemptions > 0


@pytest.mark.parametrize("family", [n for n in available() if windowed(n)], indirect=True)
def test_sliding_window_decodes_read_only_in_window_blocks(family, monkeypatch):
    name, path, prompts, want = family
    llm = LLM(model=path, dtype="float32", skip_tokenizer_init=True)
    backend = llm.engine.backend
    plans = []
    make_plan = backend.make_plan
    monkeypatch.setattr(backend, "make_plan", lambda md: plans.append(make_plan(md)) or plans[-1])
    got = run(llm, [prompts[7]])  # 200 prompt tokens: every decode is far past the 24-token window
    assert got == [want[7]]
    decodes = [p for p in plans[1:] if WINDOW in p.plans]
    assert len(decodes) == MAX_TOKENS - 1  # every decode step ran windowed layers
    for p in decodes:
        seq_len = int(p.metadata.seq_lens[0])
        full, windowed_plan = p.plans[0] if 0 in p.plans else None, p.plans[WINDOW]
        # the window (24 keys) spans at most 3 blocks of 16, per work item (one per KV head, or several per KV
        # head where a lone decode's items are split over the group's query heads to fill the threads)
        items = windowed_plan.num_work_items
        assert items % backend.spec.num_kv_heads == 0
        assert windowed_plan.num_blocks_visited <= 3 * items < (seq_len // 16) * items
        if full is not None:  # global layers (Gemma) still read everything
            assert full.num_blocks_visited == -(-seq_len // 16) * full.num_work_items


def test_families_table_in_the_readme_names_each_test():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name in FAMILIES:
        assert f"| {name} |" in readme, f"README's family table lacks {name}"


@pytest.mark.parametrize("name", available())
def test_a_local_folder_of_the_family_serves_chat_end_to_end(name, smollm2_dir, tmp_path):
    """--model with a local folder: the server loads the family, renders chat
    prompts with the folder's own tokenizer and chat template, and answers."""
    import httpx
    from transformers import AutoTokenizer

    from serverlib import start_server, stop_server

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    folder = tmp_path / f"tiny-{name}"
    build(name, folder, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder)
    proc, base = start_server("--model", str(folder), "--dtype", "float32", "--max-model-len", "256",
                              "--log-level", "warning")
    try:
        messages = [{"role": "user", "content": "Hello there"}]
        r = httpx.post(base + "/v1/chat/completions", json={"model": str(folder), "messages": messages,
                                                            "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] >= 1
        assert isinstance(body["choices"][0]["message"]["content"], str)
        tok = httpx.post(base + "/tokenize", json={"model": str(folder), "messages": messages}, timeout=60).json()
        want = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False).input_ids
        assert tok["tokens"] == want and body["usage"]["prompt_tokens"] == len(want)
        assert "<|im_start|>" in tokenizer.decode(tok["tokens"])  # the folder's template rendered it
    finally:
        stop_server(proc)
