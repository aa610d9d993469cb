"""The training loop: devices, DDP / FSDP2, one backward per segment, checkpoints, resume.

One optimizer step consumes one global step of :class:`~.data.PackedBatches`: every rank
trains on its own packed ``[1, S]`` row and DDP averages the gradients, so the step equals
a single process averaging the per-row losses of the same rows. With
``sequence_partitions > 1`` each row runs one forward + backward per segment; the segment
losses add up exactly to the row's flat loss (causal completion), so the gradients do too.

Every step is a pure function of ``(weights, optimizer state, seed, step)``: the batch is
addressed by ``(epoch, step)`` and the COD sample is drawn from a generator seeded by
``(seed, step, rank)``. Resuming from a checkpoint therefore reproduces an uninterrupted
run bit for bit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import shutil
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .algorithm import load_algorithm
from .config import TrainConfig

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "training_state.pt"
METRICS_FILE = "metrics.jsonl"
# Fields that may change between a run and its resumption; any other change is refused.
RESUMABLE_CHANGES = frozenset(
    {"max_steps", "epochs", "resume", "no_resume_from_checkpoint", "log_freq",
     "checkpoint_freq", "device", "keep_checkpoints"}
)  # fmt: skip


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM arrived; the step in flight finished and a checkpoint was saved."""

    def __init__(self, signum: int, checkpoint: Path):
        super().__init__(f"interrupted by signal {signum}; checkpoint saved to {checkpoint}")
        self.signum = signum
        self.checkpoint = checkpoint


# ---- processes and devices ---------------------------------------------------------


@dataclass(frozen=True)
class _World:
    rank: int
    size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def from_env(cls, device: str) -> _World:
        """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; each rank takes its local GPU."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dev.index or 0)))
            torch.cuda.set_device(dev)
        if size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        return cls(rank, size, dev)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=op)
        return tensor


class _StepModule(nn.Module):
    """What DDP/FSDP wraps: one forward of the trainer module on a row or segment.

    The loss also carries ``0 * p[0]`` for every trainable parameter. That adds exact
    zeros to the gradients, but keeps every parameter in every graph — a segment with no
    ``lm_head`` rows, or a rank with no segment at all (``segment=EMPTY``), still runs the
    same gradient collectives as the other ranks, so nothing hangs.
    """

    EMPTY = "empty"

    def __init__(self, trainer_module: nn.Module):
        super().__init__()
        self.trainer_module = trainer_module

    def forward(self, batch: dict, segment=None) -> dict:
        touch = sum(p.view(-1)[0] * 0 for p in self.parameters() if p.requires_grad)
        if segment == self.EMPTY:
            return {"loss": touch, "metrics": None}
        metrics = self.trainer_module.forward_batch(batch, peagle_segment=segment)
        return {"loss": metrics.loss + touch, "metrics": metrics}


def _wrap(step_module: _StepModule, config: TrainConfig, world: _World) -> nn.Module:
    if not world.distributed:
        return step_module
    if config.fsdp:
        from torch.distributed.fsdp import fully_shard

        # One FSDP unit: parameters, gradients and optimizer state are sharded, and every
        # forward all-gathers the whole draft once. Per-layer units would all-gather per
        # layer, and a rank padding with EMPTY segments (no layer calls) would then fall out
        # of step with the others' collectives.
        return fully_shard(step_module)
    device_ids = [world.device.index] if world.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(step_module, device_ids=device_ids)


def _sync_context(wrapped: nn.Module, config: TrainConfig, world: _World, last: bool):
    """Gradient all-reduce only on a rank's last backward of the step."""
    if not world.distributed:
        return nullcontext()
    if config.fsdp:
        wrapped.set_requires_gradient_sync(last)
        return nullcontext()
    return nullcontext() if last else wrapped.no_sync()


# ---- one optimizer step -------------------------------------------------------------


def _to_device(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    return {
        k: (v.to(device, dtype) if "hidden_states" in k else v.to(device))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in batch.items()
    }


def autocast_context(config: TrainConfig, device: torch.device):
    """``torch.autocast`` for a forward when ``config.autocast`` asks for mixed precision.

    Only forwards run under it; backward follows the dtypes the forward recorded.
    """
    if config.autocast == "none":
        return nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, config.autocast))


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
    world: _World,
    step: int,
) -> dict[str, torch.Tensor]:
    """Forward + backward of this rank's row (one pass per segment); returns summed stats.

    The optimizer is not stepped here. Stats: ``loss_sum``, ``total_den``, ``correct [K]``,
    ``valid [K]`` of this rank's row.
    """
    module.generator = cod_generator(config.seed, step, world.rank, world.device)
    if config.sequence_partitions > 1:
        plan = module.build_peagle_plan(batch["loss_mask"], document_ids=batch["document_ids"])
        segments: list = [(plan, i) for i in range(len(plan))]
    else:
        segments = [None]
    if config.fsdp and world.distributed:
        # FSDP all-gathers in every forward: all ranks must run the same number of them.
        count = world.all_reduce(torch.tensor([len(segments)]), dist.ReduceOp.MAX)
        segments += [_StepModule.EMPTY] * (int(count) - len(segments))
    elif not segments:
        segments = [_StepModule.EMPTY]
    k = config.num_depths
    stats = {
        "loss_sum": torch.zeros((), dtype=torch.float64),
        "total_den": torch.zeros((), dtype=torch.float64),
        "correct": torch.zeros(k, dtype=torch.float64),
        "valid": torch.zeros(k, dtype=torch.float64),
    }
    for j, segment in enumerate(segments):
        with _sync_context(wrapped, config, world, last=j == len(segments) - 1):
            with autocast_context(config, world.device):
                out = wrapped(batch, segment)
            out["loss"].backward()
        metrics = out["metrics"]
        if metrics is not None:
            stats["loss_sum"] += metrics.loss_sum.detach().double().cpu()
            stats["total_den"] = metrics.total_den.detach().double().cpu()
            stats["correct"] += metrics.correct.detach().double().cpu()
            stats["valid"] += metrics.valid.detach().double().cpu()
    return stats


# ---- checkpoints --------------------------------------------------------------------


def checkpoint_dirs(save_path: Path) -> list[Path]:
    """Complete checkpoints (those with a training state), oldest first."""
    found = [
        p
        for p in save_path.glob(f"{CHECKPOINT_PREFIX}*")
        if p.is_dir() and p.name[len(CHECKPOINT_PREFIX) :].isdigit() and (p / STATE_FILE).exists()
    ]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def _model_state(wrapped: nn.Module, draft: nn.Module, config: TrainConfig, world: _World):
    if config.fsdp and world.distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        prefix = "trainer_module.draft."
        return {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}
    return {k: v.detach().cpu() for k, v in draft.state_dict().items()}


def _optim_state(wrapped, optimizer, config: TrainConfig, world: _World):
    if config.fsdp and world.distributed:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(
            wrapped, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
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
    world: _World,
) -> Path:
    """Write ``checkpoint-<step>`` atomically: a temporary directory renamed when complete.

    It holds the draft in speculators format (``save_pretrained``: ``config.json`` +
    ``model.safetensors``, loadable by ``SpeculatorModel.from_pretrained`` and vLLM) and
    ``training_state.pt`` (optimizer, scheduler, step, config, RNG) for ``--resume``.
    """
    model_state = _model_state(wrapped, draft, config, world)
    optim_state = _optim_state(wrapped, optimizer, config, world)
    final = save_path / f"{CHECKPOINT_PREFIX}{step}"
    if world.rank == 0:
        tmp = save_path / f".tmp-{CHECKPOINT_PREFIX}{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        draft.save_pretrained(tmp, state_dict=model_state)
        state = {
            "step": step,
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict(),
            "config": config.to_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        torch.save(state, tmp / STATE_FILE)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoint_dirs(save_path)[: -config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    if world.distributed:
        dist.barrier()
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


def _load_checkpoint(path: Path, wrapped, draft, optimizer, scheduler, config, world) -> int:
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
    if config.fsdp and world.distributed:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(
            wrapped, {f"trainer_module.draft.{k}": v for k, v in weights.items()}, options=opts
        )
        set_optimizer_state_dict(wrapped, optimizer, state["optimizer"], options=opts)
    else:
        missing, unexpected = draft.load_state_dict(weights, strict=False)
        assert not unexpected, unexpected
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


# ---- signals, logging ---------------------------------------------------------------


class _StopFlag:
    """SIGINT/SIGTERM ask the loop to finish the step, save and exit (a second one kills)."""

    def __init__(self):
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum:  # second signal: give up at once
            signal.signal(signum, self._previous[signum])
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _trim_metrics_log(path: Path, after_step: int) -> None:
    """Drop lines a killed run logged past the checkpoint it resumes from."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln)["step"] <= after_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    os.replace(tmp, path)


def _format_postfix(record: dict) -> dict:
    per_depth = "/".join(f"{a:.2f}" for a in record["accuracy_per_depth"][:4])
    return {
        "loss": f"{record['loss']:.3f}",
        "acc@d": per_depth,
        "AL~": f"{record['acceptance_length']:.2f}",
        "tok/s": f"{record['tokens_per_s']:.0f}",
    }


# ---- the loop -----------------------------------------------------------------------


@dataclass
class TrainingSetup:
    """Everything a step needs, built once by :func:`build_training`."""

    config: TrainConfig
    world: _World
    draft: nn.Module
    module: nn.Module
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    batches: object
    total_steps: int
    mask_token_id: int
    mask_token_reason: str


def _resolve_mask_token(config: TrainConfig, vocab_size: int) -> tuple[int, str]:
    from transformers import AutoTokenizer

    from ..model.mask_token import choose_mask_token_id, mask_token_problem

    tokenizer = AutoTokenizer.from_pretrained(config.verifier_name_or_path)
    if config.mask_token_id is None:
        return choose_mask_token_id(tokenizer, vocab_size)
    problem = mask_token_problem(tokenizer, config.mask_token_id, vocab_size)
    if problem:
        raise ValueError(problem)
    return config.mask_token_id, "given with --mask-token-id"


def _scheduler(optimizer, config: TrainConfig, total_steps: int):
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    warmup = config.scheduler_warmup_steps
    if warmup is None:
        warmup = total_steps // 100  # speculators' default: 1% of the steps
    if config.scheduler_type == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total_steps)
    if config.scheduler_type == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    return get_constant_schedule_with_warmup(optimizer, warmup)


ONEDNN_CACHE_CAPACITY = 128


def _bound_onednn_cache() -> None:
    """Cap oneDNN's primitive cache (unless the user set it), before its first matmul.

    Every step's flattened COD sequence has its own length, so the matmuls meet new shapes
    all run long, and oneDNN keeps a primitive per shape, up to 1024 of them by default.
    bfloat16 primitives hold reordered weights: training the demo's draft reached 3.4 GiB
    RSS (float32: 1.1). 128 holds a step's shapes several times over (eval/RESULTS.md).
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))


def build_training(config: TrainConfig) -> TrainingSetup:
    """Validate the data, build draft, trainer module, wrapper, optimizer and schedule.

    Raises ``ValueError`` (one sentence) on bad input before anything is written.
    """
    from transformers import AutoConfig

    from ..data import PackedBatches, default_target_layer_ids, open_training_data

    world = _World.from_env(config.device)
    if world.device.type == "cpu" and config.autocast != "none":
        _bound_onednn_cache()
    algorithm = load_algorithm(config.algorithm)
    verifier = Path(config.verifier_name_or_path)
    if not (verifier / "config.json").exists():
        raise ValueError(
            f"--verifier-name-or-path {verifier} is not a local transformers model directory "
            "(no config.json); the hub is not used."
        )
    verifier_config = AutoConfig.from_pretrained(verifier)
    verifier_config = getattr(verifier_config, "text_config", verifier_config)
    data = open_training_data(
        config.data_path,
        draft_vocab_size=config.draft_vocab_size,
        verifier_hidden_size=verifier_config.hidden_size,
        num_aux_layers=len(config.target_layer_ids) if config.target_layer_ids else None,
    )
    data.validate(progress=world.rank == 0)
    vocab = verifier_config.vocab_size
    if config.draft_vocab_size > vocab:
        raise ValueError(
            f"--draft-vocab-size {config.draft_vocab_size} exceeds the target's vocabulary "
            f"({vocab})."
        )
    d2t, t2d = data.vocab_mapping(config.draft_vocab_size, target_vocab_size=vocab)
    mask_token_id, reason = _resolve_mask_token(config, vocab)
    layer_ids = (
        config.target_layer_ids
        or data.target_layer_ids
        or default_target_layer_ids(verifier_config.num_hidden_layers)
    )
    if len(layer_ids) != data.num_aux_layers:
        raise ValueError(
            f"--target-layer-ids {list(layer_ids)} names {len(layer_ids)} layers but "
            f"{config.data_path} holds {data.num_aux_layers} aux hidden states per token."
        )

    torch.manual_seed(config.seed)
    dtype = getattr(torch, config.dtype)
    draft = algorithm.build_draft(
        config, d2t=d2t, t2d=t2d, target_layer_ids=layer_ids, mask_token_id=mask_token_id
    ).to(world.device, dtype)
    if config.gradient_checkpointing:
        draft.gradient_checkpointing_enable({"use_reentrant": False})
    draft.train()
    module = algorithm.build_trainer(draft, config, mask_token_id=mask_token_id)
    wrapped = _wrap(_StepModule(module), config, world)
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    # fused: one kernel over every parameter. On CPU torch's default is a loop per tensor:
    # 8.3 vs 3.5 ms per demo step (scheduler included).
    optimizer = torch.optim.AdamW(
        trainable, lr=config.lr, weight_decay=config.weight_decay, fused=True
    )
    batches = PackedBatches(
        data,
        config.total_seq_len,
        seed=config.seed,
        rank=world.rank,
        world_size=world.size,
        hidden_states_dtype=getattr(torch, config.hidden_states_dtype),
    )
    if len(batches) == 0:
        raise ValueError(
            f"{config.data_path} gives no training step for {world.size} rank(s); "
            "it needs at least one sample per rank."
        )
    total = config.epochs * len(batches)
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    return TrainingSetup(
        config, world, draft, module, wrapped, optimizer, _scheduler(optimizer, config, total),
        batches, total, mask_token_id, reason,
    )  # fmt: skip


def train(config: TrainConfig, *, progress: bool = True) -> Path:
    """Train a draft; returns the final checkpoint directory.

    Raises :class:`TrainingInterrupted` after saving when SIGINT/SIGTERM arrives.
    """
    from tqdm import tqdm

    setup = build_training(config)
    world, draft, module = setup.world, setup.draft, setup.module
    save_path = Path(config.save_path)
    if world.rank == 0:
        save_path.mkdir(parents=True, exist_ok=True)
        logger.info("mask_token_id %d: %s", setup.mask_token_id, setup.mask_token_reason)
    source = _resolve_source_everywhere(config, save_path, world)
    start = 0
    if source is not None:
        start = _load_checkpoint(
            source, setup.wrapped, draft, setup.optimizer, setup.scheduler, config, world
        )
        if world.rank == 0:
            logger.info("resumed from %s at step %d", source, start)
    metrics_path = save_path / METRICS_FILE
    if world.rank == 0:
        _trim_metrics_log(metrics_path, start)
    steps_per_epoch = len(setup.batches)
    every = max(1, math.floor(config.checkpoint_freq * steps_per_epoch))
    dtype = getattr(torch, config.hidden_states_dtype)
    saved = source
    bar = tqdm(
        total=setup.total_steps, initial=start, disable=not progress or world.rank != 0,
        desc=f"train {config.algorithm}", unit="step", dynamic_ncols=True,
    )  # fmt: skip
    run_began = time.perf_counter()
    with _StopFlag() as stop:
        for step in range(start, setup.total_steps):
            began = time.perf_counter()
            epoch, index = divmod(step, steps_per_epoch)
            batch = _to_device(setup.batches.batch(epoch, index), world.device, dtype)
            setup.optimizer.zero_grad(set_to_none=True)
            stats = train_step(setup.wrapped, module, batch, config, world, step)
            if config.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(
                    [p for p in setup.wrapped.parameters() if p.requires_grad],
                    config.max_grad_norm,
                )
            setup.optimizer.step()
            setup.scheduler.step()
            tokens = float((batch["document_ids"] >= 0).sum())
            record = _reduce_record(stats, tokens, stop.signum, world)
            now = time.perf_counter()
            record.update(
                step=step + 1, epoch=epoch, lr=setup.scheduler.get_last_lr()[0],
                tokens_per_s=record["tokens"] / (now - began), wall_s=now - run_began,
            )  # fmt: skip
            stop_now = record.pop("stop")
            bar.update(1)
            bar.set_postfix(_format_postfix(record), refresh=False)
            if world.rank == 0 and ((step + 1) % config.log_freq == 0 or stop_now):
                with open(metrics_path, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
            done = step + 1 == setup.total_steps
            if stop_now or done or (step + 1) % every == 0:
                saved = save_checkpoint(
                    save_path, step + 1, wrapped=setup.wrapped, draft=draft,
                    optimizer=setup.optimizer, scheduler=setup.scheduler,
                    config=config, world=world,
                )  # fmt: skip
            if stop_now:
                bar.close()
                raise TrainingInterrupted(stop.signum or signal.SIGTERM, saved)
    bar.close()
    if saved is None:  # resumed from a finished run: nothing left to do
        raise ValueError(f"{save_path} holds no checkpoint to return.")
    return saved


def _resolve_source_everywhere(config, save_path: Path, world: _World) -> Path | None:
    """Rank 0 picks the checkpoint to resume from; the others wait and agree."""
    source = _resume_source(config, save_path) if world.rank == 0 else None
    if world.distributed:
        holder = [str(source) if source else ""]
        dist.broadcast_object_list(holder, src=0)
        source = Path(holder[0]) if holder[0] else None
    return source


def _reduce_record(stats: dict, tokens: float, signum: int, world: _World) -> dict:
    """Global step figures (sums over ranks) and the stop flag, in one all-reduce."""
    k = len(stats["correct"])
    flat = torch.cat(
        [
            torch.tensor([stats["loss_sum"], stats["total_den"], tokens, float(signum)]),
            stats["correct"],
            stats["valid"],
        ]
    ).to(world.device)
    flat = world.all_reduce(flat).cpu()
    loss_sum, den, tokens, stop = flat[:4].tolist()
    correct, valid = flat[4 : 4 + k], flat[4 + k :]
    acc = correct / valid.clamp(min=1)
    return {
        "loss": loss_sum / max(den, 1.0),
        "accuracy": float(correct.sum() / valid.sum().clamp(min=1)),
        "accuracy_per_depth": acc.tolist(),
        "valid_per_depth": valid.tolist(),
        "acceptance_length": float(1 + torch.cumprod(acc, 0).sum()),
        "tokens": tokens,
        "stop": stop > 0,
    }
