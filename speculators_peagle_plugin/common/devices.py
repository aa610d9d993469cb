"""The torch device a user names, refused in one sentence when this machine lacks it; and
the precision a CPU without native bfloat16 runs in."""

from __future__ import annotations

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
