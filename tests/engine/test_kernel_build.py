"""The kernel build: named after its inputs, and never waiting on a lock a killed build left."""
import os
import shutil
import subprocess
import sys

import pytest

from pdserve import kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_supports_avx512(), reason="the CPU kernels need AVX-512")


def test_builds_here():
    # This machine has AVX-512 and a compiler: a failed build is a failure, not a silent fallback.
    assert kernels.cpu_ops() is not None


def test_stale_lock_from_a_killed_build_is_removed():
    kernels.cpu_ops()   # built and imported in this process
    lock = os.path.join(kernels.build_directory(kernels.build_name()), "lock")
    open(lock, "w").close()   # what torch's loader leaves when its build is killed
    try:
        # torch's loader alone would wait on this file forever
        r = subprocess.run([sys.executable, "-c", "from pdserve.kernels import load_cpu_ops; load_cpu_ops()"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "stale build lock" in r.stderr
        assert not os.path.exists(lock)
    finally:
        if os.path.exists(lock):
            os.remove(lock)


def test_build_name_covers_the_header(tmp_path, monkeypatch):
    header = tmp_path / "vec512.h"
    header.write_text("// one\n")
    monkeypatch.setattr(kernels, "HEADERS", [str(header)])
    before = kernels.build_name()
    assert kernels.build_name() == before
    header.write_text("// two\n")
    assert kernels.build_name() != before


def test_build_name_covers_the_compiler(tmp_path, monkeypatch):
    before = kernels.build_name()
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'c++ (Fake) 99.1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    assert "Fake" in kernels.compiler_version()
    assert kernels.build_name() != before
    monkeypatch.delenv("CXX")
    assert kernels.build_name() == before


def test_a_checkout_elsewhere_with_the_same_kernels_reuses_the_build(tmp_path):
    # Same sources at another path (a second clone, CI's clean clone): torch's loader alone would
    # compile them again (its build file names the sources' paths) and the two would keep
    # rebuilding each other's. pdserve imports the build its hash names instead.
    kernels.cpu_ops()
    built = os.path.join(kernels.build_directory(kernels.build_name()), kernels.build_name() + ".so")
    before = os.stat(built).st_mtime_ns
    package = os.path.dirname(os.path.dirname(kernels.__file__))
    shutil.copytree(package, tmp_path / "pdserve", ignore=shutil.ignore_patterns("data", "__pycache__"))
    code = ("import pdserve.kernels as k; assert k.__file__.startswith(%r), k.__file__; "
            "print(k.build_name()); assert k.load_cpu_ops().packed_linear" % str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == kernels.build_name()
    assert os.stat(built).st_mtime_ns == before   # not compiled again
