import pytest

from pdserve.engine.llm_engine import LLMEngine
from tests.kv_transfer.pd import ENGINE, SECRET


@pytest.fixture
def pair(tiny_llama):
    """pair(pre_kwargs, dec_kwargs) -> (a prefill engine, a decode engine) of one deployment; closed after."""
    engines = []

    def make(pre_kwargs=None, dec_kwargs=None):
        pre = LLMEngine(tiny_llama, role="prefill", kv_transfer_secret=SECRET, **ENGINE, **(pre_kwargs or {}))
        dec = LLMEngine(tiny_llama, role="decode", kv_transfer_secret=SECRET, **ENGINE, **(dec_kwargs or {}))
        engines.extend([pre, dec])
        return pre, dec
    yield make
    for e in engines:
        e.close()
