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
  time grows with the prompt tokens and the most that fit is found by bisection (exactly
  within a shape class, below);
* down-weights a step whose time is far from the prediction (a stall of another process,
  a page fault storm) instead of letting it drag the fit;
* is multiplied by corrections learnt from the measured / fitted ratios. A decode-only
  step::

      predicted = fit(x) * speed * bias[shape class]

  - ``speed``: the machine's speed right now, the median of the last ``SPEED_WINDOW``
    steps' (of every kind) measured / (fit * bias). On a shared machine it moves within
    seconds, faster than the fit forgets, and a slowdown lasts several steps, so the last
    few steps say the most about the next; a median of three ignores one stalled step;
  - ``bias``, per shape class (decode-only steps by rows in powers of two): what the fit
    gets wrong about that size persistently (a kernel's efficiency at one size, per-row
    Python work the cost model does not count), so that a change of batch size does not
    carry the old size's correction. It is learnt after the speed, from
    measured / (fit * speed), at ``BIAS_SMOOTHING``, a step counting at most
    ``LOG_STEP_LIMIT`` (one stalled step moves it little); a class not seen yet takes its
    kind's bias, so the first step of a new batch size starts from its neighbours; and the
    biases are kept centred on the recent steps, so that what all classes share goes to
    the speed.

  A step with prompt tokens (mixed or prefill-only)::

      predicted = fit(x) * median(measured / fitted of the last PROMPT_WINDOW such steps)

  They come a few seconds apart between runs of short decode steps, and the decode steps'
  speed did not carry over to them: replayed step traces (``benchmarks.step_replay``)
  of a quiet machine had them far closer with their own median than with the decode
  steps' speed (benchmarks/RESULTS.md). Classes and kinds are still learnt for them
  (the fallback before any such step).

Ownership: the fit's sums are this object's. The engine calls ``features``/``observe`` per
step; the scheduler calls ``predict``/``prefill_tokens_within`` (it sees this object only
through the ``StepTimePredictor`` protocol of scheduler/latency_targets.py).
"""

from __future__ import annotations

import math
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
# shut prefill down (the targets' minimum chunk applies anyway). The ratios are those of the
# steps with prompt tokens, the steps the answer sizes, once HEADROOM_MIN_STEPS of them are
# in the window: the decode-only steps of a few rows, short and so jittering the most,
# would otherwise leave a quarter of every mixed step's budget unused.
HEADROOM_QUANTILE = 0.9
HEADROOM_WINDOW = 128
HEADROOM_MIN_STEPS = 16
MAX_HEADROOM = 1.5

# The speed is the median of the last this many steps' log(measured / (fit * bias)).
SPEED_WINDOW = 3
# Weight of the newest step in a shape class's running log average, and the bound on that
# step's log(measured / predicted) in it (log 1.105: a stalled step moves a bias by 3% at most).
BIAS_SMOOTHING = 0.3
LOG_STEP_LIMIT = 0.1
# Steps with prompt tokens are corrected by the median measured / fitted of the last this
# many such steps (see the module's docstring).
PROMPT_WINDOW = 7
# Weight of the newest step in the classes' shares of the recent steps (``_centre``).
CENTRE_SMOOTHING = 0.05

NUM_FEATURES = 4
# Step kinds of the shape classes.
DECODE, MIXED, PREFILL = 0, 1, 2
# A step's shape class: (kind, size class), size in powers of two (rows of a decode-only
# step, prompt tokens / 16 of the others).
ShapeClass = tuple[int, int]
# The four features and the step's shape class.
Features = tuple[float, float, float, float, ShapeClass]


def shape_class(num_rows: int, num_decode_rows: int, num_prefill_tokens: int) -> ShapeClass:
    if num_prefill_tokens == 0:
        return DECODE, num_rows.bit_length()
    kind = PREFILL if num_decode_rows == 0 else MIXED
    return kind, (num_prefill_tokens >> 4).bit_length()


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
        # measured / predicted of recent steps, all and those with prompt tokens, and the
        # headroom factor they give.
        self._ratios: deque[float] = deque(maxlen=HEADROOM_WINDOW)
        self._prompt_ratios: deque[float] = deque(maxlen=HEADROOM_WINDOW)
        self.headroom = 1.0
        # The corrections, as logs: the machine's speed, and the bias of each shape class
        # and of each kind (the fallback of a class not seen yet).
        self._log_speed = 0.0
        self._recent_speeds: deque[float] = deque(maxlen=SPEED_WINDOW)
        # Each class's share of the recent steps (a running average), for ``_centre``.
        self._share: dict[ShapeClass, float] = {}
        # measured / fitted of the last steps with prompt tokens (their correction).
        self._prompt_corrections: deque[float] = deque(maxlen=PROMPT_WINDOW)
        self._log_bias: dict[ShapeClass, float] = {}
        self._log_kind_bias: dict[int, float] = {}

    # ---- features -------------------------------------------------------------------------

    def features(
        self,
        num_tokens: int,
        num_logit_rows: int,
        num_pairs: int,
        num_kv_tokens: int,
        num_prefill_tokens: int = 0,
        num_decode_rows: int | None = None,
    ) -> Features:
        """The feature vector of a step from its totals.

        Args:
            num_tokens: tokens computed.
            num_logit_rows: rows the LM head runs on.
            num_pairs: causal (query, key) pairs of its attention.
            num_kv_tokens: cached tokens its attention reads (each row's ``seq_len``).
            num_prefill_tokens: of ``num_tokens``, prompt tokens (rows of more than one).
            num_decode_rows: one-token rows (default: ``num_tokens - num_prefill_tokens``).
        """
        if num_decode_rows is None:
            num_decode_rows = num_tokens - num_prefill_tokens
        weight_bytes, matmul_flops, attention_flops = self.cost_model.parts(
            num_tokens, num_logit_rows, num_pairs
        )
        kv_bytes = num_kv_tokens * self.kv_bytes_per_token
        return (
            FIXED_S,
            weight_bytes / NOMINAL_BANDWIDTH,
            matmul_flops / NOMINAL_FLOPS,
            attention_flops / NOMINAL_FLOPS + kv_bytes / NOMINAL_BANDWIDTH,
            shape_class(
                num_decode_rows + (num_prefill_tokens > 0), num_decode_rows, num_prefill_tokens
            ),  # fmt: skip
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
            shape.num_decode_rows,
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
            load.num_rows,
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
            self._correct(features[NUM_FEATURES], seconds / fitted)
        if predicted is not None and predicted > 0:
            residual = abs(predicted / seconds - 1.0)
            if residual > OUTLIER:
                weight = OUTLIER / residual
            self._ratios.append(seconds / predicted)
            if features[NUM_FEATURES][0] != DECODE:
                self._prompt_ratios.append(seconds / predicted)
            ratios = self._prompt_ratios
            if len(ratios) < HEADROOM_MIN_STEPS:
                ratios = self._ratios
            ordered = sorted(ratios)
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

    def _correct(self, shape: ShapeClass, ratio: float) -> None:
        """Move the shape class's bias and the speed towards a step's measured / fitted
        ``ratio``."""
        if shape[0] != DECODE:
            self._prompt_corrections.append(ratio)
        log_ratio = math.log(ratio)
        bias = self._bias_log(shape)
        recent = self._recent_speeds
        recent.append(log_ratio - bias)
        self._log_speed = sorted(recent)[len(recent) // 2]
        residual = log_ratio - self._log_speed  # what the speed does not explain
        self._log_bias[shape] = bias + BIAS_SMOOTHING * _limit(residual - bias)
        kind = shape[0]
        kind_bias = self._log_kind_bias.get(kind, 0.0)
        self._log_kind_bias[kind] = kind_bias + BIAS_SMOOTHING * _limit(residual - kind_bias)
        self._centre(shape)

    def _centre(self, shape: ShapeClass) -> None:
        """Move what the biases share into the speed: shift every bias so that their mean
        over the recent steps is 0, and the speed by the opposite (no prediction changes).
        Without this, speed + bias of a class is learnt but not the split: a slowdown seen
        during a run of one class would partly stay in that class's bias, and the other
        classes would not be predicted slower."""
        for c in self._share:
            self._share[c] *= 1.0 - CENTRE_SMOOTHING
        self._share[shape] = self._share.get(shape, 0.0) + CENTRE_SMOOTHING
        total = sum(self._share.values())
        mean = sum(w * self._log_bias[c] for c, w in self._share.items()) / total
        for c in self._log_bias:
            self._log_bias[c] -= mean
        for k in self._log_kind_bias:
            self._log_kind_bias[k] -= mean
        self._recent_speeds = deque((v + mean for v in self._recent_speeds), SPEED_WINDOW)
        self._log_speed += mean

    def _bias_log(self, shape: ShapeClass) -> float:
        bias = self._log_bias.get(shape)
        return bias if bias is not None else self._log_kind_bias.get(shape[0], 0.0)

    @property
    def speed(self) -> float:
        """The machine's speed factor now (1.0 until a step is seen)."""
        return math.exp(self._log_speed)

    def bias(self, shape: ShapeClass) -> float:
        """The correction of a shape class (its kind's for a class not seen yet)."""
        return math.exp(self._bias_log(shape))

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
        shape = features[NUM_FEATURES]
        if shape[0] != DECODE and self._prompt_corrections:
            recent = sorted(self._prompt_corrections)
            return fitted * recent[len(recent) // 2]
        return fitted * math.exp(self._log_speed + self._bias_log(shape))

    def predict(self, load: DecodeLoad, num_prefill_tokens: int) -> float | None:
        return self.predict_features(self.load_features(load, num_prefill_tokens))

    def prefill_tokens_within(self, load: DecodeLoad, budget_s: float, max_tokens: int) -> int:
        """The most prompt tokens in [0, max_tokens] whose predicted step, times the
        ``headroom`` recent overruns call for, stays within ``budget_s``, by bisection: the
        fit grows with the tokens (theta >= 0), and so does the prediction within a shape
        class; where a class boundary lowers it, the answer is a count that fits with the
        next one not fitting, which may be short of the largest."""
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


def _limit(log_ratio: float) -> float:
    return max(-LOG_STEP_LIMIT, min(LOG_STEP_LIMIT, log_ratio))


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
