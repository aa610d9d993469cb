"""Processes and devices: the ``runtime`` section, the world of ranks, the DDP / FSDP2
wrapper, gradient-sync control."""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..common.devices import checked_device
from ..common.dtypes import DTYPE_NAMES
from ..common.errors import UserError
from ..common.settings import check_choices, setting


@dataclass(frozen=True)
class RuntimeConfig:
    """The ``runtime`` section: where and in what precision the draft trains."""

    gradient_checkpointing: bool = setting(False, "Recompute each draft layer in backward.")
    dtype: str = setting("float32", "Training precision.", choices=DTYPE_NAMES)
    autocast: str = setting(
        "none",
        "Mixed precision: forward matmuls in this dtype under torch.autocast, weights and "
        "optimizer state in float32 (speculators' trainer autocasts to bfloat16).",
        choices=("none", "bfloat16"),
        card=True,
    )
    device: str = setting(
        "cpu", "cpu, cuda or cuda:N (under torchrun: each rank's local GPU).", resumable=True
    )
    fsdp: bool = setting(False, "Shard the draft with FSDP2 under torchrun (large drafts).")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.autocast != "none" and self.dtype != "float32":
            raise UserError(
                f"autocast {self.autocast} keeps float32 weights: it needs dtype float32, "
                f"got {self.dtype}."
            )

    @property
    def hidden_states_dtype(self) -> str:
        """The batches' hidden states: the autocast dtype (all they meet first is ``fc`` and
        the verifier head, linears that autocast would lower them for), else ``dtype``."""
        return self.dtype if self.autocast == "none" else self.autocast


def env_rank() -> int:
    """This process's rank as torchrun sets it (0 outside torchrun), before any group exists."""
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class World:
    """This process's rank, the number of ranks, and its device."""

    rank: int
    size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def from_env(cls, device: str) -> World:
        """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; each rank takes its local GPU."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        dev = checked_device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dev.index or 0)))
            torch.cuda.set_device(dev)
        if size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        return cls(env_rank(), size, dev)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=op)
        return tensor

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


@contextmanager
def process_group_of_run(clean_exits: tuple[type[BaseException], ...] = ()):
    """Destroys the process group that the code inside creates, when every rank is done.

    A rank that exits with its gloo group alive can abort in the group's destructor during
    interpreter shutdown (SIGABRT, "terminate called without an active exception"), and
    torchrun then fails a run that finished; so do the group's worker threads when anything
    still holds it (:func:`_let_destroyed_groups_go`). The group goes on a normal return and on the
    exceptions in ``clean_exits``, which every rank raises at the same step; not on any
    other error, where a rank may still wait in a collective and destroying could hang.
    A group that existed before (the caller's own) is left alone.
    """
    created = not dist.is_initialized()

    def leave() -> None:
        if created and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
            _let_destroyed_groups_go()

    try:
        yield
    except clean_exits:
        leave()
        raise
    leave()


def _let_destroyed_groups_go() -> None:
    """Drops what still holds the destroyed groups, so that gloo joins their threads now.

    ``destroy_process_group`` forgets a group, but a DeviceMesh (FSDP2's) still holds it, and
    DTensor's sharding caches keep every mesh for the life of the process. The group's gloo
    worker threads then outlive the run, and one of them can free a finished collective's
    tensors after interpreter shutdown began: taking the GIL there aborts the rank (SIGABRT,
    "terminate called without an active exception"). With the last holder gone, the group's
    destructor runs here and joins its threads. Called only when every group of the process
    was the run's own.
    """
    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()  # the wrappers' own reference cycles (FSDP2's state, DDP's reducer)
    for mesh in [o for o in gc.get_objects() if isinstance(o, DeviceMesh)]:
        getattr(mesh, "_pg_registry", {}).clear()  # torch keeps no public way to drop them


class StepModule(nn.Module):
    """What DDP/FSDP wraps: one forward of the trainer module on a row or segment.

    With ``every_parameter`` (several ranks) the loss also carries ``0 * p[0]`` for every
    trainable parameter. That adds exact zeros to the gradients, but keeps every parameter
    in every graph — a segment with no ``lm_head`` rows, or a rank with no segment at all
    (``segment=EMPTY``), still runs the same gradient collectives as the other ranks, so
    nothing hangs. One process has no collectives to keep in step, and those zeros cost a
    full-size gradient add per parameter: it leaves them out.
    """

    EMPTY = "empty"

    def __init__(self, trainer_module: nn.Module, every_parameter: bool = True):
        super().__init__()
        self.trainer_module = trainer_module
        self.every_parameter = every_parameter

    def _touch(self) -> torch.Tensor:
        return sum(p.view(-1)[0] * 0 for p in self.parameters() if p.requires_grad)

    def forward(self, batch: dict, segment=None) -> dict:
        if segment == self.EMPTY:
            return {"loss": self._touch(), "metrics": None}
        metrics = self.trainer_module.forward_batch(batch, peagle_segment=segment)
        loss = metrics.loss + self._touch() if self.every_parameter else metrics.loss
        return {"loss": loss, "metrics": metrics}


def wrap(step_module: StepModule, runtime: RuntimeConfig, world: World) -> nn.Module:
    """``step_module`` as the world trains it: itself alone, else under FSDP2 or DDP."""
    if not world.distributed:
        return step_module
    if runtime.fsdp:
        from torch.distributed.fsdp import fully_shard

        # One FSDP unit: parameters, gradients and optimizer state are sharded, and every
        # forward all-gathers the whole draft once. Per-layer units would all-gather per
        # layer, and a rank padding with EMPTY segments (no layer calls) would then fall out
        # of step with the others' collectives.
        return fully_shard(step_module)
    device_ids = [world.device.index] if world.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(step_module, device_ids=device_ids)


def sync_context(wrapped: nn.Module, runtime: RuntimeConfig, world: World, last: bool):
    """Gradient all-reduce only on a rank's last backward of the step."""
    if not world.distributed:
        return nullcontext()
    if runtime.fsdp:
        wrapped.set_requires_gradient_sync(last)
        return nullcontext()
    return nullcontext() if last else wrapped.no_sync()


def sharded(runtime: RuntimeConfig, world: World) -> bool:
    """Whether the draft's state lives sharded across ranks (FSDP2 over several ranks)."""
    return runtime.fsdp and world.distributed
