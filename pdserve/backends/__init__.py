"""Backends: how a model runs on a device, behind one small interface (base.py) that the model
runner asks. torch_backend.py is the reference (the model's torch modules, any device); cpu/ is
the CPU fast path (pdserve's kernels, packed weights, huge pages, the decoder stack); cuda/ the GPU's
(Triton paged attention, decode CUDA graphs, the KV cache sized from the GPU's memory)."""
import torch

from pdserve.backends.base import Backend
from pdserve.backends.torch_backend import TorchBackend
from pdserve.config import EngineConfig, ModelConfig


def _cuda_backend(model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> Backend:
    """The CUDA backend, or the torch backend where its kernels cannot serve the model, saying why."""
    from pdserve.models import kv_spec
    if kv_spec(model_config).planes != 2:
        return TorchBackend(device, "multi-head latent attention: the Triton kernels read K and V heads")
    try:
        import triton  # noqa: F401
    except ImportError:
        return TorchBackend(device, "Triton is not installed: pip install 'pdserve[cuda]'")
    from pdserve.backends.cuda.backend import CudaBackend
    return CudaBackend(model_config, config, dtype)


def select_backend(model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> Backend:
    """The CUDA backend where the device is CUDA (the torch backend where it cannot serve the
    model); the CPU backend where the device is the CPU and its kernels apply (not fp16, not turned off
    by --no-cpu-kernels) and build; else the torch backend. Raises where the kernels are asked
    for (--cpu-kernels, --quantization) and cannot be built."""
    device = torch.device(config.device)
    if device.type == "cuda":
        return _cuda_backend(model_config, config, dtype, device)
    if device.type != "cpu":
        return TorchBackend(device)
    if config.cpu_kernels is False:
        return TorchBackend(device, "--no-cpu-kernels")
    if dtype == torch.float16:
        return TorchBackend(device, "the CPU kernels take fp32 and bf16 models")
    from pdserve.backends.cpu.backend import CpuBackend
    from pdserve.backends.cpu.kernels import cpu_ops
    if cpu_ops() is None:
        if config.cpu_kernels or config.quantization:
            raise RuntimeError("pdserve's CPU kernels could not be built (see the warning above)")
        return TorchBackend(device, "the CPU kernels are not built")
    return CpuBackend(model_config, config, dtype)
