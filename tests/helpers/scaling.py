"""Oracles of the scaling-curve tests (``eval/scaling.py``)."""

from __future__ import annotations

import math


def checkpoints_of_loop(plan):
    """training/loop.py's rule: every floor(checkpoint_freq * steps_per_epoch) steps and at
    the last of min(epochs * steps_per_epoch, max_steps); the newest keep_checkpoints kept."""
    total = min(plan["epochs"] * plan["steps_per_epoch"], plan["max_steps"])
    every = max(1, math.floor(plan["checkpoint_freq"] * plan["steps_per_epoch"]))
    saved = [s for s in range(1, total + 1) if s % every == 0 or s == total]
    return total, saved[-plan["keep_checkpoints"] :]
