"""``kernels/__init__.py``: re-exports the reference twins and never imports triton, so the
CPU code paths (engine with the torch backend, server, tests) never need triton at import."""

from __future__ import annotations

import subprocess
import sys

import kernels
from kernels import reference


def test_package_reexports_the_reference():
    assert kernels.__all__ == ["paged_attention_decode", "paged_attention_prefill", "store_kv"]
    for name in kernels.__all__:
        assert getattr(kernels, name) is getattr(reference, name)


def test_importing_the_package_does_not_import_triton():
    # A child process: this one has imported triton already (the kernel tests).
    code = "import sys, kernels; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
