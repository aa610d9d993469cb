"""Where a regeneration stands, for :mod:`.generation`: the finished conversations' shards
(:func:`done_shards`, :class:`ShardFiles`), and for conversations of several user turns each
one's finished turns (:class:`Conversations`) and the files that keep them across a stop
(:class:`TurnFiles`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..common.files import atomic_write_json


class Conversations:
    """A batch of conversations mid-regeneration: each one's rows and reply texts so far,
    its history (what its next prompt renders) and the turns still pending."""

    def __init__(self, conversations: list[list[dict]]):
        self.rows: list[list[dict]] = [[] for _ in conversations]
        self.replies: list[list[str]] = [[] for _ in conversations]
        self.history: list[list[dict]] = [[] for _ in conversations]
        self.pending = [list(turns) for turns in conversations]

    def has_user_turn(self, k: int) -> bool:
        return any(t["role"] == "user" for t in self.pending[k])

    def next_user_turn(self, k: int) -> None:
        """Move conversation k's turns up to its next user turn from pending to history."""
        users = [i for i, t in enumerate(self.pending[k]) if t["role"] == "user"]
        self.history[k].extend(self.pending[k][: users[0] + 1])
        del self.pending[k][: users[0] + 1]

    def add_reply(self, k: int, row: dict, text: str) -> None:
        self.rows[k].append(row)
        self.replies[k].append(text)
        self.history[k].append({"role": "assistant", "content": text})

    def resume(self, started: dict[int, dict]) -> None:
        """Conversation k past its first turns ``started[k]`` (``{"rows", "replies"}``)."""
        for k, done in started.items():
            for row, text in zip(done["rows"], done["replies"], strict=True):
                self.next_user_turn(k)
                self.add_reply(k, row, text)

    def so_far(self) -> dict[int, dict]:
        """``{k: {"rows", "replies"}}`` of every conversation with a reply."""
        return {k: {"rows": rows, "replies": self.replies[k]}
                for k, rows in enumerate(self.rows) if rows}


class TurnFiles:
    """The ``*.turns`` files: a job's finished turns of its conversations (``{prompt index:
    {"rows", "replies"}}``), rewritten after each turn, gone once the job's shards are."""

    def __init__(self, responses: Path):
        self.responses = responses
        self.started: dict[int, dict] = {}  # the most turns where a stopped run's files overlap
        for path in sorted(responses.glob("*.turns")):
            try:
                for key, done in json.loads(path.read_text()).items():
                    if len(done["rows"]) > len(self.started.get(int(key), {"rows": ()})["rows"]):
                        self.started[int(key)] = done
            except (ValueError, AttributeError, KeyError, TypeError):  # damaged: start again
                path.unlink()

    def path(self, job: list[int]) -> Path:
        return self.responses / f"{job[0]:09d}-{job[-1]:09d}.turns"

    def started_of(self, job: list[int]) -> dict[int, dict]:
        """The stopped run's turns of the job's conversations, by their place in the job."""
        return {k: self.started[i] for k, i in enumerate(job) if i in self.started}

    def saver(self, job: list[int]) -> Callable[[dict[int, dict]], None]:
        def save(so_far: dict[int, dict]) -> None:
            atomic_write_json(self.path(job), {str(job[k]): v for k, v in so_far.items()},
                              indent=None)

        return save

    def drop_finished(self, done: dict) -> None:
        """Remove every turns file whose conversations are all in shard files."""
        for path in self.responses.glob("*.turns"):
            if all(int(i) in done for i in json.loads(path.read_text())):
                path.unlink()


def done_shards(responses: Path) -> dict[int, list[dict]]:
    """Rows of every prompt already regenerated (one JSON shard per finished batch)."""
    done: dict[int, list[dict]] = {}
    for shard in sorted(responses.glob("*.json")):
        try:
            done.update({int(k): v for k, v in json.loads(shard.read_text()).items()})
        except (ValueError, AttributeError):  # unreadable: written by hand or damaged
            shard.unlink()
    return done


class ShardFiles:
    """The resume files of one job's conversations (``job``: their prompt indices), each
    written as soon as the last of its ``shard_size`` conversations is complete."""

    def __init__(self, responses: Path, job: list[int], shard_size: int, done: dict, bar):
        self.responses, self.job, self.shard_size, self.done, self.bar = (
            responses, job, shard_size, done, bar,
        )
        self.left = [len(job[s : s + shard_size]) for s in range(0, len(job), shard_size)]

    def complete(self, k: int, rows: list[dict]) -> None:
        """Conversation ``k`` of the job has all its rows."""
        self.done[self.job[k]] = rows
        self.bar.update(1)
        n = k // self.shard_size
        self.left[n] -= 1
        if self.left[n] == 0:
            shard = self.job[n * self.shard_size : (n + 1) * self.shard_size]
            atomic_write_json(
                self.responses / f"{shard[0]:09d}-{shard[-1]:09d}.json",
                {str(i): self.done[i] for i in shard},
                indent=None,
            )
