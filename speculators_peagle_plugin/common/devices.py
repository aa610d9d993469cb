"""The torch device a user names, refused in one sentence when this machine lacks it; the
precision a CPU without native bfloat16 runs in; and the cores processes run at once share."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from .errors import UserError


def checked_device(name: str, flag: str = "--device") -> torch.device:
    """``torch.device(name)``, if it parses and this machine has it (cpu, cuda, cuda:N)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UserError(
            f"{flag} {name!r} is not a torch device; use cpu, cuda or cuda:N."
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"{flag} {name}: this machine has no CUDA device; use {flag} cpu.")
        if device.index is not None and device.index >= count:
            raise UserError(f"{flag} {name}: this machine has {count} CUDA device(s).")
    elif device.type != "cpu":
        raise UserError(f"{flag} {name!r} is not supported; use cpu, cuda or cuda:N.")
    return device


def cpu_has_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 / AMX), per oneDNN."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def low_precision_dtype(device: torch.device) -> torch.dtype:
    """The dtype of matmuls that need not be exact (Muon's Newton-Schulz iteration): bfloat16,
    but float32 on a CPU without native bfloat16, where bfloat16 matmuls are emulated and many
    times slower than float32 ones."""
    if device.type == "cpu" and not cpu_has_bfloat16():
        return torch.float32
    return torch.bfloat16


def cpu_train_settings(native_bf16: bool) -> dict[str, str]:
    """The training settings a CPU without native bfloat16 overrides: ``{"autocast":
    "none"}`` (emulated bfloat16 matmuls are slower than float32 ones); none where native."""
    return {} if native_bf16 else {"autocast": "none"}


def cpu_target_dtype(native_bf16: bool) -> str:
    """The target's dtype when the user leaves it to the CPU (``auto``): bfloat16 where
    native, float32 elsewhere."""
    return "bfloat16" if native_bf16 else "float32"


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity), in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_shares(count: int, ranks: int = 1) -> list[tuple[dict[str, str], list[int]]]:
    """:func:`usable_cores` dealt into ``count`` contiguous shares, as even as they divide,
    for processes that run at once: per share, the variables its process runs with
    (``OMP_NUM_THREADS``: its core count; vLLM's ``VLLM_CPU_OMP_THREADS_BIND``: its cores
    split among an engine's ``ranks``) and its cores (for ``os.sched_setaffinity``). A
    process that computes with every core beside another makes both wait at each OpenMP
    barrier (``python -m eval.bench_test_threads``). The caller checks that there are
    ``count * ranks`` cores."""
    cores = usable_cores()
    shares = []
    for r in range(count):
        mine = cores[r * len(cores) // count : (r + 1) * len(cores) // count]
        bound = [mine[k * len(mine) // ranks : (k + 1) * len(mine) // ranks] for k in range(ranks)]
        shares.append(({
            "OMP_NUM_THREADS": str(len(mine)),
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, c)) for c in bound),
        }, mine))
    return shares


def start_on_cores(
    command: list[str], env: dict, cores: list[int] | None, log: Path
) -> subprocess.Popen:
    """Start ``command`` with ``env`` on ``cores`` (this process's, where None), its output
    appended to ``log``."""
    with open(log, "ab") as fh:
        return subprocess.Popen(
            command, env=env, stdout=fh, stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )
