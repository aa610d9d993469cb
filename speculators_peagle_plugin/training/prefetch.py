"""The next step's row, read on a thread while this step trains.

A step's row is its samples' hidden-state files, read and packed
(:meth:`~speculators_peagle_plugin.data.packing.PackedBatches.batch`): file reads and copies
that leave the accelerator idle when they run between steps. For a large target a row is
hundreds of MB (``L x (A + 1) x H`` values), which can take as long to read as the draft's
step on a GPU takes to run; one row read ahead hides it. ``python -m eval.bench_loop``
measures the loop with and without it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor


class RowsAhead:
    """This rank's rows, step after step, each read while the previous step trains.

    Args:
        batches: :class:`~speculators_peagle_plugin.data.packing.PackedBatches` (``len()``
            steps per epoch, ``batch(epoch, index)`` a pure function of the step).
        stop: the run's last step + 1; nothing past it is read.
        ahead: False reads each row when asked, in the caller's thread (online data:
            reading a row runs the target, which must not run beside the step).

    ``get(step)`` returns ``(row, waited_s)``: the tensors ``batches.batch(*divmod(step,
    len(batches)))`` gives, and the seconds the caller waited for them. An error while
    reading a row is raised by that step's ``get``. Leaving the ``with`` block cancels the
    row read ahead (a read in progress finishes first).
    """

    def __init__(self, batches, stop: int, *, ahead: bool = True):
        self._batches = batches
        self._stop = stop
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rows-ahead") if ahead else None
        self._next: tuple[int, Future] | None = None

    def __enter__(self) -> RowsAhead:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _read(self, step: int) -> dict:
        return self._batches.batch(*divmod(step, len(self._batches)))

    def get(self, step: int) -> tuple[dict, float]:
        began = time.perf_counter()
        if self._next is not None and self._next[0] == step:
            row = self._next[1].result()
        else:  # the first step, or a step other than the one read ahead
            if self._next is not None:
                self._next[1].cancel()
            row = self._read(step)
        waited = time.perf_counter() - began
        self._next = None
        if self._pool is not None and step + 1 < self._stop:
            self._next = (step + 1, self._pool.submit(self._read, step + 1))
        return row, waited
