"""Checkpoints: ``checkpoint-<step>`` written atomically, found, and resumed from.

A checkpoint holds the draft in speculators format (``save_pretrained``: ``config.json`` +
``model.safetensors``, loadable by ``SpeculatorModel.from_pretrained`` and vLLM) and
``training_state.pt`` (optimizers, schedulers, step, config, RNG) for ``--resume``.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import MISSING, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..common.errors import UserError
from ..common.files import atomic_directory
from ..common.paths import check_free_space, writing
from ..common.reading import UnreadableFile, load_plain_torch, load_safetensors
from ..common.settings import (
    check_int_at_least,
    keys_with,
    leaves,
    setting,
)
from ..data.prompts import resolved_spec
from ..model.model_card import write_model_card
from .distributed import RuntimeConfig, World, sharded

CHECKPOINT_PREFIX = "checkpoint-"
RESUME_ADVICE = (
    "free some space or choose another --save-path, then run the same command again to resume"
)
STATE_FILE = "training_state.pt"
# The draft's keys inside the wrapped StepModule's state dict.
_DRAFT_PREFIX = "trainer_module.draft."

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go, how many stay, and what a run resumes (the ``trainer`` group's
    part that checkpointing reads)."""

    save_path: str = setting(
        "./checkpoints", "Directory for checkpoints and the metrics log.", output=True,
        resumable=True,
    )
    keep_checkpoints: int = setting(
        2, "How many of the newest checkpoints to keep.", resumable=True
    )
    no_resume_from_checkpoint: bool = setting(
        False, "Start fresh even if save_path holds a checkpoint.", switch=True, resumable=True
    )
    resume: str | None = setting(
        None, "Resume from this checkpoint directory.", resumable=True
    )

    def __post_init__(self) -> None:
        if Path(self.save_path).is_file():
            raise UserError(
                f"--save-path {self.save_path} is a file, not a directory; choose a new or "
                "empty directory, or the save path of the run to resume."
            )
        check_int_at_least("keep_checkpoints", self.keep_checkpoints, 1)


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


def _model_state(wrapped: nn.Module, draft: nn.Module, runtime: RuntimeConfig, world: World):
    if sharded(runtime, world):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = get_model_state_dict(wrapped, options=_full_state_options(cpu_offload=True))
        return {k[len(_DRAFT_PREFIX) :]: v for k, v in full.items() if k.startswith(_DRAFT_PREFIX)}
    return {k: v.detach().cpu() for k, v in draft.state_dict().items()}


def _optim_state(wrapped, optimizers, runtime: RuntimeConfig, world: World):
    """Sharded: one full state of all the optimizers, keyed by parameter name (how
    ``set_optimizer_state_dict`` reads it back); else :meth:`Optimizers.state_dict`."""
    if sharded(runtime, world):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(
            wrapped, list(optimizers), options=_full_state_options(cpu_offload=True)
        )
    return optimizers.state_dict()


def _nbytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict: what writing it needs on disk."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_nbytes(v) for v in state)
    return 0


def checkpoint_bytes(draft: nn.Module) -> int:
    """About what one checkpoint takes on disk: the weights, and two optimizer moments per
    trainable weight (AdamW's; Muon keeps one). Example: 10M bfloat16 weights -> 60 MB."""
    weights = sum(p.numel() * p.element_size() for p in draft.parameters())
    moments = sum(2 * p.numel() * p.element_size() for p in draft.parameters() if p.requires_grad)
    return weights + moments


def check_checkpoint_space(save_path: Path, draft: nn.Module) -> None:
    """Refuse, before the first step, a ``--save-path`` whose disk cannot hold a checkpoint
    (the next one is written before the oldest kept one is removed)."""
    check_free_space(
        "--save-path", save_path, checkpoint_bytes(draft), "a checkpoint",
        "free some space or choose another --save-path",
    )


def save_checkpoint(
    save_path: Path,
    step: int,
    *,
    wrapped: nn.Module,
    draft: nn.Module,
    optimizers,
    schedulers,
    config,
    world: World,
    made: dict,
) -> Path:
    """Write ``checkpoint-<step>`` atomically (complete, or not there); keep the newest few.

    ``config``: the run's settings (a ``TrainConfig``: recorded whole for the resumption's
    comparison, its ``runtime`` and ``trainer`` sections read); ``made``: the model card's
    account of the checkpoint (:func:`~.provenance.how_it_was_made`). Every rank takes part
    in gathering a sharded state; rank 0 writes. A write that fails for lack of space leaves
    nothing behind (the older checkpoints stay) and raises
    :class:`~..common.errors.DiskFull` saying what it needed.
    """
    model_state = _model_state(wrapped, draft, config.runtime, world)
    optim_state = _optim_state(wrapped, optimizers, config.runtime, world)
    final = save_path / f"{CHECKPOINT_PREFIX}{step}"
    if world.rank == 0:
        need = _nbytes(model_state) + _nbytes(optim_state)
        with writing(final, "a checkpoint", need, RESUME_ADVICE), atomic_directory(final) as tmp:
            draft.save_pretrained(tmp, state_dict=model_state)
            write_model_card(tmp, made, location=final)
            state = {
                "step": step,
                "optimizer": optim_state,
                "scheduler": schedulers.state_dict(),
                "config": config.to_dict(),
                "torch_rng": torch.get_rng_state(),
            }
            torch.save(state, tmp / STATE_FILE)
        for old in checkpoint_dirs(save_path)[: -config.trainer.checkpoints.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    world.barrier()
    return final


@dataclass
class ResumePoint:
    """A checkpoint read completely (training state and weights) before anything is built."""

    path: Path
    state: dict
    weights: dict


def read_checkpoint(path: Path) -> ResumePoint:
    """Both files of a checkpoint; :class:`UnreadableFile` names the one that fails."""
    state = load_plain_torch(path / STATE_FILE, "a training state")
    if not isinstance(state, dict) or not {"step", "config", "optimizer"} <= state.keys():
        raise UnreadableFile(path / STATE_FILE, "lacks the step, config or optimizer state.")
    return ResumePoint(path, state, load_safetensors(path / "model.safetensors"))


def _resume_point(config: CheckpointConfig, save_path: Path) -> ResumePoint | None:
    if config.resume:
        path = Path(config.resume)
        if not (path / STATE_FILE).exists():
            raise UserError(f"--resume {path} is not a checkpoint (no {STATE_FILE} in it).")
        return read_checkpoint(path)
    if config.no_resume_from_checkpoint:
        return None
    damaged = []
    for path in reversed(checkpoint_dirs(save_path)):
        try:
            return read_checkpoint(path)
        except UnreadableFile as exc:
            logger.warning("not resuming from %s: %s", path.name, exc)
            damaged.append(exc)
    if damaged:  # starting over would silently replace them: the user decides
        raise UserError(
            f"No checkpoint in {save_path} loads (newest: {damaged[0]}); remove the damaged "
            "checkpoints, or pass --no-resume-from-checkpoint to start over."
        )
    return None


def resume_point(config, save_path: Path, world: World) -> ResumePoint | None:
    """The checkpoint to resume from, read, or None: rank 0 picks it, the others read it.

    ``--resume DIR`` must load; otherwise the newest checkpoint in ``save_path`` that loads
    (a damaged one is skipped with a warning). Its settings are checked against ``config``
    (the run's settings, a ``TrainConfig``: its ``trainer`` section says what to resume).
    """
    point = _resume_point(config.trainer.checkpoints, save_path) if world.rank == 0 else None
    if world.distributed:
        holder = [str(point.path) if point else ""]
        dist.broadcast_object_list(holder, src=0)
        if world.rank != 0 and holder[0]:
            point = read_checkpoint(Path(holder[0]))
    if point is not None:
        _check_resumable(point, config)
    return point


def changed_settings(cls, recorded: dict, current: dict) -> list[str]:
    """The keys, sorted, of the settings of config class ``cls`` whose ``current`` value
    differs from the checkpoint's ``recorded`` one, where a resumption must keep it.

    A setting's metadata says how (:func:`~..common.settings.setting`): a ``resumable`` one
    may change (how long, how often, where to); a ``path`` is compared resolved, so the
    same directory however spelled is no change; a ``prompts`` spec with its sources
    resolved. A setting the checkpoint does not record is younger than it: its run had the
    setting's ``unrecorded`` value, else its default (an AdamW checkpoint of before
    ``--optimizer`` existed resumes only as adamw); a key recorded that ``cls`` no longer
    has differs unless it was None.

    Example: ``changed_settings(TrainConfig, {"lr": 0.1, "epochs": 3}, {"lr": 0.2,
    "epochs": 9, ...})`` -> ``["lr"]``.
    """
    defaults = {leaf.key: leaf.field.metadata.get("unrecorded", leaf.default)
                for leaf in leaves(cls)}
    recorded = {k: v for k, v in defaults.items() if v is not MISSING} | recorded
    resumable = set(keys_with(cls, "resumable"))
    paths, prompts = set(keys_with(cls, "path")), set(keys_with(cls, "prompts"))

    def comparable(key: str, value):
        if key in paths and value:
            return str(Path(value).resolve())
        if key in prompts and value:  # a prompt-set spec whose source may be a file
            return resolved_spec(value)
        return list(value) if isinstance(value, tuple) else value

    return sorted(
        k for k, v in recorded.items()
        if k not in resumable and comparable(k, current.get(k)) != comparable(k, v)
    )


def _check_resumable(point: ResumePoint, config) -> None:
    """Refuse, in one sentence, a resumption whose settings differ from the checkpoint's
    (:func:`changed_settings`)."""
    changed = changed_settings(type(config), point.state["config"], config.to_dict())
    if changed:
        raise UserError(
            f"Cannot resume from {point.path}: it was trained with different "
            f"{', '.join(changed)}; to resume, run with the settings it was trained with "
            "(to start over instead, use a new --save-path)."
        )


def load_checkpoint(
    point: ResumePoint, wrapped, draft, optimizers, schedulers, config, world
) -> int:
    """Restore weights, optimizers, schedulers and RNG from ``point``; returns its step."""
    state, weights = point.state, point.weights
    if sharded(config.runtime, world):
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = _full_state_options(strict=False)
        set_model_state_dict(
            wrapped, {f"{_DRAFT_PREFIX}{k}": v for k, v in weights.items()}, options=opts
        )
        set_optimizer_state_dict(wrapped, list(optimizers), state["optimizer"], options=opts)
    else:
        missing, unexpected = draft.load_state_dict(weights, strict=False)
        assert not unexpected, unexpected
        optimizers.load_state_dict(state["optimizer"])
    schedulers.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])
