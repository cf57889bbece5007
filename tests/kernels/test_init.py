"""``kernels/__init__.py``: re-exports the reference twins and never imports triton, so the
CPU code paths (engine with the torch backend, server, tests) never need triton at import.

Checked in a child process: this one has imported triton already, and also the Triton module
``kernels.store_kv``, which Python binds over the package attribute ``kernels.store_kv`` (a
name clash the README warns about: import launchers and references from their modules).
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys
import kernels
from kernels import reference
assert "triton" not in sys.modules, "import kernels pulled in triton"
assert kernels.__all__ == ["paged_attention_decode", "paged_attention_prefill", "store_kv"]
for name in kernels.__all__:
    assert getattr(kernels, name) is getattr(reference, name), name
"""


def test_package_reexports_the_reference_without_importing_triton():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
