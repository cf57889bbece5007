"""The paged-attention benchmark's test runs the Triton kernels, so it shares the kernel tests'
set-up: importing tests/kernels/conftest.py sets ``TRITON_INTERPRET=1`` without CUDA (before
any kernel module is imported), provides the ``device`` fixture and, under the interpreter,
checks every kernel access against the launch's tensors (``_checked_addresses``)."""

from tests.kernels.conftest import _checked_addresses, device  # noqa: F401 - fixtures
