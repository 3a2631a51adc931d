"""cpu_qgemm across instruction sets: the C check program (qgemm_check.c) prints a hash of every
output for fixed inputs; every variant this host runs, and the arm64 build's portable and NEON
(dotprod) variants under qemu-user, must print the same hashes. The arm64 part needs Debian's
gcc-aarch64-linux-gnu and qemu-user (scripts/setup.sh installs them) and skips without them."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess

import pytest

from kernels import cpu_gemv

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "qgemm_check.c")


def _build(cc: str, arch: str, out_dir: str, static: bool) -> str:
    cmds, objs = cpu_gemv.qgemm_compile_commands(cc, arch, out_dir)
    for cmd in cmds:
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    exe = os.path.join(out_dir, "qgemm_check")
    subprocess.run([cc, "-O2", *(["-static"] if static else []), CHECK, *objs, "-fopenmp", "-o", exe],
                   check=True, capture_output=True, timeout=300)
    return exe


def _hashes(lines: str) -> dict[str, dict[tuple[str, ...], str]]:
    """variant -> {(kind, K, M): hash}"""
    out: dict[str, dict[tuple[str, ...], str]] = {}
    for line in lines.splitlines():
        variant, kind, k, m, rc, h = line.split()
        assert rc == "rc=0", line
        out.setdefault(variant, {})[(kind, k, m)] = h
    return out


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    if platform.machine() not in ("x86_64", "AMD64") or not shutil.which("gcc"):
        pytest.skip("native build is x86-64 here")
    exe = _build("gcc", "x86_64", str(tmp_path_factory.mktemp("native")), static=False)
    return _hashes(subprocess.run([exe], check=True, capture_output=True, text=True, timeout=300).stdout)


def test_every_native_variant_prints_the_same_hashes(native):
    assert "portable" in native and len(native["portable"]) == 48
    for variant, table in native.items():
        assert table == native["portable"], variant


@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64")),
                    reason="needs gcc-aarch64-linux-gnu and qemu-user")
def test_arm64_neon_and_portable_match_x86_under_qemu(native, tmp_path):
    exe = _build("aarch64-linux-gnu-gcc", "aarch64", str(tmp_path), static=True)
    res = subprocess.run(["qemu-aarch64", "-cpu", "max", exe], check=True, capture_output=True, text=True, timeout=600)
    arm = _hashes(res.stdout)
    assert set(arm) == {"portable", "neon"}, res.stdout[:500]
    for variant, table in arm.items():
        assert table == native["portable"], variant
