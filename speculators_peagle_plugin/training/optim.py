"""The ``optimizer`` and ``scheduler`` sections, and what they build: AdamW and its schedule."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..common.errors import UserError
from ..common.settings import check_choices, check_finite, check_optional_ints, fail, setting

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW's settings and the clipping of the gradient before each step."""

    lr: float = setting(1e-3, "AdamW learning rate.")
    weight_decay: float = setting(0.01, "AdamW weight decay.")
    max_grad_norm: float | None = setting(1.0, "Gradient clipping norm; none disables it.")

    def __post_init__(self) -> None:
        check_finite("lr", self.lr, 0)
        if self.max_grad_norm is not None:
            check_finite("max_grad_norm", self.max_grad_norm, 0, off=" (or none: no clipping)")
        check_finite("weight_decay", self.weight_decay, 0, strict=False)


@dataclass(frozen=True)
class SchedulerConfig:
    """The learning rate's schedule: a warmup, then this shape."""

    scheduler_type: str = setting(
        "linear", "LR schedule after warmup.", choices=("linear", "cosine", "none")
    )
    scheduler_warmup_steps: int | None = setting(None, "Warmup steps; default 1% of the total.")
    scheduler_warmup_ratio: float | None = setting(
        None,
        "Warmup as a fraction of the run's total steps, in [0, 1] (speculators' key: "
        "int(ratio * total) steps); ignored, with a warning, when --scheduler-warmup-steps "
        "is also set.",
    )

    def __post_init__(self) -> None:
        check_choices(self)
        check_optional_ints(self, {"scheduler_warmup_steps": 0})
        ratio = self.scheduler_warmup_ratio
        if ratio is not None and not (math.isfinite(ratio) and 0 <= ratio <= 1):
            fail("scheduler_warmup_ratio", ratio, "a number in [0, 1]")


def build_optimizer(parameters, config: OptimizerConfig) -> torch.optim.Optimizer:
    # fused: one kernel over every parameter; torch's default on CPU is a loop per tensor.
    return torch.optim.AdamW(
        parameters, lr=config.lr, weight_decay=config.weight_decay, fused=True
    )


def warmup_steps(config: SchedulerConfig, total_steps: int) -> int:
    """The warmup of a run of ``total_steps`` steps, resolved as speculators resolves it.

    ``scheduler_warmup_steps`` wins (a ratio given beside it is ignored with a warning);
    else ``int(scheduler_warmup_ratio * total_steps)``; else 1% of the steps. Example:
    ratio 0.25 of 10 steps -> 2 warmup steps.
    """
    steps, ratio = config.scheduler_warmup_steps, config.scheduler_warmup_ratio
    if steps is not None:
        if ratio is not None:
            logger.warning(
                "scheduler_warmup_steps %d and scheduler_warmup_ratio %g are both set; "
                "using scheduler_warmup_steps, as speculators does", steps, ratio,
            )
        return steps
    if ratio is not None:
        return int(ratio * total_steps)  # speculators' rounding: down
    return total_steps // 100  # speculators' default: 1% of the steps


def build_scheduler(optimizer, config: SchedulerConfig, total_steps: int):
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    warmup = warmup_steps(config, total_steps)
    if warmup > total_steps:
        raise UserError(
            f"scheduler_warmup_steps {warmup} is more than the run's {total_steps} steps: the "
            "learning rate would never reach lr; use at most that many warmup steps."
        )
    if config.scheduler_type == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total_steps)
    if config.scheduler_type == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    return get_constant_schedule_with_warmup(optimizer, warmup)
