"""One writer per output directory: an exclusive ``flock`` on ``DIR/.lock`` for a run's duration.

The kernel drops a ``flock`` when its process dies, however it dies, so a lock left by a killed
run is free to take; the PID written in the file only names the holder in the refusal. A forked
child (a ``datasets`` map's worker pool) would share the lock and keep it past its parent's
death, so children close their copy at the fork; the refusal says when the named writer has
exited and something it started (another program's child) still holds the lock.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError
from .files import is_temporary

LOCK_FILE = ".lock"

logger = logging.getLogger(__name__)

_HELD: set[int] = set()  # this process's lock descriptors


def _close_inherited() -> None:
    """In a forked child: drop the parent's locks (closing a copy keeps the parent's flock)."""
    for fd in _HELD:
        os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited)


class DirectoryLocked(UserError):
    """Another live process holds the directory's lock."""


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 64).decode(errors="replace").strip()


def _runs(pid: str) -> bool:
    """Whether the process ``pid`` (as written in a lock file) still runs."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _refusal(directory: Path, command: str, holder: str) -> str:
    """The sentence for a lock held by someone else: the writer named in the file, or, when
    that writer has exited, the processes it left holding the lock."""
    if holder and not _runs(holder):
        return (
            f"{directory} is locked by a process that outlived the {command} that took it "
            f"(PID {holder}, exited): stop what that run started, or use another directory."
        )
    return (
        f"{directory} is in use by another {command} (PID {holder or 'unknown'}); "
        f"wait for it to finish or stop it, or use another directory."
    )


def _open_locked(lock: Path, command: str) -> int:
    """A descriptor holding the flock on ``lock``, which is still the file at that path."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise DirectoryLocked(_refusal(lock.parent, command, holder)) from None
        # A holder that was releasing may have unlinked the file we opened: lock the new one.
        if os.path.exists(lock) and os.path.samestat(os.fstat(fd), os.stat(lock)):
            return fd
        os.close(fd)


@contextmanager
def exclusive_directory(directory: Path, command: str, *, hold: bool = True) -> Iterator[Path]:
    """Create ``directory`` if needed and hold its lock for the block.

    Raises :class:`DirectoryLocked` (one sentence naming the holder's PID) at once when a live
    process holds it. On leaving, the lock file goes, and so does ``directory`` if this call
    created it and nothing was written into it. ``hold=False`` (ranks other than 0 under
    torchrun) takes no lock.
    """
    directory = Path(directory)
    if not hold:
        yield directory
        return
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / LOCK_FILE
    try:
        fd = _open_locked(lock, command)
    except BaseException:
        if created:
            _remove_if_empty(directory)
        raise
    _HELD.add(fd)
    try:
        previous = _holder(fd)
        if previous and previous != str(os.getpid()):
            logger.info(
                "%s: took over the lock of PID %s, which no longer runs", directory, previous
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield directory
    finally:
        if fd in _HELD:  # not in a forked child: it has closed its copy and leaves the lock be
            _HELD.discard(fd)
            lock.unlink(missing_ok=True)
            os.close(fd)
            if created:
                _remove_if_empty(directory)


def holds_nothing_written(directory: Path) -> bool:
    """Whether ``directory`` holds nothing but its lock and killed writers' temporaries (a run
    killed while writing its first file leaves that)."""
    return all(p.name == LOCK_FILE or is_temporary(p) for p in Path(directory).iterdir())


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass  # not empty: something was written, keep it
