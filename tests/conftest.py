"""Shared fixtures. Tiny checkpoints are built once per test session into a temp dir."""
import json

import pytest

from tools.make_model import make_model


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory):
    """make_tiny(arch, **config_overrides) -> path of a tiny random checkpoint, cached by arguments."""
    cache = {}

    def build(arch: str = "llama", **overrides) -> str:
        key = (arch, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            cache[key] = make_model(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch, **overrides)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(make_tiny):
    return make_tiny("qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(make_tiny):
    return make_tiny("mistral")


@pytest.fixture(scope="session")
def tiny_opt(make_tiny):
    return make_tiny("opt")
