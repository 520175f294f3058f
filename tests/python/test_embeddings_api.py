"""Issue 33 part 3: POST /v1/embeddings with the official `openai` SDK against
a real server on SmolLM2 (float32, --embedding-pooling last, the default):
float and base64 answers equal; a text embedded alone and in a batch gives
the same vector; a paraphrase ranks above unrelated sentences by cosine
similarity; token-id inputs; a repeated long input hits the prefix cache;
bad inputs get OpenAI-style 400/404s; a client that goes away gets its
requests aborted and every KV block back."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from serverlib import MODEL, metrics, wait_idle

ANCHOR = "The cat sat on the mat."
PARAPHRASE = "A cat was sitting on the rug."
UNRELATED = ["Quarterly tax filings are due in April.", "The stock market fell sharply on Monday.",
             "Photosynthesis converts light into chemical energy."]


def _vectors(resp) -> np.ndarray:
    return np.array([d.embedding for d in resp.data], dtype=np.float32)


def test_float_and_base64_equal_and_batch_equals_alone(client):
    texts = [ANCHOR, PARAPHRASE, *UNRELATED]
    as_float = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    as_base64 = client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64 and decodes it
    assert as_float.object == "list" and as_float.model == MODEL
    assert [d.index for d in as_float.data] == list(range(len(texts)))
    vf, vb = _vectors(as_float), _vectors(as_base64)
    assert vf.shape == (len(texts), 576)  # SmolLM2's hidden size
    assert np.array_equal(vf, vb)
    np.testing.assert_allclose(np.linalg.norm(vf, axis=1), 1.0, atol=1e-5)
    for i, text in enumerate(texts):
        alone = _vectors(client.embeddings.create(model=MODEL, input=text, encoding_format="float"))[0]
        assert np.abs(alone - vf[i]).max() <= 1e-5
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens > len(texts)


def test_paraphrase_ranks_above_unrelated(client):
    """On SmolLM2-135M-Instruct with last-token pooling (measured 2026-12-04:
    paraphrase 0.98, unrelated 0.80-0.90)."""
    v = _vectors(client.embeddings.create(model=MODEL, input=[ANCHOR, PARAPHRASE, *UNRELATED],
                                          encoding_format="float"))
    cos = v[1:] @ v[0]
    assert cos[0] > cos[1:].max(), cos


def test_token_ids_and_prefix_cache(server, client):
    text = "A long shared preamble about the history of tea in China and Japan. " * 6
    ids = httpx.post(server + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()["tokens"]
    by_text = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    batch_ids = client.embeddings.create(model=MODEL, input=[ids, ids[:10]], encoding_format="float")
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert np.abs(_vectors(by_ids)[0] - _vectors(by_text)[0]).max() <= 1e-5
    assert np.abs(_vectors(batch_ids)[0] - _vectors(by_text)[0]).max() <= 1e-5
    # the second time, every full block of the input came from the prefix cache
    r = httpx.post(server + "/v1/embeddings", json={"model": MODEL, "input": ids}, timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16 > 0


@pytest.mark.parametrize("body,status,param", [
    ({"model": MODEL, "input": "hi", "dimensions": 64}, 400, "dimensions"),
    ({"model": MODEL, "input": ""}, 400, "input"),
    ({"model": MODEL, "input": ["a", ""]}, 400, "input[1]"),
    ({"model": MODEL, "input": []}, 400, "input"),
    ({"model": MODEL, "input": [[1, 2], []]}, 400, "input[1]"),
    ({"model": MODEL, "input": [2**40]}, 400, None),
    ({"model": MODEL, "input": ["a", 1]}, 400, "input"),  # one error at the field, not per shape of the union
    ({"model": MODEL, "input": [1.5]}, 400, "input"),
    ({"model": MODEL, "input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"model": MODEL, "input": [49152]}, 400, "input"),  # outside SmolLM2's vocabulary
    ({"model": MODEL, "input": "hi", "encoding_format": "int8"}, 400, None),
    ({"model": MODEL, "input": "hi " * 2100}, 400, "input"),  # longer than max_model_len 2048
    ({"model": MODEL, "input": ["hi"] * 2049}, 400, "input"),
    ({"model": "other-model", "input": "hi"}, 404, "model"),
    ({"model": MODEL, "input": "hi", "priority": 1}, 400, "priority"),
    ({"model": MODEL}, 400, None),
])
def test_bad_input_gets_openai_error(server, client, body, status, param):
    r = httpx.post(server + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    assert len(client.embeddings.create(model=MODEL, input="still serving").data[0].embedding) == 576
    assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0


def test_truncate_minus_one_keeps_what_fits(client):
    r = client.embeddings.create(model=MODEL, input="hi " * 2100, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == 2047  # max_model_len 2048 less the token the prefill samples


def test_client_that_goes_away_is_aborted(server):
    before = wait_idle(server)
    inputs = [f"{i} " + "Tell me about the long history of tea. " * 150 for i in range(32)]  # ~32 x 1,200 tokens
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/embeddings", json={"model": MODEL, "input": inputs}, timeout=1.0)
    # the queued requests go at once, whatever the prefill step in flight costs (~2 s on an AVX-512 EPYC,
    # ~10 s on an AVX2-only one): the disconnect is seen within a poll, the abort does not wait for the step
    deadline = time.monotonic() + 2.0
    while (waiting := metrics(server)["vllm:num_requests_waiting"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiting == 0
    # the ones the step in flight computes end right after it
    m = wait_idle(server, timeout=120.0)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == before["vllm:kv_cache_usage_perc"]
    assert m["vllm:request_success_total{finished_reason=abort}"] > \
        before["vllm:request_success_total{finished_reason=abort}"]
    assert metrics(server)["vllm:kv_cache_usage_perc"] == 0


def test_tiny_model_vectors_are_its_last_hidden_states(tiny_tools_server):
    """Over HTTP on a tiny random chat model: each vector is the Hugging Face
    decoder's normalised final hidden state of the input's last token."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, path = tiny_tools_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    texts = ["one two three", "a somewhat longer sentence about paged attention and caches " * 3]
    got = _vectors(client.embeddings.create(model=client.models.list().data[0].id, input=texts))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for text, vec in zip(texts, got):
        with torch.no_grad():
            h = model.model(input_ids=torch.tensor([tok(text).input_ids])).last_hidden_state[0, -1]
        np.testing.assert_allclose(vec, torch.nn.functional.normalize(h, dim=-1).numpy(), atol=1e-5, rtol=0)
