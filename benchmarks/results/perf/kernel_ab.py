"""One kernel source at OLD_REV and in the working tree, each built as its own extension with a
small binding, for the labs that alternate old and new in one process
(prefill_attention_blocks/lab.py, decode_attention_labs/spread_ab.py). Sources are rewritten only
when they change, so the loader's build cache holds across runs."""
import os
import subprocess
import tempfile

from torch.utils.cpp_extension import load

from pdserve.kernels import CFLAGS, _DIR


def build_old_new(kernel: str, old_rev: str, bind: str, symbol: str, work_name: str) -> dict:
    """{"old": module, "new": module} for pdserve/kernels/`kernel`; `bind` declares `symbol` and
    binds it. Each build renames `symbol` (two libraries exporting one symbol: the first loaded
    would serve both)."""
    work = os.path.join(tempfile.gettempdir(), work_name)
    sources = {"old": subprocess.run(["git", "show", f"{old_rev}:pdserve/kernels/{kernel}"],
                                     capture_output=True, text=True, check=True).stdout,
               "new": open(os.path.join(_DIR, kernel)).read()}
    mods = {}
    for v, src in sources.items():
        d = os.path.join(work, v)
        os.makedirs(os.path.join(d, "build"), exist_ok=True)
        for name, text in (("kernel.cpp", src), ("bind.cpp", bind)):
            path = os.path.join(d, name)
            if not os.path.exists(path) or open(path).read() != text:
                open(path, "w").write(text)
        mods[v] = load(f"{work_name}_{v}", [os.path.join(d, "kernel.cpp"), os.path.join(d, "bind.cpp")],
                       extra_include_paths=[_DIR], extra_cflags=CFLAGS + [f"-D{symbol}={symbol}_{v}"],
                       extra_ldflags=["-lgomp"], build_directory=os.path.join(d, "build"))
    return mods
