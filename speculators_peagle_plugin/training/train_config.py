"""``speculators-peagle train``'s settings: sections owned by the modules that use them.

The sections and their owners, grouped as speculators 0.9.0 groups its train keys:

==========  ==========================  ==================================================
section     class                       owner
==========  ==========================  ==================================================
verifier    VerifierConfig              :mod:`..model.target`
draft       DraftConfig                 :mod:`..model.build`
data        DataConfig                  :mod:`..data.packing`
online      OnlineConfig (+ replies)    :mod:`.online` (:mod:`..datagen.datagen_config`)
generation  GenerationConfig            :mod:`..datagen.served_states`
loss        LossConfig                  :mod:`..kernels.fused_kl`
optimizer   OptimizerConfig             :mod:`.optim`
scheduler   SchedulerConfig             :mod:`.optim`
trainer     TrainerConfig               :mod:`.checkpoint`, :mod:`.schedule`,
                                        :mod:`.validation` (one part each)
logging     LoggingConfig               :mod:`.trackers`
runtime     RuntimeConfig               :mod:`.distributed`
peagle      PEagleConfig                :mod:`..core.peagle_config`
==========  ==========================  ==================================================

Each section validates its own settings; :class:`TrainConfig` checks only what joins two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..common.errors import UserError
from ..common.settings import Settings, fail, section, setting
from ..core.peagle_config import PEagleConfig
from ..data.packing import DataConfig
from ..datagen.served_states import GenerationConfig
from ..kernels.fused_kl import LossConfig
from ..model.build import DraftConfig
from ..model.target import VerifierConfig
from .checkpoint import CheckpointConfig
from .distributed import RuntimeConfig
from .online import OnlineConfig
from .optim import OptimizerConfig, SchedulerConfig
from .schedule import ScheduleConfig
from .speculators_keys import from_speculators
from .trackers import LoggingConfig
from .validation import ValidationConfig


@dataclass(frozen=True)
class TrainerConfig:
    """The ``trainer`` group: how long to train, where checkpoints go and what a run
    resumes, what validation keeps; each part owned by the module that reads it, their keys
    the group's own (``trainer: {epochs: 3}``, ``--epochs 3``)."""

    checkpoints: CheckpointConfig = section(CheckpointConfig)
    schedule: ScheduleConfig = section(ScheduleConfig)
    validation: ValidationConfig = section(ValidationConfig)


@dataclass(frozen=True)
class TrainConfig(Settings):
    """Everything ``speculators-peagle train`` reads, with each default in one place.

    Names and meanings follow ``speculators train`` for the shared concepts (the flag is
    the key with dashes). Precedence: these defaults < ``--config FILE.yaml`` (flat keys,
    or keys grouped under their section) < command-line flags.
    """

    verifier: VerifierConfig = section(VerifierConfig)
    data: DataConfig = section(DataConfig)
    online: OnlineConfig = section(OnlineConfig)
    generation: GenerationConfig = section(GenerationConfig)
    trainer: TrainerConfig = section(TrainerConfig)
    algorithm: str = setting("peagle", "Drafting algorithm (entry point speculators.algorithms).")
    draft: DraftConfig = section(DraftConfig)
    peagle: PEagleConfig = section(PEagleConfig)
    loss: LossConfig = section(LossConfig)
    optimizer: OptimizerConfig = section(OptimizerConfig)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    logging: LoggingConfig = section(LoggingConfig)
    seed: int = setting(
        42, "Seed for initialisation, data order and COD sampling.", card=True
    )
    runtime: RuntimeConfig = section(RuntimeConfig)

    @classmethod
    def file_values(cls, values: Mapping, source: str | Path | None) -> dict:
        """Our keys, flat or grouped, or speculators' train YAML (:mod:`.speculators_keys`)."""
        return from_speculators(values, source)

    def __post_init__(self) -> None:
        if not self.verifier.verifier_name_or_path:
            runs = " (--online runs the target inside training)" if self.online.online else ""
            raise UserError(f"verifier_name_or_path is required (--verifier-name-or-path){runs}.")
        if self.online.prompts is not None and self.data.data_path:
            raise UserError("Pass one of --data-path or --prompts, not both.")
        if self.online.prompts is None and not self.data.data_path:
            instead = "; with --online, --prompts can stand in for it" if self.online.online else ""
            raise UserError(f"data_path is required (--data-path){instead}.")
        served, depths = self.draft.num_speculative_tokens, self.peagle.cod.num_depths
        if served is not None and served > depths:
            fail("num_speculative_tokens", served, f"an integer in [1, num_depths={depths}]")
        warmup, steps = self.scheduler.scheduler_warmup_steps, self.trainer.schedule.max_steps
        if warmup is not None and steps is not None and warmup > steps:
            raise UserError(
                f"scheduler_warmup_steps {warmup} is more than max_steps {steps}: the "
                "learning rate would never reach lr; use at most max_steps warmup steps."
            )
        data, ratio = self.data, self.data.train_data_ratio
        if ratio < 1 and data.validation_data_path:
            raise UserError(
                f"train_data_ratio {ratio:g} holds rows of data_path out for validation, "
                "and validation_data_path gives validation data too; use one of them "
                "(train_data_ratio 1 with validation_data_path)."
            )
        if ratio < 1 and self.online.online:
            raise UserError(
                f"train_data_ratio {ratio:g} needs offline data (hidden states on disk) to "
                "score its held-out rows; with --online, give validation_data_path instead."
            )
        needs = "validation_data_path or a train_data_ratio below 1"
        if self.trainer.validation.early_stop_patience is not None and not self.validating:
            raise UserError(
                f"early_stop_patience needs {needs}: held-out data to score each checkpoint on."
            )
        if self.trainer.validation.save_best and not self.validating:
            raise UserError(
                f"save_best needs {needs} (speculators' default is 0.9, ours 1: no split): "
                "held-out data to rank the checkpoints by."
            )

    @property
    def validating(self) -> bool:
        """Whether every checkpoint is scored on held-out data."""
        return bool(self.data.validation_data_path) or self.data.train_data_ratio < 1
