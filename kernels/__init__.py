"""Attention kernels over the paged KV cache.

Owns: no state. Every kernel exists twice with one signature:

- the plain-PyTorch reference (re-exported here; the CPU path and the test oracle), and
- a Triton launcher, one file per kernel, imported explicitly by whoever chose it::

      from kernels.store_kv import store_kv
      from kernels.paged_attention import paged_attention_decode  # + split-K, num_splits=
      from kernels.prefill_attention import paged_attention_prefill

This module must not import triton, so CPU code paths never need it at import time.

NOTE: ``kernels.store_kv`` is both a re-exported function (the reference) and a submodule
(the Triton launcher). Once the submodule is imported, Python binds it over the package
attribute, so ``from kernels import store_kv`` would then return the module. Always import
from the defining module: ``kernels.reference`` or ``kernels.store_kv``.
"""

from kernels.reference import paged_attention_decode, paged_attention_prefill, store_kv

__all__ = ["paged_attention_decode", "paged_attention_prefill", "store_kv"]
