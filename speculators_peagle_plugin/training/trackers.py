"""Metric trackers (TensorBoard, W&B, Trackio, MLflow) through speculators' own logger.

``speculators train`` logs its metrics as dicts to the ``speculators.metrics`` logger,
whose handlers :func:`speculators.train.logger.setup_metric_logger` installs; we do the
same with the step records our metrics log holds, so a run shows in the tracker a
speculators user already reads. Only rank 0 logs.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

from ..common.errors import UserError
from ..common.paths import writing
from ..common.settings import check_int_at_least, fail, setting

__all__ = ["LoggingConfig", "Trackers", "check_trackers_installed"]

METRICS_LOGGER = "speculators.metrics"
STEP_KEYS = ("loss", "accuracy", "acceptance_length", "lr", "grad_norm", "tokens_per_s")


@dataclass(frozen=True)
class LoggingConfig:
    """The ``logging`` section: how often a step's record goes to the metrics log, and the
    metric trackers that get it too (speculators' ``logger`` / ``log_dir`` / ``run_name``,
    through its :func:`speculators.train.logger.setup_metric_logger`)."""

    log_freq: int = setting(
        1, "Write the metrics log (and the trackers) every N steps.", resumable=True
    )
    logger: str = setting(
        "", "Metric trackers as well as SAVE/metrics.jsonl, comma-separated: tensorboard, "
        "wandb, trackio, mlflow (speculators' loggers; each needs its package).", show=None,
    )
    log_dir: str = setting(
        "./logs", "Directory of the trackers' files (RUN_NAME under it).", output="logger"
    )
    run_name: str | None = setting(
        None, "The trackers' run name; {time}, {utc_time}, {rank}, {local_rank} are filled "
        "in.", show="the start time",
    )

    def __post_init__(self) -> None:
        check_int_at_least("log_freq", self.log_freq, 1)
        unknown = [n for n in self.trackers if n not in TRACKER_PACKAGES]
        if unknown:
            fail("logger", self.logger, f"a comma-separated list of {', '.join(TRACKER_PACKAGES)}")

    @property
    def trackers(self) -> list[str]:
        """The tracker names of ``logger``, in order."""
        return [n.strip() for n in self.logger.split(",") if n.strip()]


# Tracker -> the module it needs (speculators' handlers import it at the first metric).
TRACKER_PACKAGES = {
    "tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow",
}


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
