"""Shared fixtures. Tiny checkpoints are built once per test session into a temp dir."""
import json

import os

import pytest

from pdserve.backends.cpu import kernels
from tools.make_model import make_model

# The kernels' builds the tests run: each this CPU executes (an AVX-512 machine runs the AVX2 build
# too), or the one PDSERVE_CPU_ISA names (=avx2 stands in for an AVX2-only machine).
if os.environ.get("PDSERVE_CPU_ISA", "auto") == "auto":
    KERNEL_ISAS = kernels.supported_isas()
else:
    KERNEL_ISAS = [isa for isa in [kernels.selected_isa()] if isa]


@pytest.fixture(scope="module", params=KERNEL_ISAS or [pytest.param(None, marks=pytest.mark.skip(
        reason="this CPU runs none of the kernels' builds (AVX2, AVX-512)"))])
def cpu_isa(request):
    """Runs a module's tests once per kernel build: the models and kernels they make use that build."""
    kernels.use_isa(request.param)
    yield request.param
    kernels.use_isa(None)


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


@pytest.fixture(scope="module", params=KERNEL_ISAS or [None])
def isa_or_torch(request):
    """cpu_isa where a build runs here; else one run on torch's ops instead of a skip."""
    kernels.use_isa(request.param)
    yield request.param
    kernels.use_isa(None)


@pytest.fixture
def bf16_dot(cpu_isa):
    """Skips where the build in use has no AVX512-BF16 dot products (its bf16 weights then take the
    portable widened path, which the other tests run)."""
    if not kernels.cpu_supports_bf16_dot():
        pytest.skip(f"the {cpu_isa} build has no AVX512-BF16 dot products")
