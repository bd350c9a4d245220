"""The CUDA backend's modules as the CPU suite runs them: under Triton's interpreter.

Triton decides at decoration (@triton.jit, at import) whether a function is compiled or
interpreted, from TRITON_INTERPRET, and that holds for its own library functions (tl.zeros,
tl.sum, ...) as well as ours. So the `cuda` fixture imports triton and pdserve.backends.cuda
afresh with the variable set (triton's compiled extension, triton._C, stays as it is), and after
the module's tests puts back the variable and whatever modules were there before: no other module
(test_gpu.py runs the compiled kernels) and no subprocess started later sees either."""
import os
import sys
from types import SimpleNamespace

import pytest

PACKAGES = ("triton", "pdserve.backends.cuda")


def _fresh(name: str) -> bool:
    """A module the fixture imports again: triton's Python modules and the CUDA backend's."""
    if name == "triton._C" or name.startswith("triton._C."):
        return False
    return any(name == p or name.startswith(p + ".") for p in PACKAGES)


def _index_scalars_numpy_2_4() -> None:
    """Triton 3.6's interpreter holds a scalar as a 1-element array and takes it as an index
    (`range(lo, hi)` over loaded bounds) by int(array), which numpy 2.4 refuses for arrays of one
    dimension; .item() is what it means. Patched in the fresh import only (dropped after the tests)."""
    from triton.runtime import interpreter
    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    interpreter._patch_lang_tensor = patched


@pytest.fixture(scope="module")
def cuda():
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the CUDA backend's kernels are Triton's (pip install 'pdserve[cuda]')")
    import pdserve.backends as backends
    saved_env = os.environ.get("TRITON_INTERPRET")
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if _fresh(n)}
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _index_scalars_numpy_2_4()
        import pdserve.backends.cuda.backend as backend
        mods = SimpleNamespace(backend=backend, **{n: sys.modules[f"pdserve.backends.cuda.{n}"] for n in
                                                   ("kernels", "layers", "metadata", "graphs", "memory")})
        assert mods.kernels.interpreted()
        yield mods
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        for n in [n for n in sys.modules if _fresh(n)]:
            del sys.modules[n]
        sys.modules.update(saved)
        if "pdserve.backends.cuda" in saved:
            backends.cuda = saved["pdserve.backends.cuda"]
        elif hasattr(backends, "cuda"):
            del backends.cuda
