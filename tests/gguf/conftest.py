"""GGUF files made as users make them: llama.cpp's own convert_hf_to_gguf.py (from the vendored
llama.cpp tree of the llama-cpp-python sdist, benchmarks/peers.py) for F32/F16/BF16/Q8_0, and its
llama-quantize for Q4_0/Q4_1/Q4_K_M/Q5_K_M/Q6_K. The tree and the llama-quantize build are cached
in ~/.cache/pdserve-peers by version (the first build takes about 5 minutes on 2 cores); the tiny
checkpoints and their GGUF files are made once per session. Where cmake/ninja/a C++ compiler are
missing, the llama-quantize tests skip, saying so."""
import os
import sys

import pytest

from benchmarks import peers
from pdserve.bench.servers import PeerError

PEERS_DIR = os.environ.get("PDSERVE_PEERS_DIR", peers.DEFAULT_PEERS_DIR)
# K-quants take rows of 256: the quantized models are 256 wide (llama-quantize would fall back to
# other types for narrower rows). 2 layers, 4 heads of 64, 2 KV heads.
WIDE = dict(hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="session")
def llama_tree():
    try:
        return peers.llama_src(PEERS_DIR)
    except PeerError as e:
        pytest.skip(f"llama.cpp's source tree (llama-cpp-python sdist) is not available: {e}")


@pytest.fixture(scope="session")
def make_gguf(make_tiny, llama_tree, tmp_path_factory):
    """make_gguf(arch, outtype, **config_overrides) -> the tiny checkpoint's directory and its
    GGUF file, converted by llama.cpp's convert_hf_to_gguf.py (outtype f32, f16, bf16 or q8_0)."""
    out_dir = tmp_path_factory.mktemp("gguf")
    made = {}

    def make(arch: str, outtype: str = "f32", **overrides) -> tuple[str, str]:
        key = (arch, outtype, tuple(sorted(overrides.items())))
        if key not in made:
            model_dir = make_tiny(arch, **overrides)
            name = f"{arch}-{abs(hash(key[2])) % 10**6}-{outtype}.gguf"
            out = str(out_dir / name)
            peers.convert_to_gguf(PEERS_DIR, model_dir, outtype, out=out, python=sys.executable)
            made[key] = (model_dir, out)
        return made[key]
    return make


@pytest.fixture(scope="session")
def llama_quantize():
    missing = peers.build_tools_missing()
    if missing:
        pytest.skip(f"llama-quantize cannot be built here: {missing}")
    try:
        return peers.install_llama_tool(PEERS_DIR, "llama-quantize")
    except PeerError as e:
        pytest.skip(f"llama-quantize did not build: {str(e).splitlines()[0]}")


@pytest.fixture(scope="session")
def make_quantized(make_gguf, llama_quantize):
    """make_quantized(arch, qtype) -> (checkpoint dir, F32 GGUF, the GGUF llama-quantize made)."""
    def make(arch: str, qtype: str) -> tuple[str, str, str]:
        model_dir, f32 = make_gguf(arch, "f32", **WIDE)
        return model_dir, f32, peers.quantize_gguf(PEERS_DIR, f32, qtype)
    return make
