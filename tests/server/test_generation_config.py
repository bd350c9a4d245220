"""generation_config.json's sampling defaults, as vLLM's --generation-config auto|vllm|DIR: every
request that leaves a field out gets the file's value, a field the request sets wins, `vllm`
ignores the file, DIR reads another folder's, and a bad value is a one-line error at start."""
import json
import shutil
import subprocess
import sys

import httpx
import openai
import pytest

from pdserve import LLM
from pdserve.bench.servers import free_port
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import ConfigError
from pdserve.sampling_params import SamplingParams
from tests.server.inprocess import serve

DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1,
            "max_new_tokens": 7}
AS_PARAMS = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "max_tokens": 7}


def with_generation_config(src: str, dst, **fields) -> str:
    """A copy of checkpoint `src` whose generation_config.json also sets `fields`."""
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return str(dst)


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory):
    return with_generation_config(tiny_llama, tmp_path_factory.mktemp("gen") / "ckpt", **DEFAULTS)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("other-gen")
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3, "do_sample": True}))
    return str(d)


def fields(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in AS_PARAMS}


@pytest.fixture(scope="module")
def recorded(model):
    """An in-process server whose engine records the SamplingParams of every request it admits."""
    engine = LLMEngine(model, max_num_batched_tokens=64)
    seen: list[SamplingParams] = []
    add = engine.add_request

    def recording(rid, prompt, params, **kw):
        seen.append(params)
        return add(rid, prompt, params, **kw)
    engine.add_request = recording
    with serve(engine) as url:
        yield url, seen


def last(seen, n=1) -> list[dict]:
    return [fields(p) for p in seen[-n:]]


def test_requests_without_the_fields_get_the_file_s_defaults(recorded):
    url, seen = recorded
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Once upon"}],
                                          extra_body={"ignore_eos": True})
    assert last(seen) == [AS_PARAMS]
    assert chat.usage.completion_tokens == 7   # max_new_tokens is the default max_tokens
    # completions: left out, max_tokens is OpenAI's and vLLM's 16; an explicit null takes max_new_tokens
    client.completions.create(model="tiny", prompt="Once upon", extra_body={"ignore_eos": True})
    assert last(seen) == [{**AS_PARAMS, "max_tokens": 16}]
    client.completions.create(model="tiny", prompt="Once upon", max_tokens=None)
    assert last(seen) == [AS_PARAMS]
    # the origin endpoints: the file's temperature over their greedy default
    r = httpx.post(url + "/generate", json={"prompts": ["a", "b"]})
    assert r.status_code == 200 and last(seen, 2) == [AS_PARAMS] * 2


def test_fields_the_request_sets_override(recorded):
    url, seen = recorded
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Once upon"}], temperature=0,
                                   max_tokens=3, top_p=0.5, extra_body={"top_k": 2, "min_p": 0.2,
                                                                         "repetition_penalty": 1.0})
    assert last(seen) == [dict(temperature=0, top_p=0.5, top_k=2, min_p=0.2, repetition_penalty=1.0, max_tokens=3)]
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Once upon"}], n=2,
                                   max_completion_tokens=4, temperature=1.0)
    assert last(seen, 2) == [{**AS_PARAMS, "temperature": 1.0, "max_tokens": 4}] * 2
    client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, top_p=1.0)
    assert last(seen) == [{**AS_PARAMS, "top_p": 1.0, "max_tokens": 5}]
    r = httpx.post(url + "/generate", json={"prompts": ["a"], "temperature": 0.0, "max_tokens": 2})
    assert r.status_code == 200 and last(seen) == [{**AS_PARAMS, "temperature": 0.0, "max_tokens": 2}]


def test_offline_llm_uses_them_when_given_no_sampling_params(model, other_dir):
    llm = LLM(model, generation_config=other_dir)   # DIR: another folder's file
    assert fields(llm.get_default_sampling_params()) == fields(SamplingParams(temperature=0.0, max_tokens=3))
    out = llm.generate("Once upon a time", None)[0]
    assert len(out.token_ids) <= 3
    for source, want in (("auto", SamplingParams(**AS_PARAMS)), ("vllm", SamplingParams())):
        llm.generation = EngineConfig(model=model, generation_config=source).generation_defaults()
        assert fields(llm.get_default_sampling_params()) == fields(want)


def pdserve_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", "serve", *args], capture_output=True, text=True,
                          timeout=120)


def test_vllm_ignores_the_file_and_dir_reads_another(start_server, model, other_dir):
    def chat_tokens(server) -> int:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        return client.chat.completions.create(model=client.models.list().data[0].id, extra_body={"ignore_eos": True},
                                              messages=[{"role": "user", "content": "Hi"}]).usage.completion_tokens
    auto = start_server(model, "--max-tokens-cap", "12")
    assert chat_tokens(auto) == 7
    assert "generation defaults: temperature=0.7" in auto.log() and "max_tokens=7" in auto.log()
    ignored = start_server(model, "--generation-config", "vllm", "--max-tokens-cap", "12")
    assert chat_tokens(ignored) == 12   # the server's own default: as many as fit, here the cap
    other = start_server(model, "--generation-config", other_dir)
    assert chat_tokens(other) == 3
    assert "temperature=0.0" in other.log()

    def texts(server, **kw) -> set[str]:   # seeded samples, and the greedy answer
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        return {client.completions.create(model=client.models.list().data[0].id, prompt="The little dog", max_tokens=8,
                                          seed=seed, extra_body={"ignore_eos": True}, **kw).choices[0].text
                for seed in range(4)}
    # the other folder's temperature 0 makes a seeded request greedy; ignoring the files, it samples
    assert texts(other) == texts(other, temperature=0) and len(texts(other)) == 1
    assert texts(ignored) != texts(ignored, temperature=0)


@pytest.mark.parametrize("source, content, words", [
    ("missing", None, ["--generation-config", "not a directory"]),
    ("empty", None, ["no generation_config.json"]),
    ("dir", {"temperature": -1}, ["temperature must be >= 0", "--generation-config vllm"]),
    ("dir", {"max_new_tokens": 0}, ["max_new_tokens must be an integer >= 1"]),
    ("dir", "{not json", ["cannot read JSON"]),
])
def test_a_bad_generation_config_is_a_one_line_error(tiny_llama, tmp_path, source, content, words):
    d = tmp_path / "gen"
    if source != "missing":
        d.mkdir()
    if content is not None:
        (d / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError) as e:
        EngineConfig(model=tiny_llama, generation_config=str(d))
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)
    if source == "dir" and content == {"temperature": -1}:   # and the CLI says it in one line, no traceback
        out = pdserve_serve("--model", tiny_llama, "--generation-config", str(d), "--port", str(free_port()))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and "Traceback" not in out.stderr and 1 <= len(lines) <= 2, out.stderr
        assert "temperature must be >= 0" in lines[0]
