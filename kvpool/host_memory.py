"""Host (CPU) tensors on transparent huge pages.

Owns nothing after it returns: a tensor it makes keeps its own memory alive.

Why: with 4 KiB pages, a CPU decode step that streams the weights and walks the KV cache
through scattered blocks misses the TLB on every page it touches, and in a virtual machine
each miss is a two-level page walk. On 2 MiB pages the same reads need 512x fewer
translations. Paged attention over cold caches gains the most; streaming matmuls gain little;
a plain reduction reads measurably faster, which is why the bandwidth probe
(``planner.cpu``) reads huge pages too: the floor it sets is what the memory gives
(figures: benchmarks/RESULTS.md).

Linux only hands huge pages to an anonymous mapping advised with ``MADV_HUGEPAGE`` *before*
its pages are first touched (``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``madvise`` or ``always``): advising a tensor that ``torch.zeros`` has already written gets
none. Elsewhere, or when the kernel declines, the memory is ordinary pages and everything
works the same, only without the speed-up.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import torch

HUGE_PAGE_BYTES = 2 << 20
# Smaller tensors gain nothing: they fit in a few pages either way.
MIN_BYTES = HUGE_PAGE_BYTES

# Tests and A/B runs turn it off: PAGEDSERVE_HUGE_PAGES=0.
ENV_SWITCH = "PAGEDSERVE_HUGE_PAGES"


def enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV_SWITCH, "1") != "0"


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, contiguous CPU tensor, on huge pages where the kernel gives them.

    Its pages are faulted in here, as ``torch.zeros`` does by writing them: a huge page's
    first touch zeroes 2 MiB (and may compact memory to find it), a cost that belongs to
    start-up, not to the first requests that would reach those pages."""
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * dtype.itemsize
    if nbytes < MIN_BYTES or not enabled():
        return torch.zeros(tuple(shape), dtype=dtype)
    # One huge page more than asked, so a 2 MiB-aligned start can be chosen inside.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # a kernel without THP: ordinary pages
    # frombuffer keeps `region` alive for as long as the tensor (or a view of it) lives.
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start : start + nbytes].view(dtype).view(tuple(shape)).zero_()


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of huge pages in the mappings that hold ``t`` (whole mappings, which may hold
    other tensors too), from /proc/self/smaps; 0 where that file is missing. For tests and
    diagnostics: it reads the whole file."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total = 0
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > start
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
