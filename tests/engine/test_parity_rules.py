"""The near-tie rules of ``tests/engine/parity.py`` themselves (CPU, no model)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.parity import (
    BF16_ULPS,
    MARGIN,
    Reference,
    assert_parity,
    bf16_ulp,
    is_near_tie,
    tie_threshold,
)


def test_bf16_ulp_is_the_gap_to_the_next_bf16_value():
    """Against bf16 itself: the next representable value above x (its bits + 1), for
    values across many binades, including powers of two and negatives."""
    values = torch.cat([torch.randn(2000) * 10.0 ** torch.randint(-6, 7, (2000,)),
                        torch.tensor([1.0, 2.0, 0.5, 12.0, -3.0, 65536.0])])  # fmt: skip
    x = values.to(torch.bfloat16)
    # one step away from zero in magnitude: +1 on the bit pattern of |x|
    up = (x.abs().view(torch.int16) + 1).view(torch.bfloat16)
    gaps = (up.float() - x.abs().float()).tolist()
    for value, gap in zip(x.float().tolist(), gaps, strict=True):
        assert bf16_ulp(value) == gap, (value, gap)


def test_bf16_ulp_known_values():
    assert bf16_ulp(1.0) == 2.0**-7
    assert bf16_ulp(1.99) == 2.0**-7
    assert bf16_ulp(12.0) == 2.0**-4  # [8, 16): 2**(3 - 7)
    assert bf16_ulp(-12.0) == 2.0**-4
    assert bf16_ulp(0.0) == 2.0**-133


def test_bf16_rule_accepts_within_two_ulps_of_the_top_logit():
    assert BF16_ULPS == 2
    threshold, rule = tie_threshold(torch.bfloat16, 12.0)
    assert threshold == 0.125 and "2 bf16 ulps" in rule
    assert is_near_tie(torch.bfloat16, 0.125, 12.0)  # "within": the bound itself counts
    assert not is_near_tie(torch.bfloat16, 0.126, 12.0)
    assert is_near_tie(torch.bfloat16, 0.015, 1.5)  # 2 * 2**-7 = 0.0156
    assert not is_near_tie(torch.bfloat16, 0.02, 1.5)


def test_float32_rule_is_the_fixed_margin():
    assert tie_threshold(torch.float32, 123.0)[0] == MARGIN == 1e-3
    assert is_near_tie(torch.float32, 9e-4, 50.0)
    assert not is_near_tie(torch.float32, 1e-3, 0.0)  # strictly below
    with pytest.raises(ValueError, match="no written near-tie rule"):
        tie_threshold(torch.float16, 1.0)


def test_assert_parity_reports_an_accepted_bf16_divergence(capsys):
    ref = Reference([5, 6, 7], margins=[1.0, 0.1, 2.0], top_logits=[20.0, 12.0, 9.0])
    note = assert_parity([5, 9, 1], ref, label="p", dtype=torch.bfloat16)
    assert note is not None and "token 1" in note and "2 bf16 ulps" in note
    assert note in capsys.readouterr().out
    assert assert_parity([5, 6, 7], ref, dtype=torch.bfloat16) is None


def test_assert_parity_rejects_a_bf16_divergence_past_the_rule():
    ref = Reference([5, 6], margins=[0.2, 1.0], top_logits=[12.0, 12.0])
    with pytest.raises(AssertionError, match="a real mismatch"):
        assert_parity([4, 6], ref, dtype=torch.bfloat16)  # 0.2 > 0.125


def test_the_float32_rule_would_reject_what_bf16_accepts():
    ref = Reference([5], margins=[0.1], top_logits=[12.0])
    assert assert_parity([4], ref, dtype=torch.bfloat16) is not None
    with pytest.raises(AssertionError, match="a real mismatch"):
        assert_parity([4], ref)  # float32: 0.1 is no near-tie
