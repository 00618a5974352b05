"""`attribution.roi.optimise`: a fixed budget is reallocated, never grown, even when some channels
were credited nothing (a Markov run that gives one channel every conversion)."""

from __future__ import annotations

import numpy as np

from attribution.roi import optimise


def test_channels_without_value_keep_the_budget_fixed() -> None:
    spend = np.array([1000.0, 400.0, 50.0])
    value = np.array([0.0, 0.0, 1002.2])  # all the credit on the smallest channel
    new = optimise(spend, value, spend * 0.5, spend * 1.5, 0.5)
    assert np.isclose(new.sum(), spend.sum())  # the moves cancel out
    assert new[2] == 75.0  # the credited channel at its top
    assert np.all(new >= spend * 0.5 - 1e-9) and np.all(new <= spend * 1.5 + 1e-9)


def test_a_budget_the_bounds_cannot_hold_puts_every_channel_at_its_top() -> None:
    spend = np.array([100.0, 100.0])
    new = optimise(spend, np.array([0.0, 5.0]), spend * 0.5, spend * 0.9, 0.5)
    assert new.tolist() == [90.0, 90.0]
