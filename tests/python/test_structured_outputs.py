"""Structured outputs through the real server and the openai client: JSON
schema, JSON object, choice, regex, grammar; errors named by field; constrained
and unconstrained requests in one batch under preemption (engine level)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from serverlib import MODEL

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "doctor", "artist", "teacher"]},
        "skills": {"type": "array", "maxItems": 4, "items": {
            "type": "object",
            "properties": {"skill": {"type": "string", "maxLength": 30},
                           "years": {"type": "integer", "minimum": 0, "maximum": 60}},
            "required": ["skill", "years"]}},
    },
    "required": ["name", "age", "role", "skills"],
}
TOPICS = ["a nurse", "a pilot", "a baker", "a chess player", "a painter", "a farmer", "a physicist", "a poet",
          "a carpenter", "a librarian", "a sailor", "a dancer", "a judge", "a chef", "a plumber", "a violinist",
          "an astronaut", "a gardener", "a firefighter", "a student"]


def _chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_json_schema_output_validates_for_20_seeded_prompts(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(i: int):
        return _chat(client, f"Describe {TOPICS[i]} as a JSON object.", response_format=fmt, temperature=0.8,
                     seed=i, max_tokens=400)

    with ThreadPoolExecutor(len(TOPICS)) as pool:  # one batch: the masks of 20 rows per step
        answers = list(pool.map(ask, range(len(TOPICS))))
    for r in answers:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_streamed_and_n_choices(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = _chat(client, "Describe a teacher as JSON.", response_format=fmt, temperature=0.8, seed=3,
                   max_tokens=400, n=3, stream=True)
    texts, reasons = ["", "", ""], {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "stop", 1: "stop", 2: "stop"}
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_parses(client):
    r = _chat(client, "Give a JSON object with the name and colour of a cat.", response_format={"type": "json_object"},
              temperature=0.7, seed=1, max_tokens=300)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_guided_choice_regex_and_grammar(client):
    choices = ["Paris", "London", "Berlin", "Madrid"]
    r = _chat(client, "What is the capital of France?", extra_body={"guided_choice": choices}, max_tokens=10)
    assert r.choices[0].message.content in choices
    r = _chat(client, "Pick a city.", extra_body={"structured_outputs": {"choice": choices}}, temperature=1.0,
              seed=5, n=4, max_tokens=10)
    assert all(c.message.content in choices for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20, temperature=0.9, seed=2,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    r = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=20,
                                  extra_body={"guided_grammar": grammar})
    assert r.choices[0].text in ("The answer is yes.", "The answer is no.")


def test_constraint_cut_by_max_tokens_ends_with_length(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = _chat(client, "Describe a pilot as JSON.", response_format=fmt, max_tokens=6)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.choices[0].message.content.startswith('{"name"')  # a valid prefix (properties in schema order)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[" * 5000}, "guided_json"),  # nested deeper than Python's parser recurses
    ({"guided_json": '{"type": "object", "properties": {"a": ' * 1500 + '{"type": "string"}' + "}}" * 1500},
     "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_grammar": "root ::= root"}, "guided_grammar"),  # compiles, but admits no output at all
    ({"guided_choice": []}, None),  # empty list: unset, accepted
    ({"guided_choice": ["a", 3]}, "guided_choice.1"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
def test_invalid_constraints_are_400_naming_the_field(server, body, param):
    import httpx

    r = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **body})
    if param is None:
        assert r.status_code == 200
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(server + "/health").status_code == 200


def test_constrained_and_unconstrained_share_a_batch_under_preemption(smollm2_dir):
    """A KV pool of 14 blocks (224 tokens) for 6 requests of up to ~125 tokens: sequences are
    preempted and recomputed. Each output must equal the same request run alone
    with room to spare (greedy, float32): the grammar state survives recompute."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    small = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 60},
                                              "facts": {"type": "array", "maxItems": 3,
                                                        "items": {"type": "string", "maxLength": 60}}},
             "required": ["city", "facts"]}
    prompts = [f"<|im_start|>user\nTell me about {city} in JSON.<|im_end|>\n<|im_start|>assistant\n"
               for city in ("Paris", "Rome", "Tokyo", "Lima", "Oslo", "Cairo")]
    params = [SamplingParams(temperature=0, max_tokens=100, ignore_eos=i % 2 == 1,
                             structured_outputs=StructuredOutputsParams(json=small) if i % 2 == 0 else None)
              for i in range(len(prompts))]
    llm = LLM(model=smollm2_dir, dtype="float32", max_model_len=512, num_kv_blocks=14, max_num_seqs=6)
    together = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    assert llm.engine.num_free_blocks == llm.engine.num_kv_blocks
    alone = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    for i, (a, b) in enumerate(zip(together, alone)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, i
        if i % 2 == 0:
            assert a.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(a.outputs[0].text), small)
        else:
            assert a.outputs[0].finish_reason == "length"


def test_a_grammar_that_ends_on_the_last_allowed_token_ends_with_stop(smollm2_dir):
    """Scheduler.update decides every finish: a grammar that accepts its end at
    max_tokens (ignore_eos: nothing but the grammar ends the output) gives
    "stop", as a stop string found at the last token does; one more token of
    room gives the same output and reason; one less cuts it with "length"."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    llm = LLM(model=smollm2_dir, dtype="float32", max_model_len=256)
    choice = StructuredOutputsParams(choice=["yes", "no"])
    prompt = "<|im_start|>user\nIs Paris in France?<|im_end|>\n<|im_start|>assistant\n"

    def run(max_tokens):
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                      structured_outputs=choice), use_tqdm=False)
        return out.outputs[0]

    roomy = run(16)
    n = len(roomy.token_ids)
    assert roomy.finish_reason == "stop" and roomy.text in ("yes", "no")
    exact, cut = run(n), run(n - 1)
    assert (exact.token_ids, exact.text, exact.finish_reason) == (roomy.token_ids, roomy.text, "stop")
    assert cut.finish_reason == "length" and cut.token_ids == roomy.token_ids[:n - 1]


def test_engine_refuses_an_invalid_constraint_and_keeps_serving(smollm2_dir):
    from pagedserve import SamplingParams
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.config import EngineArgs
    from pagedserve.errors import InvalidStructuredOutputError
    from pagedserve.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    engine = LLMEngine(EngineArgs(model=smollm2_dir, dtype="float32", max_model_len=256, num_kv_blocks=16))
    with pytest.raises(InvalidStructuredOutputError) as e:
        engine.add_request("hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a")))
    assert e.value.kind == "regex"
    assert not engine.has_unfinished_requests()
    engine.add_request("hi", SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"])), request_id="ok")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].text in ("yes", "no")
