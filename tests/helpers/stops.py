"""A run stopped (``KeyboardInterrupt``) on the n-th call of a function it makes, as a user's
Ctrl-C or a killed process would stop it there: what a resume test starts from."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def stopped_at_call(monkeypatch, owner, name: str, n: int,
                    note: Callable = lambda *args: args) -> Iterator[list]:
    """``owner.name`` raises ``KeyboardInterrupt`` on its ``n``-th call (earlier calls run
    it); the block must end in that interrupt. Yields the list of ``note(*args)`` of every
    call, and puts the real function back afterwards."""
    real, calls = getattr(owner, name), []

    def stopping(*args, **kwargs):
        calls.append(note(*args))
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, stopping)
    with pytest.raises(KeyboardInterrupt):
        yield calls
    monkeypatch.setattr(owner, name, real)
