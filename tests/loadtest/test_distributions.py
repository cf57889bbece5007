from __future__ import annotations

import math
import random
import statistics

import pytest

from loadtest.distributions import LengthDist


@pytest.mark.parametrize(
    "spec, canonical",
    [
        ("128", "fixed:128"),
        ("fixed:7", "fixed:7"),
        ("uniform:32:256", "uniform:32:256"),
        ("exponential:64:384", "exponential:64:384"),
        ("exp:64", "exponential:64"),
        ("lognormal:48:1.0:512", "lognormal:48:1:512"),
    ],
)
def test_parse_round_trips(spec: str, canonical: str) -> None:
    dist = LengthDist.parse(spec)
    assert dist.spec() == canonical
    assert LengthDist.parse(dist.spec()) == dist


@pytest.mark.parametrize(
    "spec",
    ["", "zipf:3", "uniform:10", "uniform:9:3", "fixed:0", "exponential:0", "lognormal:5:0", "x"],
)
def test_parse_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        LengthDist.parse(spec)


def test_fixed_and_uniform_bounds() -> None:
    rng = random.Random(0)
    assert set(LengthDist.parse("fixed:9").sample_many(50, rng)) == {9}
    values = LengthDist.parse("uniform:3:6").sample_many(2000, rng)
    assert set(values) == {3, 4, 5, 6}  # both ends included, all values reached


def test_exponential_mean_and_cap() -> None:
    rng = random.Random(1)
    values = LengthDist.parse("exponential:64:384").sample_many(20000, rng)
    assert min(values) >= 1 and max(values) == 384  # the cap is reached and never exceeded
    # Mean of min(max(1, round(Exp(64))), 384): the cap removes ~0.25 % of the mass above it.
    assert statistics.fmean(values) == pytest.approx(64 * (1 - math.exp(-6)), rel=0.03)
    # Heavy tail relative to the median: median of Exp(64) is 64 ln 2 ~ 44.
    assert statistics.median(values) == pytest.approx(64 * math.log(2), rel=0.05)


def test_lognormal_median_and_cap() -> None:
    rng = random.Random(2)
    values = LengthDist.parse("lognormal:48:1.0:512").sample_many(20000, rng)
    assert statistics.median(values) == pytest.approx(48, rel=0.05)
    assert max(values) <= 512 and min(values) >= 1
    assert LengthDist.parse("lognormal:48:1.0:512").max_value == 512
    assert LengthDist.parse("exponential:10").max_value is None


def test_same_seed_same_samples() -> None:
    dist = LengthDist.parse("exponential:64:384")
    assert dist.sample_many(100, random.Random(5)) == dist.sample_many(100, random.Random(5))
    assert dist.sample_many(100, random.Random(5)) != dist.sample_many(100, random.Random(6))
