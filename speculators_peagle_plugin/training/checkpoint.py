"""Checkpoints: ``checkpoint-<step>`` written atomically, found, and resumed from.

A checkpoint holds the draft in speculators format (``save_pretrained``: ``config.json`` +
``model.safetensors``, loadable by ``SpeculatorModel.from_pretrained`` and vLLM) and
``training_state.pt`` (optimizer, scheduler, step, config, RNG) for ``--resume``.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..common.files import atomic_directory
from .config import TrainConfig
from .distributed import World, sharded

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "training_state.pt"
# Fields that may change between a run and its resumption; any other change is refused.
RESUMABLE_CHANGES = frozenset(
    {"max_steps", "epochs", "resume", "no_resume_from_checkpoint", "log_freq",
     "checkpoint_freq", "device", "keep_checkpoints"}
)  # fmt: skip
# The draft's keys inside the wrapped StepModule's state dict.
_DRAFT_PREFIX = "trainer_module.draft."


def checkpoint_dirs(save_path: Path) -> list[Path]:
    """Complete checkpoints (those with a training state), oldest first."""
    found = [
        p
        for p in save_path.glob(f"{CHECKPOINT_PREFIX}*")
        if p.is_dir() and p.name[len(CHECKPOINT_PREFIX) :].isdigit() and (p / STATE_FILE).exists()
    ]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def _full_state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _model_state(wrapped: nn.Module, draft: nn.Module, config: TrainConfig, world: World):
    if sharded(config, world):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = get_model_state_dict(wrapped, options=_full_state_options(cpu_offload=True))
        return {k[len(_DRAFT_PREFIX) :]: v for k, v in full.items() if k.startswith(_DRAFT_PREFIX)}
    return {k: v.detach().cpu() for k, v in draft.state_dict().items()}


def _optim_state(wrapped, optimizer, config: TrainConfig, world: World):
    if sharded(config, world):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(
            wrapped, optimizer, options=_full_state_options(cpu_offload=True)
        )
    return optimizer.state_dict()


def save_checkpoint(
    save_path: Path,
    step: int,
    *,
    wrapped: nn.Module,
    draft: nn.Module,
    optimizer,
    scheduler,
    config: TrainConfig,
    world: World,
) -> Path:
    """Write ``checkpoint-<step>`` atomically (complete, or not there); keep the newest few.

    Every rank takes part in gathering a sharded state; rank 0 writes.
    """
    model_state = _model_state(wrapped, draft, config, world)
    optim_state = _optim_state(wrapped, optimizer, config, world)
    final = save_path / f"{CHECKPOINT_PREFIX}{step}"
    if world.rank == 0:
        with atomic_directory(final) as tmp:
            draft.save_pretrained(tmp, state_dict=model_state)
            state = {
                "step": step,
                "optimizer": optim_state,
                "scheduler": scheduler.state_dict(),
                "config": config.to_dict(),
                "torch_rng": torch.get_rng_state(),
            }
            torch.save(state, tmp / STATE_FILE)
        for old in checkpoint_dirs(save_path)[: -config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    world.barrier()
    return final


def _resume_source(config: TrainConfig, save_path: Path) -> Path | None:
    if config.resume:
        path = Path(config.resume)
        if not (path / STATE_FILE).exists():
            raise ValueError(f"--resume {path} is not a checkpoint (no {STATE_FILE} in it).")
        return path
    if config.no_resume_from_checkpoint:
        return None
    found = checkpoint_dirs(save_path)
    return found[-1] if found else None


def resume_source(config: TrainConfig, save_path: Path, world: World) -> Path | None:
    """The checkpoint to resume from, or None: rank 0 picks it, the others agree."""
    source = _resume_source(config, save_path) if world.rank == 0 else None
    if world.distributed:
        holder = [str(source) if source else ""]
        dist.broadcast_object_list(holder, src=0)
        source = Path(holder[0]) if holder[0] else None
    return source


def load_training_state(path: Path) -> dict:
    """Read ``training_state.pt`` without running code from it.

    ``weights_only=True`` restricts unpickling to tensors and plain containers, so a
    crafted file (a pickle whose ``__reduce__`` calls a program) is refused, not run.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{path} is not a training state this program wrote (only tensors and plain "
            f"containers are read from it): {first}"
        ) from None


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


def load_checkpoint(path: Path, wrapped, draft, optimizer, scheduler, config, world) -> int:
    """Restore weights, optimizer, scheduler and RNG from ``path``; returns its step.

    Refuses (``ValueError``) a checkpoint trained with settings outside
    ``RESUMABLE_CHANGES`` that differ from ``config``.
    """
    from safetensors.torch import load_file

    state = load_training_state(path / STATE_FILE)
    changed = sorted(
        k
        for k, v in state["config"].items()
        if k not in RESUMABLE_CHANGES and _jsonable(getattr(config, k, None)) != _jsonable(v)
    )
    if changed:
        raise ValueError(
            f"Cannot resume from {path}: it was trained with different {', '.join(changed)}; "
            "use the same settings, or --no-resume-from-checkpoint / a new --save-path."
        )
    weights = load_file(path / "model.safetensors")
    if sharded(config, world):
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = _full_state_options(strict=False)
        set_model_state_dict(
            wrapped, {f"{_DRAFT_PREFIX}{k}": v for k, v in weights.items()}, options=opts
        )
        set_optimizer_state_dict(wrapped, optimizer, state["optimizer"], options=opts)
    else:
        missing, unexpected = draft.load_state_dict(weights, strict=False)
        assert not unexpected, unexpected
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])
