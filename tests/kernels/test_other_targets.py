"""The C++ CPU kernels built for the targets this machine is not.

The kernels have three vector paths chosen at compile time by ``-march``: AVX-512 (16-float
vectors, 64-column panels), AVX2 (8 floats, 16 columns, smaller tiles) and the portable one
(4 floats, no intrinsics); the GGUF-block matmul also has an integer path (AVX-512 VNNI)
beside its float one. ``-march=native`` tests only the machine's own, so a developer's
AVX-512 machine never runs the AVX2 code that most 2-core cloud machines run, and the
reverse. Here the kernel tests run again in a subprocess against an extension built with
``PAGEDSERVE_CPU_MARCH`` for each target the CPU can execute, other than the one native
builds already test.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/kernels/test_cpu_kernels.py",
    "tests/kernels/test_gguf_matmul.py",
    "tests/kernels/test_int8_matmul.py",
    # the int8 and fp8 KV caches' C++ paths (vload_i8 and vload_e4m3_scaled have an AVX-512,
    # an AVX2 and a portable form)
    "tests/kernels/test_kv_quant.py::test_cpu_decode_over_a_quantized_cache_matches_reference",
    "tests/kernels/test_kv_quant.py::test_cpu_decode_reads_every_e4m3_byte_as_torch_does",
    "tests/kernels/test_kv_quant.py::test_cpu_rope_and_store_quantizes_like_the_reference",
    "tests/kernels/test_kv_quant.py::test_cpu_rope_and_store_writes_the_reference_bytes_at_the_edges",
]
X86 = platform.machine() in ("x86_64", "AMD64")
# (target, the flags the CPU needs to run it, the flag whose absence makes a native build
# already this target)
TARGETS = [
    # AVX-512 without VNNI: the GGUF-block matmul's float path on 64-column panels.
    ("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}, "avx512_vnni"),
    ("x86-64-v3", {"avx2", "fma", "bmi2"}, "avx512f"),
    ("x86-64", set(), "avx2"),
]


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="the -march targets named here are x86-64 ones")
@pytest.mark.skipif(os.environ.get("PAGEDSERVE_CPU_KERNELS") == "0", reason="C++ kernels disabled")
@pytest.mark.skipif(
    bool(os.environ.get("PAGEDSERVE_CPU_MARCH")), reason="already running for a chosen target"
)
@pytest.mark.parametrize("target,needs,native_lacks", TARGETS, ids=[t[0] for t in TARGETS])
def test_kernel_tests_pass_when_built_for(target, needs, native_lacks, cpu_flags):
    if not needs <= cpu_flags:
        pytest.skip(f"this CPU cannot run {target} code (lacks {sorted(needs - cpu_flags)})")
    if native_lacks not in cpu_flags:
        pytest.skip(f"the native build is already the {target} path")
    env = dict(os.environ, PAGEDSERVE_CPU_MARCH=target)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"kernel tests built for {target} failed:\n{tail}"
    # Some tests passed rather than all skipping. That they ran on the build for `target` is
    # checked inside: test_gguf_matmul's test_panel_width_follows_the_build_target.
    assert " passed" in proc.stdout, tail
