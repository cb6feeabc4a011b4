"""A short-horizon load forecast: Holt's linear smoothing (a level and a trend).

The planner forecasts the prompt-token arrival rate `horizon_s` ahead, because capacity asked
for now only serves once its engines have started. A level alone lags a rising load by the
whole start-up time; the trend term extrapolates it. Samples come once per tick; the trend is
kept per second so ticks of uneven length extrapolate correctly.

It also keeps the mean absolute error of its one-tick-ahead forecast (smoothed with the level's
weight), so a caller can size for the forecast plus a margin that grows with how badly the load
follows it: large for bursts from nothing, small for a smooth load.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class HoltForecast:
    alpha: float  # weight of a new sample in the level
    beta: float  # weight of a new slope in the trend
    level: float | None = None
    trend_per_s: float = 0.0
    last_s: float | None = None
    mean_abs_error: float = 0.0  # of the forecast for each sample, made a tick before it

    def update(self, sample: float, now_s: float) -> None:
        if self.level is None or self.last_s is None:
            self.level, self.last_s = sample, now_s
            return
        dt_s = now_s - self.last_s
        if dt_s <= 0:
            return
        expected = self.level + self.trend_per_s * dt_s
        self.mean_abs_error += self.alpha * (abs(sample - expected) - self.mean_abs_error)
        level = self.alpha * sample + (1 - self.alpha) * expected
        slope = (level - self.level) / dt_s
        self.trend_per_s = self.beta * slope + (1 - self.beta) * self.trend_per_s
        self.level, self.last_s = level, now_s

    def forecast(self, horizon_s: float) -> float:
        """The rate expected `horizon_s` from the last sample (never below zero)."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.trend_per_s * horizon_s)
