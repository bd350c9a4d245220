"""The kernels' first use as a user meets it: processes that build at once share one build, each
with a visible line; without a compiler, one warning and torch's ops. A one-function stand-in for
the kernels (plain Python C API) keeps each build short."""
import fcntl
import os
import subprocess
import sys
import textwrap

import pytest

from pdserve.backends.cpu import kernels

pytestmark = pytest.mark.skipif(kernels.selected_isa() is None, reason="this CPU runs none of the kernels' builds")

TINY = textwrap.dedent("""
    #include <Python.h>
    #define CAT2(a, b) a##b
    #define CAT(a, b) CAT2(a, b)
    #define STR2(a) #a
    #define STR(a) STR2(a)
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
    static PyModuleDef module = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
    PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
""")   # the Python C API alone: seconds to compile where torch's headers take minutes


def _tiny_load(tmp_path, env_extra=None):
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY)
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING, stream=sys.stderr); "
            "from pdserve.backends.cpu import kernels as k; k.SOURCES = [%r]; k.HEADERS = []; "
            "ops = k.cpu_ops(); print(ops.answer() if ops else None, ops.__file__ if ops else '')" % str(src))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PDSERVE_CPU_ISA": kernels.selected_isa(),
           **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def test_two_processes_building_at_once_both_load_one_build(tmp_path, monkeypatch):
    # a server started while the tests build: neither fails nor overwrites the other's build. The
    # build's flock is held here until both processes wait on it, so they meet the build at once
    # however fast the machine starts them and compiles (the stand-in compiles in under a second).
    monkeypatch.setattr(kernels, "SOURCES", [str(tmp_path / "tiny.cpp")])
    monkeypatch.setattr(kernels, "HEADERS", [])
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "tiny.cpp").write_text(TINY)
    directory = kernels.build_directory(kernels.build_name(kernels.selected_isa()))
    os.makedirs(directory)
    with open(directory + ".flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        first, second = _tiny_load(tmp_path), _tiny_load(tmp_path)
        heard = [p.stderr.readline() for p in (first, second)]   # each one's first line: it waits
        fcntl.flock(held, fcntl.LOCK_UN)
    assert all("waiting for another process's build" in line for line in heard), heard
    outs = [p.communicate(timeout=900) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    answers = [out.split() for out, _ in outs]
    assert answers[0][0] == answers[1][0] == "42" and answers[0][1] == answers[1][1]
    logs = outs[0][1] + outs[1][1]
    assert logs.count("compiling pdserve's CPU kernels") == 1   # one built, with a visible line


def test_without_a_compiler_one_warning_and_torch_ops(tmp_path):
    p = _tiny_load(tmp_path, {"CXX": str(tmp_path / "no-such-compiler")})
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0 and out.split() == ["None"], err
    warnings = [line for line in err.splitlines() if "using torch's ops" in line]
    assert len(warnings) == 1 and "could not build pdserve's CPU kernels" in warnings[0], err
