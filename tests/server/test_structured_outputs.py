"""Structured outputs through the official openai client, on a random-weight model: every answer
matches its schema (jsonschema), greedy and sampled, streamed and not, in batches mixing
constrained and free requests; bad constraints are a 400 naming the field."""
import concurrent.futures as cf
import json
import re

import httpx
import jsonschema
import openai
import pytest

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 16},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
    "rating": {"type": "number"},
    "seen": {"type": "boolean"},
    "cast": {"type": "array", "maxItems": 3,
             "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                        "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["name", "age"], "additionalProperties": False}}},
    "required": ["title", "year", "rating", "seen", "cast"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a movie as JSON."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat(client, model, stream=False, **kw):
    kw = {"model": model, "messages": MESSAGES, "max_completion_tokens": 300, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        return [(c.message.content, c.finish_reason) for c in sorted(r.choices, key=lambda c: c.index)]
    texts, ends = {}, {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            ends[c.index] = c.finish_reason or ends.get(c.index)
    return [(texts[i], ends[i]) for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate_greedy_and_sampled_mixed_with_free(client, model, stream):
    jobs = [dict(temperature=0, response_format=FORMAT),
            dict(temperature=1.0, seed=7, n=3, response_format=FORMAT),
            dict(temperature=1.3, top_p=0.9, seed=1, response_format=FORMAT),
            dict(temperature=0.8, seed=3, extra_body={"structured_outputs": {"json": SCHEMA}}),
            dict(temperature=0, extra_body={"guided_json": json.dumps(SCHEMA)}),
            dict(temperature=1.0, max_completion_tokens=20),   # free ones in the same batches
            dict(temperature=0, max_completion_tokens=20)]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda kw: chat(client, model, stream, **kw), jobs))
    for kw, answers in zip(jobs, results):
        constrained = "max_completion_tokens" not in kw
        for text, finish in answers:
            if constrained:
                assert finish == "stop", text
                jsonschema.validate(json.loads(text), SCHEMA)
            else:
                assert finish in ("stop", "length")
    assert len(results[1]) == 3


def test_the_same_greedy_answer_streamed_and_not(client, model):
    assert chat(client, model, False, temperature=0, response_format=FORMAT) == \
        chat(client, model, True, temperature=0, response_format=FORMAT)


def test_json_object_regex_choice_and_grammar(client, model):
    r = chat(client, model, temperature=0, response_format={"type": "json_object"})
    assert r[0][0].startswith("{")
    if r[0][1] == "stop":
        assert isinstance(json.loads(r[0][0]), dict)
    for body, check in [
        ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,6} [0-9]{4}"}}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{4}", t)),
        ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
        ({"structured_outputs": {"choice": ["alpha", "beta", "gamma ray"]}}, lambda t: t in ("alpha", "beta", "gamma ray")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"grammar": 'start: item ("," item)*\nitem: /[a-c]{1,3}/'}},
         lambda t: re.fullmatch(r"[a-c]{1,3}(,[a-c]{1,3})*", t)),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x[0-9]{1,2}", t)),   # GBNF
    ]:
        for temp in (0, 1.0):
            text, finish = chat(client, model, temperature=temp, seed=2, extra_body=body)[0]
            assert finish == "stop" and check(text), (body, text)


def test_completions_take_response_format_too(client, model):
    r = client.completions.create(model=model, prompt="A movie:", max_tokens=300, temperature=0.9, seed=5, n=2,
                                  extra_body={"response_format": FORMAT})
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    s = client.completions.create(model=model, prompt="A movie:", max_tokens=300, temperature=0, stream=True,
                                  extra_body={"guided_choice": ["one", "two"]})
    assert "".join(c.choices[0].text for c in s if c.choices) in ("one", "two")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/chat/completions", {"guided_json": {"type": "object", "properties": {"a": {"$ref": "http://x/y.json"}}}},
     "guided_json"),
])
def test_bad_constraints_are_a_400_naming_the_field(server, path, body, param):
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "Hi"}
    r = httpx.post(server.url + path, json={**base, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_properties_come_in_the_schema_order(client, model):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "integer", "maximum": 9},
                                               "mid": {"type": "boolean"}},
              "required": ["zeta", "alpha", "mid"], "additionalProperties": False}
    text, finish = chat(client, model, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "o", "schema": schema}})[0]
    assert finish == "stop" and list(json.loads(text)) == ["zeta", "alpha", "mid"]
