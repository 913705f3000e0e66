"""The step-cost model behind `itl_target_ms`: predicted step time from the work a step carries.

    t = level * (w . x) * noise,   x = [1, prefill tokens, decode tokens, attention pairs] (scaled)

Three parts, each robust on its own to a noisy machine (CPU step times vary by +-25-30 %):
- the shape `w`: exponentially weighted least squares over durations divided by the level in
  force when they were taken, with a long memory and the work coefficients kept >= 0. Noise never
  discounts it, so the slope information of earlier steps is kept (a constant chunk at a growing
  context carries none of its own); steps without prefill tokens add to it without discounting the
  past (they carry nothing of prefill's cost); a fit that would drop every work term is refused and
  the previous coefficients stay;
- the `level`: the machine's speed relative to the shape. A two-sided CUSUM on
  r = log(actual / predicted) needs evidence, a change that persists over several steps (2x: two
  steps; 1.3x: about fifteen), before it moves the level by the mean residual of that run; one
  slow step does nothing. The steps of that run are then re-normalised by the new level, so the
  shape never learns the change as work;
- the calibration: the recent ratios actual / predicted. `predict_upper` is the point prediction
  times their `quantile` (0.9): a chunk sized by it keeps about 90 % of steps under the target
  rather than half. Only the ratios of steps of about the same size count (predicted at least
  `comparable_fraction` of it): a small step's relative noise is no guide to a large one's. A decode
  step of a few milliseconds doubles when a thread wakes late or the host's work for the next step
  runs beside it (the overlapped loop); a 150 ms step does not. Calibrated by the decodes before it,
  a long prompt's first chunks were sized for half the target.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from backend.scheduler.plan import ScheduledChunk


@dataclass(frozen=True)
class StepFeatures:
    """What a step's cost is modelled on.

    `attention_pairs` approximates attention work: a chunk of n tokens after c computed ones
    attends over about n * (c + (n + 1) / 2) (query, key) pairs; a decode over c + 1.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    attention_pairs: float = 0.0

    @classmethod
    def of(cls, chunks: Iterable[ScheduledChunk]) -> "StepFeatures":
        prefill = decode = 0
        pairs = 0.0
        for chunk in chunks:  # plus() for each chunk, without a new object each time
            n = chunk.num_tokens
            pairs += _attention_pairs(n, chunk.start)
            if chunk.is_decode:
                decode += n
            else:
                prefill += n
        return cls(prefill, decode, pairs)

    def plus(self, num_tokens: int, context: int, *, is_decode: bool = False) -> "StepFeatures":
        pairs = self.attention_pairs + _attention_pairs(num_tokens, context)
        if is_decode:
            return StepFeatures(self.prefill_tokens, self.decode_tokens + num_tokens, pairs)
        return StepFeatures(self.prefill_tokens + num_tokens, self.decode_tokens, pairs)

    def vector(self) -> list[float]:
        # Scaled so that typical values are O(1..100): keeps the normal equations well conditioned.
        return [1.0, self.prefill_tokens / 1e3, self.decode_tokens / 1e2, self.attention_pairs / 1e8]


def _attention_pairs(num_tokens: int, context: int) -> float:
    """(query, key) pairs of `num_tokens` tokens after `context` computed ones (see StepFeatures)."""
    return num_tokens * (context + (num_tokens + 1) / 2)


class StepCostModel:
    """Online model of step time (see the module docstring); fed by the scheduler after every step."""

    NUM_FEATURES = 4

    def __init__(self, decay: float = 0.99, ridge: float = 1e-6, cusum_slack: float = 0.15,
                 cusum_threshold: float = 1.0, quantile: float = 0.9, quantile_window: int = 64,
                 min_ratios: int = 8, default_upper_ratio: float = 1.3, comparable_fraction: float = 0.5,
                 warm_up: int = 20, refit_every: int = 1):
        """`refit_every`: observations between two fits of the shape. 1 (an ITL target sizes every step by the
        model); more when the predictions are only recorded (a fit is a few small solves: host time each step)."""
        self.decay = decay
        self.refit_every = refit_every
        self._observations_at_fit = 0
        self.ridge = ridge
        self.cusum_slack = cusum_slack
        self.cusum_threshold = cusum_threshold
        self.quantile = quantile
        self.min_ratios = min_ratios
        self.default_upper_ratio = default_upper_ratio  # used until min_ratios comparable ratios are known
        self.comparable_fraction = comparable_fraction
        self.warm_up = warm_up  # observations before drift is looked for (a young shape mispredicts anyway)
        n = self.NUM_FEATURES
        self._gram = np.zeros((n, n))  # sum of weight * x x^T
        self._moment = np.zeros(n)  # sum of weight * x * (duration / level)
        self._coef: np.ndarray | None = None
        self._accepted: np.ndarray | None = None  # the last fit that kept a work term
        self.level = 1.0
        self._recent: deque[_Observation] = deque(maxlen=quantile_window)  # newest last
        self._calibration: tuple[np.ndarray, np.ndarray] | None = None  # (predicted, ratio) of _recent, made on use
        self._cusum = {+1: _Run(), -1: _Run()}
        self.num_observations = 0
        self.num_level_shifts = 0
        self.max_prefill_seen = 0  # the budget search never extrapolates past 2x this

    # --- learning ---------------------------------------------------------------------------------
    def observe(self, features: StepFeatures, duration_s: float) -> None:
        predicted = self.predict(features)
        x = np.asarray(features.vector())
        normalised = duration_s / self.level
        # Only a step with prefill tokens makes the past count less: a decode-only one says nothing of what prefill
        # costs, and 2,000 of them (a quiet minute) had faded the prefill steps behind it to nothing, so the next
        # prompt's first chunk was sized as if prefill were free (6.9x a 100 ms target).
        decay = self.decay if features.prefill_tokens else 1.0
        self._moment = decay * self._moment + x * normalised
        self._gram = decay * self._gram + np.outer(x, x)
        ratio = duration_s / predicted if predicted is not None and duration_s > 0 else None
        self._recent.append(_Observation(x, normalised, predicted, ratio))
        self._calibration = None
        self.num_observations += 1
        self.max_prefill_seen = max(self.max_prefill_seen, features.prefill_tokens)
        if ratio is not None and self.num_observations > self.warm_up:
            self._detect_drift(math.log(ratio))

    def _detect_drift(self, residual: float) -> None:
        """Two-sided CUSUM on log(actual / predicted); a run past the threshold moves the level."""
        for sign, run in self._cusum.items():
            run.add(sign * residual - self.cusum_slack, residual)
            if run.score > self.cusum_threshold:
                self._shift_level(math.exp(run.mean_residual), run.count)
                self._cusum = {+1: _Run(), -1: _Run()}
                return

    def _shift_level(self, factor: float, num_steps: int) -> None:
        """Adopt a level `factor` times the current one, shown by the last `num_steps` observations.

        Those observations entered the shape normalised by the old level and their ratios were
        taken against it: both are moved to the new level (earlier ones stay, they were right).
        """
        self.level *= factor
        self.num_level_shifts += 1
        for age, obs in enumerate(list(reversed(self._recent))[:num_steps]):
            self._moment -= self.decay ** age * obs.x * obs.normalised * (1.0 - 1.0 / factor)
            obs.normalised /= factor
            if obs.ratio is not None:
                obs.predicted, obs.ratio = obs.predicted * factor, obs.ratio / factor
        self._coef, self._calibration = None, None

    # --- predicting -------------------------------------------------------------------------------
    def predict(self, features: StepFeatures) -> float | None:
        """Point prediction of the step time in seconds, or None before the first observation."""
        if self.num_observations == 0:
            return None
        if self._coef is None or self.num_observations - self._observations_at_fit >= self.refit_every:
            self._coef, self._observations_at_fit = self._solve(), self.num_observations
        return self.level * max(float(self._coef @ np.asarray(features.vector())), 1e-6)

    def upper_ratio(self, predicted_s: float = 0.0) -> float:
        """The `quantile` of the recent actual / predicted ratios of steps predicted at least `comparable_fraction`
        of `predicted_s` (every recent step by default); a default until `min_ratios` of them are known."""
        predicted, ratios = self._calibration_arrays()
        comparable = ratios[predicted >= self.comparable_fraction * predicted_s]
        if len(comparable) < self.min_ratios:
            return self.default_upper_ratio
        return float(np.quantile(comparable, self.quantile))

    def _calibration_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._calibration is None:
            known = [obs for obs in self._recent if obs.ratio is not None]
            self._calibration = (np.array([obs.predicted for obs in known]), np.array([obs.ratio for obs in known]))
        return self._calibration

    def predict_upper(self, features: StepFeatures) -> float | None:
        """The time `quantile` of such steps stay under: what a step is sized by."""
        predicted = self.predict(features)
        return None if predicted is None else predicted * self.upper_ratio(predicted)

    def max_prefill_tokens(self, target_s: float, base: StepFeatures, context: int, lo: int, hi: int) -> int:
        """The most prefill tokens in [lo, hi] whose step (base + them) is predicted (upper) <= target_s.

        `context` is the computed length of the sequence the tokens will mostly go to. Returns lo
        when even lo misses the target (prefill must progress; ItlTargetBudget flags such steps)
        and lo before any observation; never more than twice the largest prefill observed, so a young model is not
        trusted far outside its data.
        """
        hi = max(lo, min(hi, 2 * self.max_prefill_seen))
        if self.num_observations == 0:
            return lo

        def fits(num_tokens: int) -> bool:
            return self.predict_upper(base.plus(num_tokens, context)) <= target_s

        if fits(hi):
            return hi
        if not fits(lo):
            return lo
        while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _solve(self) -> np.ndarray:
        """Least squares with the work coefficients kept >= 0 (all but the intercept).

        A negative coefficient is dropped (fixed at 0) and the rest refitted, the active-set idea
        of non-negative least squares. Merely clamping it would not do: prefill tokens and
        attention pairs are nearly collinear while one long prompt is prefilled, so a fit often
        pairs a too-large prefill cost with a negative attention cost; clamping the latter alone
        would then predict far too slow a step and starve the prefill. A solution without any work
        term (a step's cost independent of its work) is refused: the last one that had one stays.
        """
        active = list(range(self.NUM_FEATURES))
        while True:
            gram = self._gram[np.ix_(active, active)] + self.ridge * np.eye(len(active))
            solution = dict(zip(active, np.linalg.solve(gram, self._moment[active]).tolist()))
            negative = [i for i in active[1:] if solution[i] < 0]
            if not negative:
                break
            active.remove(min(negative, key=solution.__getitem__))
        coef = np.array([solution.get(i, 0.0) for i in range(self.NUM_FEATURES)])
        if np.any(coef[1:] > 0) or self._accepted is None:
            self._accepted = coef
        return self._accepted


@dataclass
class _Observation:
    x: np.ndarray
    normalised: float  # duration / level at the time (moved when the level moves)
    predicted: float | None  # the prediction for the step (moved with the level), None before the model had data
    ratio: float | None  # duration / predicted (None likewise)


@dataclass
class _Run:
    """One side of the CUSUM: its score and the residuals since the score last left zero."""

    score: float = 0.0
    total: float = 0.0
    count: int = 0

    def add(self, increment: float, residual: float) -> None:
        if self.score == 0.0:
            self.total, self.count = 0.0, 0
        self.score = max(0.0, self.score + increment)
        if self.score > 0.0:
            self.total += residual
            self.count += 1

    @property
    def mean_residual(self) -> float:
        return self.total / self.count if self.count else 0.0
