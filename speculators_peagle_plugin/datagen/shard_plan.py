"""Which conversations a part of ``generate-data`` makes: ``--shard I/N`` and the replicas of
``--data-parallel-size``.

The conversations are the prompts, each once per sample, in prompt order (conversation ``c``
is sample ``c % num_samples`` of prompt ``c // num_samples``). They are cut into pieces of
``lcm(batch_size, num_samples)``: whole batches (the transformers backend generates a batch
together) holding whole prompts (the hidden-state pass shares a prompt's prefix among its
rows). Shard ``I`` of ``N`` makes the pieces ``[I*P//N, (I+1)*P//N)`` of the ``P``. So every
batch of a shard is a batch of the run that makes them all, each reply samples with a seed
drawn from its conversation's global index, and each row's states depend on its prompt's rows
alone: a shard's rows are that run's rows. Replica ``r`` of ``D`` of shard ``I/N`` is shard
``I*D + r`` of ``N*D``; the ``D`` replicas together make exactly shard ``I/N``
(``floor(I*D*P / (N*D)) = floor(I*P/N)``).

Example: 10 conversations, pieces of 3 -> 4 pieces; shard 0/2 makes conversations ``[0, 6)``,
shard 1/2 ``[6, 10)``; its replicas 2/4 and 3/4 make ``[6, 9)`` and ``[9, 10)``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..common.errors import UserError

_SHARD = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


@dataclass(frozen=True)
class Shard:
    """Part ``index`` of ``count`` (``0 <= index < count``)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str, flag: str = "--shard") -> Shard:
        """``"I/N"`` -> ``Shard(I, N)``; anything else is refused in one sentence."""
        match = _SHARD.fullmatch(text)
        if match is None:
            raise UserError(f"{flag} must be I/N (part I of N, counted from 0), got {text!r}.")
        index, count = int(match.group(1)), int(match.group(2))
        if not 0 <= index < count:
            raise UserError(
                f"{flag} {text} names part {index} of {count}; parts are counted from 0, so "
                f"I must be in [0, {count})."
            )
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def span(self, conversations: int, piece: int) -> tuple[int, int]:
        """``[start, stop)``: the conversations this part makes, in pieces of ``piece``
        (:func:`piece_size`; rule above)."""
        pieces = -(-conversations // piece)
        first = self.index * pieces // self.count
        last = (self.index + 1) * pieces // self.count
        return min(first * piece, conversations), min(last * piece, conversations)

    def replica(self, rank: int, replicas: int) -> Shard:
        """Replica ``rank`` of ``replicas`` of this part, as a part of the whole."""
        return Shard(self.index * replicas + rank, self.count * replicas)


WHOLE = Shard(0, 1)


def piece_size(batch_size: int, num_samples: int) -> int:
    """Conversations per piece: whole batches of whole prompts. Example: 8, 3 -> 24."""
    return math.lcm(batch_size, num_samples)


def shard_record(shard: Shard, conversations: int, batch_size: int, num_samples: int):
    """What ``generation_settings.json`` keeps of a part (its ``shard`` key): its name, its
    conversations ``[start, stop)`` of ``of``, and the batch size that cut them; None for the
    whole. Example: ``Shard(1, 2)``, 10 conversations, batch 3, 1 sample ->
    ``{"name": "1/2", "conversations": [6, 10], "of": 10, "batch_size": 3}``."""
    if shard == WHOLE:
        return None
    piece = piece_size(batch_size, num_samples)
    start, stop = shard.span(conversations, piece)
    if start == stop:
        raise UserError(
            f"--shard {shard} gets no prompts: {conversations} conversations in pieces of "
            f"{piece} (whole batches of --batch-size holding whole prompts) make "
            f"{-(-conversations // piece)} pieces for {shard.count} parts; use fewer parts or "
            "a smaller --batch-size."
        )
    return {
        "name": str(shard), "conversations": [start, stop], "of": conversations,
        "batch_size": batch_size,
    }


def record_span(record: dict | None, conversations: int) -> tuple[int, int]:
    """The conversations ``[start, stop)`` a ``shard`` record names (None: all of them)."""
    return (0, conversations) if record is None else tuple(record["conversations"])
