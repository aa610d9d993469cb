"""Atomic writes: a file or directory appears under its name only when complete.

Every writer in the package goes through these helpers, so there is one temporary-name
scheme (``.<name>.tmp-<pid>`` beside the target, hidden and unique per process) and one
rule for cleaning up after a killed writer (:func:`remove_stale_temporaries`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_MARK = ".tmp-"
# the training run's step records, in its save path beside its checkpoint-<step> folders
# (written by training, plotted by evaluation)
METRICS_FILE = "metrics.jsonl"


def temporary_name(path: Path) -> Path:
    """``dir/.name.tmp-<pid>``: beside ``path`` (same filesystem, so the rename is atomic)."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is named as :func:`temporary_name` names (any process's)."""
    return path.name.startswith(".") and TMP_MARK in path.name


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)``, then rename ``tmp`` to ``path``; on any error remove ``tmp``."""
    path = Path(path)
    tmp = temporary_name(path)
    _remove(tmp)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: Path, obj, indent: int | None = 1) -> None:
    """``json.dumps(obj, indent=indent)``, atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent))


@contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces ``path`` when the block succeeds.

    An existing ``path`` is removed only after the new one is complete; on an error the
    temporary directory is removed and ``path`` is left as it was.
    """
    path = Path(path)
    tmp = temporary_name(path)
    _remove(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def remove_stale_temporaries(directory: Path) -> None:
    """Remove what killed writers left in ``directory`` (any process's temporaries)."""
    for leftover in Path(directory).glob(f".*{TMP_MARK}*"):
        _remove(leftover)
