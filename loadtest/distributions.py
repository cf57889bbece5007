"""Token-length distributions for synthetic prompts and outputs, parsed from short specs.

Spec syntax (what ``--prompt-len-dist`` / ``--output-len-dist`` take):

=============================  ===========================================================
``128`` or ``fixed:128``       always 128
``uniform:32:256``             integers 32..256, both ends included
``exponential:64:384``         exponential with mean 64, rounded, at least 1, capped at 384
``exponential:64``             the same without a cap (heavy tail; use with care)
``lognormal:48:1.0:512``       log-normal with median 48 and sigma 1.0 (of the underlying
                               normal), rounded, at least 1, capped at 512
=============================  ===========================================================

NOTE: a cap truncates the tail, so the sample mean of a capped distribution is below its
nominal mean (exponential mean 64 capped at 384 loses exp(-6) of its mass: about 0.25 %, so
the mean is about 63.8). Sampling uses ``random.Random`` so results are identical across
platforms and Python versions for the same seed, with no numpy needed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

DIST_KINDS = ("fixed", "uniform", "exponential", "lognormal")


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution over positive integer token counts.

    Args:
        kind: one of ``DIST_KINDS``.
        a: fixed value, uniform low, exponential mean, or lognormal median.
        b: uniform high or lognormal sigma (unused otherwise).
        cap: upper bound applied after sampling (``None`` for none).
    """

    kind: str
    a: float
    b: float = 0.0
    cap: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DIST_KINDS:
            raise ValueError(f"length distribution must be one of {DIST_KINDS}, got {self.kind!r}")
        # A lognormal median may be fractional (the sample is clamped to >= 1 anyway).
        min_a = 0.0 if self.kind == "lognormal" else 1.0
        if self.a < min_a or self.a <= 0:
            raise ValueError(f"{self.kind} length parameter must be >= 1, got {self.a}")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform high ({self.b}) is below low ({self.a})")
        if self.kind == "lognormal" and self.b <= 0:
            raise ValueError(f"lognormal sigma must be positive, got {self.b}")
        if self.cap is not None and self.cap < 1:
            raise ValueError(f"length cap must be >= 1, got {self.cap}")

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """Parse a spec such as ``exponential:64:384`` (see the module docstring)."""
        parts = [p.strip() for p in spec.strip().split(":")]
        try:
            if len(parts) == 1:
                return cls("fixed", float(int(parts[0])))
            kind, args = parts[0].lower(), parts[1:]
            if kind == "fixed" and len(args) == 1:
                return cls("fixed", float(int(args[0])))
            if kind == "uniform" and len(args) == 2:
                return cls("uniform", float(int(args[0])), float(int(args[1])))
            if kind in ("exponential", "exp") and len(args) in (1, 2):
                cap = int(args[1]) if len(args) == 2 else None
                return cls("exponential", float(args[0]), cap=cap)
            if kind == "lognormal" and len(args) in (2, 3):
                cap = int(args[2]) if len(args) == 3 else None
                return cls("lognormal", float(args[0]), float(args[1]), cap=cap)
        except ValueError as exc:
            raise ValueError(f"bad length distribution {spec!r}: {exc}") from exc
        raise ValueError(
            f"bad length distribution {spec!r}; expected N, fixed:N, uniform:LO:HI, "
            "exponential:MEAN[:MAX] or lognormal:MEDIAN:SIGMA[:MAX]"
        )

    def spec(self) -> str:
        """The canonical spec string (round-trips through :meth:`parse`)."""
        cap = f":{self.cap}" if self.cap is not None else ""
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        if self.kind == "exponential":
            return f"exponential:{self.a:g}{cap}"
        return f"lognormal:{self.a:g}:{self.b:g}{cap}"

    def sample(self, rng: random.Random) -> int:
        """Draw one length (always >= 1 and <= cap)."""
        if self.kind == "fixed":
            value = int(self.a)
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "exponential":
            value = round(rng.expovariate(1.0 / self.a))
        else:
            value = round(rng.lognormvariate(math.log(self.a), self.b))
        value = max(1, value)
        return min(value, self.cap) if self.cap is not None else value

    def sample_many(self, n: int, rng: random.Random) -> list[int]:
        return [self.sample(rng) for _ in range(n)]

    @property
    def max_value(self) -> int | None:
        """The largest value this distribution can produce, or ``None`` if unbounded."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(self.b)
        return self.cap
