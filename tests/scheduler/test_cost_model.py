"""The step-cost model behind itl_target_ms, on its own: fits, constraints, predictions."""

from __future__ import annotations

import random
import statistics

import pytest

from backend.scheduler import StepCostModel, StepFeatures


def test_step_cost_model_keeps_work_coefficients_non_negative_and_fits_the_mean():
    """Data whose best unconstrained fit has a negative attention cost (collinear features).

    Predictions must still grow with work (the budget search relies on it), and the fit must stay
    a least-squares fit: with the intercept free, mean prediction == mean observation.
    """
    rng = random.Random(1)
    model = StepCostModel(decay=1.0)
    observed = []
    for _ in range(40):
        num_prefill = rng.randint(500, 1500)
        features = StepFeatures(num_prefill, 1, num_prefill * rng.uniform(1e5, 1.2e5))
        duration = 0.005 + 2e-5 * num_prefill - 1e-11 * features.attention_pairs + rng.uniform(-1e-3, 1e-3)
        model.observe(features, duration)
        observed.append((features, duration))
    base = StepFeatures(1000, 1, 1e8)
    assert model.predict(StepFeatures(1000, 1, 2e8)) >= model.predict(base)
    assert model.predict(StepFeatures(2000, 1, 1e8)) > model.predict(base)
    mean_predicted = statistics.mean(model.predict(f) for f, _ in observed)
    assert mean_predicted == pytest.approx(statistics.mean(d for _, d in observed), rel=1e-3)


def test_step_cost_model_recovers_a_linear_cost_including_context():
    rng = random.Random(0)
    truth = [0.004, 0.02, 0.01, 0.003]  # seconds per unit of StepFeatures.vector()
    model = StepCostModel(decay=1.0)
    samples = [StepFeatures(rng.randint(0, 4000), rng.randint(0, 64), rng.uniform(0, 5e8)) for _ in range(50)]
    for features in samples:
        model.observe(features, sum(w * x for w, x in zip(truth, features.vector())))
    probe = StepFeatures(2500, 10, 3e8)
    expected = sum(w * x for w, x in zip(truth, probe.vector()))
    assert model.predict(probe) == pytest.approx(expected, rel=1e-4)
