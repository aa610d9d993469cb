"""The torch device a user names, refused in one sentence when this machine lacks it."""

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
