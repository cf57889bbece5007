"""A record of the split-K matmul kernel's calls (``kernels.quant_matmul._split_k``): which
launch each call ran and on which weight, for tests of what the launchers choose. The calls
still run."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class SplitKCall:
    weight_shape: tuple[int, ...]
    launch: object  # kernels.quant_matmul.SplitKLaunch


def record_split_k_calls(monkeypatch: pytest.MonkeyPatch) -> list[SplitKCall]:
    """Every split-K call from now on, appended to the returned list as it runs."""
    import kernels.quant_matmul as qm

    calls: list[SplitKCall] = []
    split_k = qm._split_k

    def spy(out, x, weight, scale, bias, launch, pdl, **kw):  # type: ignore[no-untyped-def]
        calls.append(SplitKCall(tuple(weight.shape), launch))
        return split_k(out, x, weight, scale, bias, launch, pdl, **kw)

    monkeypatch.setattr(qm, "_split_k", spy)
    return calls
