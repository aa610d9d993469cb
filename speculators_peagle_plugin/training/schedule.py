"""How long a run trains and when it stops to log and save: the ``trainer`` group's part
that the loop's schedule reads (:class:`ScheduleConfig`), and :class:`Cadence`.

Example: 100 rows per epoch, ``epochs: 3``, ``checkpoint_freq: 0.5`` -> 300 steps, a
checkpoint every 50 and after the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..common.settings import check_finite, check_int_at_least, check_optional_ints, setting
from .trackers import LoggingConfig

__all__ = ["Cadence", "ScheduleConfig"]


@dataclass(frozen=True)
class ScheduleConfig:
    """How long to train, and how often to checkpoint."""

    epochs: int = setting(20, "Passes over the data.", resumable=True, card=True)
    max_steps: int | None = setting(
        None, "Stop after this many optimizer steps.", resumable=True, card=True
    )
    checkpoint_freq: float = setting(
        1.0, "Checkpoint every N epochs (< 1: several times per epoch).", resumable=True
    )

    def __post_init__(self) -> None:
        check_int_at_least("epochs", self.epochs, 1)
        check_optional_ints(self, {"max_steps": 1})
        check_finite("checkpoint_freq", self.checkpoint_freq, 0)

    def total_steps(self, steps_per_epoch: int) -> int:
        """``epochs`` passes of ``steps_per_epoch``, at most ``max_steps``."""
        total = self.epochs * steps_per_epoch
        return total if self.max_steps is None else min(total, self.max_steps)


@dataclass(frozen=True)
class Cadence:
    """When a run logs and saves, by the steps done: a record every ``log_freq`` steps, a
    checkpoint (then its validation) every ``every`` steps and after the last; both when a
    signal stops the run."""

    log_freq: int
    every: int
    total: int

    @classmethod
    def of(cls, schedule: ScheduleConfig, logging: LoggingConfig, steps_per_epoch: int,
           total: int) -> Cadence:
        every = max(1, math.floor(schedule.checkpoint_freq * steps_per_epoch))
        return cls(logging.log_freq, every, total)

    def on_grid(self, done: int) -> bool:
        """A checkpoint after ``done`` steps is one of the grid's (not a signal's)."""
        return done % self.every == 0 or done == self.total

    def logs(self, done: int, stop: bool) -> bool:
        return stop or done % self.log_freq == 0

    def saves(self, done: int, stop: bool) -> bool:
        return stop or self.on_grid(done)
