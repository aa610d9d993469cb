"""The ``selftest`` command's settings (its flags), and the options a run resolves them to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.devices import checked_device
from ..common.errors import UserError
from ..common.settings import Settings, setting
from .shapes import SHAPES

# Row lengths of the speed comparison when --seq-lens is not given.
DEFAULT_SEQ_LENS = {"quick": (256,), "cpu": (2048,), "cuda": (8192, 32768)}
SHORTEST_ROW = 16


def _default_lens() -> str:
    """DEFAULT_SEQ_LENS as the help text shows it."""
    where = {"quick": "with --quick", "cpu": "on cpu", "cuda": "on cuda"}
    return ", ".join(f"{','.join(map(str, v))} {where[k]}" for k, v in DEFAULT_SEQ_LENS.items())


@dataclass(frozen=True)
class Options:
    """A run's options, every default chosen for this machine."""

    device: torch.device
    quick: bool
    shape: str
    seq_lens: tuple[int, ...]
    json_path: str | None
    ours_seq_lens: tuple[int, ...] = ()  # rows ours alone runs too (speculators' cannot fit)
    profile: bool = False  # a profiler table of one step per side, beside the record

    @property
    def seeds(self) -> range:
        return range(2 if self.quick else 4)


@dataclass(frozen=True)
class SelftestConfig(Settings):
    """The settings of ``selftest``; None: chosen for this machine by :meth:`options`."""

    device: str | None = setting(
        None, "Where to run.", choices=("cpu", "cuda"),
        show="cuda if this machine has it, else cpu",
    )
    quick: bool = setting(
        False, "Fewer seeds, the tiny shape, short rows, no torchrun or longest-row search.",
        switch=True, show=None,
    )
    shape: str | None = setting(
        None, "The target shape of the draft.", choices=tuple(sorted(SHAPES)),
        show="tiny with --quick, llama8b on cuda, smollm2 on cpu",
    )
    seq_lens: tuple[int, ...] | None = setting(
        None, "Row lengths of the speed comparison, comma-separated.", show=_default_lens()
    )
    ours_seq_lens: tuple[int, ...] | None = setting(
        None,
        "Longer rows ours alone runs too, in partitions, comma-separated (speculators' side "
        "does not fit them).",
        show="none",
    )
    json_path: str | None = setting(
        None, "Also write the record to this JSON file.", flag="--json"
    )
    profile: bool = setting(
        False,
        "Also write, beside --json, a torch.profiler table of the 20 costliest kernels of one "
        "step per side at the first --seq-lens row.",
        switch=True, show=None,
    )

    def __post_init__(self) -> None:
        for flag, lens in (("--seq-lens", self.seq_lens), ("--ours-seq-lens", self.ours_seq_lens)):
            if lens is not None and (not lens or min(lens) < SHORTEST_ROW):
                text = ",".join(map(str, lens))
                raise UserError(
                    f"{flag} {text!r}: give row lengths of {SHORTEST_ROW} tokens or more."
                )
        if self.json_path is not None:
            if Path(self.json_path).is_dir():
                raise UserError(f"--json {self.json_path} is a directory; give a file name.")
            if not Path(self.json_path).resolve().parent.is_dir():
                raise UserError(f"--json {self.json_path}: its directory does not exist.")
        if self.profile and self.json_path is None:
            raise UserError("--profile writes its tables beside the record: give --json too.")

    def options(self) -> Options:
        """The run's options: the device checked, every default chosen for it."""
        dev = checked_device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        shape = self.shape or (
            "tiny" if self.quick else "llama8b" if dev.type == "cuda" else "smollm2"
        )
        lens = self.seq_lens or DEFAULT_SEQ_LENS["quick" if self.quick else dev.type]
        lens = tuple(sorted(set(lens)))
        ours = set(self.ours_seq_lens or ()) - set(lens)
        return Options(dev, self.quick, shape, lens, self.json_path, tuple(sorted(ours)),
                       self.profile)
