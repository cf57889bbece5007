"""The paged-attention benchmark's test runs the Triton kernels, so it shares the kernel tests'
set-up: importing tests/kernels/conftest.py sets ``TRITON_INTERPRET=1`` without CUDA (before
any kernel module is imported) and provides the ``device`` fixture."""

from tests.kernels.conftest import device  # noqa: F401 - a fixture
