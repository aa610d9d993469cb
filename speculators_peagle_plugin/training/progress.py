"""What a run reports, and how it is stopped: the step record, the metrics log, signals.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``K`` depths.
"""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import torch

from ..common.errors import UserError
from ..common.files import METRICS_FILE as METRICS_FILE  # the loop and tests read it here
from ..common.files import atomic_write_text
from ..common.paths import writing
from .distributed import World
from .metrics import acceptance_length, depth_accuracy, pooled_accuracy


class TrainingInterrupted(Exception):
    """SIGINT/SIGTERM arrived; the step in flight finished and a checkpoint was saved."""

    def __init__(self, signum: int, checkpoint: Path):
        super().__init__(f"interrupted by signal {signum}; checkpoint saved to {checkpoint}")
        self.signum = signum
        self.checkpoint = checkpoint


class StopFlag:
    """SIGINT/SIGTERM ask the loop to finish the step, save and exit (a second one kills)."""

    def __init__(self):
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum:  # second signal: give up at once
            signal.signal(signum, self._previous[signum])
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def check_finite(loss: float, grad_norm: float, step: int, last_saved: Path | None) -> None:
    """Stop (``ValueError``) before the optimizer applies a non-finite loss or gradient.

    Every rank sees the same all-reduced loss and the same gradient norm, so all stop together,
    and the non-finite state is never saved: the newest checkpoint stays the last finite one.
    """
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    what = f"the gradient norm is {grad_norm}"
    if not math.isfinite(loss):
        what = f"the loss is {loss}"
    kept = "no checkpoint was saved"
    if last_saved:
        kept = f"the newest checkpoint is still {last_saved}"
    raise UserError(
        f"Training diverged at step {step}: {what}, so it stopped before applying it ({kept}); "
        "lower --lr or keep --max-grad-norm on."
    )


def reduce_record(stats: dict, tokens: float, signum: int, world: World) -> dict:
    """Global step figures (sums over ranks) and the stop flag, in one all-reduce.

    ``stats``: :func:`~.step.train_step`'s ``loss_sum``, ``total_den``, ``correct [K]``,
    ``valid [K]``; ``tokens``: this rank's non-padding tokens; ``signum``: its stop signal.
    """
    k = len(stats["correct"])
    flat = torch.cat(
        [
            torch.tensor([stats["loss_sum"], stats["total_den"], tokens, float(signum)]),
            stats["correct"],
            stats["valid"],
        ]
    ).to(world.device)
    flat = world.all_reduce(flat).cpu()
    loss_sum, den, tokens, stop = flat[:4].tolist()
    correct, valid = flat[4 : 4 + k], flat[4 + k :]
    acc = depth_accuracy(correct, valid)
    return {
        "loss": loss_sum / max(den, 1.0),
        "accuracy": pooled_accuracy(correct, valid),
        "accuracy_per_depth": acc.tolist(),
        "valid_per_depth": valid.tolist(),
        "acceptance_length": acceptance_length(acc),
        "tokens": tokens,
        "stop": stop > 0,
    }


def format_postfix(record: dict) -> dict:
    """The progress bar's figures for one step record."""
    per_depth = "/".join(f"{a:.2f}" for a in record["accuracy_per_depth"][:4])
    postfix = {
        "loss": f"{record['loss']:.3f}",
        "acc@d": per_depth,
        "AL~": f"{record['acceptance_length']:.2f}",
        "tok/s": f"{record['tokens_per_s']:.0f}",
    }
    if "target_share" in record:  # online training: the target's part of the step time
        postfix["target"] = f"{record['target_share']:.0%}"
    else:  # the part of the step spent waiting for its row to be read
        postfix["data"] = f"{record['data_share']:.0%}"
    return postfix


def append_record(path: Path, record: dict) -> None:
    """One JSON line per logged step; a full disk is one sentence (a resumed run drops a
    line cut short, :func:`trim_metrics_log`)."""
    line = json.dumps(record) + "\n"
    with writing(path, "a metrics line", len(line)), open(path, "a") as fh:
        fh.write(line)


def trim_metrics_log(path: Path, after_step: int) -> None:
    """Drop lines a killed run logged past the checkpoint it resumes from, and a line it
    was killed while writing (one that does not parse)."""
    if not path.exists():
        return
    kept = [ln for ln in path.read_text().splitlines() if _logged_step(ln) <= after_step]
    atomic_write_text(path, "".join(ln + "\n" for ln in kept))


def _logged_step(line: str) -> float:
    """The step of a metrics line; a line that is not a step record counts as never logged."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
