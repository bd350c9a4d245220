"""The origin server's three generation paths, kept as selectable backends to measure against.

Each backend has the engine's interface (add_request, abort_request, step,
has_unfinished_requests, get_stats, last_step), so the same server, endpoints and metrics run
on top of any of them."""
from pdserve.baselines.generate_backend import GenerateBackend
from pdserve.baselines.nocache_backend import NoCacheBackend
from pdserve.baselines.static_backend import StaticBackend

BACKENDS = {"hf": GenerateBackend, "static": StaticBackend, "nocache": NoCacheBackend}
