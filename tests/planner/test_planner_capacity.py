"""The planner's learned inputs: the load forecast extrapolates a rising load, and the pass
cost model follows the fleet as its costs change, never fitting a cost below zero."""

from __future__ import annotations

import pytest

from planner.config import CapacityConfig
from planner.core.capacity import CostModel
from planner.core.forecast import HoltForecast


def test_a_steadily_rising_load_is_forecast_ahead_not_at_its_last_level() -> None:
    """Capacity asked for now serves only once its engines have started: a load rising by
    20 tokens/s every second is forecast 30 s ahead at 600 more than it is now."""
    forecast = HoltForecast(alpha=0.5, beta=0.5)
    for tick in range(40):
        forecast.update(100.0 * tick, 5.0 * tick)
    assert forecast.forecast(0.0) == pytest.approx(3_900, rel=0.01)
    assert forecast.forecast(30.0) == pytest.approx(3_900 + 600, rel=0.01)


def observe_passes(model: CostModel, start_s: float, end_s: float, pass_ms: float) -> None:
    """100 passes of no prompt tokens at an empty cache, each `pass_ms` long, every 5 s."""
    now_s = start_s
    while now_s < end_s:
        model.observe(now_s, 100, 100 * pass_ms, 0, 0.0)
        now_s += 5.0


def test_the_cost_model_follows_passes_that_became_slower() -> None:
    """Passes that take 30 ms after 10 ms (a heavier model rolled out, a slower node): ten
    half-lives on, the fit is the new cost, not a mean of old and new."""
    model = CostModel(CapacityConfig(half_life_s=60.0))
    observe_passes(model, 0.0, 600.0, 10.0)
    assert model.cost().fixed_ms == pytest.approx(10.0, rel=0.05)
    observe_passes(model, 600.0, 1200.0, 30.0)
    assert model.cost().fixed_ms == pytest.approx(30.0, rel=0.05)


def test_no_cost_is_fitted_below_zero() -> None:
    """Passes that carried more prompt tokens yet took less time (noise, another engine's
    load): a negative cost per token would size a pool for its prompts with fewer engines
    the more prompts come. The fit keeps each cost at least 0."""
    model = CostModel(CapacityConfig())
    for tick in range(100):
        model.observe(5.0 * tick, 100, 2_000.0, 0, 0.0)
        model.observe(5.0 * tick, 100, 1_000.0, 200_000, 0.0)
    cost = model.cost()
    assert cost.prefill_ms_per_token == 0.0
    assert cost.fixed_ms >= 0.0 and cost.kv_ms >= 0.0
