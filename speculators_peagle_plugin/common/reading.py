"""Reading files the user hands in: a corrupt one is one sentence naming it, never a traceback.

Every reader raises :class:`UnreadableFile` (a :class:`~.errors.UserError`, which each
command prints as its one-line error) with the path and the first line of what went wrong. Pickled
state is read with ``weights_only=True``: tensors and plain containers only, no code runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError, first_line


class UnreadableFile(UserError):
    """A file that is missing, truncated or not in the format its name promises."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path} {problem}")
        self.path = Path(path)


@contextmanager
def opening(path: Path) -> Iterator[None]:
    """Read a file the user named: an ``OSError`` (gone, a directory, no permission) is
    :class:`UnreadableFile` naming it. Only around a user's path: elsewhere it is a bug."""
    try:
        yield
    except OSError as exc:
        raise UnreadableFile(path, f"cannot be read ({exc.strerror or first_line(exc)}).") from None


def read_json(path: Path, kind: type = dict):
    """``path``'s JSON value, which must be a ``kind`` (an object by default)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnreadableFile(path, f"is not readable JSON ({first_line(exc)}).") from None
    if not isinstance(value, kind):
        names = {dict: "an object", list: "a list"}
        raise UnreadableFile(
            path,
            f"holds a JSON {type(value).__name__}, but {names.get(kind, kind.__name__)} is "
            "expected.",
        )
    return value


def read_yaml_mapping(path: Path) -> dict:
    """``path``'s YAML mapping (an empty file is an empty mapping)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            value = yaml.safe_load(fh) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        problem = " ".join(first_line(exc).split())
        raise UnreadableFile(path, f"is not readable YAML ({problem}).") from None
    if not isinstance(value, dict):
        raise UnreadableFile(path, "must hold a mapping of option: value.")
    return value


def load_plain_torch(path: Path, what: str):
    """``torch.load`` of tensors and plain containers only (``weights_only=True``).

    A crafted pickle (one whose ``__reduce__`` calls a program) is refused, not run.
    """
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UnreadableFile(
            path,
            f"is not {what} this program wrote (only tensors and plain containers are read "
            f"from it): {first_line(exc)}",
        ) from None


def load_safetensors(path: Path) -> dict:
    """Every tensor of a safetensors file, on the CPU."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise safetensors_problem(path, exc) from None


def safetensors_problem(path: Path, exc: BaseException) -> UnreadableFile:
    """The one-sentence error for a safetensors file that failed to open or read."""
    return UnreadableFile(path, f"is corrupt or truncated ({first_line(exc)}).")
