"""Address checks for Triton kernels run under the interpreter (``TRITON_INTERPRET=1``).

On a GPU a load or store outside every allocation is an illegal memory access: the kernel
faults asynchronously, the fault is reported at the process's next synchronising call
(often in a later, unrelated test) and every CUDA call after it fails, because the error
is sticky for the process's CUDA context. One just past the end of a tensor may instead
read or overwrite a neighbouring allocation silently. Under the interpreter the same access
reads or writes host memory through a raw pointer and usually goes unnoticed.

``checked_launches()`` makes such accesses fail where they happen: every element a kernel
loads, stores or updates atomically (masked-off lanes excepted, as on the GPU) must lie
inside the storage of one of the launch's tensor arguments. The failure names the kernel,
the operation and the nearest argument.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from triton.runtime import interpreter

__all__ = ["OutOfBoundsAccess", "checked_launches"]


class OutOfBoundsAccess(AssertionError):
    """A kernel touched memory outside every tensor it was given."""


class _Launch:
    """The address ranges ``[start, end)`` of one launch's tensor storages, sorted."""

    def __init__(self, kernel: str, tensors: dict[str, torch.Tensor]) -> None:
        self.kernel = kernel
        spans: dict[int, tuple[int, str]] = {}
        for name, tensor in tensors.items():
            storage = tensor.untyped_storage()
            start = storage.data_ptr()
            if start and storage.nbytes():
                spans.setdefault(start, (start + storage.nbytes(), name))
        order = sorted(spans)
        self.starts = np.array(order, dtype=np.uint64)
        self.ends = np.array([spans[s][0] for s in order], dtype=np.uint64)
        self.names = [spans[s][1] for s in order]

    def check(self, op: str, ptrs: Any, mask: Any) -> None:
        addresses = np.asarray(ptrs.data, dtype=np.uint64)
        live = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
        if live.size == 0:
            return
        itemsize = np.uint64(np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize)
        if self.starts.size == 0:
            raise OutOfBoundsAccess(f"{self.kernel}: {op} with no tensor arguments")
        index = np.searchsorted(self.starts, live, side="right").astype(np.int64) - 1
        inside = (index >= 0) & (live + itemsize <= self.ends[np.maximum(index, 0)])
        if inside.all():
            return
        first = int(np.flatnonzero(~inside)[0])
        raise OutOfBoundsAccess(
            f"{self.kernel}: {op} of {int((~inside).sum())} element(s) outside every tensor "
            f"argument, the first at {self._where(int(live[first]), int(index[first]))}"
        )

    def _where(self, address: int, below: int) -> str:
        """The address against the nearer of the tensors around it: past the end of the one
        starting below it (``below``, -1 if none) or before the start of the next one."""
        after = address - int(self.ends[below]) if below >= 0 else None
        before = int(self.starts[below + 1]) - address if below + 1 < len(self.names) else None
        if after is not None and (before is None or after < before):
            size = int(self.ends[below] - self.starts[below])
            offset = address - int(self.starts[below])
            return f"{offset} bytes into {self.names[below]}, which holds {size} bytes"
        return f"{before} bytes before {self.names[below + 1]}"


_current: _Launch | None = None  # the launch being interpreted
_depth = 0  # nested checked_launches() blocks (one conftest's fixture inside another's)


def _tensors(args: dict[str, Any]) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for name, value in args.items():
        items = value if isinstance(value, tuple) else (value,)
        for i, item in enumerate(items):
            if isinstance(item, torch.Tensor):
                found[name if len(items) == 1 else f"{name}[{i}]"] = item
    return found


def _check(op: str, ptrs: Any, mask: Any) -> None:
    if _current is not None:
        _current.check(op, ptrs, mask)


@contextlib.contextmanager
def checked_launches() -> Iterator[None]:
    """Within the block, every interpreted kernel launch checks each memory access.

    Wraps the interpreter's argument set-up (to learn each launch's tensors) and its memory
    builders, passing their arguments through unchanged."""
    global _current, _depth
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    executor = interpreter.GridExecutor
    builder = interpreter.InterpreterBuilder
    init_args = executor._init_args_hst
    masked_load = builder.create_masked_load
    masked_store = builder.create_masked_store
    atomic_rmw = builder.create_atomic_rmw
    atomic_cas = builder.create_atomic_cas

    def _init_args_hst(self, args_dev, kwargs):
        global _current
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        names = dict(zip(self.arg_names, args_hst, strict=False))
        names.update(kwargs_hst)
        _current = _Launch(self.fn.__name__, _tensors(names))
        return args_hst, kwargs_hst

    def create_masked_load(self, ptrs, mask, *args, **kwargs):
        _check("load", ptrs, mask)
        return masked_load(self, ptrs, mask, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        _check("store", ptrs, mask)
        return masked_store(self, ptrs, value, mask, *args, **kwargs)

    def create_atomic_rmw(self, rmw_op, ptr, val, mask, *args, **kwargs):
        _check("atomic", ptr, mask)
        return atomic_rmw(self, rmw_op, ptr, val, mask, *args, **kwargs)

    def create_atomic_cas(self, ptr, *args, **kwargs):
        _check("atomic_cas", ptr, interpreter.TensorHandle(np.ones_like(ptr.data, bool), None))
        return atomic_cas(self, ptr, *args, **kwargs)

    patches = [
        (executor, "_init_args_hst", _init_args_hst),
        (builder, "create_masked_load", create_masked_load),
        (builder, "create_masked_store", create_masked_store),
        (builder, "create_atomic_rmw", create_atomic_rmw),
        (builder, "create_atomic_cas", create_atomic_cas),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    _depth = 1
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        _current = None
        _depth = 0
