"""The step-cost model behind `itl_target_ms`: predicted step time from the work a step carries."""

from __future__ import annotations

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
        features = cls()
        for chunk in chunks:
            features = features.plus(chunk.num_tokens, chunk.start, is_decode=chunk.is_decode)
        return features

    def plus(self, num_tokens: int, context: int, *, is_decode: bool = False) -> "StepFeatures":
        pairs = self.attention_pairs + num_tokens * (context + (num_tokens + 1) / 2)
        if is_decode:
            return StepFeatures(self.prefill_tokens, self.decode_tokens + num_tokens, pairs)
        return StepFeatures(self.prefill_tokens + num_tokens, self.decode_tokens, pairs)

    def vector(self) -> list[float]:
        # Scaled so that typical values are O(1..100): keeps the normal equations well conditioned.
        return [1.0, self.prefill_tokens / 1e3, self.decode_tokens / 1e2, self.attention_pairs / 1e8]


class StepCostModel:
    """Online linear model of step time: t = w . [1, prefill, decode, attention] (StepFeatures).

    Fitted by exponentially weighted ridge least squares: each observation multiplies the
    weight of all earlier ones by `decay`, so a machine that gets slower (thermal throttling, a
    neighbour on the GPU) is followed within a few steps. When an observation misses its
    prediction by more than `drift_tolerance`, history is discounted by an extra `drift_decay`:
    a real change of machine speed is adopted quickly, while ordinary noise keeps the long memory.
    Coefficients other than the intercept are kept >= 0 (see _solve), so predictions grow with
    the work, which keeps the budget search monotone.
    """

    NUM_FEATURES = 4

    def __init__(self, decay: float = 0.98, ridge: float = 1e-6, drift_tolerance: float = 0.25,
                 drift_decay: float = 0.1):
        self.decay = decay
        self.ridge = ridge
        self.drift_tolerance = drift_tolerance
        self.drift_decay = drift_decay
        n = self.NUM_FEATURES
        self._gram = np.zeros((n, n))  # sum of w * x x^T
        self._moment = np.zeros(n)  # sum of w * x * t
        self._coef: list[float] | None = None
        self.num_observations = 0
        self.max_prefill_seen = 0  # the budget search never extrapolates past 2x this

    def observe(self, features: StepFeatures, duration_s: float) -> None:
        predicted = self.predict(features)
        discount = self.decay
        if predicted is not None and abs(duration_s - predicted) > self.drift_tolerance * predicted:
            discount *= self.drift_decay
        x = np.asarray(features.vector())
        self._moment = discount * self._moment + x * duration_s
        self._gram = discount * self._gram + np.outer(x, x)
        self._coef = None
        self.num_observations += 1
        self.max_prefill_seen = max(self.max_prefill_seen, features.prefill_tokens)

    def predict(self, features: StepFeatures) -> float | None:
        """Predicted step time in seconds, or None before the first observation."""
        if self.num_observations == 0:
            return None
        if self._coef is None:
            self._coef = self._solve()
        return sum(w * x for w, x in zip(self._coef, features.vector()))

    def max_prefill_tokens(self, target_s: float, base: StepFeatures, context: int, lo: int, hi: int) -> int:
        """The most prefill tokens in [lo, hi] whose step (base + them) is predicted <= target_s.

        `context` is the computed length of the sequence the tokens will mostly go to. Returns lo
        when even lo misses the target (prefill must progress) and lo before any observation;
        never more than twice the largest prefill observed, so a young model is not trusted far
        outside its data.
        """
        hi = max(lo, min(hi, 2 * self.max_prefill_seen))
        if self.num_observations == 0:
            return lo

        def fits(num_tokens: int) -> bool:
            return self.predict(base.plus(num_tokens, context)) <= target_s

        if fits(hi):
            return hi
        if not fits(lo):
            return lo
        while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _solve(self) -> list[float]:
        """Least squares with the work coefficients kept >= 0 (all but the intercept).

        A negative coefficient is dropped (fixed at 0) and the rest refitted, the active-set idea
        of non-negative least squares. Merely clamping it would not do: prefill tokens and
        attention pairs are nearly collinear while one long prompt is prefilled, so a fit often
        pairs a too-large prefill cost with a negative attention cost; clamping the latter alone
        would then predict far too slow a step and starve the prefill.
        """
        active = list(range(self.NUM_FEATURES))
        while True:
            gram = self._gram[np.ix_(active, active)] + self.ridge * np.eye(len(active))
            solution = dict(zip(active, np.linalg.solve(gram, self._moment[active]).tolist()))
            negative = [i for i in active[1:] if solution[i] < 0]
            if not negative:
                return [solution.get(i, 0.0) for i in range(self.NUM_FEATURES)]
            active.remove(min(negative, key=solution.__getitem__))
