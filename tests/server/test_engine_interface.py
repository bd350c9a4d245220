"""The engine's interface to the server (pdserve/engine/interface.py): LLMEngine is a
PagedEngine, the baselines and the tests' stand-in are EngineClients only, and the server opens a
paged cache's endpoints by that one question."""
import typing

import pytest
from fastapi.testclient import TestClient

from pdserve.baselines import BASELINES
from pdserve.engine.interface import EngineClient, PagedEngine, grammars, paged
from pdserve.engine.llm_engine import LLMEngine
from pdserve.server.app import build_app
from pdserve.server.config import ServerConfig
from tests.server.fake_engine import FakeEngine, FakePagedEngine


def members(protocol) -> set[str]:
    """The attributes and methods a protocol declares, its bases' too."""
    names = set()
    for cls in protocol.__mro__:
        if cls not in (object, typing.Protocol, typing.Generic):
            names |= {n for n in vars(cls) if not n.startswith("_")} | set(vars(cls).get("__annotations__", {}))
    return names


def test_llm_engine_has_every_member_of_the_interface(tiny_llama):
    engine = LLMEngine(tiny_llama, num_kv_blocks=8, block_size=16)
    assert paged(engine) is engine
    assert members(PagedEngine) - set(dir(engine)) == set()
    assert (engine.kv_capacity, engine.num_kv_blocks, engine.num_kv_leases) == (128, 8, 0)
    assert grammars(engine) is engine.processor.grammars


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_a_baseline_is_an_engine_client_without_a_paged_cache(tiny_llama, name):
    engine = BASELINES[name](tiny_llama)
    assert members(EngineClient) - set(dir(engine)) == set()
    assert paged(engine) is None and grammars(engine) is engine.processor.grammars   # constrained decoding too


def test_the_paged_endpoints_follow_the_interface():
    config = ServerConfig("fake-model")
    with TestClient(build_app(FakeEngine(), config)) as c:
        r = c.post("/reset_prefix_cache")
        assert r.status_code == 400 and "no prefix cache" in r.json()["error"]["message"]
        assert c.get("/v1/kv_transfer").json()["block_size"] is None
    engine = FakePagedEngine(block_size=8)
    with TestClient(build_app(engine, config)) as c:
        assert c.post("/reset_prefix_cache").status_code == 200 and engine.resets == 1
        assert c.get("/v1/kv_transfer").json()["block_size"] == 8
        assert c.app.state.pdserve.max_seq_len == min(engine.max_model_len, engine.kv_capacity)
