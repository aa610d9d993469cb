"""Validation while training: held-out acceptance after each checkpoint, the best kept, early stop.

With ``validation_data_path`` set, or ``train_data_ratio`` below 1 (the held-out samples
of ``data_path``), every checkpoint is scored on that data by
:func:`~.heldout.heldout_metrics` (teacher-forced accuracy per depth and the acceptance
length it predicts, the figure vLLM's acceptance follows) and the record appended to
``SAVE/validation.jsonl``. Unless ``save_best`` is false, the checkpoint with the highest
estimated acceptance so far is copied to ``SAVE/best`` (weights and config, what vLLM
serves), so pruning older checkpoints never loses it. With ``early_stop_patience = p``
training stops once ``p`` checkpoints in a row have not beaten the best.

A resumed run reads the records up to its checkpoint (later ones, written by a run killed
after them, are dropped) and so continues with the same best and the same patience count;
the checkpoint a signal saves between two of the grid is never scored.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..common.files import atomic_directory, atomic_write_text
from ..common.settings import check_optional_ints, setting
from ..model.model_card import read_card, write_model_card
from .checkpoint import STATE_FILE
from .distributed import World

logger = logging.getLogger(__name__)

__all__ = ["BEST_DIR", "VALIDATION_FILE", "Validation", "ValidationConfig"]

VALIDATION_FILE = "validation.jsonl"
BEST_DIR = "best"


@dataclass(frozen=True)
class ValidationConfig:
    """What validation does with its scores: keep the best checkpoint, stop early (the
    ``trainer`` group's part that :class:`Validation` reads; the held-out data is the
    ``data`` section's)."""

    early_stop_patience: int | None = setting(
        None,
        "With validation (--validation-data-path or --train-data-ratio below 1): stop once "
        "this many checkpoints in a row have not beaten the best estimated acceptance.",
        resumable=True,
    )
    save_best: bool | None = setting(
        None,
        "With validation (--validation-data-path or --train-data-ratio below 1): keep the "
        "checkpoint of the best estimated acceptance in SAVE/best and return it; false: "
        "score every checkpoint but keep no copy, and return the last one. Default: on "
        "whenever there is validation (speculators' default is false, and it ranks by "
        "validation loss).",
        show="on with validation",
    )

    def __post_init__(self) -> None:
        check_optional_ints(self, {"early_stop_patience": 1})


class Validation:
    """The validation records of one run (``SAVE/validation.jsonl``) and its best checkpoint.

    Args:
        config: the ``trainer`` group's validation part (``early_stop_patience``,
            ``save_best``).
        score: a checkpoint's held-out metrics (``acceptance_length`` among them), e.g.
            :func:`~.heldout.heldout_metrics` on the run's held-out data.
        save_path: the run's directory.
        resumed_step: the step the run continues from (0 for a fresh run); records of
            later steps are dropped.
    """

    def __init__(
        self,
        config: ValidationConfig,
        score: Callable[[Path], dict],
        save_path: Path,
        resumed_step: int,
        world: World,
    ):
        self.config, self.scorer, self.world = config, score, world
        self.keeps_best = config.save_best is not False
        self.path = save_path / VALIDATION_FILE
        self.best_dir = save_path / BEST_DIR
        self.records: list[dict] = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line a killed run was writing
                if record.get("step", float("inf")) <= resumed_step:
                    self.records.append(record)
        if world.rank == 0:
            text = "".join(json.dumps(r) + "\n" for r in self.records)
            atomic_write_text(self.path, text)

    def resume(self, checkpoint: Path | None, step: int, epoch: float, on_grid: bool) -> bool:
        """Score the checkpoint a run resumes from if a kill left it unscored; returns
        whether the run had already stopped early.

        Only a checkpoint of the grid is scored (``on_grid``): the one a signal saves
        between two of them is not, as an uninterrupted run would not have scored it.
        """
        if checkpoint is not None and on_grid and all(r["step"] != step for r in self.records):
            self.score(checkpoint, step, epoch)
        return self.should_stop

    @property
    def best(self) -> dict | None:
        """The record with the highest estimated acceptance (the earliest of equals)."""
        best = None
        for record in self.records:
            if best is None or record["acceptance_length"] > best["acceptance_length"]:
                best = record
        return best

    @property
    def since_best(self) -> int:
        """Checkpoints scored after the best one."""
        best = self.best
        return 0 if best is None else len(self.records) - 1 - self.records.index(best)

    @property
    def should_stop(self) -> bool:
        patience = self.config.early_stop_patience
        return patience is not None and self.since_best >= patience

    @property
    def stop_reason(self) -> str:
        best = self.best
        kept = f", kept in {self.best_dir}" if self.keeps_best else ""
        return (
            f"{self.since_best} checkpoints since the best estimated acceptance "
            f"{best['acceptance_length']:.4f} (step {best['step']}){kept}"
        )

    def score(self, checkpoint: Path, step: int, epoch: float) -> bool:
        """Score ``checkpoint``; keep it as the best if it is; returns whether to stop."""
        metrics = self.scorer(checkpoint)
        record = {"step": step, "epoch": epoch, "checkpoint": checkpoint.name, **metrics}
        previous = self.best
        self.records.append(record)
        improved = previous is None or record["acceptance_length"] > previous["acceptance_length"]
        if self.world.rank == 0:
            if improved and self.keeps_best:
                with atomic_directory(self.best_dir) as tmp:
                    for item in checkpoint.iterdir():
                        if item.is_file() and item.name != STATE_FILE:
                            shutil.copy2(item, tmp / item.name)
                    if read_card(tmp) is not None:  # its serve line names this directory
                        write_model_card(tmp, location=self.best_dir)
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            logger.info(
                "validation at step %d: estimated acceptance %.4f (best %.4f at step %d)",
                step, record["acceptance_length"], self.best["acceptance_length"],
                self.best["step"],
            )
        self.world.barrier()
        return self.should_stop
