"""Metric trackers (TensorBoard, W&B, Trackio, MLflow) through speculators' own logger.

``speculators train`` logs its metrics as dicts to the ``speculators.metrics`` logger,
whose handlers :func:`speculators.train.logger.setup_metric_logger` installs; we do the
same with the step records our metrics log holds, so a run shows in the tracker a
speculators user already reads. Only rank 0 logs.
"""

from __future__ import annotations

import importlib.util
import logging

from ..common.errors import UserError
from ..common.paths import writing
from .progress import TRACKER_PACKAGES, LoggingConfig

__all__ = ["Trackers", "check_trackers_installed"]

METRICS_LOGGER = "speculators.metrics"
STEP_KEYS = ("loss", "accuracy", "acceptance_length", "lr", "grad_norm", "tokens_per_s")


def check_trackers_installed(config: LoggingConfig) -> None:
    """One sentence for the first tracker whose package is missing, before anything runs."""
    for name in config.trackers:
        package = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise UserError(
                f"--logger {name} needs the {package} package, which is not installed "
                f"(pip install {package}), or leave {name} out of --logger."
            )


def tracker_metrics(record: dict, prefix: str) -> dict:
    """A step or validation record as the nested dict the trackers take: ``prefix/loss``,
    ..., and ``prefix/accuracy_depth/<k>`` per depth."""
    out = {key: record[key] for key in STEP_KEYS if key in record}
    per_depth = record.get("accuracy_per_depth") or []
    out["accuracy_depth"] = {str(k): acc for k, acc in enumerate(per_depth)}
    return {prefix: out}


class Trackers:
    """The run's trackers, open for the ``with`` block: ``log(record, step, prefix)``."""

    def __init__(self, config: LoggingConfig, rank: int, hparams: dict | None = None):
        self.names = config.trackers if rank == 0 else []
        self.config, self.hparams = config, hparams
        self.logger = logging.getLogger(METRICS_LOGGER)

    def __enter__(self) -> Trackers:
        if self.names:
            from speculators.train.logger import setup_metric_logger

            setup_metric_logger(self.names, self.config.run_name, self.config.log_dir)
            # its records are dicts for the handlers, not lines for the console
            self.logger.propagate = False
            if self.hparams is not None:
                self.logger.info(self.hparams, extra={"hparams": True})
        return self

    def log(self, record: dict, step: int, prefix: str = "train") -> None:
        if self.names:
            with writing(self.config.log_dir, "the trackers' records"):
                self.logger.info(tracker_metrics(record, prefix), extra={"step": step})

    def __exit__(self, *exc) -> None:
        """Flush and close every handler (the event files are complete after the run)."""
        if not self.names:
            return
        try:
            if exc[0] is None:  # the run's own error, if any, is the one to report
                with writing(self.config.log_dir, "the trackers' records"):
                    for handler in self.logger.handlers:
                        handler.flush()
        finally:
            for handler in list(self.logger.handlers):
                handler.close()
                self.logger.removeHandler(handler)
            self.logger.propagate = True
