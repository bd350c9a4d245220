"""Which backend --device cuda gets: the CUDA backend, or the torch backend saying why (a model
whose attention the kernels do not do, Triton missing). Asked with the device's name only, on the CPU."""
import sys

import torch

from pdserve.backends import TorchBackend, _cuda_backend
from pdserve.config import EngineConfig, ModelConfig


def choose(path: str, device: str = "cpu"):
    config = EngineConfig(model=path, device="cpu")
    return _cuda_backend(ModelConfig.from_dir(path), config, torch.float32, torch.device(device))


def test_cuda_backend_for_a_model_its_kernels_serve(cuda, make_tiny):
    backend = choose(make_tiny("llama"))
    assert isinstance(backend, cuda.backend.CudaBackend)
    assert backend.block_q == {True: 8, False: 32}   # 4 query heads on 2 KV heads: rows of 16 and 64


def test_torch_backend_for_latent_attention(cuda, make_tiny):
    backend = choose(make_tiny("deepseek_v3"))
    assert isinstance(backend, TorchBackend) and "latent attention" in backend.describe()


def test_torch_backend_without_triton(make_tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)   # import triton raises ImportError
    backend = choose(make_tiny("llama"))
    assert isinstance(backend, TorchBackend) and "Triton is not installed" in backend.describe()
