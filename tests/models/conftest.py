"""The runs every family test takes: torch's ops, then each kernel build this CPU runs."""
import pytest

from pdserve.backends.cpu import kernels
from tests.conftest import KERNEL_ISAS

RUNS = [("torch", None)] + [("kernels", isa) for isa in KERNEL_ISAS]


@pytest.fixture(scope="module", params=RUNS, ids=[k if isa is None else isa for k, isa in RUNS])
def cpu_kernels(request) -> bool:
    """torch's ops (--no-cpu-kernels), then each kernel build this CPU runs."""
    kind, isa = request.param
    kernels.use_isa(isa)
    yield kind == "kernels"
    kernels.use_isa(None)
