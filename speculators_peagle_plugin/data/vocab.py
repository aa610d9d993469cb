"""The draft vocabulary's mapping: ``d2t-<V>.npy`` / ``t2d-<V>.npy`` of a data directory, or
built from its ``token_freq.pt`` and cached, as ``speculators train`` does.

``d2t: [V]`` int64 OFFSETS (``target_id = draft_id + d2t[draft_id]``), ``t2d: [target_vocab]``
bool, ``V`` the draft vocabulary's size. Example: draft ids -> target ids [0, 3, 4] gives
d2t [0, 2, 2] and t2d true at 0, 3 and 4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..common.files import atomic_write
from ..common.reading import load_plain_torch
from ..common.settings import check_int_at_least
from .layout import TOKEN_FREQ_FILE, DataError


def check_vocab_mapping(path: Path, draft_vocab_size: int) -> None:
    """Raise DataError unless :func:`vocab_mapping` can give this size (builds nothing)."""
    check_int_at_least("draft_vocab_size", draft_vocab_size, 1)
    d2t_path = path / f"d2t-{draft_vocab_size}.npy"
    if d2t_path.exists() and d2t_path.with_name(f"t2d-{draft_vocab_size}.npy").exists():
        vocab_mapping(path, draft_vocab_size)  # loads and checks the two files
    elif not (path / TOKEN_FREQ_FILE).exists():
        raise DataError(
            f"{path} has neither d2t-{draft_vocab_size}.npy/t2d-{draft_vocab_size}.npy "
            f"nor {TOKEN_FREQ_FILE} to build a {draft_vocab_size}-token draft vocabulary from."
        )


def vocab_mapping(
    path: Path, draft_vocab_size: int, target_vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` for a draft vocabulary of ``draft_vocab_size`` tokens in the data
    directory ``path``.

    Loads ``d2t-<V>.npy``/``t2d-<V>.npy``; when missing, builds them from ``token_freq.pt``
    with speculators' ``build_vocab_mappings_from_distribution`` (most frequent supervised
    tokens) and caches them. ``target_vocab_size`` is needed only to build, when no
    ``t2d-*.npy`` of the data records it.
    """
    check_int_at_least("draft_vocab_size", draft_vocab_size, 1)
    d2t_path = path / f"d2t-{draft_vocab_size}.npy"
    t2d_path = path / f"t2d-{draft_vocab_size}.npy"
    if d2t_path.exists() and t2d_path.exists():
        try:
            d2t = torch.from_numpy(np.load(d2t_path))
            t2d = torch.from_numpy(np.load(t2d_path))
        except (OSError, ValueError) as err:
            msg = f"Vocab mapping {d2t_path} or {t2d_path} is unreadable ({err})."
            raise DataError(msg) from err
        _check_vocab_mapping(d2t, t2d, draft_vocab_size, d2t_path)
        return d2t, t2d
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    freq_path = path / TOKEN_FREQ_FILE
    if not freq_path.exists():
        raise DataError(
            f"{path} has neither {d2t_path.name}/{t2d_path.name} nor {TOKEN_FREQ_FILE} "
            f"to build a {draft_vocab_size}-token draft vocabulary from."
        )
    target_vocab_size = target_vocab_size or _recorded_target_vocab_size(path)
    if target_vocab_size is None:
        raise DataError(
            f"Building {d2t_path.name} from {freq_path} needs the target's vocabulary size, "
            "which this data does not record; pass target_vocab_size."
        )
    if draft_vocab_size > target_vocab_size:
        raise DataError(
            f"draft_vocab_size {draft_vocab_size} exceeds the target's vocabulary size "
            f"{target_vocab_size}."
        )
    freq = load_plain_torch(freq_path, "a token frequency file")
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size, target_vocab_size)
    _save_npy(d2t_path, d2t.numpy())
    _save_npy(t2d_path, t2d.numpy())
    return d2t, t2d


def _recorded_target_vocab_size(path: Path) -> int | None:
    for t2d_path in sorted(path.glob("t2d-*.npy")):
        return int(np.load(t2d_path, mmap_mode="r").shape[0])
    return None


def _save_npy(path: Path, array: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:  # a file object: np.save would append ".npy" to a name
            np.save(fh, array)

    atomic_write(path, write)


def _check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, size: int, path: Path) -> None:
    ok = d2t.shape == (size,) and t2d.dim() == 1 and t2d.dtype == torch.bool
    if ok:
        target_ids = torch.arange(size) + d2t
        ok = int(t2d.sum()) == size and bool(
            ((target_ids >= 0) & (target_ids < t2d.shape[0])).all()
        )
        ok = ok and bool(t2d[target_ids].all())
    if not ok:
        raise DataError(
            f"Vocab mapping {path} and its t2d file do not describe a {size}-token draft "
            "vocabulary (d2t offsets must select exactly the ids t2d marks)."
        )
