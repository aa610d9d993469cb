"""Packing samples into ``[1, S]`` rows: deterministic per ``(seed, epoch)``, split over ranks;
the seeded split of a data directory into training and held-out samples, whole prompts on
each side; and the ``data`` section: what training reads, how long its rows are, what is
held out.

Legend: ``S`` = tokens per packed row, ``H`` = target hidden size, ``n_aux`` = aux layers.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..common.errors import UserError
from ..common.settings import check_int_at_least, fail, setting
from .layout import DataError, mix_seed, row_prompts

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .dataset import TrainingData


@dataclass(frozen=True)
class DataConfig:
    """The ``data`` section: the training data, its packed rows, held-out data."""

    data_path: str = setting(
        "",
        "Training data in speculators' on-disk format (with --online, token ids and loss "
        "masks are enough).",
        path=True,
    )
    total_seq_len: int = setting(8192, "Tokens per packed row.", card=True)
    validation_data_path: str | None = setting(
        None,
        "Held-out data (speculators format, same target and aux layers): every checkpoint's "
        "estimated acceptance on it goes to validation.jsonl, the best checkpoint to best/.",
    )
    train_data_ratio: float = setting(
        1.0,
        "Fraction of data_path's samples to train on, in (0, 1]; below 1 the rest (a "
        "permutation seeded by --seed) are held out and scored like --validation-data-path. "
        "Ours defaults to 1 (no split); speculators' to 0.9.",
    )

    def __post_init__(self) -> None:
        check_int_at_least("total_seq_len", self.total_seq_len, 1)
        ratio = self.train_data_ratio
        if not (math.isfinite(ratio) and 0 < ratio <= 1):
            fail("train_data_ratio", ratio, "a number in (0, 1] (1: no held-out split)")
        if self.validation_data_path and not Path(self.validation_data_path).is_dir():
            raise UserError(
                f"validation_data_path {self.validation_data_path} is not a directory; give "
                "data made by generate-data for held-out prompts."
            )


# mix_seed's second value for the train/held-out split; packing uses the epoch (>= 0)
# there, so the split draws from a stream of its own.
SPLIT_STREAM = 2**32


def split_samples(
    data: TrainingData, train_ratio: float, seed: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(train, held_out)`` sample indices of ``data``, whole prompts on each side, both
    ascending.

    A prompt's rows (every turn of a conversation, every sample of a prompt:
    ``row_prompts.json``; each row is its own prompt in data without that file) stay
    together. The prompts, in a permutation seeded by ``seed``, go to train until it holds
    at least ``round(train_ratio * n)`` of the ``n`` rows; the rest are held out. With one
    row per prompt that is exactly ``round(train_ratio * n)`` rows, those of
    ``randperm(n)[:keep]``.

    A pure function of ``(data's rows and prompts, train_ratio, seed)``, so every rank and
    every resumption draws the same split; ``train_ratio`` 1 holds nothing out. Example: 16
    rows, one per prompt, ratio 0.75 -> 12 train, 4 held out; prompts of 3, 1 and 2 rows,
    ratio 0.5, permutation [2, 0, 1] -> train the rows of prompts 2 and 0 (5), held out 1.
    Raises :class:`DataError` when either part would be empty.
    """
    n = data.num_samples
    if train_ratio == 1:
        return tuple(range(n)), ()
    keep = round(train_ratio * n)
    groups = prompt_groups(row_prompts(Path(data.path), n), n)
    generator = torch.Generator().manual_seed(mix_seed(seed, SPLIT_STREAM))
    train: list[int] = []
    for g in torch.randperm(len(groups), generator=generator).tolist():
        if len(train) >= keep:
            break
        train += groups[g]
    if not 0 < len(train) < n:
        empty = "no training sample" if not train else "no held-out sample"
        raise DataError(
            f"train_data_ratio {train_ratio:g} of the {n} samples in {data.path} "
            f"({len(groups)} prompts) leaves {empty} (round({train_ratio:g} * {n}) = {keep} "
            "train, whole prompts on each side); choose a ratio that keeps at least one "
            "prompt on each side, or 1 for no split."
        )
    held = sorted(set(range(n)) - set(train))
    return tuple(sorted(train)), tuple(held)


def prompt_groups(prompts: Sequence[int] | None, n: int) -> list[list[int]]:
    """The row indices of each prompt, prompts in order of their first row; ``prompts[i]``
    is row ``i``'s prompt (None: each of the ``n`` rows alone).

    Example: ``[0, 0, 2, 0, 5]`` -> ``[[0, 1, 3], [2], [4]]``.
    """
    if prompts is None:
        return [[i] for i in range(n)]
    rows: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        rows.setdefault(prompt, []).append(i)
    return list(rows.values())


def pack_rows(lengths: list[int], capacity: int, order: list[int]) -> list[list[int]]:
    """Greedy best-fit-decreasing packing of samples into rows of ``capacity`` tokens.

    Samples are taken longest first (a stable sort of ``order``, so equal lengths keep
    ``order``'s shuffle) and each goes to the fullest row it fits in, else a new row. A sample
    longer than ``capacity`` fills a row alone (speculators truncates it). The number of rows
    depends only on the lengths, never on ``order``: every epoch has the same number of steps.
    Example: lengths [5, 3, 4, 2], capacity 8, order [0, 1, 2, 3] -> [[0, 1], [2, 3]].
    """
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(order, key=lambda i: -min(lengths[i], capacity)):
        need = min(lengths[i], capacity)
        k = bisect.bisect_left(free, (need, -1))
        if k == len(free):
            rows.append([i])
            room, row = capacity - need, len(rows) - 1
        else:
            room, row = free.pop(k)
            rows[row].append(i)
            room -= need
        if room > 0:
            bisect.insort(free, (room, row))
    return rows


class PackedBatches:
    """Deterministic, addressable packed rows: ``batch(epoch, step)`` is this rank's row.

    Each epoch shuffles the samples with a generator seeded from ``(seed, epoch)``, packs them
    into rows of ``total_seq_len`` tokens (:func:`pack_rows`), and shuffles the rows. Global
    step ``g`` gives rank ``r`` row ``g * world_size + r``; on the last step a rank past the end
    gets an all-padding row (loss_mask 0, document_ids -1). Every sample packed appears once
    per epoch across all ranks, and the same ``(epoch, step)`` always gives the same rows, so
    resuming needs only ``(epoch, step)``.

    Args:
        training_data: from :func:`open_training_data`.
        total_seq_len: ``S``, tokens per row.
        samples: the sample indices to pack (default: all); e.g. one side of
            :func:`split_samples`. Rows hold dataset indices either way.
        seed: data-order seed (>= 0), the same on every rank.
        rank, world_size: this process and the number of data-parallel processes.
        shuffle: False keeps dataset order (rows still packed longest first).
        hidden_states_dtype: dtype of both hidden-state tensors.

    ``batch()`` returns speculators' packed batch (built by its ``CollateFn``):
    ``input_ids [1, S]``, ``hidden_states [1, S, n_aux*H]``, ``verifier_last_hidden_states
    [1, S, H]``, ``loss_mask [1, S]`` (int64), ``position_ids [1, S]``, ``document_ids [1, S]``
    (-1 for padding) and ``lengths [n_docs]``.
    Example: lengths [5, 3, 4, 2], S 8, world_size 2 -> one step; each rank gets one row.
    """

    def __init__(
        self,
        training_data: TrainingData,
        total_seq_len: int,
        *,
        seed: int,
        samples: Sequence[int] | None = None,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        hidden_states_dtype: torch.dtype = torch.float32,
    ):
        from speculators.models.eagle3.data import shift_batch
        from speculators.train.data import CollateFn

        check_int_at_least("total_seq_len", total_seq_len, 1)
        check_int_at_least("seed", seed, 0)
        check_int_at_least("world_size", world_size, 1)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise UserError(f"rank must be an integer in [0, {world_size}), got {rank!r}.")
        self.data = training_data
        self.samples = tuple(range(training_data.num_samples) if samples is None else samples)
        self.total_seq_len = total_seq_len
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        # shift_batch (what `speculators train` applies for eagle3 and peagle): slot t
        # carries (token t+1, aux states t) and is supervised by the target at t+1, as
        # vLLM drafts: each sample loses its first token.
        self._collate = CollateFn(
            total_seq_len,
            training_data.hidden_size,
            num_target_layers=training_data.num_aux_layers,
            dtype=hidden_states_dtype,
            preprocess=shift_batch,
        )
        self._cache: tuple[int, list[list[int]]] = (-1, [])
        self.num_rows = len(self.rows(0))

    def __len__(self) -> int:
        return math.ceil(self.num_rows / self.world_size)

    def rows(self, epoch: int) -> list[list[int]]:
        """Sample indices of every packed row of ``epoch``, in global row order."""
        if self._cache[0] == epoch:
            return self._cache[1]
        samples, lengths, capacity = self.samples, self.data.lengths, self.total_seq_len
        if self.shuffle:
            gen = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            order = [samples[j] for j in torch.randperm(len(samples), generator=gen).tolist()]
            rows = pack_rows(lengths, capacity, order)
            rows = [rows[j] for j in torch.randperm(len(rows), generator=gen).tolist()]
        else:
            rows = pack_rows(lengths, capacity, list(samples))
        self._cache = (epoch, rows)
        return rows

    def step_samples(self, epoch: int, step: int, rank: int | None = None) -> list[int]:
        """Sample indices in ``rank``'s (default: this rank's) row of global step ``step``."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} is outside this epoch's {len(self)} steps.")
        row = step * self.world_size + (self.rank if rank is None else rank)
        rows = self.rows(epoch)
        return rows[row] if row < len(rows) else []

    def batch(self, epoch: int, step: int) -> dict:
        """This rank's packed row of global step ``step`` of ``epoch``."""
        return self._collate_row(self.step_samples(epoch, step))

    def global_rows(self, epoch: int, step: int) -> list[dict]:
        """All ``world_size`` rows of global step ``step``, in rank order."""
        ranks = range(self.world_size)
        return [self._collate_row(self.step_samples(epoch, step, r)) for r in ranks]

    def _collate_row(self, samples: list[int]) -> dict:
        if hasattr(self.data.online, "prefetch"):  # a server's rows: requested all at once
            self.data.online.prefetch(samples)
        batch = self._collate([self.data.dataset[i] for i in samples])
        docs = batch["document_ids"]
        out = {
            key: batch[key]
            for key in (
                "input_ids",
                "hidden_states",
                "verifier_last_hidden_states",
                "position_ids",
            )
        }
        # CollateFn's empty-row placeholder has a bool loss_mask; real rows are int64.
        out["loss_mask"] = batch["loss_mask"].long()
        out["document_ids"] = docs
        out["lengths"] = torch.bincount(docs[docs >= 0], minlength=len(samples))
        return out
