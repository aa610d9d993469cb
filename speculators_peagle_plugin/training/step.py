"""One optimizer step's forwards and backwards, and what makes each step reproducible.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``K`` depths.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .distributed import RuntimeConfig, StepModule, World, sharded, sync_context

if TYPE_CHECKING:
    from .train_config import TrainConfig


def to_device(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The batch's tensors on ``device``; hidden states also cast to ``dtype``."""
    return {
        k: (v.to(device, dtype) if "hidden_states" in k else v.to(device))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in batch.items()
    }


def autocast_context(runtime: RuntimeConfig, device: torch.device):
    """``torch.autocast`` for a forward when ``runtime.autocast`` asks for mixed precision.

    Only forwards run under it; backward follows the dtypes the forward recorded.
    """
    if runtime.autocast == "none":
        return nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, runtime.autocast))


def cod_generator(seed: int, step: int, rank: int, device: torch.device) -> torch.Generator:
    """The COD sampler's generator for one (step, rank): a pure function, for exact resume."""
    gen = torch.Generator(device=device)
    gen.manual_seed(((seed * 1_000_003 + step) * 4099 + rank) % 2**63)
    return gen


def train_step(
    wrapped: nn.Module,
    module: nn.Module,
    batch: dict,
    config: TrainConfig,
    world: World,
    step: int,
) -> dict[str, torch.Tensor]:
    """Forward + backward of this rank's row (one pass per segment); returns summed stats.

    The optimizer is not stepped here. Stats: ``loss_sum``, ``total_den``, ``correct [K]``,
    ``valid [K]`` of this rank's row.
    """
    module.generator = cod_generator(config.seed, step, world.rank, world.device)
    segments = module.segments(batch)
    if sharded(config.runtime, world):
        # FSDP all-gathers in every forward: all ranks must run the same number of them.
        # The count lives on the rank's device: NCCL reduces CUDA tensors only.
        count = world.all_reduce(torch.tensor([len(segments)], device=world.device),
                                 dist.ReduceOp.MAX)
        segments += [StepModule.EMPTY] * (int(count) - len(segments))
    elif not segments:
        segments = [StepModule.EMPTY]
    k = module.num_depths
    stats = {
        "loss_sum": torch.zeros((), dtype=torch.float64),
        "total_den": torch.zeros((), dtype=torch.float64),
        "correct": torch.zeros(k, dtype=torch.float64),
        "valid": torch.zeros(k, dtype=torch.float64),
    }
    for j, segment in enumerate(segments):
        with sync_context(wrapped, config.runtime, world, last=j == len(segments) - 1):
            with autocast_context(config.runtime, world.device):
                out = wrapped(batch, segment)
            out["loss"].backward()
        metrics = out["metrics"]
        if metrics is not None:
            stats["loss_sum"] += metrics.loss_sum.detach().double().cpu()
            stats["total_den"] = metrics.total_den.detach().double().cpu()
            stats["correct"] += metrics.correct.detach().double().cpu()
            stats["valid"] += metrics.valid.detach().double().cpu()
    return stats


def gradient_norm(parameters: list[nn.Parameter], max_norm: float | None) -> float:
    """The gradients' total 2-norm, after clipping them to ``max_norm`` (None: no clipping).

    Under FSDP2 the norm of sharded gradients comes back as a DTensor: its full value is
    the same on every rank, so every rank takes the same decision on it.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if max_norm is None:
        norm = nn.utils.get_total_norm(grads)
    else:
        norm = nn.utils.clip_grad_norm_(parameters, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
