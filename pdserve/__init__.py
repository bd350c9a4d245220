"""pdserve: a single-model LLM serving engine."""
from pdserve.engine.outputs import RequestMetrics, RequestOutput
from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestMetrics", "__version__"]
