"""StepTimePredictor: a step's wall time from its shape, the cost model calibrated online.

The latency targets (scheduler/latency_targets.py) ask, every step, how many prompt tokens
fit beside the running decodes in a time budget. The answer comes from four features of the
step, each the cost model's figure (engine/cost.py) turned into seconds at nominal peaks::

    x = [ 1 ms,                                    fixed per-step work (Python, launches)
          weight bytes / BW,                        reading the weights once
          matmul FLOPs / F,                         every token through the layers, logit rows
          attention FLOPs / F + KV bytes read / BW ] (query, key) pairs, KV read

    t ~ theta . x

The coefficients ``theta`` are a running least-squares fit on measured step times, so they
absorb what the nominal peaks get wrong about this machine (its real bandwidth and FLOP/s,
GGUF blocks, kernel efficiency at each size). The fit:

* minimises *relative* error, ``sum w (1 - theta . x / t)^2``: a 30 ms decode step and a
  2 s prefill step count alike, as a +-20 % target on both asks;
* forgets old steps geometrically (``FORGETTING``: about the last 200 steps count), since a
  shared machine's speed moves from minute to minute;
* is pulled (ridge) towards the one-parameter fit ``theta = s * [1, 1, 1, 1]``, the cost
  model scaled by one measured factor, so directions the recent steps do not vary (a run
  of decode-only steps says nothing about prefill) keep a sensible value; that factor alone
  is the prediction after the first step;
* keeps every coefficient >= 0 (a step never gets faster with more work), so the predicted
  time grows with the prompt tokens and the most that fit is found by bisection;
* down-weights a step whose time is far from the prediction (a stall of another process,
  a page fault storm) instead of letting it drag the fit;
* multiplies the fit by a fast correction per step shape (decode-only steps, steps with
  prompt tokens): the median of the last few such steps' measured / fitted ratios, since on
  a shared machine the speed moves within seconds, faster than the fit forgets (a median,
  so that one stalled step does not move it).

Ownership: the fit's sums are this object's. The engine calls ``features``/``observe`` per
step; the scheduler calls ``predict``/``prefill_tokens_within`` (it sees this object only
through the ``StepTimePredictor`` protocol of scheduler/latency_targets.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine.cost import StepCostModel
from scheduler.latency_targets import DecodeLoad
from scheduler.output import SchedulerOutput

# Nominal peaks that turn bytes and FLOPs into seconds; the fit rescales them, so they only
# set the starting balance between the terms (a CPU-like 10 FLOPs per byte).
NOMINAL_BANDWIDTH = 20e9  # bytes/s
NOMINAL_FLOPS = 200e9  # FLOP/s
FIXED_S = 1e-3
FORGETTING = 0.995
# Ridge strength towards the one-parameter fit, relative to each feature's own weight.
RIDGE = 0.05
# Residuals (relative) beyond this are down-weighted in proportion.
OUTLIER = 0.5
# ``prefill_tokens_within`` answers "fits" when the prediction times this quantile of the
# recent measured/predicted ratios stays within the budget: a step sized to the budget by an
# unbiased prediction would overrun it half the time. Bounded, so a burst of outliers cannot
# shut prefill down (the targets' minimum chunk applies anyway).
HEADROOM_QUANTILE = 0.9
HEADROOM_WINDOW = 128
MAX_HEADROOM = 1.5

# A shape's correction is the median measured / fitted ratio of its last this many steps.
CORRECTION_WINDOW = 7

NUM_FEATURES = 4
# The four features and the step's shape (0: decode-only, 1: with prompt tokens).
Features = tuple[float, float, float, float, int]


@dataclass(frozen=True, slots=True)
class StepShape:
    """A step's totals, all the predictor (and a step trace, engine/step_trace.py) needs.

    Args:
        num_rows: scheduled rows (requests).
        num_decode_rows: of those, one-token rows (decodes and static-batch padding).
        num_tokens: tokens computed.
        num_prefill_tokens: of ``num_tokens``, those of rows of more than one token.
        num_logit_rows: rows the LM head runs on.
        num_pairs: causal (query, key) pairs of its attention.
        num_kv_tokens: cached tokens its attention reads (each row's ``start + num_tokens``).
    """

    num_rows: int
    num_decode_rows: int
    num_tokens: int
    num_prefill_tokens: int
    num_logit_rows: int
    num_pairs: int
    num_kv_tokens: int

    @classmethod
    def of_plan(cls, plan: SchedulerOutput) -> StepShape:
        num_tokens = num_logit_rows = num_pairs = num_kv_tokens = num_prefill = decodes = 0
        for item in plan.scheduled:
            n, start = item.num_tokens, item.start
            num_tokens += n
            if n > 1:
                num_prefill += n
            else:
                decodes += 1
            num_logit_rows += item.samples or item.padding
            num_pairs += n * start + n * (n + 1) // 2
            num_kv_tokens += start + n
        return cls(
            len(plan.scheduled),
            decodes,
            num_tokens,
            num_prefill,
            num_logit_rows,
            num_pairs,
            num_kv_tokens,
        )


class StepTimePredictor:
    def __init__(self, cost_model: StepCostModel, kv_bytes_per_token: int) -> None:
        """Args:
        cost_model: the engine's per-step bytes and FLOPs.
        kv_bytes_per_token: K and V bytes of one token over all layers.
        """
        self.cost_model = cost_model
        self.kv_bytes_per_token = kv_bytes_per_token
        n = NUM_FEATURES
        # Exponentially weighted normal equations of the relative-error fit.
        self._a = [[0.0] * n for _ in range(n)]
        self._b = [0.0] * n
        # For the one-parameter fit t ~ s * sum(x): sums of (sum x / t) and its square.
        self._s_num = 0.0
        self._s_den = 0.0
        self.num_observed = 0
        self._theta: list[float] | None = None
        # measured / predicted of recent steps, and the headroom factor they give.
        self._ratios: deque[float] = deque(maxlen=HEADROOM_WINDOW)
        self.headroom = 1.0
        # Per shape: the last steps' measured / fitted ratios, and their median (1.0 until
        # a step of the shape is seen).
        self._shape_ratios = [deque(maxlen=CORRECTION_WINDOW) for _ in range(2)]
        self.corrections = [1.0, 1.0]

    # ---- features -------------------------------------------------------------------------

    def features(
        self,
        num_tokens: int,
        num_logit_rows: int,
        num_pairs: int,
        num_kv_tokens: int,
        num_prefill_tokens: int = 0,
    ) -> Features:
        """The feature vector of a step from its totals.

        Args:
            num_tokens: tokens computed.
            num_logit_rows: rows the LM head runs on.
            num_pairs: causal (query, key) pairs of its attention.
            num_kv_tokens: cached tokens its attention reads (each row's ``seq_len``).
            num_prefill_tokens: of ``num_tokens``, prompt tokens (rows of more than one).
        """
        weight_bytes, matmul_flops, attention_flops = self.cost_model.parts(
            num_tokens, num_logit_rows, num_pairs
        )
        kv_bytes = num_kv_tokens * self.kv_bytes_per_token
        return (
            FIXED_S,
            weight_bytes / NOMINAL_BANDWIDTH,
            matmul_flops / NOMINAL_FLOPS,
            attention_flops / NOMINAL_FLOPS + kv_bytes / NOMINAL_BANDWIDTH,
            int(num_prefill_tokens > 0),
        )

    def plan_features(self, plan: SchedulerOutput) -> Features:
        """The features of a planned step, exactly from its rows."""
        return self.shape_features(StepShape.of_plan(plan))

    def shape_features(self, shape: StepShape) -> Features:
        """The features of a step from its totals (a planned step's, or a traced one's)."""
        return self.features(
            shape.num_tokens,
            shape.num_logit_rows,
            shape.num_pairs,
            shape.num_kv_tokens,
            shape.num_prefill_tokens,
        )

    def load_features(self, load: DecodeLoad, num_prefill_tokens: int) -> Features:
        """The features of a step with ``load``'s decodes and ``num_prefill_tokens`` prompt
        tokens taken as one chunk after ``load.prefill_start`` cached tokens (the scheduler
        has not yet split them between requests); the chunk is counted as reaching its
        prompt's end (one logit row), the costlier case."""
        p, s = num_prefill_tokens, load.prefill_start
        prefill = p > 0
        return self.features(
            load.num_rows + p,
            load.num_rows + prefill,
            load.num_context_tokens + p * s + p * (p + 1) // 2,
            load.num_context_tokens + (s + p if prefill else 0),
            p,
        )

    # ---- the fit --------------------------------------------------------------------------

    def observe(self, features: Features, seconds: float) -> None:
        """Fold one measured step into the fit.

        Args:
            features: the step's features (``plan_features``).
            seconds: its measured wall time.
        """
        if seconds <= 0:
            return
        z = [x / seconds for x in features[:NUM_FEATURES]]  # relative error: theta . z ~ 1
        weight = 1.0
        # What the scheduler was told before this step ran: the headroom and the outlier
        # test judge that, then the shape's correction moves.
        predicted = self.predict_features(features)
        fitted = self._fitted(features)
        if fitted is not None and fitted > 0:
            shape = features[NUM_FEATURES]
            recent = self._shape_ratios[shape]
            recent.append(seconds / fitted)
            self.corrections[shape] = sorted(recent)[len(recent) // 2]
        if predicted is not None and predicted > 0:
            residual = abs(predicted / seconds - 1.0)
            if residual > OUTLIER:
                weight = OUTLIER / residual
            self._ratios.append(seconds / predicted)
            ordered = sorted(self._ratios)
            quantile = ordered[min(len(ordered) - 1, int(HEADROOM_QUANTILE * len(ordered)))]
            self.headroom = min(MAX_HEADROOM, max(1.0, quantile))
        n = NUM_FEATURES
        for i in range(n):
            row = self._a[i]
            zi = weight * z[i]
            for j in range(n):
                row[j] = FORGETTING * row[j] + zi * z[j]
            self._b[i] = FORGETTING * self._b[i] + zi
        total = sum(z)
        self._s_num = FORGETTING * self._s_num + weight * total
        self._s_den = FORGETTING * self._s_den + weight * total * total
        self.num_observed += 1
        self._theta = None

    @property
    def coefficients(self) -> list[float] | None:
        """The fitted multipliers of the four features (None before any step)."""
        if self._theta is None and self.num_observed:
            self._theta = self._solve()
        return self._theta

    def _solve(self) -> list[float]:
        """Ridge least squares towards ``s * ones``, with coefficients kept >= 0 (an active
        set: a coefficient the solve makes negative is fixed at 0 and the rest re-solved)."""
        n = NUM_FEATURES
        scale = self._s_num / self._s_den if self._s_den > 0 else 0.0
        diag = [self._a[i][i] for i in range(n)]
        floor = 1e-9 * max(max(diag), 1e-30)
        free = list(range(n))
        theta = [0.0] * n
        while free:
            matrix = []
            rhs = []
            for i in free:
                ridge = RIDGE * diag[i] + floor
                matrix.append([self._a[i][j] + (ridge if i == j else 0.0) for j in free])
                rhs.append(self._b[i] + ridge * scale)
            solution = _solve_linear(matrix, rhs)
            negative = [i for i, v in zip(free, solution, strict=True) if v < 0]
            if not negative:
                for i, v in zip(free, solution, strict=True):
                    theta[i] = v
                return theta
            free = [i for i in free if i not in negative]
        return theta

    # ---- predictions ----------------------------------------------------------------------

    def _fitted(self, features: Features) -> float | None:
        """The fit alone, without the shape's correction."""
        theta = self.coefficients
        if theta is None:
            return None
        return sum(c * x for c, x in zip(theta, features[:NUM_FEATURES], strict=True))

    def predict_features(self, features: Features) -> float | None:
        fitted = self._fitted(features)
        if fitted is None:
            return None
        return fitted * self.corrections[features[NUM_FEATURES]]

    def predict_plan(self, plan: SchedulerOutput) -> float | None:
        return self.predict_features(self.plan_features(plan))

    def predict(self, load: DecodeLoad, num_prefill_tokens: int) -> float | None:
        return self.predict_features(self.load_features(load, num_prefill_tokens))

    def prefill_tokens_within(self, load: DecodeLoad, budget_s: float, max_tokens: int) -> int:
        """The most prompt tokens in [0, max_tokens] whose predicted step, times the
        ``headroom`` recent overruns call for, stays within ``budget_s`` (bisection: the
        prediction grows with the tokens, theta >= 0)."""
        if self.coefficients is None or max_tokens <= 0:
            return 0
        budget_s /= self.headroom
        if not _over(self.predict(load, max_tokens), budget_s):
            return max_tokens
        low, high = 0, max_tokens  # predict(low) may fit; predict(high) does not
        if _over(self.predict(load, 0), budget_s):
            return 0
        while high - low > 1:
            middle = (low + high) // 2
            if _over(self.predict(load, middle), budget_s):
                high = middle
            else:
                low = middle
        return low


def _over(predicted: float | None, budget_s: float) -> bool:
    return predicted is None or predicted > budget_s


def _solve_linear(matrix: list[list[float]], rhs: Iterable[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the systems here are at most 4 x 4)."""
    a = [row[:] + [b] for row, b in zip(matrix, rhs, strict=True)]
    n = len(a)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if a[col][col] == 0:
            continue
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            if factor:
                for c in range(col, n + 1):
                    a[r][c] -= factor * a[col][c]
    solution = [0.0] * n
    for r in range(n - 1, -1, -1):
        if a[r][r] == 0:
            continue
        solution[r] = (a[r][n] - sum(a[r][c] * solution[c] for c in range(r + 1, n))) / a[r][r]
    return solution
