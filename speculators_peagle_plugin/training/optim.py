"""The ``optimizer`` and ``scheduler`` sections, and what they build: AdamW, or speculators'
Muon with AdamW beside it, and one schedule per optimizer.

``--optimizer muon`` is speculators 0.9.0's (``speculators/train/optimizers.py``):
``torch.optim.Muon`` on the weight matrices :func:`muon_split` picks, at ``muon_lr`` (default
``lr``), and AdamW on the rest at ``lr``; both step every step, each under its own copy of
the schedule, and a checkpoint holds both.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..common.devices import low_precision_dtype
from ..common.errors import UserError
from ..common.settings import (
    check_choices,
    check_finite,
    check_int_at_least,
    check_optional_ints,
    fail,
    setting,
)

logger = logging.getLogger(__name__)

# speculators' list: 2-D weights that stay with AdamW (embeddings, embedding-like codebooks,
# vocabulary factors, output heads), matched anywhere in a parameter's name.
ADAMW_NAMES = ("embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, with speculators' names, defaults and meanings, and the clipping of the
    gradient before each step."""

    optimizer: str = setting(
        "muon",
        "muon (speculators' default): torch.optim.Muon on the 2-D weight matrices (not "
        "embed_tokens or lm_head) and AdamW on the rest, as speculators splits them; it "
        "serves longer acceptance than AdamW at equal steps (python -m eval.ablate --variant "
        "adamw optimizer=adamw --variant muon3x optimizer=muon muon_lr=0.003). adamw: AdamW "
        "on every weight.",
        choices=("adamw", "muon"),
        card=True,
        unrecorded="adamw",  # the optimizer of every run before the key existed
    )
    lr: float = setting(
        1e-3, "AdamW learning rate (with --optimizer muon: of the AdamW part).", card=True
    )
    weight_decay: float = setting(0.01, "AdamW weight decay.")
    muon_lr: float | None = setting(
        None, "Muon's learning rate (--optimizer muon); unset: --lr.", show="--lr", card=True
    )
    muon_momentum: float = setting(0.95, "Muon's momentum (Nesterov), in [0, 1).")
    muon_weight_decay: float = setting(0.1, "Muon's weight decay.")
    muon_ns_steps: int = setting(5, "Muon's Newton-Schulz iterations, in [0, 100).")
    muon_adjust_lr_fn: str = setting(
        "match_rms_adamw",
        "Muon's learning rate for an A x B matrix: match_rms_adamw: lr * 0.2 * sqrt(max(A, B)) "
        "(an update of AdamW's size); original: lr * sqrt(max(1, A / B)).",
        choices=("match_rms_adamw", "original"),
    )
    max_grad_norm: float | None = setting(1.0, "Gradient clipping norm; none disables it.")

    def __post_init__(self) -> None:
        check_choices(self)
        check_finite("lr", self.lr, 0)
        if self.max_grad_norm is not None:
            check_finite("max_grad_norm", self.max_grad_norm, 0, off=" (or none: no clipping)")
        check_finite("weight_decay", self.weight_decay, 0, strict=False)
        if self.muon_lr is not None:
            check_finite("muon_lr", self.muon_lr, 0, off=" (or none: --lr)")
        momentum = self.muon_momentum
        check_finite("muon_momentum", momentum, 0, strict=False)
        if momentum >= 1:
            fail("muon_momentum", momentum, "a number in [0, 1)")
        check_finite("muon_weight_decay", self.muon_weight_decay, 0, strict=False)
        if check_int_at_least("muon_ns_steps", self.muon_ns_steps, 0) >= 100:
            fail("muon_ns_steps", self.muon_ns_steps, "an integer in [0, 100)")

    @property
    def resolved_muon_lr(self) -> float:
        """``muon_lr``, or ``lr`` when it is unset (speculators' fallback)."""
        return self.lr if self.muon_lr is None else self.muon_lr


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


def muon_split(named_parameters) -> tuple[list[tuple], list[tuple]]:
    """speculators' split of the trainable weights: ``(muon, adamw)`` lists of ``(name, p)``.

    Muon takes a weight iff it is a matrix with both dimensions > 1 and its name holds none of
    :data:`ADAMW_NAMES`; AdamW takes the rest; frozen weights go to neither. Example (our
    draft): ``fc.weight [H, 3H]``, ``layers.0.self_attn.q_proj.weight`` -> Muon;
    ``norm.weight [H]``, ``mask_hidden [1, 1, 3H]``, a trained ``embed_tokens.weight`` ->
    AdamW.
    """
    muon, adamw = [], []
    for name, p in named_parameters:
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and min(p.shape) > 1  # Muon orthogonalizes matrices, not vectors
        named_out = any(hint in name for hint in ADAMW_NAMES)
        (muon if matrix and not named_out else adamw).append((name, p))
    return muon, adamw


def newton_schulz(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch's Muon orthogonalization (``torch.optim._muon._zeropower_via_newtonschulz``, the
    same operations) in ``dtype``; torch's is always bfloat16.

    Args:
        grad: ``[m, n]``, left unchanged; the result is ``[m, n]`` in ``dtype``.
        coefficients: ``(a, b, c)`` of the quintic step ``X <- aX + (bA + cA^2)X``, ``A = XX^T``.
    """
    a, b, c = coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.to(dtype, copy=True)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with its Newton-Schulz iteration in ``ns_dtype`` (torch's:
    bfloat16; :func:`..common.devices.low_precision_dtype` picks float32 on a CPU that
    emulates bfloat16), and seeing each matrix whole under FSDP2.

    FSDP2 holds a weight, its gradient and its momentum as row shards (DTensors). Muon
    orthogonalizes the whole matrix, so here each rank gathers the momentum-corrected
    update, orthogonalizes it (every rank the same) and applies its own rows: the update one
    process makes. torch's step on the shards themselves gives another update
    (tests/test_loop.py compares two FSDP2 ranks with one process).
    """

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor, Replicate
        from torch.optim._muon import _adjust_lr

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                # torch's _single_tensor_muon, the orthogonalization on the whole matrix
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                sharded = isinstance(update, DTensor)
                ortho = newton_schulz(update.full_tensor() if sharded else update,
                                      group["ns_coefficients"], group["ns_steps"], group["eps"],
                                      self.ns_dtype)
                if sharded:
                    ortho = DTensor.from_local(
                        ortho, p.device_mesh, [Replicate()] * p.device_mesh.ndim
                    ).redistribute(p.device_mesh, p.placements)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


class _Parts(list):
    """Objects used as one. A checkpoint holds one part's state as that part's own state dict
    (what a run with one optimizer always wrote), several parts' as a list, in order."""

    def state_dict(self):
        states = [part.state_dict() for part in self]
        return states[0] if len(states) == 1 else states

    def load_state_dict(self, state) -> None:
        states = [state] if len(self) == 1 else state
        # a checkpoint of the other optimizer is refused before this (its config differs)
        assert isinstance(states, list) and len(states) == len(self), len(self)
        for part, part_state in zip(self, states, strict=True):
            part.load_state_dict(part_state)


class Optimizers(_Parts):
    """The run's optimizers, stepped together: ``[AdamW]``, or with muon speculators' order
    ``[Muon, AdamW]`` (a part with no weights is left out)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for optimizer in self:
            optimizer.step()

    def learning_rates(self) -> dict[str, float]:
        """The learning rate each part uses next, by the setting it comes from:
        ``{"lr": AdamW's}`` and with muon ``"muon_lr": Muon's``."""
        return {
            "muon_lr" if isinstance(o, torch.optim.Muon) else "lr": o.param_groups[0]["lr"]
            for o in self
        }


class Schedulers(_Parts):
    """One learning-rate schedule per optimizer (each scales its own optimizer's base rate),
    stepped together."""

    def step(self) -> None:
        for scheduler in self:
            scheduler.step()


def _adamw(parameters, config: OptimizerConfig) -> torch.optim.AdamW:
    # fused: one kernel over every parameter; torch's default on CPU is a loop per tensor.
    return torch.optim.AdamW(
        parameters, lr=config.lr, weight_decay=config.weight_decay, fused=True
    )


def build_optimizers(named_parameters, config: OptimizerConfig) -> Optimizers:
    """The run's optimizers over the trainable ones of ``named_parameters`` (``(name, p)``)."""
    trainable = [(name, p) for name, p in named_parameters if p.requires_grad]
    if config.optimizer == "adamw":
        return Optimizers([_adamw([p for _, p in trainable], config)])
    muon, adamw = muon_split(trainable)
    logger.info("muon: %d weight matrices with Muon, %d weights with AdamW", len(muon), len(adamw))
    parts = Optimizers()
    if muon:
        parts.append(Muon(
            [p for _, p in muon], lr=config.resolved_muon_lr, momentum=config.muon_momentum,
            weight_decay=config.muon_weight_decay, ns_steps=config.muon_ns_steps,
            adjust_lr_fn=config.muon_adjust_lr_fn, ns_dtype=low_precision_dtype(muon[0][1].device),
        ))
    if adamw:
        parts.append(_adamw([p for _, p in adamw], config))
    return parts


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


def build_schedulers(optimizers: Optimizers, config: SchedulerConfig, total_steps: int):
    """:func:`build_scheduler` for each of the run's optimizers."""
    return Schedulers(build_scheduler(o, config, total_steps) for o in optimizers)
