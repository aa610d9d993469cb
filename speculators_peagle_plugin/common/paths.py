"""Output paths the user names: checked before work starts, and writes that run out of space.

Each refusal names the flag that gave the path. :func:`writing` turns a write that runs out
of space into one :class:`~.errors.DiskFull` sentence: what was written, where, how much
it needs and how much is free.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import DiskFull, UserError, first_line, is_disk_full
from .files import TMP_MARK

RERUN = "free some space, then run the same command again"


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` itself, or its nearest parent that exists (absolute)."""
    probe = Path(path).absolute()
    while not probe.exists():
        probe = probe.parent
    return probe


def check_output_dir(flag: str, path: str | os.PathLike) -> None:
    """Refuse, naming ``flag``, a directory that cannot be made or written: a file in its
    place or above it, or a parent in which nothing can be created (read-only, ``/proc``).

    Example: ``check_output_dir("--log-dir", "/proc/nope/tb")`` -> "--log-dir /proc/nope/tb
    cannot be created: making a directory in /proc fails (No such file or directory); ...".
    """
    base = nearest_existing(path)
    if not base.is_dir():
        raise UserError(
            f"{flag} {path} cannot be a directory: {base} is a file; choose another path."
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".probe{TMP_MARK}", dir=base))
    except OSError as exc:
        raise UserError(
            f"{flag} {path} cannot be created: making a directory in {base} fails "
            f"({exc.strerror or first_line(exc)}); choose a writable path."
        ) from None


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the disk of ``path`` (or of its nearest existing parent)."""
    return shutil.disk_usage(nearest_existing(path)).free


def check_free_space(flag: str, path: str | os.PathLike, need: int, what: str,
                     advice: str) -> None:
    """Refuse, naming ``flag``, a ``path`` whose disk has less than ``need`` bytes free."""
    free = free_bytes(path)
    if need > free:
        raise DiskFull(
            f"{flag} {path} needs about {format_bytes(need)} for {what} but its disk has "
            f"{format_bytes(free)} free; {advice}."
        )


def no_space_sentence(target: Path, what: str, need: int | None, advice: str = RERUN) -> str:
    """The sentence of a write that ran out of space (``need`` None: the free space alone).

    Example: "Writing SAVE/checkpoint-4 failed, no space left on the device: a checkpoint
    needs about 7.0 MiB and 1.2 MiB are free; free some space, then run the same command
    again."
    """
    free = format_bytes(free_bytes(Path(target).parent))
    needs = f"{what} needs about {format_bytes(need)} and {free} are free" if need else (
        f"{free} free for {what}"
    )
    return f"Writing {target} failed, no space left on the device: {needs}; {advice}."


@contextmanager
def writing(target: str | os.PathLike, what: str, need: int | None = None,
            advice: str = RERUN) -> Iterator[None]:
    """Run a write of ``what`` to ``target``; a lack of space becomes :class:`DiskFull`.

    Besides ENOSPC itself, a failed write while the disk has less than ``need`` bytes free
    counts (torch's writer reports only "file write failed").
    """
    try:
        yield
    except Exception as exc:
        short = need is not None and "write failed" in str(exc) and free_bytes(
            Path(target).parent) < need
        if not (is_disk_full(exc) or short):
            raise
        raise DiskFull(no_space_sentence(Path(target), what, need, advice)) from exc
