"""Every family runs on the CPU decoder stack (one C++ call for the layers), except the one whose
recipe cannot express a part, which says why in one start-up line: no silent fallback
(docs/ARCHITECTURE.md, "Supported architectures"). Exactness on the stack is the family tests'."""
import logging

import pytest

from pdserve import LLM
from pdserve.backends.cpu import kernels

pytestmark = pytest.mark.skipif(not kernels.supported_isas(), reason="this CPU runs none of the kernels' builds")

ON_THE_STACK = [("qwen3", {}), ("olmo2", {}), ("granite", {}), ("smollm3", {}), ("ministral", {}), ("gemma2", {}),
                ("gemma3", {}), ("phi3", {}), ("phi3", {"partial_rotary_factor": 0.5}),
                ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1})]


@pytest.mark.parametrize("arch, overrides", ON_THE_STACK, ids=lambda v: v if isinstance(v, str) else "")
def test_family_runs_on_the_decoder_stack(make_tiny, arch, overrides, caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        llm = LLM(make_tiny(arch, **overrides), num_kv_blocks=16)
    assert llm.engine.runner.backend.stack is not None, llm.engine.runner.backend.why_no_stack
    assert not [r for r in caplog.records if "decoder stack cannot run" in r.getMessage()]


def test_ministral3_says_why_it_is_not_on_the_stack(make_tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        llm = LLM(make_tiny("ministral3", sliding_window=16), num_kv_blocks=16)
    assert llm.engine.runner.backend.stack is None
    lines = [r.getMessage() for r in caplog.records if "decoder stack cannot run" in r.getMessage()]
    assert len(lines) == 1 and "a part its recipe cannot express" in lines[0], lines
