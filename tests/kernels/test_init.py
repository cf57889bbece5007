"""``kernels/__init__.py``: re-exports the reference module and never imports triton, so the
CPU code paths (engine with the torch backend, server, tests) never need triton at import;
nor torch, so the capacity planner, which reads the engine's config and through it the
kernels' launch switches, starts without it.

Checked in a child process: this one has imported triton and torch already.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys
import kernels
from kernels import reference
assert "triton" not in sys.modules, "import kernels pulled in triton"
assert kernels.__all__ == ["reference"]
assert kernels.reference is reference
for name in ("paged_attention_decode", "paged_attention_prefill", "store_kv"):
    assert callable(getattr(reference, name)), name
"""


NO_TORCH = """
import sys
import engine.config
import kernels.settings
import planner.cli
assert "torch" not in sys.modules, "engine.config or the planner pulled in torch"
"""


def test_the_planner_and_the_engine_config_import_without_torch():
    done = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_package_reexports_the_reference_without_importing_triton():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
