"""The training loop: build everything once, then step, log and checkpoint until done.

One optimizer step consumes one global step of :class:`~.data.PackedBatches`: every rank
trains on its own packed ``[1, L]`` row and DDP averages the gradients, so the step equals
a single process averaging the per-row losses of the same rows. With
``sequence_partitions > 1`` each row runs one forward + backward per segment; the segment
losses add up exactly to the row's flat loss (causal completion), so the gradients do too.

Every step is a pure function of ``(weights, optimizer state, seed, step)``: the batch is
addressed by ``(epoch, step)`` and the COD sample is drawn from a generator seeded by
``(seed, step, rank)``. Resuming from a checkpoint therefore reproduces an uninterrupted
run bit for bit.

The parts: :mod:`.weights_start` (where the weights start), :mod:`.run_data` (the data),
:mod:`.distributed` (ranks, wrappers), :mod:`.step` (one step), :mod:`.checkpoint` (save,
resume), :mod:`.progress` (records, the log, signals).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..common.devices import cpu_has_bfloat16
from ..common.errors import UserError, memory_for
from ..common.files import remove_stale_temporaries
from ..common.lock import exclusive_directory
from ..data import PackedBatches
from . import heldout
from .checkpoint import ResumePoint, check_checkpoint_space, load_checkpoint, save_checkpoint
from .distributed import StepModule, World, env_rank, process_group_of_run, wrap
from .online import prepare_cache
from .optim import Optimizers, Schedulers, build_optimizers, build_schedulers
from .prefetch import RowsAhead
from .pretrained import copy_pretrained_weights
from .progress import (
    METRICS_FILE,
    StopFlag,
    TrainingInterrupted,
    append_record,
    check_finite,
    format_postfix,
    reduce_record,
    trim_metrics_log,
)
from .provenance import how_it_was_made
from .run_data import RunData, open_run_data
from .schedule import Cadence
from .step import gradient_norm, to_device, train_step
from .trackers import Trackers, check_trackers_installed
from .train_config import TrainConfig
from .validation import Validation
from .weights_start import WeightsStart, start_weights

logger = logging.getLogger(__name__)

__all__ = ["TrainingInterrupted", "TrainingSetup", "build_training", "train"]


@dataclass
class TrainingSetup:
    """Everything a step needs, built once by :func:`build_training`."""

    config: TrainConfig
    world: World
    draft: nn.Module
    module: nn.Module
    wrapped: nn.Module
    optimizers: Optimizers
    schedulers: Schedulers
    batches: object
    total_steps: int
    mask_token_id: int
    mask_token_reason: str
    resume: ResumePoint | None = None
    heldout_samples: tuple[int, ...] = ()  # of data_path, scored after each checkpoint


ONEDNN_CACHE_CAPACITY = 128


def _bound_onednn_cache() -> None:
    """Cap oneDNN's primitive cache (unless the user set it), before its first matmul.

    Every step's flattened COD sequence has its own length, so the matmuls meet new shapes
    all run long, and oneDNN keeps a primitive per shape, up to 1024 of them by default.
    bfloat16 primitives hold reordered weights, so an unbounded cache grows the process
    for the whole run; the cap holds a step's shapes several times over (eval/RESULTS.md
    records the resident memory with and without it).
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))


# A step under emulated bfloat16 takes many times the float32 one (eval/RESULTS.md,
# "Precision": `train --config configs/demo_smollm2.yaml --max-steps 25 [--autocast none]`).
EMULATED_AUTOCAST = (
    "This CPU has no native bfloat16 (AVX-512 BF16 or AMX): autocast bfloat16 emulates its "
    "matmuls and trains many times slower than float32 here; pass --autocast none."
)


def build_training(config: TrainConfig, save_path: Path | None = None) -> TrainingSetup:
    """Start the weights, open the data, then build draft, trainer module, wrapper,
    optimizers and schedules.

    With ``from_pretrained`` the draft starts from that draft's weights (unless the run
    resumes: its checkpoint's weights replace them anyway); with ``train_data_ratio`` below
    1 it trains on its share of ``data_path`` and ``heldout_samples`` are the rest.

    Raises ``ValueError`` (one sentence) on bad input before anything is written. The cheap
    checks (device, verifier, mask token, the checkpoint to resume from in ``save_path``, the
    data's layout and layer ids) run before the scan of every hidden-state file, and, with
    ``--online --prompts``, before the replies are generated.
    """
    world = World.from_env(config.runtime.device)
    if world.device.type == "cpu" and config.runtime.autocast != "none":
        _bound_onednn_cache()
        if not cpu_has_bfloat16():
            logger.warning(EMULATED_AUTOCAST)
    start = start_weights(config, save_path, world)
    run_data = open_run_data(config, start, world)
    return _build(config, world, start, run_data)


def _build(config: TrainConfig, world: World, start: WeightsStart, run_data: RunData):
    """The draft, its trainer module, wrapper, optimizers, batches and schedules."""
    draft = _build_draft(config, world, start, run_data)
    module = start.algorithm.build_trainer(draft, config, mask_token_id=start.mask_token_id)
    wrapped = wrap(StepModule(module, every_parameter=world.distributed), config.runtime, world)
    optimizers = build_optimizers(wrapped.named_parameters(), config.optimizer)
    batches = PackedBatches(
        run_data.data,
        config.data.total_seq_len,
        seed=config.seed,
        samples=run_data.train_samples,
        rank=world.rank,
        world_size=world.size,
        hidden_states_dtype=getattr(torch, config.runtime.hidden_states_dtype),
    )
    if len(batches) == 0:
        raise UserError(
            f"{config.data.data_path} gives no training step for {world.size} rank(s); "
            "it needs at least one training sample per rank."
        )
    total = config.trainer.schedule.total_steps(len(batches))
    if config.online.online:
        prepare_cache(run_data.data, world)
    schedulers = build_schedulers(optimizers, config.scheduler, total)
    return TrainingSetup(
        config, world, draft, module, wrapped, optimizers, schedulers, batches, total,
        start.mask_token_id, start.mask_token_reason, start.resume, run_data.heldout_samples,
    )


def _build_draft(config: TrainConfig, world: World, start: WeightsStart, run_data: RunData):
    """The draft, seeded by ``config.seed``, with the pretrained draft's weights when there
    is one (dropped once copied), on the run's device and dtype, in training mode."""
    torch.manual_seed(config.seed)
    draft = start.algorithm.build_draft(
        config, d2t=run_data.d2t, t2d=run_data.t2d, target_layer_ids=run_data.layer_ids,
        mask_token_id=start.mask_token_id,
    )
    if start.pretrained is not None:
        copy_pretrained_weights(start.pretrained, draft, config.draft.from_pretrained)
        start.pretrained = None
    draft = draft.to(world.device, getattr(torch, config.runtime.dtype))
    if config.runtime.gradient_checkpointing:
        draft.gradient_checkpointing_enable({"use_reentrant": False})
    draft.train()
    return draft


def train(config: TrainConfig, *, progress: bool = True) -> Path:
    """Train a draft; returns the final checkpoint directory (with validation and
    ``save_best``: ``SAVE/best``).

    Rank 0 holds ``save_path``'s lock for the whole run: a second run on the same path is
    refused at once. Raises :class:`TrainingInterrupted` after saving when SIGINT/SIGTERM
    arrives, and ``ValueError`` when the loss or gradient norm stops being finite. Under
    torchrun it destroys the process group it made when it returns or is interrupted.
    """
    save_path = Path(config.trainer.checkpoints.save_path)
    check_trackers_installed(config.logging)
    with (
        exclusive_directory(save_path, "training run", hold=env_rank() == 0),
        process_group_of_run(clean_exits=(TrainingInterrupted,)),
    ):
        return _train(config, save_path, progress)


def _train(config: TrainConfig, save_path: Path, progress: bool) -> Path:
    if env_rank() == 0:
        remove_stale_temporaries(save_path)  # what a killed run's atomic writes left
    setup = build_training(config, save_path)
    start, saved = _resume(setup, save_path)
    steps_per_epoch = len(setup.batches)
    cadence = Cadence.of(config.trainer.schedule, config.logging, steps_per_epoch,
                         setup.total_steps)
    validation = _validation(config, save_path, start, setup.world, setup.heldout_samples)
    on_grid = cadence.on_grid(start)
    if validation is not None and validation.resume(saved, start, start / steps_per_epoch, on_grid):
        return validation.best_dir if validation.keeps_best else saved  # it stopped early before
    saved = _run_steps(setup, save_path, start, saved, cadence, validation, progress)
    if validation is not None and validation.keeps_best and validation.best is not None:
        return validation.best_dir
    if saved is None:  # resumed from a finished run: nothing left to do
        raise UserError(f"{save_path} holds no checkpoint to return.")
    return saved


def _resume(setup: TrainingSetup, save_path: Path) -> tuple[int, Path | None]:
    """``(first step, checkpoint resumed from)``: the run's checkpoint loaded, if any, and
    the metrics log cut back to it."""
    world, draft = setup.world, setup.draft
    if world.rank == 0:
        check_checkpoint_space(save_path, draft)
        logger.info("mask_token_id %d: %s", setup.mask_token_id, setup.mask_token_reason)
    start, saved = 0, None
    if setup.resume is not None:
        start = load_checkpoint(
            setup.resume, setup.wrapped, draft, setup.optimizers, setup.schedulers,
            setup.config, world,
        )
        saved, setup.resume = setup.resume.path, None  # the loaded tensors are not kept
        if world.rank == 0:
            logger.info("resumed from %s at step %d", saved, start)
    if world.rank == 0:
        trim_metrics_log(save_path / METRICS_FILE, start)
    return start, saved


def _validation(config: TrainConfig, save_path: Path, resumed_step: int, world: World,
                heldout_samples: tuple[int, ...] | None) -> Validation | None:
    """The run's validation: on ``validation_data_path``, or on ``data_path``'s held-out
    samples; None without either."""
    if config.data.validation_data_path:
        data_path, samples = config.data.validation_data_path, None
    elif heldout_samples:
        data_path, samples = config.data.data_path, heldout_samples
    else:
        return None

    def score(checkpoint: Path) -> dict:
        return heldout.heldout_metrics(checkpoint, config, data_path, samples=samples)

    return Validation(config.trainer.validation, score, save_path, resumed_step, world)


@dataclass
class _StepRecords:
    """Runs one optimizer step and builds its record."""

    setup: TrainingSetup
    trainable: list[nn.Parameter]  # the parameters whose gradient norm is clipped
    states_dtype: torch.dtype  # of the hidden states on the device
    online: object | None  # the online source whose target time a record reports
    run_began: float

    def record(self, step: int, rows: RowsAhead, stop: StopFlag, saved: Path | None) -> dict:
        """Step ``step`` (0-based) on its row: loss and figures reduced over the ranks,
        learning rates, gradient norm, speeds, ``stop`` (a signal arrived on some rank)."""
        setup = self.setup
        config, world = setup.config, setup.world
        began = time.perf_counter()
        row, waited = rows.get(step)
        with memory_for(row["input_ids"].shape[-1]):
            batch = to_device(row, world.device, self.states_dtype)
            setup.optimizers.zero_grad(set_to_none=True)
            stats = train_step(setup.wrapped, setup.module, batch, config, world, step)
            grad_norm = gradient_norm(self.trainable, config.optimizer.max_grad_norm)
            tokens = float((batch["document_ids"] >= 0).sum())
            record = reduce_record(stats, tokens, stop.signum, world)
            check_finite(record["loss"], grad_norm, step + 1, saved)
            setup.optimizers.step()
        setup.schedulers.step()
        now = time.perf_counter()
        record.update(
            step=step + 1, epoch=step // len(setup.batches), **setup.optimizers.learning_rates(),
            grad_norm=grad_norm, tokens_per_s=record["tokens"] / (now - began),
            data_share=waited / (now - began), wall_s=now - self.run_began,
        )
        if self.online is not None:  # this rank's share of the step spent in the target
            record["target_share"] = self.online.take_seconds() / (now - began)
        return record


def _run_steps(setup: TrainingSetup, save_path: Path, start: int, saved: Path | None,
               cadence: Cadence, validation: Validation | None, progress: bool) -> Path | None:
    """Steps ``start`` to the last (or an early stop); returns the last checkpoint saved.
    Raises :class:`TrainingInterrupted` after saving when a signal stops the run."""
    from tqdm import tqdm

    config, world = setup.config, setup.world
    dtype = getattr(torch, config.runtime.hidden_states_dtype)
    trainable = [p for p in setup.wrapped.parameters() if p.requires_grad]
    bar = tqdm(
        total=setup.total_steps, initial=start, disable=not progress or world.rank != 0,
        desc=f"train {config.algorithm}", unit="step", dynamic_ncols=True,
    )
    online = setup.batches.data.online
    if online is not None and getattr(online, "read_ahead", False):
        online = None  # a server computes its rows: read like files
    steps = _StepRecords(setup, trainable, dtype, online, time.perf_counter())
    # Reading a row ahead hides it behind the step; an online row runs the target instead.
    with (
        bar,  # closed however the loop ends, so an error starts on a line of its own
        StopFlag() as stop,
        RowsAhead(setup.batches, setup.total_steps, ahead=online is None) as rows,
        Trackers(config.logging, world.rank, hparams=config.to_dict()) as trackers,
    ):
        for step in range(start, setup.total_steps):
            record = steps.record(step, rows, stop, saved)
            stop_now, done = record.pop("stop"), step + 1
            bar.update(1)
            bar.set_postfix(format_postfix(record), refresh=False)
            if world.rank == 0 and cadence.logs(done, stop_now):
                append_record(save_path / METRICS_FILE, record)
                trackers.log(record, done)
            if cadence.saves(done, stop_now):
                saved = save_checkpoint(
                    save_path, done, wrapped=setup.wrapped, draft=setup.draft,
                    optimizers=setup.optimizers, schedulers=setup.schedulers,
                    config=config, world=world, made=how_it_was_made(config, done),
                )
                if validation is not None and not stop_now:
                    stop_early = validation.score(saved, done, done / len(setup.batches))
                    trackers.log(validation.records[-1], done, prefix="val")
                    if stop_early:
                        logger.info("stopping early: %s", validation.stop_reason)
                        break
            if stop_now:
                bar.close()
                raise TrainingInterrupted(stop.signum or signal.SIGTERM, saved)
    bar.close()
    return saved
