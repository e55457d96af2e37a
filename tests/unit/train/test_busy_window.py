"""Busy share over the training window: the trainer's start-up (no rollouts asked for) is not counted."""

from __future__ import annotations

import pytest

from factory.train.rl_report import busy_share_in, training_window


def test_the_window_runs_from_the_first_batch_request_to_the_last_step() -> None:
    rows = [{"step": 1, "time": 110.0, "wait_s": 6.0, "compute_s": 4.0}, {"step": 2, "time": 130.0}]
    assert training_window(rows) == (100.0, 130.0)
    assert training_window([]) is None


def test_busy_share_uses_the_samples_inside_the_window() -> None:
    samples = [(0.0, 0.0), (50.0, 5.0), (100.0, 10.0), (130.0, 34.0), (200.0, 40.0)]  # idle start-up, then busy
    assert busy_share_in(samples, 100.0, 130.0) == pytest.approx(0.8)
    assert busy_share_in(samples, 101.0, 129.0) is None  # fewer than two samples inside
