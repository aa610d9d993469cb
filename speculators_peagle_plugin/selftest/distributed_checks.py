"""The training step under torchrun, DDP and FSDP2, against one process on the same batch.

Each wrapper runs ``speculators-peagle train``'s own step (:mod:`..training.distributed`,
:func:`..training.step.train_step`) in ``torchrun`` ranks, one row each:

- correctness: a narrow draft of the shape, partitioned rows; the averaged gradients
  and the loss equal one process's on all the ranks' rows (each row's COD drawn as its
  rank draws it);
- speed: the draft of the shape at the first row length, ``tokens/s`` over all ranks
  and the peak memory of rank 0.

On CUDA every GPU is a rank (NCCL); on a CPU two ranks (gloo) stand in.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..model.build import DEFAULT_SLIDING_WINDOW
from .checks import PARTITIONS
from .perf import _peak_gib, _sync, make_row, segments_for
from .rows import packed_batch
from .selftest_report import FAIL, SKIP, Check, relative_error, verdict
from .shapes import NARROW_WINDOW, SHAPES, build_draft, trainer_for

WRAPPERS = ("ddp", "fsdp")
TOLERANCE = 1e-5  # float32 gradients summed across ranks in another order
ROW_TOKENS = 97  # correctness rows: several documents, padding, a few segments each


def _config(world, wrapper: str, partitions: int, autocast: str, scratch: str, seed: int = 0):
    """The step's settings (``train_step`` draws each rank's COD from ``seed``)."""
    from ..training.train_config import TrainConfig

    return TrainConfig.from_sources(
        verifier_name_or_path="selftest", data_path="selftest", save_path=scratch,
        sequence_partitions=partitions, fsdp=wrapper == "fsdp", autocast=autocast,
        device=str(world.device), seed=seed,
    )


def _full_grads(model) -> dict[str, torch.Tensor]:
    """Every gradient, whole (FSDP2 shards them: gathering is a collective on all ranks)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().cpu()
    return out


def _reference(shape, device, rows: list[dict], seed: int) -> tuple[float, dict]:
    """One process, the same initial draft, every rank's row: ``(loss, grads)``."""
    from ..training.step import cod_generator

    draft = build_draft(shape, device, seed, NARROW_WINDOW)
    module = trainer_for(draft, PARTITIONS, seed)
    loss = 0.0
    for rank, row in enumerate(rows):
        module.generator = cod_generator(seed, 0, rank, device)
        for segment in module.segments(row):
            m = module.forward_batch(row, peagle_segment=segment)
            (m.loss / len(rows)).backward()
            loss += float(m.loss) / len(rows)
    return loss, {n: p.grad.cpu() for n, p in draft.model.named_parameters() if p.grad is not None}


def _correctness(world, spec: dict, scratch: str) -> dict:
    from ..training.distributed import StepModule, wrap
    from ..training.step import train_step

    shape, seed, device = SHAPES[spec["shape"]].narrow(), 0, world.device
    draft = build_draft(shape, device, seed, NARROW_WINDOW)
    module = trainer_for(draft, PARTITIONS, seed)
    config = _config(world, spec["wrapper"], PARTITIONS, "none", scratch, seed)
    wrapped = wrap(StepModule(module, every_parameter=True), config.runtime, world)
    batch = packed_batch(seed, vocab=shape.vocab_size, aux_width=draft.model.fc.in_features,
                         hidden=shape.hidden_size, batch=world.size, seq_len=ROW_TOKENS,
                         dtype=torch.float32)
    rows = [{k: v[r : r + 1].to(device) for k, v in batch.items()} for r in range(world.size)]
    stats = train_step(wrapped, module, rows[world.rank], config, world, 0)
    loss = stats["loss_sum"] / stats["total_den"].clamp(min=1)
    loss = float(world.all_reduce(loss.to(device)) / world.size)
    grads = _full_grads(draft.model)
    if world.rank != 0:
        return {}
    want_loss, want = _reference(shape, device, rows, seed)
    errors = {"loss": relative_error(torch.tensor(loss), torch.tensor(want_loss))}
    errors |= {f"grad {n}": relative_error(g, want[n]) if n in want else float("inf")
               for n, g in grads.items()}
    return {"errors": errors}


def _speed(world, spec: dict, scratch: str) -> dict:
    from ..training.distributed import StepModule, wrap
    from ..training.step import gradient_norm, train_step

    shape, device, seq_len = SHAPES[spec["shape"]], world.device, spec["seq_len"]
    cuda = device.type == "cuda"
    autocast, dtype = ("bfloat16", torch.bfloat16) if cuda else ("none", torch.float32)
    draft = build_draft(shape, device, 0, DEFAULT_SLIDING_WINDOW)
    module = trainer_for(draft, segments_for(seq_len))
    config = _config(world, spec["wrapper"], segments_for(seq_len), autocast, scratch)
    wrapped = wrap(StepModule(module, every_parameter=True), config.runtime, world)
    params = [p for p in draft.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    batch = make_row(shape, seq_len, device, dtype)
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        if cuda and i == spec["warmup"]:
            torch.cuda.reset_peak_memory_stats(device)
        world.barrier()
        _sync(device)
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        train_step(wrapped, module, batch, config, world, i)
        gradient_norm(params, 1.0)
        optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - began)
    median = statistics.median(times[spec["warmup"] :])
    return {"tokens_per_s": world.size * seq_len / median, "step_s": median,
            "peak_gib": _peak_gib(device), "segments": segments_for(seq_len)}


def worker(spec: dict) -> None:
    """One torchrun rank: both measurements; rank 0 writes them to ``spec["out"]``."""
    from ..training.distributed import World, process_group_of_run

    world = World.from_env(spec["device"])
    with process_group_of_run(), tempfile.TemporaryDirectory() as scratch:
        result = {"ranks": world.size, **_correctness(world, spec, scratch)}
        result["speed"] = _speed(world, spec, scratch)
    if world.rank == 0:
        Path(spec["out"]).write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(device: torch.device, quick: bool) -> tuple[int, str | None]:
    """How many ranks to start, or 0 and why none."""
    if device.type == "cuda":
        n = torch.cuda.device_count()
        return (n, None) if n >= 2 else (0, f"needs 2+ CUDA devices; this machine has {n}.")
    if quick:
        return 0, "--quick leaves out the torchrun checks."
    return 2, None


def _run(wrapper: str, ranks: int, spec: dict, env: dict) -> Check:
    """One torchrun job of ``ranks`` ranks under ``wrapper``; its verdict."""
    name = f"torchrun {wrapper.upper()}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        spec = {**spec, "wrapper": wrapper, "out": str(out)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", str(_free_port()), "-m", __name__, json.dumps(spec)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return Check(name, FAIL, f"{ranks} ranks exited {done.returncode}: {tail[0]}")
        result = json.loads(out.read_text())
    speed = result["speed"]
    what = (f"{ranks} ranks, gradients and loss vs one process on the same rows; the step at "
            f"{spec['seq_len']:,} tokens a rank: {speed['tokens_per_s']:,.0f} tokens/s over all "
            f"ranks, peak {speed['peak_gib']:.2f} GiB on rank 0")
    check = verdict(name, result["errors"], TOLERANCE, what)
    check.data |= {"ranks": ranks, "speed": speed}
    return check


def distributed_checks(shape, device, seq_len: int, warmup: int, steps: int, quick: bool):
    """PASS/FAIL per wrapper (gradients vs one process), with its speed in ``data``."""
    ranks, why = _ranks(device, quick)
    if not ranks:
        return [Check(f"torchrun {w.upper()}", SKIP, why) for w in WRAPPERS]
    env = {**os.environ}
    if device.type == "cpu":  # ranks share the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // ranks))
    spec = {"shape": shape.name, "device": device.type, "seq_len": seq_len, "warmup": warmup,
            "steps": steps}
    return [_run(wrapper, ranks, spec, env) for wrapper in WRAPPERS]


if __name__ == "__main__":  # a torchrun rank: `torchrun ... -m ...distributed_checks SPEC_JSON`
    worker(json.loads(sys.argv[1]))
