"""What a command reports as one sentence, and what it reports as a bug.

A :class:`OneSentenceError` (bad input, a full disk, too little memory, a failed engine or
stage) is something the user acts on: the command prints ``Error: <its message>``. Any
other exception is a bug, here or in a library: the command keeps its traceback and adds
:func:`bug_report_line`. ``SPECULATORS_PEAGLE_TRACEBACK=1`` shows the traceback of a
one-sentence error as well.

The package refuses input with :class:`UserError`. The plain ``ValueError`` that some public
functions raise for a malformed argument (a tensor's shape or order, a draft without
``mask_hidden``) is not a refusal: the commands build those arguments themselves, so a
command that trips one has a bug.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata

TRACEBACK_ENV = "SPECULATORS_PEAGLE_TRACEBACK"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# how libraries that raise their own types (safetensors, torch) word an ENOSPC / EDQUOT
_NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded")
_CPU_OOM_TEXT = ("can't allocate memory", "Cannot allocate memory")
REPORTED_VERSIONS = ("torch", "speculators", "vllm", "transformers")


class OneSentenceError(Exception):
    """An error the user acts on; its message is one sentence saying what and what to do."""


class UserError(OneSentenceError, ValueError):
    """Input a command refuses (what was wrong, what is allowed), or a fault of the user's
    machine it cannot work around. A ``ValueError``, as the public API documents."""


class DiskFull(UserError):
    """A write that ran out of space; what it was replacing is left as it was."""


class OutOfMemory(OneSentenceError, MemoryError):
    """Memory ran out; the message names which memory and what to lower."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC / EDQUOT, as an ``OSError`` or in the words of a library's own error type."""
    if getattr(exc, "errno", None) in _NO_SPACE:
        return True
    return isinstance(exc, Exception) and any(t in str(exc) for t in _NO_SPACE_TEXT)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's CUDA out-of-memory, Python's ``MemoryError``, or a failed CPU allocation."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    if getattr(exc, "errno", None) == errno.ENOMEM:
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc) for t in _CPU_OOM_TEXT)


def out_of_memory_sentence(exc: BaseException, row_tokens: int | None = None) -> str:
    """Which memory ran out, at which row length (when known), and what to lower."""
    what = "GPU memory" if type(exc).__name__ == "OutOfMemoryError" else "memory"
    at = f" at rows of {row_tokens} tokens" if row_tokens else ""
    return (
        f"Out of {what}{at} ({first_line(exc)[:200]}); lower --total-seq-len or raise "
        "--sequence-partitions (train), lower --batch-size or --kv-cache-gb (generate-data, "
        "eval), or free memory, then run the same command again."
    )


@contextmanager
def memory_for(row_tokens: int) -> Iterator[None]:
    """Run work on rows of ``row_tokens`` tokens; running out of memory there becomes
    :class:`OutOfMemory` naming that length."""
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfMemory(out_of_memory_sentence(exc, row_tokens)) from exc


def one_sentence(exc: BaseException) -> str | None:
    """The sentence a command prints for ``exc``, or None when ``exc`` is a bug."""
    if isinstance(exc, OneSentenceError):
        return str(exc)
    if is_out_of_memory(exc):
        return out_of_memory_sentence(exc)
    if is_disk_full(exc):
        where = getattr(exc, "filename", None)
        return (
            f"No space left on the device{f' writing {where}' if where else ''} "
            f"({first_line(exc)}); free some space, then run the same command again."
        )
    return None


def _version(name: str) -> str:
    for dist in (name, f"{name}-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def bug_report_line() -> str:
    """What to include when reporting an unexpected error, with this machine's versions."""
    versions = ", ".join(f"{n} {_version(n)}" for n in REPORTED_VERSIONS)
    return (
        "This is a bug in speculators-peagle or a library it uses, not a problem with your "
        "input: please report it with the traceback above, the command you ran, the output "
        f"of `speculators-peagle --version` and these versions: {versions}."
    )
