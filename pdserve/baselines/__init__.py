"""The origin server's three generation paths, kept as baselines to measure against (`--baseline`).

Each baseline is an EngineClient (pdserve/engine/interface.py), so the same server, endpoints and
metrics run on top of any of them."""
from pdserve.baselines.generate import GenerateBaseline
from pdserve.baselines.nocache import NoCacheBaseline
from pdserve.baselines.static import StaticBaseline

BASELINES = {"hf": GenerateBaseline, "static": StaticBaseline, "nocache": NoCacheBaseline}
