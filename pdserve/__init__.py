"""pdserve: a single-model LLM serving engine.

`LLM`, `SamplingParams`, `RequestOutput` and `RequestMetrics` are imported on first use, so
that `pdserve --help` does not pay for importing torch."""
__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestMetrics", "__version__"]

_LAZY = {"LLM": "pdserve.llm", "SamplingParams": "pdserve.sampling_params",
         "RequestOutput": "pdserve.engine.outputs", "RequestMetrics": "pdserve.engine.outputs"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
