"""The kernel build: one per instruction set, named after its inputs, never waiting on a lock a
killed build left (test_kernel_first_use.py: processes building at once, no compiler)."""
import os
import shutil
import subprocess
import sys

import pytest

import pdserve
from pdserve.backends.cpu import kernels

pytestmark = pytest.mark.usefixtures("cpu_isa")


def test_builds_here(cpu_isa):
    # A compiler and a CPU that runs this build: a failed build is a failure, not a silent fallback.
    ops = kernels.cpu_ops()
    assert ops is not None and ops.isa == cpu_isa == kernels.selected_isa()
    assert kernels.kernel_path().startswith(f"kernels {cpu_isa} (")


def test_each_instruction_set_has_its_own_build():
    names = {kernels.build_name(isa) for isa in kernels.ISAS}
    assert len(names) == len(kernels.ISAS) and all(f"_{isa}_" in kernels.build_name(isa) for isa in kernels.ISAS)


def test_forced_avx2_is_honoured(monkeypatch):
    monkeypatch.setattr(kernels, "_forced", None)   # the environment decides; the fixture's choice comes back after
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")
    assert kernels.selected_isa() == "avx2" and not kernels.cpu_supports_avx512() and not kernels.cpu_supports_bf16_dot()
    monkeypatch.setenv("PDSERVE_CPU_ISA", "auto")
    assert kernels.selected_isa() == kernels.supported_isas()[0]
    monkeypatch.setenv("PDSERVE_CPU_ISA", "sse9")   # a typo: said once, then the best this CPU runs
    assert kernels.selected_isa() == kernels.supported_isas()[0]


def test_build_kernels_command_builds_ahead_of_use(cpu_isa):
    kernels.cpu_ops()   # built (or found) here first: the command then only finds it
    r = subprocess.run([sys.executable, "-m", "pdserve", "build-kernels", "--isa", cpu_isa], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"{cpu_isa}:", kernels.cpu_ops().__file__]


def test_stale_lock_from_a_killed_build_is_removed():
    kernels.cpu_ops()   # built and imported in this process
    lock = os.path.join(kernels.build_directory(kernels.build_name()), "lock")
    open(lock, "w").close()   # what torch's loader leaves when its build is killed
    try:
        # torch's loader alone would wait on this file forever
        r = subprocess.run([sys.executable, "-c", "from pdserve.backends.cpu.kernels import load_cpu_ops; load_cpu_ops()"],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PDSERVE_CPU_ISA": kernels.selected_isa()})
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
    package = os.path.dirname(pdserve.__file__)
    shutil.copytree(package, tmp_path / "pdserve", ignore=shutil.ignore_patterns("data", "__pycache__"))
    code = ("import pdserve.backends.cpu.kernels as k; assert k.__file__.startswith(%r), k.__file__; "
            "print(k.build_name()); assert k.load_cpu_ops().packed_linear" % str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(tmp_path), "PDSERVE_CPU_ISA": kernels.selected_isa()},
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == kernels.build_name()
    assert os.stat(built).st_mtime_ns == before   # not compiled again

