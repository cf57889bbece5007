"""Launcher and device helpers that need triton (the kernel files import this)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels._common import dot_precision
from kernels.settings import PDL_ENV, pdl_env

# The one-launch split-K paths' arrival counters (one int32 per group of splits: a decode's
# (sequence, KV head), a matmul's column strip) are allocated once per device with room for
# at least this many groups (256 KiB), so that no CUDA-graph capture needs a new buffer.
MIN_ARRIVAL_COUNTERS = 1 << 16

try:  # Triton >= 3.4: grid dependency control, for programmatic dependent launches
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # never traced: PDL is False wherever these are missing (pdl_supported)
    gdc_launch_dependents = gdc_wait = None

__all__ = [
    "MIN_ARRIVAL_COUNTERS",
    "PDL_ENV",
    "TL_DTYPES",
    "arrival_counters",
    "dot_args",
    "last_to_arrive",
    "pdl_args",
    "pdl_enter",
    "pdl_policy",
    "pdl_supported",
    "round_args",
    "round_to",
]

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_args(kernel: object, dtype: torch.dtype) -> dict[str, object]:
    """The ``DOT_DTYPE`` and ``DOT_PRECISION`` constexprs of an attention kernel.

    Kernels cast both ``tl.dot`` operands to ``DOT_DTYPE`` (a no-op when it is the cache
    dtype). It differs only under the interpreter with bf16: Triton 3.x's interpreter
    multiplies bf16 operands as their raw uint16 bits (numpy has no bf16) and returns
    garbage. Upcasting to fp32 is exact (bf16 x bf16 products are exact in fp32, as in bf16
    tensor cores), so the interpreter still checks what the GPU computes. ``triton.jit``
    picks interpreter or compiler when the kernel is defined, so ask the kernel object.
    """
    if isinstance(kernel, InterpretedFunction) and dtype == torch.bfloat16:
        return {"DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee"}
    return {"DOT_DTYPE": TL_DTYPES[dtype], "DOT_PRECISION": dot_precision(dtype)}


def round_args(kernel: object, dtype: torch.dtype) -> dict[str, object]:
    """The ``DTYPE`` and ``SOFT_BF16_ROUND`` constexprs of a kernel that calls ``round_to``.

    Triton 3.x's interpreter converts fp32 to bf16 by truncation, compiled code (and torch)
    round to nearest even. Kernels whose every intermediate rounding must match torch's
    op-by-op rounding then round in software under the interpreter, so that CPU tests can
    compare them bit for bit; compiled kernels use the hardware conversion.
    """
    soft = isinstance(kernel, InterpretedFunction) and dtype == torch.bfloat16
    return {"DTYPE": TL_DTYPES[dtype], "SOFT_BF16_ROUND": soft}


@triton.jit
def round_to(x, DTYPE: tl.constexpr, SOFT_BF16_ROUND: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (nearest even, as torch's ``.to()``), returned as fp32.

    What a torch elementwise op in a half dtype stores: it computes in fp32 and rounds once.
    A value returned here converts to ``DTYPE`` exactly, so a later store's cast (even the
    interpreter's truncating one) does not round again. NaN and inf are not handled in the
    software path (interpreter only).
    """
    if SOFT_BF16_ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Whether a kernel can run as a programmatic dependent launch on ``device``: compiled
    (not the interpreter), compute capability 9.0 or later, and a Triton with grid
    dependency control and the ``launch_pdl`` option (3.4 and later)."""
    # The interpreter runs no grid dependency control; triton.jit picked it or the compiler
    # when the kernels were defined (dot_args), so ask one.
    if device.type != "cuda" or isinstance(pdl_enter, InterpretedFunction):
        return False
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if "launch_pdl" not in CUDAOptions.__dataclass_fields__:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_policy(device: torch.device) -> bool | None:
    """``PAGEDSERVE_PDL`` on ``device``: True (on, where supported), False (off), or None
    (unset: each launcher's default)."""
    value = pdl_env()
    return value if value is None else value and pdl_supported(device)


def pdl_args(pdl: bool | None, device: torch.device) -> dict[str, object]:
    """A PDL-capable kernel's ``PDL`` constexpr and launch option; ``pdl=None`` takes
    ``PAGEDSERVE_PDL``'s (``pdl_policy``). ``launch_pdl`` is passed only when set, so a
    Triton without the option still runs the plain launches."""
    if pdl is None:
        pdl = bool(pdl_policy(device))
    if not pdl:
        return {"PDL": False}
    if not pdl_supported(device):
        raise ValueError(
            f"a programmatic dependent launch needs compiled kernels on a GPU of compute "
            f"capability >= 9.0 and Triton >= 3.4; {device} cannot run one"
        )
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Where a kernel that may be a programmatic dependent launch starts to depend on the
    kernel before: wait until that one has completed and its writes are visible, then let
    the next one launch (it waits in turn before reading anything this kernel writes).

    NOTE: as the first statement nothing is read early, so any kernel may come before. A
    load placed above it runs while the kernel before may still be writing: it may only
    read what that kernel never writes. A dependent launches once every program of the
    kernel before has passed this point or exited, so every kernel before that one has
    completed by then."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def last_to_arrive(counter, arrivals):
    """Whether this program is the last of ``arrivals`` to take a ticket from ``counter`` (an
    int32 of ``arrival_counters``); the last resets it to zero for the next launch (and
    every replay of a CUDA graph that captured this one): none touches it again in this one.

    NOTE: every thread's stores before the call happen before the barrier, and the barrier
    before the release half of the atomic: the program that sees the count reach
    ``arrivals - 1`` (acquire) sees every other program's stores, which it must read past L1
    (``.cg``: other SMs wrote them). The interpreter runs programs one after another, so
    there the last program in the grid is the last to arrive."""
    tl.debug_barrier()
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1
    if last:
        tl.store(counter, 0)
    return last


# Per device: the arrival counters, newest (largest) last. Older buffers are kept: a CUDA
# graph captured with one keeps its address.
_ARRIVAL_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, count: int, user: str) -> torch.Tensor:  # [count] int32
    """A persistent int32 scratch of ``count`` zeros on ``device`` for a one-launch split-K
    (``user`` names it in the error below): the last split of each group to take a ticket
    merges, and resets its counter.

    NOTE: zero between launches is an invariant the kernels keep (the last split of each
    group resets its counter), never a host-side fill: the buffer is zeroed once, when it is
    allocated, which a CUDA-graph capture cannot do (it is allocated at the first call, with
    room for ``MIN_ARRIVAL_COUNTERS`` groups, so a warm-up call outside the capture
    suffices). Every one-launch kernel of a device shares it: their launches must be ordered
    (one stream), as a decode step's are; a programmatic dependent launch touches its
    counters only after it has waited for the kernel before to complete.
    """
    buffers = _ARRIVAL_COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{user}(one_launch=True) needs {count} arrival counters on {device}; run it "
                f"once at this size before capturing a CUDA graph"
            )
        size = max(count, MIN_ARRIVAL_COUNTERS, 2 * buffers[-1].numel() if buffers else 0)
        buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1][:count]
